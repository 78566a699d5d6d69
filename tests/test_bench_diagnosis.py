"""`bench/diagnosis.py --rescore DIR`: runs kept with ``--keep`` are judged again from
their plans, without running anything, so a change to the diagnosis can be measured on
the same plans. Only the judging is exercised here (a live matrix takes ten minutes)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DEMO = ROOT / "sample_plans" / "demo.jsonl"  # 30 measured steps of a clean 8-rank demo


def _keep(folder: Path, kind: str | None, factor: float = 1.0) -> None:
    """A kept run as ``--keep`` leaves it: the plans and what the run was."""
    folder.mkdir(parents=True)
    shutil.copy(DEMO, folder / "plans.jsonl")
    case = {"size": "default", "topology": "g1n2+g2n1+g4n1", "world": 8, "kind": kind,
            "factor": factor, "seconds": 12.5}  # fmt: skip
    (folder / "case.json").write_text(json.dumps(case))


def _diagnosis() -> ModuleType:
    """bench/diagnosis.py, loaded once (a script beside its ``footer`` module, not a
    package module)."""
    if "bench_diagnosis" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_diagnosis", BENCH / "diagnosis.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defining
        with mock.patch.object(sys, "path", [str(BENCH), *sys.path]):
            spec.loader.exec_module(module)
    return sys.modules["bench_diagnosis"]


def _rescore(folder: Path) -> subprocess.CompletedProcess:
    """``python bench/diagnosis.py --rescore FOLDER``: its exit status, stdout and stderr.
    Run in this process, as the script's ``__main__`` runs it (``SystemExit(main())``):
    --rescore starts nothing, and a process of its own would only import torch again. An
    exception other than an exit is a traceback the script would print: it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench/diagnosis.py", "--rescore", str(folder)]
    with (
        mock.patch.object(sys, "argv", argv),
        contextlib.chdir(ROOT),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = _diagnosis().main()
        except SystemExit as done:  # argparse's usage errors exit 2
            code = done.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_kept_runs_are_judged_again_and_the_targets_say_what_they_missed(tmp_path):
    _keep(tmp_path / "clean", None)
    _keep(tmp_path / "claimed_slow", "gpu", 2.0)  # the same clean plans: rank 5 is not slow
    done = _rescore(tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    clean = next(line for line in lines if line.startswith("default g1n2+g2n1+g4n1 w8 clean"))
    assert "named after None step(s)" in clean and "false alarms none" in clean
    claimed = next(line for line in lines if "w8 gpu x2 @5" in line and "named after" in line)
    assert "named after None step(s), at the end ok" in claimed
    assert any(
        line.startswith("FAIL injected rank named") and "in 0 of 1 slow runs" in line
        for line in lines
    )
    assert any(line.startswith("PASS no false alarm in any run") for line in lines)
    assert f"2 runs kept in {tmp_path}, judged again (they took 25 s when they ran)" in (
        " ".join(done.stdout.split())
    )
    assert "load average" not in done.stdout  # not measured now: nothing ran


def test_a_folder_without_kept_runs_is_refused(tmp_path):
    (tmp_path / "plans.jsonl").write_text(DEMO.read_text())  # plans, but no case.json
    done = _rescore(tmp_path)
    assert done.returncode == 2
    assert "no run kept by --keep" in done.stderr and "case.json" in done.stderr


def test_a_case_file_it_did_not_write_is_named_not_a_traceback(tmp_path):
    _keep(tmp_path / "run", None)
    (tmp_path / "run" / "case.json").write_text('{"size": "default", "seconds": 1}')
    done = _rescore(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{tmp_path / 'run' / 'case.json'}: not a case --keep wrote" in done.stderr


def test_a_kept_run_without_its_plans_is_named(tmp_path):
    _keep(tmp_path / "run", None)
    (tmp_path / "run" / "plans.jsonl").unlink()
    done = _rescore(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "plans.jsonl" in done.stderr
