"""`knapformer calibrate --benchmark` (knapformer/tools/block_benchmark.py), on the CPU
with a small block: what it times and fits, not how fast (the machine's load varies)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.tools.block_benchmark import benchmark_block, parse_lengths

LENGTHS = [8, 16, 32, 64]


def test_each_length_is_timed_on_a_batch_and_fitted():
    seen = []
    bench = benchmark_block(32, 2, LENGTHS, "cpu", tokens=128, warmup=1, repeats=2,
                            on_point=seen.append)  # fmt: skip
    assert [p.length for p in bench.points] == LENGTHS and seen == bench.points
    assert [p.sequences for p in bench.points] == [16, 8, 4, 2]  # about 128 tokens each
    assert all(len(p.times_ms) == 2 and p.ms > 0 for p in bench.points)
    cal = bench.calibration
    assert cal.model.token_dim == 32 and bench.device == "cpu" and bench.dtype == "float32"
    # fitted on the per-sequence times: one point per length
    assert cal.measured.tolist() == [p.ms_per_sequence for p in bench.points]
    assert np.isfinite(cal.scale) and cal.scale > 0 and np.isfinite(cal.gamma)


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def test_cli_prints_every_point_and_the_fit():
    code, text = _cli("calibrate", "--benchmark", "--token-dim", "32", "--heads", "2",
                      "--lengths", "8,16,32", "--tokens", "64", "--device", "cpu")  # fmt: skip
    assert code == 0, text
    assert "timing a DiT block, d = 32, 2 heads" in text
    for length in (8, 16, 32):
        assert f"L = {length:>6,}:" in text
    assert "fitted from 3 lengths of a DiT block (2 heads, float32) timed on cpu, d = 32" in text
    assert "γ (attention weight)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give a measurements FILE or --benchmark"),
        (("--benchmark", "--lengths", "8,x"), "'x' is not a whole number of tokens"),
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
