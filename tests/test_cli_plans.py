"""The validate/show/schema commands, run as a real console script."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from knapformer.contract.plan_io import read_plans

EXE = shutil.which("knapformer") or str(Path(sys.executable).parent / "knapformer")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def test_validate_passes_every_sample_plan(sample_dir):
    files = sorted(str(p) for p in sample_dir.iterdir() if p.suffix in (".json", ".jsonl"))
    assert len(files) >= 6
    done = run("validate", *files)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("OK") == len(files)


def test_validate_reports_file_and_line_and_exits_1(tmp_path, steps50_path):
    lines = steps50_path.read_text().splitlines()[:3]
    broken = json.loads(lines[1])
    broken["sequences"]["length"][0] += 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], json.dumps(broken), "garbage", lines[2]]) + "\n")
    done = run("validate", str(bad))
    assert done.returncode == 1
    out = done.stdout.splitlines()
    assert out[0].startswith(f"{bad}:2: ") and "sequence(s) 0" in out[0]
    assert out[1].startswith(f"{bad}:3: not valid JSON")
    assert "Traceback" not in done.stderr


def test_show_prints_per_gpu_table_and_figures(plan8_path):
    done = run("show", str(plan8_path))
    assert done.returncode == 0, done.stderr
    assert "bag 3 · 4 GPUs" in done.stdout
    assert "imbalance max/mean" in done.stdout and "moved tokens" in done.stdout
    assert "lower bound" in done.stdout
    # one row per GPU, in rank order, with the plan's tokens and loads
    st = read_plans(plan8_path).plans[0].stats
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.startswith("│")]
    assert [int(r[0]) for r in rows] == list(range(8))
    assert [int(r[3].replace(",", "")) for r in rows] == st.tokens_before.tolist()
    assert [int(r[4].replace(",", "")) for r in rows] == st.tokens_after.tolist()
    # loads relative to the mean GPU (the plan is not calibrated), 3 significant figures
    assert "(× mean)" in done.stdout and "relative to the mean GPU" in done.stdout
    shown = [float(r[6].replace(",", "")) for r in rows]
    np.testing.assert_allclose(shown, st.load_after / st.mean_load, rtol=5e-3)
    assert f"{st.imbalance_before:.3f} → {st.imbalance_after:.3f}" in done.stdout


def test_show_picks_a_step_and_legacy_files(steps50_path, legacy_path):
    done = run("show", str(steps50_path), "--step", "17")
    assert done.returncode == 0 and "step 17" in done.stdout
    assert run("show", str(legacy_path)).returncode == 0


STEPS50 = Path(__file__).resolve().parent.parent / "sample_plans" / "joint32_50steps.jsonl"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("show", "/no/such/file.jsonl"), "cannot read"),
        (("show", str(STEPS50), "--step", "500"), "step 500 is not"),
    ],
)
def test_errors_are_one_line_without_traceback(args, fragment):
    done = run(*args)
    assert done.returncode == 1
    assert fragment in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_schema_prints_json_schema():
    done = run("schema")
    schema = json.loads(done.stdout)
    assert schema["title"] == "RoutingPlan"
    assert "sequences" in schema["properties"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("show",), "Missing argument"),
        (("nosuch",), "No such command"),
        (("show", "x.json", "--step", "x"), "Invalid value for '--step'"),
    ],
)
def test_usage_errors_exit_2_without_traceback(args, fragment):
    done = run(*args)
    assert done.returncode == 2
    assert fragment in done.stderr
    assert "Traceback" not in done.stderr
