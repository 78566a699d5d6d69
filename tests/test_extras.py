"""The core installs and imports without the readers' extras; a reader command run without
its extra stops with one line naming the extra to install."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from knapformer.cli.extras import EXTRA_MODULES

ROOT = Path(__file__).resolve().parent.parent
READER_PACKAGES = ("dash", "plotly", "manim", "av")

# Run first in a fresh interpreter: every import of a blocked package (or of one of its
# submodules) fails as if the package were not installed.
_BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def _python(blocked: tuple[str, ...], code: str, *args: str) -> subprocess.CompletedProcess:
    script = _BLOCKER + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, ",".join(blocked), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )


def _cli(blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    return _python(
        blocked,
        "from knapformer.cli import main\nraise SystemExit(main(sys.argv[2:]))\n",
        *args,
    )


@pytest.mark.parametrize(
    ("blocked", "command", "extra"),
    [
        (("dash",), ["dashboard", "{steps50}", "--port", "0"], "dashboard"),
        (("plotly",), ["dashboard", "{steps50}", "--port", "0"], "dashboard"),
        (("manim",), ["animate", "{plan8}", "-o", "{tmp}/x.mp4"], "animate"),
        (("av",), ["animate", "{plan8}", "-o", "{tmp}/x.mp4"], "animate"),
        (("plotly",), ["report", "{plan8}", "-o", "{tmp}/r.html"], "dashboard"),
        (
            ("plotly",),
            ["calibrate", "{demo}", "--plot", "{tmp}/fit.html"],
            "dashboard",
        ),
        (("tensorboard",), ["tensorboard", "{demo}", "--logdir", "{tmp}/tb"], "tensorboard"),
    ],
)
def test_a_reader_command_without_its_extra_names_it(tmp_path, sample_dir, blocked, command, extra):
    paths = {
        "steps50": sample_dir / "joint32_50steps.jsonl",
        "plan8": sample_dir / "mixed8_g1n2+g2n1+g4n1.json",
        "demo": sample_dir / "demo.jsonl",
        "tmp": tmp_path,
    }
    proc = _cli(blocked, *(arg.format(**paths) for arg in command))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: knapformer {command[0]}")
    assert f"pip install 'knapformer[{extra}]'" in proc.stderr
    assert f"({blocked[0]} is not installed)" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # stopped before writing anything


@pytest.mark.slow
def test_the_demo_runs_headless_without_the_dashboard_extra(tmp_path):
    proc = _cli(
        ("dash", "plotly"),
        *("demo", "--steps", "1", "--world-size", "2", "--out", str(tmp_path / "demo")),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "knapformer[dashboard]" in proc.stdout and "running headless" in proc.stdout
    assert (tmp_path / "demo" / "plans.jsonl").is_file()


def test_extra_modules_are_what_pyproject_installs_with_each_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, modules in EXTRA_MODULES.items():
        packages = {req.split(">")[0].split("=")[0].split("[")[0] for req in extras[extra]}
        assert set(modules) <= packages, extra


def test_the_core_requires_no_reader_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not [p for p in READER_PACKAGES if p in core]
    # What is installed says the same: reader packages only behind an extra marker.
    installed = importlib.metadata.requires("knapformer") or []
    for requirement in installed:
        name = requirement.split(";")[0].strip()
        if any(name.startswith(p) for p in READER_PACKAGES):
            assert "extra ==" in requirement, requirement


@pytest.mark.slow
def test_the_core_imports_and_plans_with_every_reader_package_blocked():
    proc = _python(
        READER_PACKAGES,
        """
        import knapformer
        balancer, recorder = knapformer.SequenceBalancer, knapformer.PlanRecorder
        plan = knapformer.plan_routing([[100, 7], [2000]], "g1n2", knapformer.WorkloadModel(64))
        assert plan.stats.moved_tokens >= 0 and balancer.__name__ == "SequenceBalancer"
        from knapformer.cli import main
        assert main(["validate", "sample_plans/demo.jsonl"]) == 0
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        print("loaded:", loaded)
        """,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout
