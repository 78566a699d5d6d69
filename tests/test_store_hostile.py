"""Hostile run stores: every reader of the store answers one line and exit 1 (the
library: one `StoreError`), never a traceback, never reading a hostile column."""

from __future__ import annotations

import contextlib
import io

import psutil
import pytest

from knapformer.cli import main
from knapformer.contract.run_store import StoreError, read_table
from knapformer.contract.store_schema import TABLES
from knapformer.runtime.recorder import PlanRecorder
from knapformer.testing.hostile_stores import CASES, HUGE_BYTES, hostile_copy
from knapformer.testing.measured_plans import measured_run


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A recorded run of 12 steps in 3 segments (each table)."""
    run = tmp_path_factory.mktemp("good") / "run"
    with PlanRecorder(run / "plans.jsonl", every=4, store_segment_steps=4) as rec:
        for plan in measured_run(12, seed=5):
            rec.record(plan)
    return run


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def test_the_good_run_reads(good_run):
    assert {t: read_table(good_run, t).num_rows for t in TABLES} == {
        "ranks": 96, "steps": 12, "rank_windows": 24,
    }  # fmt: skip
    assert run_cli("query", str(good_run), "SELECT count(*) FROM ranks")[0] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_store_is_one_line_and_exit_1(tmp_path, good_run, case):
    run = hostile_copy(good_run, tmp_path / "run", case)
    memory = psutil.Process().memory_info().rss
    failures = []
    for table in TABLES:
        try:
            read_table(run, table)
        except StoreError as err:
            failures.append(str(err))
    assert failures, case  # at least the damaged table is refused
    assert all("\n" not in m and len(m) < 400 for m in failures), failures
    code, text = run_cli("query", str(run), "SELECT count(*) FROM steps")
    assert code == 1, text
    assert text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text
    # the huge column was refused by the file's metadata, before any of it was read
    assert psutil.Process().memory_info().rss - memory < HUGE_BYTES


def test_a_missing_run_and_a_folder_without_store_are_one_line(tmp_path):
    code, text = run_cli("query", str(tmp_path / "nothing"), "SELECT 1")
    assert (code, text.strip()) == (1, f"error: {tmp_path / 'nothing'}: no such file or folder")
    code, text = run_cli("query", str(tmp_path), "SELECT 1")
    assert code == 1 and "no run store" in text and text.count("\n") == 1


def test_bad_sql_is_one_line(good_run):
    code, text = run_cli("query", str(good_run), "SELEC step FROM steps")
    assert code == 1 and text.startswith("error: query: Parser Error") and text.count("\n") == 1
