"""Hostile run stores for tests: copies of a good run, each damaged one way a disk, a
careless copy or a hostile file damages a store (every reader must answer one line).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from knapformer.contract.run_store import list_segments, run_id, store_folder
from knapformer.contract.store_schema import META_RUN, META_SCHEMA, META_TABLE, TABLES

#: Bytes of the hostile ``partition`` text of the huge-column case: far more than a
#: column of a few rows may hold (the check refuses it by the file's metadata, before
#: reading; a real 2 GB one is refused the same way).
HUGE_BYTES = 8 << 20


def _first(run: Path, table: str) -> Path:
    return list_segments(store_folder(run), table)[0].path


def _rewrite(path: Path, table: pa.Table, run: str, name: str | None = None) -> None:
    meta = {META_SCHEMA: b"1", META_RUN: run.encode(), META_TABLE: (name or "steps").encode()}
    pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")


def _truncated(run: Path) -> None:
    path = _first(run, "ranks")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_schema(run: Path) -> None:
    path = _first(run, "steps")
    table = pq.read_table(path)
    index = table.schema.get_field_index("imbalance_after")
    text = pa.array([str(v) for v in table["imbalance_after"].to_pylist()])
    _rewrite(path, table.set_column(index, "imbalance_after", text), run_id(store_folder(run)))


def _another_run(run: Path) -> None:
    path = _first(run, "steps")
    _rewrite(path, pq.read_table(path), "f" * 32)


def _huge_column(run: Path) -> None:
    path = _first(run, "steps")
    table = pq.read_table(path).slice(0, 1)
    index = table.schema.get_field_index("partition")
    huge = pa.array(["g" * HUGE_BYTES], pa.string())
    _rewrite(path, table.set_column(index, "partition", huge), run_id(store_folder(run)))


def _not_parquet(run: Path) -> None:
    _first(run, "rank_windows").write_bytes(b'{"step": 1}\n' * 100)


def _bad_run_file(run: Path) -> None:
    (store_folder(run) / "run.json").write_bytes(b"\x00\xff not json")


def _steps_outside_its_name(run: Path) -> None:
    path = _first(run, "steps")
    last = list_segments(store_folder(run), "steps")[0].last
    path.rename(path.with_name(f"steps-0-{max(last - 1, 0)}.parquet"))


#: Each hostile case by name: what it does to a copy of a good run.
CASES: dict[str, Callable[[Path], None]] = {
    "truncated segment": _truncated,
    "wrong schema": _wrong_schema,
    "segment of another run": _another_run,
    "huge column": _huge_column,
    "not parquet": _not_parquet,
    "bad run.json": _bad_run_file,
    "steps outside its name": _steps_outside_its_name,
}


def hostile_copy(good: Path, dest: Path, case: str) -> Path:
    """A copy of the run folder ``good`` at ``dest`` damaged as `CASES` ``case`` says."""
    shutil.copytree(good, dest)
    CASES[case](dest)
    return dest


def flipped_copy(good: Path, dest: Path, rng: random.Random) -> Path:
    """A copy of ``good`` with one segment damaged at random: cut short, or a few bytes
    overwritten (in its footer, where Parquet keeps its metadata, or anywhere)."""
    shutil.copytree(good, dest)
    table = rng.choice(list(TABLES))
    path = rng.choice(list_segments(store_folder(dest), table)).path
    data = bytearray(path.read_bytes())
    if rng.random() < 0.3:
        del data[rng.randrange(len(data)) :]
    else:
        tail = rng.random() < 0.6
        for _ in range(rng.randint(1, 8)):
            at = (
                rng.randrange(max(len(data) - 2048, 0), len(data))
                if tail
                else rng.randrange(len(data))
            )
            data[at] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return dest
