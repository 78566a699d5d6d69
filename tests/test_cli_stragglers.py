"""``knapformer stragglers``, run as a real console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.contract.plan_io import write_jsonl
from knapformer.contract.runfiles import plans_file
from knapformer.testing.measured_plans import measured_run

EXE = shutil.which("knapformer") or str(Path(sys.executable).parent / "knapformer")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    """A run folder whose rank 6 computes 1.8x as long as the plan predicts."""
    folder = tmp_path_factory.mktemp("slow") / "run"
    folder.mkdir()
    write_jsonl(plans_file(folder), measured_run(12, slow_rank=6, slow_factor=1.8, seed=3))
    return folder


def test_json_names_the_slow_rank_and_no_other(slow_run):
    done = run("stragglers", str(plans_file(slow_run)), "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["rank"] for r in rows] == list(range(8))
    assert {r["rank"]: r["verdict"] for r in rows if r["verdict"] != "ok"} == {6: "slow_gpu"}
    slow = rows[6]
    assert slow["ratio"] == pytest.approx(1.8, rel=0.15)
    assert slow["steps"] == 12 and slow["last_arrivals"] >= 10


def test_a_run_folder_is_accepted_and_the_table_says_why(slow_run):
    done = run("stragglers", str(slow_run))
    assert done.returncode == 0, done.stderr
    assert "slow_gpu: rank 6" in done.stdout
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.startswith("│")]
    assert [int(r[0]) for r in rows] == list(range(8))
    assert [r[1].strip() for r in rows].count("slow_gpu") == 1
    # a folder of several runs is a one-line error naming them
    other = slow_run.parent / "other"
    other.mkdir()
    shutil.copy(plans_file(slow_run), plans_file(other))
    done = run("stragglers", str(slow_run.parent))
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "other, run" in done.stderr
    assert "Traceback" not in done.stderr


def test_window_limits_the_steps(slow_run, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    write_jsonl(mixed, measured_run(8, slow_rank=2, slow_factor=2.0, seed=4))
    write_jsonl(mixed, measured_run(5, seed=5), append=True)
    rows = json.loads(run("stragglers", str(mixed), "--json", "--window", "5").stdout)
    assert all(r["verdict"] == "ok" and r["steps"] == 5 for r in rows)
    rows = json.loads(run("stragglers", str(mixed), "--json", "--window", "0").stdout)
    assert {r["rank"] for r in rows if r["verdict"] == "slow_gpu"} == {2}


def test_plans_without_measurements_are_one_line(steps50_path):
    done = run("stragglers", str(steps50_path))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "measured a compute phase" in done.stderr


def test_skipped_records_are_counted_on_stderr_and_json_stays_one_document(slow_run, tmp_path):
    lines = plans_file(slow_run).read_text().splitlines()
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join([lines[0], "{not json", *lines[1:], '{"schema_version": 2}']) + "\n")
    done = run("stragglers", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 8
    assert done.stderr.startswith("skipped 2 unreadable record(s) (first: ")
    assert done.stderr.count("\n") == 1 and ":2" in done.stderr
