"""`knapformer calibrate --benchmark` (knapformer/tools/block_benchmark.py), on the CPU
with a small block: what it times and fits, not how fast (the machine's load varies)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.errors import KnapformerError
from knapformer.planning.workload import WorkloadModel
from knapformer.tools import block_benchmark
from knapformer.tools.block_benchmark import benchmark_block, parse_lengths

LENGTHS = [8, 16, 32, 64]


K_MS, GAMMA = 3.0, 0.7  # the synthetic block's time per workload unit and attention weight


@pytest.fixture
def modelled_times(monkeypatch):
    """Run the block once per length, as measured, but report the times of a block that
    follows the workload model exactly (ms = K_MS x workload at GAMMA): the fit is then
    known, whatever the machine's load."""
    real = block_benchmark.time_block

    def times(block, seq_lens, d, dtype, device, warmup, repeats):
        real(block, seq_lens, d, dtype, device, 0, 1)
        ms = K_MS * float(WorkloadModel(d, GAMMA).workload(seq_lens).sum())
        return [ms * f for f in (1.0, 1.1, 0.9)][:repeats]

    monkeypatch.setattr(block_benchmark, "time_block", times)


def test_each_length_is_timed_on_a_batch_and_fitted(modelled_times):
    seen = []
    bench = benchmark_block(32, 2, LENGTHS, "cpu", tokens=128, warmup=1, repeats=3,
                            on_point=seen.append)  # fmt: skip
    assert [p.length for p in bench.points] == LENGTHS and seen == bench.points
    assert [p.sequences for p in bench.points] == [16, 8, 4, 2]  # about 128 tokens each
    assert all(len(p.times_ms) == 3 for p in bench.points)
    cal = bench.calibration
    assert cal.model.token_dim == 32 and bench.device == "cpu" and bench.dtype == "float32"
    # fitted on the per-sequence times (the median of the repeats): one point per length
    assert cal.measured.tolist() == [p.ms_per_sequence for p in bench.points]
    assert cal.scale == pytest.approx(K_MS) and cal.gamma == pytest.approx(GAMMA)


def test_real_timings_give_points_and_a_fit_or_say_why_not():
    """Timed for real: on a loaded machine the times need not follow the model, and then
    the fit says so (a one-line error) rather than returning nonsense."""
    seen = []
    try:
        bench = benchmark_block(32, 2, LENGTHS, "cpu", tokens=128, warmup=1, repeats=2,
                                on_point=seen.append)  # fmt: skip
    except KnapformerError as err:
        assert "the measured times do not grow with the workload" in str(err)
    else:
        assert np.isfinite(bench.calibration.scale) and bench.calibration.gamma >= 0
    assert [p.length for p in seen] == LENGTHS
    assert all(len(p.times_ms) == 2 and min(p.times_ms) > 0 for p in seen)


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def test_cli_prints_every_point_and_the_fit(modelled_times):
    code, text = _cli("calibrate", "--benchmark", "--token-dim", "32", "--heads", "2",
                      "--lengths", "8,16,32", "--tokens", "64", "--device", "cpu")  # fmt: skip
    assert code == 0, text
    assert "timing a DiT block, d = 32, 2 heads" in text
    for length in (8, 16, 32):
        assert f"L = {length:>6,}:" in text
    assert "fitted from 3 lengths of a DiT block (2 heads, float32) timed on cpu, d = 32" in text
    assert f"γ (attention weight)     = {GAMMA:.4g}" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give a measurements FILE or --benchmark"),
        (("--benchmark", "--lengths", "8,x"), "--lengths item must be a whole number, got 'x'"),
        (("--benchmark", "--lengths", "8"), "give at least 2 different positive lengths"),
        (("--benchmark", "--token-dim", "30", "--heads", "4"), "heads of an even size"),
        (("--benchmark", "--device", "tpu"), "--device 'tpu': use cpu or cuda"),
    ],
)
def test_cli_names_the_bad_option_in_one_line(args, message):
    code, text = _cli("calibrate", *args)
    assert code != 0 and message in text and "Traceback" not in text, text
    assert "timing" not in text  # nothing was timed


def test_parse_lengths():
    assert parse_lengths("256, 512,1024") == [256, 512, 1024]
