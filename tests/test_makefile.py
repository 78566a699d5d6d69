"""The Makefile's set-up from a fresh clone (dry runs, ``make -n``): each step says what it
does, ``make demo`` installs what the demo needs and not the test tools, and neither
command's stamp makes the other skip what it needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(target: str, venv: Path) -> str:
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_demo_installs_the_readers_not_the_test_tools_and_says_each_step(tmp_path):
    venv = tmp_path / "venv"  # a fresh clone: no environment yet
    plan = dry_run("demo", venv)
    assert "-e '.[all]'" in plan and ".[dev]" not in plan
    steps = [line for line in plan.splitlines() if line.startswith('echo "==> ')]
    assert len(steps) >= 4  # venv, torch, knapformer, the demo itself
    assert " -q " not in plan.split("[2/3]")[1]  # pip shows its progress after that


def test_a_stamp_of_one_target_does_not_skip_what_the_other_needs(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    for stamp in (".torch", ".installed-all"):  # `make demo` ran first
        (venv / stamp).touch()
    plan = dry_run("test", venv)
    assert "-e '.[dev]'" in plan and "pytest" in plan
    (venv / ".installed").touch()  # and the other way round
    (venv / ".installed-all").unlink()
    assert "-e '.[all]'" in dry_run("demo", venv)


def test_setup_test_and_demo_fetch_the_dashboards_plotly_js_after_installing(tmp_path):
    # the fetch needs the installed plotly (it fetches the plotly.js version it ships)
    for target, install in (("setup", ".[dev]"), ("test", ".[dev]"), ("demo", ".[all]")):
        plan = dry_run(target, tmp_path / "venv")
        fetch = plan.find("-m knapformer.dashboard.plotly_bundle")
        assert fetch > plan.find(f"-e '{install}'") > 0, target
