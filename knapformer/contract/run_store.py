"""Reading a run store: its segments, a table over a window of steps, and their checks.

A run's store is the folder ``<run>/store/`` (`store_folder`) holding ``run.json`` (the
run's id) and Parquet segments named ``<table>-<first step>-<last step>.parquet``, each
closed whole by the writer (written under a temporary name, then renamed): a reader never
sees a half-written segment. The tables and their columns are `knapformer.contract.
store_schema`'s.

Every segment is checked before it is read (`check_segment`): Parquet that opens, the
table's columns with their types, this store's version and run id, steps inside the
range its name gives, and no column larger than its rows can hold (a hostile 2 GB
column is refused before it is read). A segment that fails raises `StoreError`, one line
naming the file and what is wrong; the command line prints it and exits 1.

While the writer compacts old segments, a merged segment and the ones it replaces may
both exist for a moment: a segment whose steps lie inside another's is skipped.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from knapformer.contract.runfiles import PLANS_FILE
from knapformer.contract.store_schema import (
    LATER_COLUMNS,
    META_RUN,
    META_SCHEMA,
    META_TABLE,
    RUN_FILE,
    STEP_COLUMN,
    STORE_FOLDER,
    STORE_VERSION,
    TABLES,
)
from knapformer.errors import KnapformerError

_SEGMENT = re.compile(r"(?P<table>[a-z_]+)-(?P<first>\d{1,19})-(?P<last>\d{1,19})\.parquet")
#: Most bytes a value of a column may take uncompressed, on average over a column chunk
#: (strings: a partition, or the bag runs of an auto plan at 16,384 GPUs, ~12 bytes a bag).
_MAX_VALUE_BYTES = 256 << 10
_MAX_RUN_FILE = 64 << 10


class StoreError(KnapformerError):
    """A run store, or one of its segments, that cannot be read (one line: which and why)."""


class SegmentGone(StoreError):
    """A listed segment was removed before it was read (the writer compacted it)."""


@dataclass(frozen=True, order=True)
class Segment:
    """One segment file of a table: its steps ``first..last`` (inclusive)."""

    first: int
    last: int
    table: str
    path: Path

    def overlaps(self, first: int | None, last: int | None) -> bool:
        return (first is None or self.last >= first) and (last is None or self.first <= last)


def store_folder(run: str | os.PathLike) -> Path:
    """The store of ``run``: a run folder, its ``plans.jsonl`` (group k's
    ``plans.group<k>.jsonl`` has ``store.group<k>``) or the store folder itself. A plans
    file of another name has a store named after it (``g3.jsonl``: ``store.g3``), so that
    two recordings in one folder never share a store."""
    path = Path(run)
    if path.name.startswith(STORE_FOLDER) and (path / RUN_FILE).is_file():
        return path
    if path.is_dir():
        return path / STORE_FOLDER
    plans = Path(PLANS_FILE).stem
    suffix = path.stem.removeprefix(plans) if path.stem.startswith(plans) else "." + path.stem
    return path.with_name(STORE_FOLDER + suffix)


def existing_store(run: str | os.PathLike) -> Path:
    """`store_folder` of ``run`` once it is one (`StoreError` naming ``run`` otherwise)."""
    if not os.path.exists(run):
        raise StoreError(f"{run}: no such file or folder")
    store = store_folder(run)
    if not (store / RUN_FILE).is_file():
        raise StoreError(f"{run}: no run store ({store} has no {RUN_FILE})")
    return store


def has_store(run: str | os.PathLike) -> bool:
    """Whether ``run`` has a store (its folder with ``run.json``)."""
    return (store_folder(run) / RUN_FILE).is_file()


def run_id(store: str | os.PathLike) -> str:
    """The id of the run a store belongs to (its ``run.json``)."""
    path = Path(store) / RUN_FILE
    try:
        with open(path, "rb") as handle:
            text = handle.read(_MAX_RUN_FILE + 1)
    except FileNotFoundError:
        raise StoreError(f"{store}: not a run store (no {RUN_FILE})") from None
    except OSError as err:
        raise StoreError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        value = json.loads(text) if len(text) <= _MAX_RUN_FILE else None
        run = value.get("run_id") if isinstance(value, dict) else None
    except ValueError:
        run = None
    if not isinstance(run, str) or not run:
        raise StoreError(f"{path}: not a run store's {RUN_FILE} (no run_id)")
    return run


def segment_name(table: str, first: int, last: int) -> str:
    """The file name of ``table``'s segment of steps ``first..last``."""
    return f"{table}-{first}-{last}.parquet"


