"""The history cost model (`knapformer.planning.history`): speeds learnt from measured compute are
robust, bounded, warmed up, and in a closed loop with the real planner take work off a
slow GPU; `recorded_speeds` recomputes them from a recording."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.contract.plan import Measurements
from knapformer.errors import KnapformerError
from knapformer.planning.compute_model import MIN_STEPS
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.history import (
    LAG_STEPS,
    SPEED_BOUNDS,
    WINDOW_STEPS,
    SpeedHistory,
    recorded_speeds,
    step_work,
)
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

WORK = np.array([4.0, 4.0, 4.0, 4.0])
#: Measured steps until a slow GPU is learnt: the fewest a window needs to show it, and
#: one more, since two windows in a row must show it.
LEARNT_AFTER = MIN_STEPS + 1


def test_nothing_is_learnt_during_the_warm_up():
    history = SpeedHistory(4, warmup=LEARNT_AFTER)
    slow = np.array([10.0, 10.0, 20.0, 10.0])
    for _ in range(LEARNT_AFTER):  # the warm-up, then the first window that shows it
        history.observe(WORK, slow)
        assert history.speeds() is None
    history.observe(WORK, slow)
    assert history.speeds() == [1.0, 1.0, 0.5, 1.0]


def test_speed_is_work_per_ms_relative_to_the_median_gpu():
    history = SpeedHistory(4, warmup=1)
    # GPU 1 got twice the work and took twice as long: as fast as the others.
    for _ in range(LEARNT_AFTER):
        history.observe([4.0, 8.0, 4.0, 2.0], [10.0, 20.0, 10.0, 10.0])
    assert history.speeds() == [1.0, 1.0, 1.0, 0.5]


def test_one_slow_step_moves_nothing():
    history = SpeedHistory(4, warmup=1)
    for _ in range(5):
        history.observe(WORK, [10.0, 10.0, 20.0, 10.0])
    history.observe(WORK, [100.0, 10.0, 20.0, 10.0])  # a hiccup on GPU 0
    assert history.speeds() == [1.0, 1.0, 0.5, 1.0]


def test_speeds_are_bounded():
    history = SpeedHistory(4, warmup=1)
    for _ in range(LEARNT_AFTER):
        history.observe(WORK, [10.0, 10.0, 10_000.0, 0.001])
    low, _ = SPEED_BOUNDS
    # a GPU that looks faster than the group is never fed more (`ComputeFit.learnt_speed`)
    assert history.speeds() == [1.0, 1.0, low, 1.0]


def test_gpus_without_work_or_time_give_no_figure():
    history = SpeedHistory(5, warmup=1)
    for _ in range(LEARNT_AFTER):
        history.observe([0.0, 4.0, 4.0, 4.0, 4.0], [1.0, 10.0, np.nan, 20.0, 10.0])
    assert history.speeds() == [1.0, 1.0, 1.0, 0.5, 1.0]  # unseen GPUs stay nominal
    # A step with a single usable GPU says nothing about relative speed.
    fresh = SpeedHistory(2, warmup=1)
    fresh.observe([0.0, 4.0], [1.0, 10.0])
    assert fresh.observed == 0 and fresh.speeds() is None


def test_a_window_too_short_or_too_noisy_to_tell_leaves_every_gpu_nominal():
    history = SpeedHistory(4, warmup=1)
    for _ in range(MIN_STEPS - 1):  # too short: a slow GPU is not learnt yet
        history.observe(WORK, [10.0, 10.0, 20.0, 10.0])
    assert history.speeds() is None
    # Healthy GPUs on a busy host: each step one of them takes up to 2x, never the same
    # one in most steps. Nobody is learnt, at any step.
    rng = np.random.default_rng(0)
    noisy = SpeedHistory(4, warmup=1)
    for step in range(40):
        work = WORK * rng.uniform(0.5, 1.5, 4)
        compute = (5.0 + 2.0 * work) * rng.uniform(0.8, 1.25, 4)  # overhead + rate x work
        compute[step % 4] *= 1.6
        noisy.observe(work, compute)
        assert noisy.speeds() is None, step


def test_a_slow_gpu_given_less_work_stays_learnt():
    # compute = 10 x (overhead 2 + rate x work); GPU 2 runs at rate 2.5. Given its share,
    # its compute is 1.5x what its work predicts: learnt, at 1 / 2.5. Given less work
    # (as the planner then does), its compute is only 1.25x the prediction, which alone
    # would not be learnt, but its rate still departs, so it stays learnt: the planner
    # does not hand the work back and take it away again.
    def compute(work):
        return 10.0 * (2.0 + np.array([1.0, 1.0, 2.5, 1.0]) * work)

    shared, relieved = np.array([1.0, 0.5, 1.0, 1.5]), np.array([1.0, 0.5, 0.4, 1.5])
    history = SpeedHistory(4, warmup=1)
    for _ in range(LEARNT_AFTER):
        history.observe(shared, compute(shared))
    learnt = pytest.approx([1.0, 1.0, 0.4, 1.0], abs=0.02)
    assert history.speeds() == learnt
    for _ in range(2 * WINDOW_STEPS):
        history.observe(relieved, compute(relieved))
        assert history.speeds() == learnt
    fresh = SpeedHistory(4, warmup=1)
    for _ in range(LEARNT_AFTER):
        fresh.observe(relieved, compute(relieved))
    assert fresh.speeds() is None


def test_equal_gpus_are_nominal():
    history = SpeedHistory(4, warmup=1)
    history.observe(WORK, [10.0, 10.0, 10.0, 10.0])
    assert history.speeds() is None


def test_bad_figures_are_refused():
    with pytest.raises(KnapformerError, match="4 GPUs got 3 workloads"):
        SpeedHistory(4).observe([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(KnapformerError, match="bounds"):
        SpeedHistory(4, bounds=(2.0, 4.0))


def _closed_loop(steps: int, true_speed: np.ndarray, overhead_ms: float, seed: int = 0):
    """Plans made with the speeds the history learns from simulated compute
    (``overhead_ms + work / true_speed``), as the balancer feeds it: plan s learns from
    the steps up to s - LAG_STEPS. Returns the plans, with their measurements."""
    codes = parse_mix("g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0")
    model = WorkloadModel(3072, 0.4)
    rng = np.random.default_rng(seed)
    history = SpeedHistory(len(true_speed))
    plans = []
    for step in range(steps):
        if step - LAG_STEPS >= 0:
            seen = plans[step - LAG_STEPS]
            history.observe(step_work(seen), seen.measurements.per_rank_ms["compute"])
        lengths = sample_lengths(codes, rng, 0.5)
        plan = plan_routing(lengths, "g1n4+g2n2", model, step=step, gpu_speed=history.speeds())
        compute = overhead_ms + 1e3 * step_work(plan) / true_speed
        plan.measurements = Measurements(per_rank_ms={"compute": compute.tolist()})
        plans.append(plan)
    return plans


def test_a_slow_gpu_gets_less_work_in_a_closed_loop_with_the_planner():
    true_speed = np.array([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0])  # GPU 2: half speed
    plans = _closed_loop(16, true_speed, overhead_ms=5.0)
    # Plan LEARNT_AFTER + 1 is the first made after LEARNT_AFTER measured steps (the lag
    # is 2): the fewest that can show, in two windows in a row, that a GPU departs.
    first = LEARNT_AFTER + LAG_STEPS - 1
    assert [p.gpu_speed is None for p in plans[: first + 1]] == [True] * first + [False]
    learnt = plans[-1].gpu_speed
    assert learnt[2] == pytest.approx(0.5, abs=0.1)
    assert all(s == pytest.approx(1.0, abs=0.1) for i, s in enumerate(learnt) if i != 2)
    # The slow GPU's share of the tokens in the last steps is well below the mean share.
    share = np.mean([p.stats.tokens_after / p.stats.total_tokens for p in plans[-4:]], axis=0)
    assert share[2] < 0.7 * share.mean()
    # ... and the compute it is given now takes about as long as everyone else's.
    compute = np.array(plans[-1].measurements.per_rank_ms["compute"])
    assert compute[2] < 1.3 * np.median(compute)


def test_recorded_speeds_recompute_a_runs_speeds_from_its_plans():
    true_speed = np.array([1.0, 0.7, 1.0, 1.0, 1.0, 1.3, 1.0, 1.0])
    plans = _closed_loop(12, true_speed, overhead_ms=3.0, seed=4)
    # What a recording holds: plans as JSON, read back.
    from knapformer.contract.plan import RoutingPlan

    read_back = [RoutingPlan.model_validate_json(p.model_dump_json()) for p in plans]
    assert recorded_speeds(read_back) == {p.step: p.gpu_speed for p in plans}
    assert any(p.gpu_speed is not None for p in plans)


def test_one_window_alone_learns_no_slow_gpu():
    # The first window that can show it (MIN_STEPS steps) does, but a window's figures can
    # be tilted by the noise of the lightly loaded GPUs: a GPU is learnt slow only when
    # the next window says so too.
    history = SpeedHistory(4, warmup=1)
    slow = np.array([10.0, 10.0, 20.0, 10.0])
    for _ in range(MIN_STEPS):
        history.observe(WORK, slow)
    assert history.speeds() is None
    history.observe(WORK, slow)
    assert history.speeds() == [1.0, 1.0, 0.5, 1.0]
