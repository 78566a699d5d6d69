import copy
import json
from contextlib import contextmanager
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.planning import fixed, levelling
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.greedy_python import greedy_plan_python

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)


@st.composite
def problems(draw):
    sizes = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4, 8]), min_size=1, max_size=6))
    topo = Topology.from_bag_sizes(sizes)
    length = st.one_of(st.just(0), st.integers(1, 7), st.integers(1, 20000))
    lengths = [draw(st.lists(length, min_size=0, max_size=6)) for _ in range(topo.num_gpus)]
    return topo, lengths


def _content(plan: RoutingPlan) -> dict:
    d = json.loads(plan.model_dump_json())
    d.pop("time")
    d.pop("measurements")
    return d


def _check_plan(plan: RoutingPlan, topo: Topology, lengths) -> None:
    RoutingPlan.model_validate_json(plan.model_dump_json())  # every invariant holds
    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in lengths] or [[]])
    st_ = plan.stats
    assert np.array_equal(plan.sequences.length, flat)
    assert st_.tokens_after.sum() == st_.tokens_before.sum() == flat.sum()
    assert st_.makespan_after >= st_.lower_bound * (1 - 1e-9)
    # a sequence goes to a bag larger than itself only as the rule's fallback: the largest bags
    size = np.array([len(b) for b in plan.bags])[plan.sequences.bag]
    positive = flat > 0
    assert np.all((size[positive] <= flat[positive]) | (size[positive] == topo.max_bag_size))


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Steps up to fixed.ONE_BY_ONE sequences are placed one by one, larger ones mostly in
# bulk; small search rounds score every pair (up to levelling.DENSE_CELLS), large ones only
# the nearest candidates; a pool of more than fixed.POUR_TAIL sequences is poured. The drawn
# problems are small, so each property is also checked with those limits at 0 (every
# step takes the large-step paths).
ONE_BY_ONE = st.sampled_from(
    [
        (fixed.ONE_BY_ONE, levelling.DENSE_CELLS, fixed.POUR_TAIL),
        (0, levelling.DENSE_CELLS, fixed.POUR_TAIL),
        (0, levelling.DENSE_CELLS, 0),
        (fixed.ONE_BY_ONE, 0, fixed.POUR_TAIL),
        (0, 0, 0),
    ]
)


@contextmanager
def _limit(limits: tuple[int, int, int]):
    one_by_one, dense_cells, pour = limits
    with (
        patch.object(fixed, "ONE_BY_ONE", one_by_one),
        patch.object(levelling, "DENSE_CELLS", dense_cells),
        patch.object(fixed, "POUR_TAIL", pour),
    ):
        yield


@SETTINGS
@given(problems(), st.sampled_from(["knapformer", "greedy"]), ONE_BY_ONE)
def test_plans_are_valid_conserve_tokens_and_respect_bounds(problem, solver, one_by_one):
    topo, lengths = problem
    with _limit(one_by_one):
        plan = plan_routing(lengths, topo, MODEL, solver=solver)
    _check_plan(plan, topo, lengths)


@SETTINGS
@given(problems(), st.sampled_from(["knapformer", "greedy"]), ONE_BY_ONE)
def test_planner_is_deterministic(problem, solver, one_by_one):
    topo, lengths = problem
    with _limit(one_by_one):
        first = plan_routing(lengths, topo, MODEL, solver=solver)
        second = plan_routing([list(x) for x in lengths], str(topo), MODEL, solver=solver)
    assert _content(first) == _content(second)


@SETTINGS
@given(problems(), ONE_BY_ONE)
def test_default_solver_makespan_is_no_worse_than_greedy(problem, one_by_one):
    topo, lengths = problem
    with _limit(one_by_one):
        ours = plan_routing(lengths, topo, MODEL).stats
    greedy = plan_routing(lengths, topo, MODEL, solver="greedy").stats
    assert ours.makespan_after <= greedy.makespan_after + 1e-3 * ours.lower_bound + 1e-12


@SETTINGS
@given(problems(), st.floats(0.3, 3.0), ONE_BY_ONE)
def test_token_cap_is_respected_or_reported(problem, slack, one_by_one):
    topo, lengths = problem
    total = sum(sum(x) for x in lengths)
    cap = max(1, int(slack * total / topo.num_gpus) + max(max(x, default=0) for x in lengths))
    try:
        with _limit(one_by_one):
            plan = plan_routing(lengths, topo, MODEL, max_tokens_per_gpu=cap)
    except ValueError as err:
        assert "max_tokens_per_gpu" in str(err)
        return
    _check_plan(plan, topo, lengths)
    assert plan.stats.tokens_after.max() <= cap


@SETTINGS
@given(problems())
def test_greedy_matches_the_plain_python_transcription(problem):
    topo, lengths = problem
    plan = plan_routing(lengths, topo, MODEL, solver="greedy")
    ref = greedy_plan_python(lengths, list(topo.bag_sizes), MODEL.token_dim, MODEL.gamma)
    assert plan.sequences.bag.tolist() == [s["bag"] for s in ref["sequences"].values()]
    for name in ("seq", "dst_gpu", "offset", "length"):
        assert getattr(plan.chunks, name).tolist() == [c[name] for c in ref["chunks"]]