def list_segments(store: str | os.PathLike, table: str) -> list[Segment]:
    """``table``'s segments in ``store``, by first step; those inside another are left out
    (a compaction in progress). Temporary files of the writer are never listed."""
    _check_table(table)
    try:
        names = os.listdir(store)
    except FileNotFoundError:
        raise StoreError(f"{store}: not a run store (no such folder)") from None
    except OSError as err:
        raise StoreError(f"{store}: cannot read: {err.strerror or err}") from None
    found = []
    for name in names:
        match = _SEGMENT.fullmatch(name)
        if match and match["table"] == table:
            first, last = int(match["first"]), int(match["last"])
            if first <= last:
                found.append(Segment(first, last, table, Path(store) / name))
    found.sort(key=lambda s: (s.first, -s.last))
    kept: list[Segment] = []
    for seg in found:
        if kept and seg.last <= kept[-1].last:
            continue  # inside the merged segment before it
        kept.append(seg)
    return kept


def check_segment(segment: Segment, run: str) -> pq.ParquetFile:
    """``segment`` opened once it is a readable segment of ``run``'s table (the module
    doc); else `StoreError`."""
    where = segment.path
    try:
        parquet = pq.ParquetFile(where)
        meta = parquet.metadata
        schema = parquet.schema_arrow
    except FileNotFoundError:
        raise SegmentGone(f"{where}: removed while reading (compacted)") from None
    except (OSError, pa.ArrowException) as err:
        what = f"not a readable segment (truncated or not Parquet: {one_line(err)})"
        raise StoreError(f"{where}: {what}") from None
    kv = schema.metadata or {}
    if kv.get(META_SCHEMA) != str(STORE_VERSION).encode():
        found = kv.get(META_SCHEMA, b"none").decode(errors="replace")[:20]
        raise StoreError(f"{where}: store version {found}, this reader reads {STORE_VERSION}")
    if kv.get(META_TABLE) != segment.table.encode():
        raise StoreError(f"{where}: holds another table than its name says ({segment.table})")
    if kv.get(META_RUN) != run.encode():
        other = kv.get(META_RUN, b"none").decode(errors="replace")[:40]
        raise StoreError(f"{where}: a segment of another run ({other}, this store is {run})")
    _check_columns(where, schema, segment.table)
    _check_sizes(where, meta)
    _check_steps(segment, parquet)
    return parquet


