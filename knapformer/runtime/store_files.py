"""The run store's files: a store made (or resumed, or moved aside), segments written
atomically, compaction, removal. `knapformer.runtime.store_writer` decides when; this
module how (see its doc for the guarantees).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from knapformer.contract.run_store import (
    RUN_FILE,
    StoreError,
    conformed,
    list_segments,
    run_id,
    segment_name,
)
from knapformer.contract.store_schema import (
    META_RUN,
    META_SCHEMA,
    META_TABLE,
    STORE_FOLDER,
    STORE_VERSION,
    TABLES,
)
from knapformer.runtime.store_rows import window_figures, window_rows

log = logging.getLogger(__name__)
#: Rows of a ``ranks`` row group (about 128 steps at 1,024 GPUs).
ROW_GROUP_ROWS = 1 << 17


def open_store(folder: Path, first_step: int) -> str:
    """Prepare ``folder`` for a run whose first step here is ``first_step``; returns its
    run id (`knapformer.runtime.store_writer`'s doc: append to a resumed run, trimmed of
    the steps it replays, else move the old store aside)."""
    if folder.is_dir() and any(folder.iterdir()):
        try:
            run = run_id(folder)
            spans = [
                (s.first, s.last) for t in ("steps", "ranks") for s in list_segments(folder, t)
            ]
        except StoreError as err:
            run, spans, why = None, [], str(err)
        first = min((span[0] for span in spans), default=None)
        last = max((span[1] for span in spans), default=None)
        if run is not None and (last is None or first_step > last):
            _remove_temporary(folder)
            return run  # a resumed run: append
        if run is not None:
            why = f"it holds steps from {first} and this run starts at step {first_step}"
        if run is not None and first < first_step:  # resumed from a checkpoint, replayed
            try:
                _remove_temporary(folder)
                trim(folder, first_step)
            except (StoreError, OSError, pa.ArrowException) as err:  # then moved aside
                why = f"its steps from {first_step} on could not be removed: {err}"
            else:
                log.warning(
                    "StoreWriter: %s held steps up to %d and this run resumes at step %d "
                    "(from a checkpoint): the steps from %d on were removed, to be written "
                    "again",
                    folder,
                    last,
                    first_step,
                    first_step,
                )
                return run
        aside = _free_aside(folder)
        os.replace(folder, aside)
        log.warning(
            "StoreWriter: %s was moved to %s (%s): two runs never mix in one store "
            "(a run resumed from a checkpoint, whose steps go on or replay some, appends)",
            folder,
            aside,
            why,
        )
    folder.mkdir(parents=True, exist_ok=True)
    run = uuid.uuid4().hex
    tmp = tmp_path(folder, RUN_FILE)
    tmp.write_text(json.dumps({"run_id": run, "store_version": STORE_VERSION}) + "\n")
    os.replace(tmp, folder / RUN_FILE)
    return run


def trim(folder: Path, step: int) -> None:
    """Remove the steps from ``step`` on from every table of the store ``folder``: the
    segments beyond are removed, one that straddles ``step`` is rewritten without them
    (its rank windows recomputed from the ranks rows kept). Safe to kill at any moment:
    the shorter copy is renamed into place before the segment it comes from is removed
    (readers skip a segment inside another), and the next writer trims again."""
    run = run_id(folder)
    for table in ("rank_windows", "steps", "ranks"):  # windows first: from the ranks rows
        while beyond := [s for s in list_segments(folder, table) if s.last >= step]:
            for segment in beyond:  # (a segment that was inside one of them is listed next)
                if segment.first < step:
                    _rewrite_before(folder, segment, step, run)
                segment.path.unlink(missing_ok=True)


def _rewrite_before(folder: Path, segment, step: int, run: str) -> None:
    """Write ``segment``'s rows of steps before ``step`` as a segment of their own."""
    tmp = tmp_path(folder, f"{segment.table}-{segment.first}-trim")
    writer = parquet_writer(tmp, segment.table, run)
    last = None
    for part in _rows_before(folder, segment, step):
        if part.num_rows:
            writer.write_table(part.cast(TABLES[segment.table]), ROW_GROUP_ROWS)
            column = part["last_step" if segment.table == "rank_windows" else "step"]
            last = max(last if last is not None else column[0].as_py(), pc.max(column).as_py())
    writer.close()
    if last is None:  # nothing before the step in it
        tmp.unlink()
        return
    os.replace(tmp, folder / segment_name(segment.table, segment.first, last))


