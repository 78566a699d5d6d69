"""What a plan file, the machine or the arguments can do to the command line: a plan never
makes a writer leave its folder, an export never breaks a run folder, a file that mixes
runs is reported, and I/O errors, over-long names, huge numbers and bytes that are not
UTF-8 end in one ``error:`` line, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import knapformer.contract.plan_io as plan_io
from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.contract.runfiles import plans_file

EXE = shutil.which("knapformer") or str(Path(sys.executable).parent / "knapformer")
ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "sample_plans" / "demo.jsonl"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------- plan content never a path
@pytest.mark.parametrize("run", ["../../ESCAPED", "/ABSOLUTE", "..", "a/../../b"])
def test_a_plan_cannot_make_tensorboard_write_outside_its_logdir(tmp_path, capsys, run):
    pytest.importorskip("tensorboard")
    plans = read_plans(DEMO).plans[:2]
    if run.startswith("/"):
        run = str(tmp_path / "ABSOLUTE")
    source = tmp_path / "a" / "b" / "p.jsonl"
    source.parent.mkdir(parents=True)
    write_jsonl(source, [p.model_copy(update={"run": run}) for p in plans])
    logdir = tmp_path / "a" / "b" / "logs"
    assert main(["tensorboard", str(source), "--logdir", str(logdir)]) == 0
    written = files_under(tmp_path) - {source}
    assert written and all(logdir in p.parents for p in written), written
    # One folder per run, directly in the logdir.
    assert {p.parent.parent for p in written} == {logdir}


def test_two_runs_whose_safe_names_collide_keep_their_own_folders(tmp_path):
    pytest.importorskip("tensorboard")
    plans = read_plans(DEMO).plans[:1]
    for folder in ("a b", "a_b"):
        (tmp_path / "runs" / folder).mkdir(parents=True)
        write_jsonl(plans_file(tmp_path / "runs" / folder), plans)
    logdir = tmp_path / "logs"
    assert main(["tensorboard", str(tmp_path / "runs"), "--logdir", str(logdir)]) == 0
    assert sorted(p.name for p in logdir.iterdir()) == ["a_b", "a_b-2"]


# ------------------------------------------------ exports beside a run, other JSON
@pytest.fixture
def job(tmp_path) -> Path:
    folder = tmp_path / "runs" / "job"
    folder.mkdir(parents=True)
    shutil.copy(DEMO, plans_file(folder))
    return folder


def test_an_export_written_into_a_run_folder_leaves_it_one_run(job, tmp_path, capsys):
    assert main(["trace", str(job), "-o", str(job / "trace.json")]) == 0
    (job / "figures.json").write_text(json.dumps({"data": [], "layout": {}}))
    capsys.readouterr()
    assert main(["stragglers", str(job)]) == 0
    assert main(["show", str(job)]) == 0
    assert main(["report", str(job), "-o", str(tmp_path / "r.html")]) == 0
    assert main(["validate", str(job)]) == 0
    if shutil.which("tensorboard") or _has("tensorboard"):
        assert main(["tensorboard", str(job), "--logdir", str(tmp_path / "tb")]) == 0
    captured = capsys.readouterr()
    assert "holds 2 runs" not in captured.err and "skipped" not in captured.err


def test_a_folder_of_runs_ignores_json_that_is_not_plans(job, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    runs = job.parent
    (runs / "figures.json").write_text(json.dumps({"data": [{"type": "bar"}]}))
    (runs / "trace.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["tensorboard", str(runs), "--logdir", str(tmp_path / "tb")]) == 0
    captured = capsys.readouterr()
    assert "skipped" not in captured.err
    assert "in 1 run" in captured.out


def test_a_run_without_a_single_plan_is_skipped_and_the_others_exported(job, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    broken = job.parent / "broken.jsonl"
    broken.write_text('{"schema_version": 2, "topology": "g1n1"}\n')  # plan-like, not a plan
    assert main(["tensorboard", str(job.parent), "--logdir", str(tmp_path / "tb")]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("skipped") == 1 and "broken.jsonl:1" in captured.err
    assert "in 1 run" in captured.out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------- mixed recordings
def test_validate_reports_a_file_in_which_steps_repeat(tmp_path, capsys):
    plans = read_plans(DEMO).plans[:3]
    mixed = tmp_path / "plans.jsonl"
    write_jsonl(mixed, plans + plans)  # a re-run appended to the earlier recording
    assert main(["validate", str(mixed), str(DEMO)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"{mixed}: step(s) 0, 1, 2 appear more than once: the file mixes runs (a re-run "
        "appended to an earlier recording); readers would mix them: give each run its own file"
    )
    assert out[1] == f"{DEMO}: 30 plan(s) OK"


# ------------------------------------------------------------ one line, no traceback
class _FailingReads:
    """A file handle whose reads fail as a dying disk's do."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name):
        if name in ("read", "readline", "readinto", "readlines"):

            def fail(*args, **kwargs):
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            return fail
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


