"""Reading the run store: windows, projections, folders, compaction in progress, and the
bench run tiny (its figures are shown in docs/performance.md, never asserted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.contract.run_store import (
    StoreError,
    list_segments,
    read_table,
    store_folder,
)
from knapformer.runtime.store_files import compact
from knapformer.runtime.store_writer import StoreWriter
from knapformer.testing.measured_plans import measured_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder whose store holds 10 steps of 8 GPUs in segments of 2."""
    folder = tmp_path_factory.mktemp("run")
    with StoreWriter(store_folder(folder), segment_steps=2, compact=0) as writer:
        for plan in measured_run(10, seed=3):
            writer.put(plan)
    return folder


def test_the_store_of_a_run_folder_a_plans_file_and_a_groups_file():
    assert store_folder("runs/a/plans.jsonl") == Path("runs/a/store")
    assert store_folder("runs/a/plans.group3.jsonl") == Path("runs/a/store.group3")
    # plans files of other names, e.g. a {group} template: never one store for two
    assert store_folder("runs/a/balance.jsonl") == Path("runs/a/store.balance")
    assert store_folder("runs/a/balance.group1.jsonl") == Path("runs/a/store.balance.group1")
    assert store_folder("runs/a/g3.jsonl") != store_folder("runs/a/g4.jsonl")


def test_the_loss_columns_are_the_diagnosis_parts():
    from knapformer.contract.store_schema import LOSS_PARTS
    from knapformer.diagnosis.step_loss import PARTS

    assert LOSS_PARTS == PARTS


def test_tables_and_columns_are_checked_by_name(run):
    with pytest.raises(StoreError, match="no table 'rank'"):
        read_table(run, "rank")
    with pytest.raises(StoreError, match="no column rates"):
        read_table(run, "ranks", columns=["step", "rates"])


def test_a_merged_segment_and_the_ones_it_replaces_give_each_row_once(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    store = store_folder(copy)
    small = list_segments(store, "ranks")[:3]
    kept = {s.path.name: s.path.read_bytes() for s in small}
    compact(store, "ranks", 3, small=2)
    for name, data in kept.items():  # as a reader sees it mid-compaction
        (store / name).write_bytes(data)
    assert len(list_segments(store, "ranks")) == 3  # the merged one and 2 later ones
    assert read_table(copy, "ranks", columns=["step"])["step"].to_pylist() == [
        s for s in range(10) for _ in range(8)
    ]


def test_a_window_inside_a_segment_is_its_rows_and_only_them(run):
    # segments of 2 steps: steps 3..6 take the second of one, two whole ones, the first
    # of another (sliced from each sorted segment)
    window = read_table(run, "ranks", (3, 6), ["step", "rank"])
    assert window["step"].to_pylist() == [s for s in range(3, 7) for _ in range(8)]
    assert window["rank"].to_pylist() == list(range(8)) * 4
    assert read_table(run, "ranks", (10, 12), ["step"]).num_rows == 0


def test_columns_come_as_numpy_gives_them():
    import numpy as np
    import pyarrow as pa

    from knapformer.contract.run_store import as_numpy

    cases = [
        pa.chunked_array([pa.array([1, 2, 3], pa.int32()), pa.array([4, 5], pa.int32()).slice(1)]),
        pa.chunked_array([pa.array([1.5, None, 3], pa.float32()), pa.array([None], pa.float32())]),
        pa.chunked_array([pa.array([1, None], pa.int32()), pa.array([7], pa.int32())]),
        pa.chunked_array([pa.array([1, 2], pa.int64())]).slice(1),
        pa.chunked_array([], pa.float32()),
        pa.array([None] * 20 + [1.0] * 5, pa.float32()).slice(13, 9),
        pa.chunked_array([pa.array([None, None], pa.float32())]),
    ]
    for column in cases:
        got, expected = as_numpy(column), column.to_numpy(zero_copy_only=False)
        assert got.dtype == expected.dtype, column
        assert np.array_equal(got, expected, equal_nan=True), column


def test_the_straggler_window_never_imports_pandas(run):
    # pyarrow's to_numpy imports pandas on first use: 0.4 s of a reader's first window
    code = (
        "import sys; from knapformer.diagnosis.store_source import window_rows; "
        "from knapformer.diagnosis.store_window import window_figures; "
        "from knapformer.diagnosis.stragglers import judge; "
        f"w = window_figures(window_rows({str(run)!r}, 2, 8)); judge(w.m, w.scopes, w.bandwidth); "
        "assert w.m.steps == list(range(2, 9)); print('pandas' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_bench_runs_tiny_and_prints_its_table():
    args = ["--steps", "300", "--gpus", "16", "--big-gpus", "32", "--plan-steps", "4",
            "--big-steps", "2", "--record-calls", "4", "--skip-duckdb-ranks"]  # fmt: skip
    command = [sys.executable, str(ROOT / "bench" / "run_store.py"), *args]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode in (0, 1), done.stderr  # a miss on a busy machine is not a bug
    out = done.stdout
    assert "bytes per rank-step" in out and "10,000 GPUs" in out, out
    assert out.count("PASS: ") + out.count("FAIL: ") == 7
    assert "step loss (its window fit)" in out and "grid / every pair" in out, out