def _rows_before(folder: Path, segment, step: int):
    """``segment``'s rows of steps before ``step``, by row group; of ``rank_windows``,
    the rows of windows that end before it, and a window that straddles it recomputed."""
    parquet = pq.ParquetFile(segment.path)
    if segment.table != "rank_windows":
        for g in range(parquet.metadata.num_row_groups):
            part = conformed(parquet.read_row_group(g), segment.table)
            yield part.filter(pc.less(part["step"], step))
        return
    windows = conformed(parquet.read(), segment.table)
    yield windows.filter(pc.less(windows["last_step"], step))
    straddling = windows.filter(pc.and_(pc.less(windows["first_step"], step),
                                        pc.greater_equal(windows["last_step"], step)))  # fmt: skip
    for first in sorted(set(straddling["first_step"].to_pylist())):
        ranks = _ranks_rows(folder, first, step - 1)
        if ranks.num_rows:
            last = pc.max(ranks["step"]).as_py()
            yield window_rows(first, last, *window_figures(ranks))


def _ranks_rows(folder: Path, first: int, last: int) -> pa.Table:
    """The ``ranks`` rows of steps ``first..last`` (a store of any folder name)."""
    wanted = [("step", ">=", first), ("step", "<=", last)]
    parts = [conformed(pq.read_table(s.path, filters=wanted), "ranks")
             for s in list_segments(folder, "ranks") if s.overlaps(first, last)]  # fmt: skip
    return pa.concat_tables(parts) if parts else TABLES["ranks"].empty_table()


def _free_aside(folder: Path) -> Path:
    """``folder`` with the first of ``.1``, ``.2``, ... not taken: an earlier store moved
    aside is never deleted (a run resumed twice from a checkpoint keeps both)."""
    index = 1
    while folder.with_name(f"{folder.name}.{index}").exists():
        index += 1
    return folder.with_name(f"{folder.name}.{index}")


def write_segment(
    folder: Path, table: str, first: int, last: int, rows: pa.Table, run: str
) -> Path:
    """Write ``rows`` as ``table``'s segment of steps ``first..last`` (atomically)."""
    tmp = tmp_path(folder, segment_name(table, first, last))
    writer = parquet_writer(tmp, table, run)
    writer.write_table(rows.cast(TABLES[table]), ROW_GROUP_ROWS)
    writer.close()
    final = folder / segment_name(table, first, last)
    os.replace(tmp, final)
    return final


def compact(folder: Path, table: str, count: int, small: int) -> None:
    """Merge the oldest run of ``count`` consecutive segments of ``table`` of at most
    ``small`` steps each into one (the module doc): the merged file is renamed into place
    before the small ones are removed, and readers skip a segment inside another."""
    segments = list_segments(folder, table)
    batch: list = []
    for seg in segments[:-1]:  # the newest is left alone: it is seconds old
        batch = [*batch, seg] if seg.last - seg.first < small else []
        if len(batch) == count:
            break
    if len(batch) < count:
        return
    first, last = batch[0].first, batch[-1].last
    tmp = tmp_path(folder, segment_name(table, first, last))
    writer = parquet_writer(tmp, table, run_id(folder))
    for seg in batch:
        parquet = pq.ParquetFile(seg.path)
        for g in range(parquet.metadata.num_row_groups):
            part = conformed(parquet.read_row_group(g), table)
            writer.write_table(part.cast(TABLES[table]), ROW_GROUP_ROWS)
    writer.close()
    os.replace(tmp, folder / segment_name(table, first, last))
    for seg in batch:
        with contextlib.suppress(FileNotFoundError):
            seg.path.unlink()


def parquet_writer(path: Path, table: str, run: str) -> pq.ParquetWriter:
    """A Parquet writer of ``table``'s segments: its schema with the store's metadata,
    zstd; floats split by byte stream (their zero low bytes then compress away)."""
    schema = TABLES[table].with_metadata(
        {META_SCHEMA: str(STORE_VERSION).encode(), META_RUN: run.encode(), META_TABLE: table}
    )
    floats = [f.name for f in schema if pa.types.is_floating(f.type)]
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=3,
        use_dictionary=[f.name for f in schema if not pa.types.is_floating(f.type)],
        use_byte_stream_split=floats,
        write_statistics=True,
    )


def remove_stores(run: str | os.PathLike) -> list[Path]:
    """Remove the stores an earlier recording in the folder ``run`` left (``store``,
    ``store.group<k>`` and their ``.1``, ``.2``... copies): a run that restarts its steps starts
    fresh. Returns what was removed."""
    pattern = re.compile(rf"{STORE_FOLDER}(\.group\d+)?(\.\d+)?")
    folder = Path(run)
    found = [p for p in folder.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]
    for path in found:
        shutil.rmtree(path)
    return found


def tmp_path(folder: Path, name: str) -> Path:
    return folder / f".{name}.{os.getpid()}.tmp"


def _remove_temporary(folder: Path) -> None:
    """Remove what a killed writer left half-written (never listed by readers)."""
    for path in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            path.unlink()