@pytest.mark.parametrize("command", ["show", "validate", "stragglers", "report"])
def test_an_io_error_while_reading_is_one_line(monkeypatch, capsys, tmp_path, command):
    real = plan_io._open_regular_file
    monkeypatch.setattr(plan_io, "_open_regular_file", lambda path: _FailingReads(real(path)))
    extra = ["-o", str(tmp_path / "r.html")] if command == "report" else []
    assert main([command, str(DEMO), *extra]) == 1
    assert "Input/output error" in one_error_line(capsys)


def test_a_name_longer_than_the_file_system_allows_is_one_line(tmp_path, capsys):
    long = str(tmp_path / ("a" * 300 + ".jsonl"))
    for args in (["show", long], ["validate", long], ["stragglers", long]):
        assert main(args) == 1
        err = one_error_line(capsys)
        assert "File name too long" in err or "cannot read" in err


def test_a_window_beyond_the_bound_is_one_line(capsys):
    assert main(["stragglers", str(DEMO), "--window", str(2**63)]) == 1
    err = one_error_line(capsys)
    assert "--window is 9,223,372,036,854,775,808; it must lie in 0..9,007" in err


def test_unusable_output_folders_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    if _has("tensorboard"):
        assert main(["tensorboard", str(DEMO), "--logdir", str(blocker)]) == 1
        assert "exists and is not a folder" in one_error_line(capsys)
        assert main(["tensorboard", str(DEMO), "--logdir", str(blocker / "x")]) == 1
        assert "cannot create the --logdir folder" in one_error_line(capsys)
    report = tmp_path / "r.html"
    assert main(["report", str(DEMO), "-o", str(report), "--png", str(blocker)]) == 1
    assert "exists and is not a folder" in one_error_line(capsys)
    assert not report.exists()  # refused before writing anything


def test_usage_errors_are_one_line_with_where_to_look(capsys):
    assert main(["show", str(DEMO), "--step", "x"]) == 2
    err = one_error_line(capsys)
    assert "Invalid value for '--step'" in err and "(see: knapformer show --help)" in err


def _surrogate_argv(*args: str) -> subprocess.CompletedProcess:
    """The console script given raw bytes that are not UTF-8 (Python decodes them to
    surrogates, as it does for a real terminal)."""
    return subprocess.run(
        [os.fsencode(EXE), *(os.fsencode(a) for a in args)],
        capture_output=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["dashboard", str(DEMO), "--host", "\udcff"], "--host '\\xff'"),
        (["animate", str(DEMO), "--title", "a\udcffb", "-o", "{tmp}/x.mp4"], "--title 'a\\xffb'"),
    ],
)
def test_text_options_that_are_not_utf8_are_one_line(tmp_path, args, said):
    done = _surrogate_argv(*(a.format(tmp=tmp_path) for a in args))
    err = done.stderr.decode("utf-8", "backslashreplace")
    assert done.returncode == 1
    assert err == f"error: {said} is not valid UTF-8 text\n"


def test_the_dashboard_of_a_device_is_refused_not_read_for_ever(capsys, tmp_path):
    from knapformer.dashboard.store import Runs

    assert main(["dashboard", "/dev/zero", "--port", "0"]) == 1
    assert "/dev/zero: not a regular file or a folder" in one_error_line(capsys)
    # A folder holding a FIFO named like a plan file offers no run to read.
    fifo = tmp_path / "plans.jsonl"
    os.mkfifo(fifo)
    assert Runs(tmp_path).files() == {}
    assert Runs("/dev/zero").files() == {}