def read_table(
    run: str | os.PathLike,
    table: str,
    steps: tuple[int | None, int | None] | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """``table`` of ``run``'s store (a run folder, its plans file or the store), its rows
    of steps ``first..last`` (inclusive; None: open-ended) and only ``columns`` (default:
    all), every segment checked (`check_segment`). Ordered by step."""
    _check_table(table)
    store = existing_store(run)
    run_name = run_id(store)
    wanted = None if columns is None else list(dict.fromkeys(columns))
    if wanted is not None:
        unknown = [c for c in wanted if c not in TABLES[table].names]
        if unknown:
            raise StoreError(f"table {table} has no column {', '.join(unknown)}")
    full = TABLES[table]
    schema = full if wanted is None else pa.schema([full.field(c) for c in wanted])
    for _ in range(3):  # a compaction may remove listed segments: list again
        try:
            parts = _read_parts(store, run_name, table, steps or (None, None), wanted)
        except SegmentGone:
            continue
        if not parts:
            return schema.empty_table()
        return pa.concat_tables([p.cast(schema) for p in parts])
    raise StoreError(f"{store}: segments kept changing while reading (compaction)")


def _read_parts(
    store: Path,
    run_name: str,
    table: str,
    steps: tuple[int | None, int | None],
    wanted: list[str] | None,
) -> list[pa.Table]:
    first, last = steps
    key = STEP_COLUMN[table]
    names = TABLES[table].names if wanted is None else wanted
    read = names if key in names else [*names, key]
    parts = []
    for seg in list_segments(store, table):
        if not seg.overlaps(first, last):
            continue
        parquet = check_segment(seg, run_name)
        if (first is not None and seg.first < first) or (last is not None and seg.last > last):
            part = _read(parquet, seg, read, _row_groups(parquet, key, first, last))
            part = _in_window(part, key, first, last)
        else:
            part = _read(parquet, seg, read)
        parts.append(part if read == names else part.select(names))
    return parts


def _row_groups(
    parquet: pq.ParquetFile, key: str, first: int | None, last: int | None
) -> list[int]:
    """The row groups of ``parquet`` whose steps (by their statistics) meet the window: a
    1,000-step window of a compacted 16,000-step segment reads 1/16 of it."""
    meta, index = parquet.metadata, parquet.schema_arrow.get_field_index(key)
    kept = []
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index).statistics
        known = stats is not None and stats.has_min_max
        before = known and first is not None and stats.max < first
        if not (before or (known and last is not None and stats.min > last)):
            kept.append(g)
    return kept


def _read(
    parquet: pq.ParquetFile, seg: Segment, columns: list[str], groups: list | None = None
) -> pa.Table:
    """``columns`` of the segment (of ``groups`` only, when given); a `LATER_COLUMNS`
    column the segment's writer did not know reads as null."""
    present = [c for c in columns if parquet.schema_arrow.get_field_index(c) >= 0]
    try:
        if groups is not None:
            part = parquet.read_row_groups(groups, columns=present)
        else:
            part = parquet.read(columns=present)
    except FileNotFoundError:
        raise SegmentGone(f"{seg.path}: removed while reading (compacted)") from None
    except (OSError, pa.ArrowException) as err:
        raise StoreError(f"{seg.path}: not a readable segment (damaged: {one_line(err)})") from None
    return conformed(part, seg.table, columns)


def conformed(part: pa.Table, table: str, columns: list[str] | None = None) -> pa.Table:
    """``columns`` (default: all) of rows of ``table`` read from one segment, in order, a
    `LATER_COLUMNS` column that the segment's writer did not know as null."""
    schema = TABLES[table]
    columns = schema.names if columns is None else columns
    for name in columns:
        if part.schema.get_field_index(name) < 0:
            field = schema.field(name)
            part = part.append_column(field, pa.nulls(part.num_rows, field.type))
    return part.select(columns)


def one_line(err: object) -> str:
    """An error (Arrow's, DuckDB's) as a short printable phrase: they quote the damaged
    bytes, newlines included."""
    text = "".join(c if c.isprintable() else " " for c in str(err))
    text = " ".join(text.split())
    return (text[:160] + "…" if len(text) > 160 else text) or type(err).__name__


def _in_window(part: pa.Table, key: str, first: int | None, last: int | None) -> pa.Table:
    """The rows of ``part`` whose ``key`` is in ``first..last``: a zero-copy slice when the
    steps are in order (the writer's order: a filter copied every column of the window),
    else a filter."""
    values = part[key]
    if values.null_count == 0:
        steps = as_numpy(values)
        if len(steps) < 2 or bool((steps[1:] >= steps[:-1]).all()):
            lo = 0 if first is None else int(np.searchsorted(steps, first, side="left"))
            hi = len(steps) if last is None else int(np.searchsorted(steps, last, side="right"))
            return part.slice(lo, max(hi - lo, 0))
    return part.filter(_window(values, first, last))


