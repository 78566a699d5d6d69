"""The figure of what each step lost against an ideal one (`step_loss_figure`): its stacks
are the parts `knapformer.diagnosis.step_loss` computes, and the warm-up stays off its scale."""

from __future__ import annotations

import numpy as np
import pytest
from knapformer.visualization.straggler_figures import WARMUP_STEPS, step_loss_figure

from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.step_loss import PART_INFO, PARTS, step_losses
from knapformer.testing.measured_plans import measured_run


def _losses(plans):
    return step_losses([measure(p).figures() for p in plans])


def _with_setup_wait(plans, extra_ms: float = 6000.0):
    """``plans`` with a first step whose ranks but rank 0 waited ``extra_ms`` more in the
    all-reduce (gloo's set-up)."""
    times = plans[0].measurements.per_rank_ms
    for phase in ("allreduce", "step"):
        times[phase] = [t + (extra_ms if i else 0.0) for i, t in enumerate(times[phase])]
    return plans


@pytest.fixture(scope="module")
def slow_run():
    return measured_run(10, seed=1, slow_rank=5, slow_factor=2.0)


def test_the_stacks_are_the_parts_from_the_ideal_up_to_the_measured_step(slow_run):
    losses = _losses(slow_run)
    fig = step_loss_figure(losses, run_start=0)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == [PART_INFO[part].label for part in PARTS]
    base = np.array([loss.ideal_ms for loss in losses])
    for part, bar in zip(PARTS, bars, strict=True):
        assert list(bar.x) == [loss.step for loss in losses]
        np.testing.assert_allclose(bar.y, [loss.part_ms[part] for loss in losses])
        np.testing.assert_allclose(np.asarray(bar.base, dtype=float), base)
        base = base + np.asarray(bar.y)
    # the stack ends on the measured step; the lines are the measured and the ideal step
    lines = {t.name: np.asarray(t.y) for t in fig.data if t.type == "scatter"}
    np.testing.assert_allclose(base, lines["measured step"])
    np.testing.assert_allclose(lines["ideal step"], [loss.ideal_ms for loss in losses])
    # rank 5 twice as slow: slow ranks is the tallest part of every step
    slow = np.asarray(bars[PARTS.index("slow_ranks")].y)
    assert np.all(slow >= np.max([np.abs(b.y) for b in bars if b.name != "slow ranks"], axis=0))
    assert "slow ranks" in fig.layout.title.text


def test_the_warm_up_steps_are_left_out_of_the_y_range():
    plans = _with_setup_wait(measured_run(10, seed=1, slow_rank=5, slow_factor=2.0))
    losses = _losses(plans)
    measured = np.array([loss.measured_ms for loss in losses])
    assert measured[0] > 5000 > 10 * measured[1:].max()
    fig = step_loss_figure(losses, run_start=0)
    lo, hi = fig.layout.yaxis.range
    warm = slice(WARMUP_STEPS, None)
    assert lo == 0.0
    assert measured[warm].max() <= hi < 1.2 * measured[warm].max()
    assert hi < 0.1 * measured[0]
    assert "warm-up steps left out" in fig.layout.title.text
    # the warm-up's own bars are still drawn, only off the scale
    assert max(fig.data[-1].y) == pytest.approx(measured[0])
    # a window that starts past the warm-up keeps every step on the scale
    late = step_loss_figure(losses, run_start=-10)
    assert late.layout.yaxis.range[1] >= measured[0]
    assert "warm-up" not in late.layout.title.text


def test_without_a_run_start_every_step_counts_and_no_step_is_none():
    plans = _with_setup_wait(measured_run(4, seed=2))
    for plan in plans:
        plan.step = None
    losses = _losses(plans)
    assert all(loss.step is None for loss in losses)
    fig = step_loss_figure(losses)
    assert list(fig.data[0].x) == [0, 1, 2, 3]  # positions stand in for missing steps
    assert fig.layout.yaxis.range[1] >= losses[0].measured_ms
