"""The Ulysses-exact cost: what each GPU of a bag really computes, planned for and shown."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapformer.contract.legacy import plan_from_legacy, plan_to_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.contract.units import (
    LoadUnit,
    round_significant,
    round_significant_array,
    significant,
)
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=5))
    topo = Topology.from_bag_sizes(sizes)
    length = st.one_of(st.just(0), st.integers(1, 9), st.integers(1, 20000))
    lengths = [draw(st.lists(length, max_size=6)) for _ in range(topo.num_gpus)]
    return topo, lengths


def chunk_by_chunk(plan: RoutingPlan, model: WorkloadModel) -> np.ndarray:
    """Per GPU position: the cost of every chunk it holds (linear part of its tokens plus
    attention on the whole sequence for 1/g of the heads), and the attention share of the
    sequences of its bag whose chunk on it is empty (shorter than the bag)."""
    pos = {g: i for i, g in enumerate(plan.gpus)}
    load = np.zeros(len(plan.gpus))
    seqs = plan.sequences
    for s in range(len(seqs)):
        length, bag = int(seqs.length[s]), plan.bags[int(seqs.bag[s])]
        held = {int(g): 0 for g in bag}
        for c in np.flatnonzero(plan.chunks.seq == s):
            held[int(plan.chunks.dst_gpu[c])] += int(plan.chunks.length[c])
        for gpu, tokens in held.items():
            load[pos[gpu]] += float(model.chunk_cost(length, tokens, len(bag)))
    return load


@SETTINGS
@given(problems(), st.sampled_from(["knapformer", "greedy"]))
def test_stats_loads_equal_a_chunk_by_chunk_recomputation(problem, solver):
    topo, lengths = problem
    plan = plan_routing(lengths, topo, MODEL, solver=solver)
    expected = chunk_by_chunk(plan, MODEL)
    np.testing.assert_allclose(plan.stats.load_after, expected, rtol=1e-9, atol=1e-12)
    assert plan.stats.load_after.sum() == pytest.approx(plan.sequences.workload.sum(), rel=1e-9)


def test_chunk_costs_of_a_sequence_add_up_to_its_workload():
    for length in (1, 7, 4096, 33_333):
        for g in (1, 2, 3, 8):
            chunks = [length // g + (k < length % g) for k in range(g)]
            total = sum(float(MODEL.chunk_cost(length, c, g)) for c in chunks)
            assert total == pytest.approx(float(MODEL.workload(length)), rel=1e-12)


def test_remainders_piling_on_one_gpu_are_charged_to_it():
    # Eight 4,099-token sequences in one bag of 4, every remainder (3 tokens) on chunk 0:
    # the old "workload / g per GPU" charge hid it; the exact cost shows GPU 0 as the
    # makespan, by exactly 8 x 3 tokens of linear cost.
    n, length, g = 8, 4099, 4
    sizes = [length // g + length % g] + [length // g] * (g - 1)
    plan = RoutingPlan.model_validate(
        {
            "topology": "g4n1",
            "gpus": [0, 1, 2, 3],
            "bags": [[0, 1, 2, 3]],
            "token_dim": 3072,
            "gamma": 0.4,
            "solver": "hand-made",
            "sequences": {
                "src_gpu": [0] * n,
                "length": [length] * n,
                "workload": MODEL.workload([length] * n).tolist(),
                "bag": [0] * n,
            },
            "chunks": {
                "seq": [s for s in range(n) for _ in range(g)],
                "src_gpu": [0] * (n * g),
                "dst_gpu": list(range(g)) * n,
                "offset": [sum(sizes[:k]) for k in range(g)] * n,
                "length": sizes * n,
            },
        }
    )
    loads = plan.stats.load_after
    assert int(np.argmax(loads)) == 0
    per_token = float(MODEL.chunk_cost(0, 1, 1))  # the linear cost of one token
    assert loads[0] - loads[1] == pytest.approx(n * (length % g) * per_token, rel=1e-9)
    assert plan.stats.makespan_over_lb > 1.0


def test_legacy_plans_are_charged_the_same_exact_cost():
    lengths = sample_lengths(parse_mix("mixres"), np.random.default_rng(3))
    plan = plan_routing(lengths, "g8n4", MODEL, solver="greedy")
    imported = plan_from_legacy(plan_to_legacy(plan))
    assert imported.token_dim is None and imported.gamma is None  # split is fitted
    np.testing.assert_allclose(imported.stats.load_after, plan.stats.load_after, rtol=1e-6)


@pytest.mark.parametrize("mix", ["lowres", "mixres", "joint", "g32b64i128f1s0"])
def test_default_solver_is_really_no_worse_than_greedy_at_g8n4(mix):
    # The table of the cost-model issue: measured with the true cost on 10 steps.
    ours, greedy = [], []
    for step in range(10):
        lengths = sample_lengths(parse_mix(mix), np.random.default_rng(1000 + step))
        ours.append(plan_routing(lengths, "g8n4", MODEL).stats.makespan_over_lb)
        greedy.append(plan_routing(lengths, "g8n4", MODEL, solver="greedy").stats.makespan_over_lb)
    assert max(ours) <= max(greedy) + 1e-3
    assert max(ours) <= 1.002


def test_slow_gpus_get_less_work_and_plans_record_their_speed():
    lengths = sample_lengths(parse_mix("joint"), np.random.default_rng(7))
    speed = np.ones(32)
    speed[5] = 0.5  # GPU 5 runs at half speed: its bag of 8 does too
    plan = plan_routing(lengths, "g8n4", MODEL, gpu_speed=speed)
    assert plan.gpu_speed == speed.tolist()
    st_ = RoutingPlan.model_validate_json(plan.model_dump_json()).stats
    slow_bag = int(st_.gpu_bag[5])
    work_per_bag = np.bincount(st_.gpu_bag, weights=st_.work_after)
    others = np.delete(work_per_bag, slow_bag)
    assert work_per_bag[slow_bag] == pytest.approx(others.mean() / 2, rel=0.05)
    # Times, not work, are balanced: the slow bag's GPUs finish with the others.
    assert st_.makespan_over_lb <= 1.002
    assert st_.load_after[5] == pytest.approx(st_.work_after[5] / 0.5)


def test_nominal_speeds_are_not_recorded_and_bad_speeds_are_named():
    plan = plan_routing([[10], [20]], "g1n2", MODEL, gpu_speed=[1.0, 1.0])
    assert plan.gpu_speed is None
    with pytest.raises(ValueError, match="gpu_speed has 3 values for 2 GPUs"):
        plan_routing([[10], [20]], "g1n2", MODEL, gpu_speed=[1.0, 1.0, 1.0])
    for bad in (0.0, 5e-324, 1e4, float("nan")):  # outside what a plan file may hold
        with pytest.raises(ValueError, match=r"must lie in 0.001..1000"):
            plan_routing([[10], [20]], "g1n2", MODEL, gpu_speed=[1.0, bad])
    record = plan_routing([[10], [20]], "g1n2", MODEL, gpu_speed=[1.0, 0.5]).model_dump()
    record["gpu_speed"] = [1.0, -1.0]
    with pytest.raises(ValueError, match="gpu_speed of GPU"):
        RoutingPlan.model_validate(record)


def test_loads_show_in_ms_when_calibrated_else_relative_to_the_mean():
    lengths = [[4096, 300], [1024], [2048, 2048], [512]]
    relative = plan_routing(lengths, "g1n2+g2n1", MODEL)
    unit = LoadUnit.of(relative)
    assert unit.relative and unit.name == "× mean"
    assert unit.format(relative.stats.mean_load) == "1.00"
    calibrated = WorkloadModel(3072, 0.4, scale=1000.0, unit="ms")
    in_ms = plan_routing(lengths, "g1n2+g2n1", calibrated)
    assert in_ms.workload_unit == "ms" and in_ms.scale == 1000.0
    ms = LoadUnit.of(in_ms)
    assert not ms.relative
    assert ms.format(in_ms.stats.makespan_after).endswith(" ms")
    assert ms.format(1234.5) == "1,230 ms"


@pytest.mark.parametrize(
    ("value", "text"),
    [(12345.6, "12,300"), (1.23456, "1.23"), (0.00123456, "0.00123"), (9.996, "10.0"), (0, "0")],
)
def test_three_significant_figures_with_thousands_separators(value, text):
    assert significant(value) == text


def test_calibrated_model_says_its_unit():
    lengths = np.array([256, 1024, 4096, 16384])
    latency = 2e3 * MODEL.workload(lengths)
    model, error = WorkloadModel.calibrate(lengths, latency, 3072)
    assert model.unit == "ms" and error < 1e-9


def test_rounding_a_column_agrees_with_rounding_each_value():
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [rng.lognormal(0, 4, 500), -rng.lognormal(0, 2, 50), [0.0, np.inf, np.nan, 9.996]]
    )
    rounded = round_significant_array(values)
    expected = [round_significant(v) for v in values.tolist()]
    np.testing.assert_allclose(rounded, expected, rtol=1e-12, equal_nan=True)
    assert rounded[-1] == 10.0
