"""Per-rank measured figures of one plan: compute apart from waiting
(knapformer.diagnosis.measured)."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.contract.phases import BAG_COLLECTIVES, COLLECTIVE_PHASES
from knapformer.contract.plan import Measurements
from knapformer.contract.plan_io import read_plans
from knapformer.contract.stats import summarize
from knapformer.diagnosis.measured import compute_ratio, measure
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.measured_plans import measured_run, with_measurements


@pytest.fixture
def plan8(plan8_path):
    """8 GPUs in bags [0], [1], [2, 3], [4, 5, 6, 7]."""
    return read_plans(plan8_path, on_error="raise").plans[0]


def _with(base, **per_rank):
    return base.model_copy(update={"measurements": Measurements(per_rank_ms=per_rank)})


def test_compute_follows_the_one_compute_phase_rule(plan8):
    ones = [1.0] * 8
    assert measure(plan8) is None  # no measurements
    assert measure(_with(plan8, route=ones, step=ones)).phase == "step"
    assert measure(_with(plan8, route=ones, plan=ones)) is None  # nothing stands for compute
    both = _with(plan8, forward_backward=[2.0] * 8, compute=[3.0] * 8, step=ones)
    m = measure(both)
    assert m.phase == both.measurements.compute_phase() == "compute"
    np.testing.assert_array_equal(m.compute_ms, 3.0)


def test_wait_is_time_minus_the_earliest_peer_and_ulysses_peers_are_the_bag(plan8):
    rng = np.random.default_rng(1)
    times = {name: rng.uniform(1, 50, 8).round(3) for name in COLLECTIVE_PHASES}
    m = measure(_with(plan8, compute=[10.0] * 8, **{k: v.tolist() for k, v in times.items()}))
    bag_of = {g: b for b, members in enumerate(plan8.bags) for g in members}
    for name, t in times.items():
        assert np.allclose(m.collective_ms[name], t)
        for i, rank in enumerate(plan8.gpus):
            peers = [
                j
                for j, other in enumerate(plan8.gpus)
                if name not in BAG_COLLECTIVES or bag_of[other] == bag_of[rank]
            ]
            expected_wait = t[i] - min(t[j] for j in peers) if len(peers) > 1 else 0.0
            assert m.wait_ms[name][i] == pytest.approx(expected_wait)
            last = len(peers) > 1 and t[i] == min(t[j] for j in peers)
            assert m.last_arrival[name][i] == last, (name, rank)
    # one last arrival for the whole group; one per multi-GPU bag in the Ulysses exchanges
    assert m.last_arrival["route"].sum() == 1
    assert m.last_arrival["pre_attn"].sum() == 2
    total = sum(times[name] for name in COLLECTIVE_PHASES)
    assert np.all(m.total_wait_ms <= total)


def test_predicted_share_is_work_at_nominal_speed_not_the_planners_time():
    model = WorkloadModel(3072, 0.4)
    lengths = [np.full(4, 4096 + 64 * i) for i in range(4)]
    speed = [1.0, 1.0, 0.5, 1.0]
    plan = plan_routing(lengths, "g1n4", model, gpu_speed=speed)
    m = measure(_with(plan, compute=[1.0] * 4))
    st = plan.stats
    np.testing.assert_allclose(m.predicted_share, st.work_after / st.work_after.sum())
    assert m.predicted_share.sum() == pytest.approx(1.0)
    # the planner gave the half-speed GPU less work; its *time* it predicted near the mean
    assert m.predicted_share[2] < 0.8 * np.median(m.predicted_share)
    np.testing.assert_allclose(m.predicted_load, st.load_after / st.mean_load)
    assert not np.allclose(m.predicted_share * 4, m.predicted_load)


def test_compute_ratio_is_relative_to_the_prediction_of_the_typical_rank():
    share = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(compute_ratio(share * 7.0, share), 1.0)
    slow = share * 7.0
    slow[1] *= 2.5
    np.testing.assert_allclose(compute_ratio(slow, share), [1, 2.5, 1, 1])
    with_idle = compute_ratio(np.array([1.0, 1.0, 1.0]), np.array([0.5, 0.5, 0.0]))
    assert np.isnan(with_idle[2]) and with_idle[0] == pytest.approx(1.0)


@pytest.mark.parametrize("slow_rank", [1, 3, 5])
def test_the_step_straggler_is_the_rank_everybody_waited_for(slow_rank):
    """Rank 1 is alone in its bag, 3 has one Ulysses peer, 5 three: each time the others
    wait for it (its peers inside the exchanges, the rest in the all-reduce)."""
    for plan in measured_run(4, slow_rank=slow_rank, slow_factor=1.6, seed=slow_rank):
        m = measure(plan)
        assert m.straggler == slow_rank
        assert m.compute_ratio[plan.gpus.index(slow_rank)] > 1.4


def test_nobody_waited_means_no_straggler(plan8):
    same = [5.0] * 8
    m = measure(_with(plan8, compute=[10.0] * 8, route=same, allreduce=same))
    assert m.straggler is None
    assert not m.total_wait_ms.any()


def test_figures_keep_what_the_views_need_in_float32(plan8):
    plan = with_measurements(plan8, np.random.default_rng(0), slow_rank=2, slow_factor=2.0)
    m = measure(plan)
    f = m.figures()
    assert f.compute_ms.dtype == np.float32 and f.wait_ms.dtype == np.float32
    np.testing.assert_allclose(f.wait_ms, m.total_wait_ms, rtol=1e-6)
    assert summarize(plan).step_ms == max(plan.measurements.per_rank_ms["step"])
    np.testing.assert_allclose(f.compute_ratio, m.compute_ratio, rtol=1e-5)
    # predicted work shown in the plan's unit: relative to the mean GPU, summing to #GPUs
    assert f.predicted_shown.sum() == pytest.approx(len(plan.gpus), rel=1e-5)
    assert f.load_axis == "load (mean GPU = 1.00)"