def _exchange_outcome(args, moves) -> list[tuple[int, int, float]]:
    """(over-loaded bag, partner, larger of the two loads per GPU after) per exchange."""
    _, _, members, _, weight, per_gpu, _, _ = args
    outcome = []
    for a, b, out_of_a, out_of_b in moves:
        net = members.workload[out_of_a] - (members.workload[out_of_b] if out_of_b >= 0 else 0)
        outcome.append((a, b, max(per_gpu[a] - net / weight[a], per_gpu[b] + net / weight[b])))
    return outcome


def test_both_exchange_searches_find_equally_good_exchanges():
    # Scoring every pair (small rounds) and only the two candidates nearest the ideal
    # exchange per partner (large rounds) must pick equally good exchanges: the same bag
    # pairs, leaving the same larger load (ties between sequences may differ).
    real, calls = levelling._best_exchanges, []

    def spy(*args):
        calls.append(copy.deepcopy(args))  # the search state changes after the call
        return real(*args)

    with patch.object(levelling, "_best_exchanges", spy):
        for topo in ("g4n8", "g8n4", "g1n32", "g1n8+g2n4+g4n2+g8n1"):
            for seed in range(4):
                for mix in ("mixres", "joint", "lowres"):
                    lengths = sample_lengths(parse_mix(mix), np.random.default_rng(seed))
                    plan_routing(lengths, topo, MODEL)
    assert len(calls) >= 20
    for args in calls:
        with patch.object(levelling, "DENSE_CELLS", 10**9):
            every = _exchange_outcome(args, real(*args))
        with patch.object(levelling, "DENSE_CELLS", 0):
            nearest = _exchange_outcome(args, real(*args))
        assert [m[:2] for m in every] == [m[:2] for m in nearest]
        assert np.allclose([m[2] for m in every], [m[2] for m in nearest], rtol=1e-12)


def test_default_solver_moves_far_fewer_tokens_at_g1n32():
    lengths = sample_lengths(parse_mix("lowres"), np.random.default_rng(0))
    ours = plan_routing(lengths, "g1n32", MODEL).stats
    greedy = plan_routing(lengths, "g1n32", MODEL, solver="greedy").stats
    assert ours.moved_fraction <= greedy.moved_fraction / 4
    assert ours.makespan_over_lb <= greedy.makespan_over_lb + 1e-3


@SETTINGS
@given(problems(), ONE_BY_ONE)
def test_default_solver_spreads_each_bags_tokens_evenly(problem, one_by_one):
    # The remainder tokens (L % g) of the bag's sequences never pile onto one GPU: every
    # GPU of a bag holds within one token of the others.
    topo, lengths = problem
    with _limit(one_by_one):
        plan = plan_routing(lengths, topo, MODEL)
    tokens = plan.stats.tokens_after
    for members in plan.bags:
        held = tokens[np.asarray(members)]  # ranks are positions here
        assert held.max() - held.min() <= 1, (members, held.tolist())


def test_whole_sequences_stay_home_when_balanced():
    lengths = [[1000, 2000]] * 4
    plan = plan_routing(lengths, "g1n4", MODEL)
    assert plan.stats.moved_tokens == 0


def test_ranks_of_a_replica_are_used_in_the_plan():
    plan = plan_routing([[5], [7], [9], [11]], "g2n2", MODEL, gpus=[4, 5, 6, 7])
    assert plan.gpus == [4, 5, 6, 7] and plan.bags == [[4, 5], [6, 7]]
    assert set(plan.chunks.dst_gpu.tolist()) <= {4, 5, 6, 7}
    plan.validated()


def test_infeasible_token_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="max_tokens_per_gpu=10 is infeasible: sequence 0"):
        plan_routing([[100], [1]], "g1n2", MODEL, max_tokens_per_gpu=10)


@pytest.mark.parametrize(
    ("lengths", "topo", "kwargs", "fragment"),
    [
        ([[1], [2]], "g1n4", {}, "lengths were given for 2 GPUs"),
        ([[1], [-2]], "g1n2", {}, "negative"),
        ([[1.5], [2]], "g1n2", {}, "whole numbers"),
        ([[1], [2]], "g1n2", {"solver": "magic"}, "unknown solver 'magic'"),
        ([[1], [2]], "g1n2", {"max_tokens_per_gpu": 0}, "max_tokens_per_gpu"),
    ],
)
def test_bad_planner_input_is_named(lengths, topo, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        plan_routing(lengths, topo, MODEL, **kwargs)


def test_empty_group_plans_nothing():
    plan = plan_routing([[], [], [], []], "g2n2", MODEL)
    assert len(plan.sequences) == 0 and len(plan.chunks) == 0
    plan.validated()