#: numpy's type of each fixed-width Arrow type a store's column may have.
_NUMPY_TYPES = {
    pa.int32(): np.dtype(np.int32),
    pa.int64(): np.dtype(np.int64),
    pa.float32(): np.dtype(np.float32),
    pa.float64(): np.dtype(np.float64),
}


def as_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A numeric column as numpy, as ``to_numpy(zero_copy_only=False)`` gives it (nulls as
    NaN; an integer column with nulls as float64), read from its buffers: pyarrow's
    ``to_numpy`` imports pandas on its first call, 0.4 s of a reader's first window."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if column.type not in _NUMPY_TYPES:
        return column.to_numpy(zero_copy_only=False)
    nulls = any(chunk.null_count for chunk in chunks)
    parts = [_chunk_values(c, nulls) for c in chunks if len(c)]
    if not parts:
        return np.zeros(0, _NUMPY_TYPES[column.type])
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _chunk_values(chunk: pa.Array, nulls: bool) -> np.ndarray:
    """One chunk's values (`as_numpy`); with ``nulls`` (in any chunk) as floats, NaN where
    its validity bitmap says null."""
    dtype = _NUMPY_TYPES[chunk.type]
    validity, data = chunk.buffers()[:2]
    values = np.frombuffer(data, dtype, len(chunk), chunk.offset * dtype.itemsize)
    if not nulls:
        return values
    values = values.astype(dtype if dtype.kind == "f" else np.float64)  # a copy
    if chunk.null_count == len(chunk):
        values[:] = np.nan
    elif chunk.null_count:
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
        values[bits[chunk.offset : chunk.offset + len(chunk)] == 0] = np.nan
    return values


def _window(values: pa.ChunkedArray, first: int | None, last: int | None) -> pa.ChunkedArray:
    keep = pc.greater_equal(values, first) if first is not None else None
    if last is not None:
        below = pc.less_equal(values, last)
        keep = below if keep is None else pc.and_(keep, below)
    return keep


def _check_table(table: str) -> None:
    if table not in TABLES:
        raise StoreError(f"no table {table!r} in a run store (tables: {', '.join(TABLES)})")


def _check_columns(where: Path, found: pa.Schema, table: str) -> None:
    """Every column of ``table`` with its type (a newer writer may add columns; an older
    one lacks the `LATER_COLUMNS`)."""
    later = LATER_COLUMNS.get(table, frozenset())
    for field in TABLES[table]:
        index = found.get_field_index(field.name)
        if index < 0 and field.name in later:
            continue
        if index < 0:
            raise StoreError(f"{where}: wrong schema: no column {field.name!r}")
        if found.field(index).type != field.type:
            raise StoreError(
                f"{where}: wrong schema: column {field.name!r} is {found.field(index).type}, "
                f"expected {field.type}"
            )


def _check_steps(segment: Segment, parquet: pq.ParquetFile) -> None:
    """Every row group's steps (by its statistics) inside the range the name gives."""
    meta = parquet.metadata
    index = parquet.schema_arrow.get_field_index(STEP_COLUMN[segment.table])
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index).statistics
        if stats is None or not stats.has_min_max:
            continue
        if stats.min < segment.first or stats.max > segment.last:
            raise StoreError(
                f"{segment.path}: holds steps {stats.min}..{stats.max}, outside the "
                f"{segment.first}..{segment.last} of its name"
            )


def _check_sizes(where: Path, meta: pq.FileMetaData) -> None:
    """No column chunk larger than its rows can hold (`_MAX_VALUE_BYTES` a value)."""
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        limit = (group.num_rows + 1) * _MAX_VALUE_BYTES
        for c in range(group.num_columns):
            column = group.column(c)
            if max(column.total_uncompressed_size, column.total_compressed_size) > limit:
                raise StoreError(
                    f"{where}: column {column.path_in_schema!r} holds "
                    f"{column.total_uncompressed_size:,} bytes for {group.num_rows:,} rows "
                    "(too large to be a store's: refused before reading)"
                )
