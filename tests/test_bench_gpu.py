"""bench/gpu.py end to end on the CPU (gloo, tiny sizes), and its answer without CUDA."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

import numpy as np
import pytest
import torch

from knapformer.planning.workload import WorkloadModel

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "gpu.py"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("GPU_CHECK_OUT", None)
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kwargs
    )


def _bench_module() -> ModuleType:
    """bench/gpu.py, loaded once (a script beside its ``comm_memory`` and ``routing``
    modules, not a package module)."""
    if "bench_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defining
        with mock.patch.object(sys, "path", [str(BENCH.parent), *sys.path]):
            spec.loader.exec_module(module)
    return sys.modules["bench_gpu"]


def _bench_here(*args: str) -> subprocess.CompletedProcess:
    """``python bench/gpu.py ARGS`` for what starts no worker (``--show``, the answer
    without CUDA): its exit status, stdout and stderr, run in this process as the script's
    ``__main__`` runs it (``sys.exit(main())``), where a fresh Python would import torch
    again. An exception is a traceback the script would print: it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ),
        contextlib.chdir(ROOT),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        os.environ.pop("GPU_CHECK_OUT", None)
        code = _bench_module().main(list(args))
    return subprocess.CompletedProcess([str(BENCH), *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _run([sys.executable, str(BENCH), "--device", "cpu", "--quick", "--out", str(out)])
    return proc, out


def test_quick_cpu_run_passes_and_writes_its_figures(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["ok"] and report["failures"] == []
    assert report["environment"]["device"] == "cpu"
    html = (out / "workload-fit.html").read_text()
    assert report["fit"]["html"] == "workload-fit.html" and "plotly" in html.lower()
    assert "GPU check passed" in proc.stdout


def test_quick_cpu_run_part1_is_exact_and_recorded(quick_run):
    _, out = quick_run
    report = json.loads((out / "gpu-check.json").read_text())
    part = report["balancer"]
    assert part["backend"] == "gloo" and part["exact"] is True
    assert part["checks"] and all(part["checks"].values())
    steps = report["sizes"]["train_steps"]
    assert len(part["recorded_ms"]) == steps
    for times in part["recorded_ms"]:
        for phase in ("plan", "route", "reverse_route", "forward_backward"):
            assert times[phase] > 0
    plans = (out / "plans.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in plans] == list(range(steps))


def test_quick_cpu_run_fit_reproduces_the_measured_times(quick_run):
    _, out = quick_run
    fit = json.loads((out / "gpu-check.json").read_text())["fit"]
    points = fit["points"]
    lengths = np.array([p["length"] for p in points], dtype=np.float64)
    measured = np.array([p["ms_per_sequence"] for p in points])
    assert lengths.tolist() == json.loads((out / "gpu-check.json").read_text())["sizes"]["lengths"]
    for p in points:  # one sequence's time is the measurement over the sequences in it
        assert p["ms"] > 0 and p["ms_per_sequence"] == pytest.approx(p["ms"] / p["sequences"])
    model = WorkloadModel(fit["token_dim"], fit["gamma"], fit["scale_ms_per_unit"])
    predicted = model.workload(lengths)
    assert predicted == pytest.approx([p["fit_ms_per_sequence"] for p in points], rel=1e-9)
    rms = np.sqrt(np.mean((predicted - measured) ** 2)) / measured.mean()
    assert rms == pytest.approx(fit["rel_rms_error"], rel=1e-6)
    r2 = 1 - np.sum((measured - predicted) ** 2) / np.sum((measured - measured.mean()) ** 2)
    assert r2 == pytest.approx(fit["r2"], rel=1e-6, abs=1e-9)
    assert fit["gamma"] >= 0 and fit["scale_ms_per_unit"] > 0


def test_quick_cpu_run_pack_figures(quick_run):
    _, out = quick_run
    report = json.loads((out / "gpu-check.json").read_text())
    pack = report["pack"]
    assert pack["exact"] is True
    sizes = {r["tokens_per_gpu"] for r in pack["rows"]}
    assert sizes == set(report["sizes"]["pack_tokens"])
    phases = {"index_select gather", "route pack", "route unpack", "reverse pack"}
    for tokens in sizes:
        rows = [r for r in pack["rows"] if r["tokens_per_gpu"] == tokens]
        assert phases | {"reverse unpack"} == {r["phase"] for r in rows}
        gather = next(r for r in rows if r["phase"] == "index_select gather")
        for r in rows:
            assert r["gb_per_s"] > 0 and r["ms"] > 0
            assert r["bytes"] == gather["bytes"] == r["rows"] * (2 * pack["dim"] + 8)
            assert r["vs_gather"] == pytest.approx(gather["ms"] / r["ms"])


def test_show_prints_a_recorded_run_and_its_verdict(quick_run, tmp_path):
    _, out = quick_run
    report = json.loads((out / "gpu-check.json").read_text())
    proc = _bench_here("--show", str(out / "gpu-check.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"recorded {report['when']} on cpu" in proc.stdout
    for title in ("1. balancer on gloo", "2. DiT block", "3. router packing"):
        assert title in proc.stdout
    assert f"γ = {report['fit']['gamma']:.4g}" in proc.stdout
    assert proc.stdout.rstrip().endswith("GPU check passed")
    # a failed run reads as failed: its failures listed, exit status 1
    report |= {"ok": False, "failures": ["pack: not bit-exact"]}
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps(report))
    proc = _bench_here("--show", str(failed))
    assert proc.returncode == 1
    assert "pack: not bit-exact" in proc.stdout and "GPU CHECK FAILED" in proc.stdout


@no_cuda
def test_without_cuda_the_bench_says_so_in_one_line(tmp_path):
    proc = _bench_here("--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


@no_cuda
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_cuda_exits_0_saying_so(tmp_path):
    out = tmp_path / "out"
    make = ["make", "--no-print-directory", f"GPU_PY={sys.executable}", f"GPU_CHECK_OUT={out}"]
    for target in ("gpu-check", "gpu-check-run"):  # no NVIDIA GPU / a torch without CUDA
        proc = _run([*make, target])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1 and "needs CUDA" in lines[0], proc.stdout
    assert not out.exists()
