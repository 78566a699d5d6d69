"""The distribution claims one import name, `knapformer`: a wheel holds nothing else, and a
training repository whose own folders are called `visualization/` or `dashboard.py` keeps
them while our readers still work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAN8 = ROOT / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (a build leaves build/ where it runs)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("knapformer", "dashboard", "visualization"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (found,) = out.glob("knapformer-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"knapformer"}
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["knapformer"]


def test_the_wheel_carries_the_readers_under_the_one_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = ("dashboard/app.py", "dashboard/server.py", "visualization/figures.py")
    for module in (*modules, "visualization/render.py", "contract/plan.py", "runtime/balancer.py"):
        assert f"knapformer/{module}" in names


def test_every_package_folder_is_in_the_wheel(wheel):
    """A new folder of the core not listed in pyproject.toml would silently go missing."""
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = {
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "knapformer").rglob("__init__.py")
    }
    for folder in sorted(folders):
        assert f"{folder}/__init__.py" in names, f"{folder} is not packaged"


def test_a_core_only_install_puts_only_knapformer_into_site_packages(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tops = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert tops - {"bin"} == {"knapformer"}


USER_CODE = """
import sys
import visualization, dashboard
assert visualization.WHO == "user" and dashboard.WHO == "user", "the user's modules lost"
from knapformer.cli import main
code = main(["report", sys.argv[1], "-o", "report.html"])
assert code in (0, None), code
import knapformer.dashboard.app, knapformer.visualization.figures
assert visualization.WHO == "user" and dashboard.WHO == "user", "ours shadowed the user's"
assert "knapformer" in knapformer.visualization.figures.__name__
print("ok")
"""


@pytest.fixture
def user_repo(tmp_path) -> Path:
    """A training repository with a `visualization/` package and a `dashboard.py` of its own."""
    (tmp_path / "visualization").mkdir()
    (tmp_path / "visualization" / "__init__.py").write_text('WHO = "user"\n')
    (tmp_path / "dashboard.py").write_text('WHO = "user"\n')
    return tmp_path


def _env() -> dict[str, str]:
    # The user's folder comes first on the path, as when their script runs from it.
    return {**os.environ, "PYTHONPATH": "."}


def test_our_readers_work_beside_the_users_own_visualization_package(user_repo):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(USER_CODE), str(PLAN8)],
        cwd=user_repo, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
    assert (user_repo / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_animate_runs_from_a_folder_with_the_users_own_visualization_package(user_repo):
    knapformer = Path(sys.executable).with_name("knapformer")
    result = subprocess.run(
        [str(knapformer), "animate", str(PLAN8), "-o", "x.mp4", "--quality", "low"],
        cwd=user_repo, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (user_repo / "x.mp4").stat().st_size > 1000
