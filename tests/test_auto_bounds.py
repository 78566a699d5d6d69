"""The bounds topology="auto" skips candidates by: a true floor of the modelled makespan, and
a skip that leaves the plan as it was."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from knapformer.planning import auto as auto_solver
from knapformer.planning.bags import bag_shape
from knapformer.planning.bounds import makespan_ceiling, makespan_floor, routed_floor
from knapformer.planning.chunks import chunk_table
from knapformer.planning.communication import CLUSTERS, CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.fixed import solve_default, solve_greedy
from knapformer.planning.mixed import solve_mixed
from knapformer.planning.partitions import mixed_partitions
from knapformer.planning.planner import plan_routing
from knapformer.planning.pricing import modelled_makespan
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
SIZES = (1, 2, 4, 8)


def _per_token(comm: CommModel) -> dict[int, float]:
    return {g: comm.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in SIZES}


def _steps(mix: str, factor: int, seed: int, comm: CommModel):
    """Solved steps of one sampled step of ``mix`` on 32 x ``factor`` GPUs: its best mixed
    partition (if any), g2/g4/g8 by the default solver and by greedy under either chunk rule,
    and each of them again with a tenth of its sequences thrown into random bags (placed
    away from home, across nodes)."""
    per_gpu = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(seed))
    n = len(per_gpu)
    lengths = np.concatenate(per_gpu).astype(np.int64)
    src = np.repeat(np.arange(n), [len(x) for x in per_gpu])
    workload = MODEL.workload(lengths)
    steps = []
    per_token = _per_token(comm)
    mixed = mixed_partitions(workload, lengths, src, n, SIZES, per_token, int(comm.node_size))
    if mixed:
        steps.append(solve_mixed(mixed[0].bag_sizes, lengths, workload, src, None, None,
                                 per_token, 0.0, comm, MODEL))  # fmt: skip
    for g in (2, 4, 8):
        shape = bag_shape((g,) * (n // g))
        steps.append(solve_default(shape, lengths, workload, src, None, None))
        steps.append(solve_greedy(shape, lengths, workload, src, None, None, even=False))
    rng = np.random.default_rng(seed)
    for step in list(steps):
        moved = replace(step, bag=step.bag.copy())
        pick = rng.choice(len(lengths), len(lengths) // 10, replace=False)
        moved.bag[pick] = rng.integers(0, len(step.layout.size), len(pick))
        steps.append(moved)
    return steps


def _exact(step, comm) -> float:
    step.chunks = chunk_table(step)
    return modelled_makespan(step, MODEL, comm, None)


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("node_size", [4, 8])
@pytest.mark.parametrize("mix", ["mixres", "joint", "video", "seqheavy"])
def test_routed_floor_never_exceeds_the_modelled_makespan(mix, node_size, cluster):
    """Whatever the placement (solved, or sequences thrown across nodes), the layout, the
    chunk rule, the cluster or the node size, the routed floor stays at or below the
    makespan the chunk table models."""
    comm = CommModel(**CLUSTERS[cluster], node_size=node_size)
    for step in _steps(mix, 1, 11, comm):
        floor = routed_floor(step, MODEL, comm, _per_token(comm))
        assert 0.0 < floor <= _exact(step, comm) * (1 + 1e-12)


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("node_size", [4, 8])
@pytest.mark.parametrize("mix", ["mixres", "joint", "seqheavy"])
def test_ceiling_never_falls_below_the_modelled_makespan(mix, node_size, cluster):
    """Whatever the placement, the layout, the chunk rule, the cluster or the node size, the
    routed ceiling stays at or above the makespan the chunk table models, and at or below
    the ceiling; on the solved mixed partition of NVLink nodes of 8, it lies within 0.1 %
    of it (a short sequence's remainder is spread over a bag's cycle, not charged to every
    GPU)."""
    comm = CommModel(**CLUSTERS[cluster], node_size=node_size)
    steps = _steps(mix, 1, 11, comm)
    per_token = _per_token(comm)
    for step in steps:
        routed = makespan_ceiling(step, MODEL, comm, per_token, routed=True)
        assert _exact(step, comm) * (1 - 1e-12) <= routed
        assert routed <= makespan_ceiling(step, MODEL, comm, per_token) * (1 + 1e-12)
    if (mix, node_size, cluster) == ("seqheavy", 8, "nvlink"):
        mixed = steps[0]
        assert len(set(mixed.layout.size.tolist())) > 1
        assert makespan_ceiling(mixed, MODEL, comm, per_token, routed=True) < 1.001 * _exact(
            mixed, comm
        )


def test_routed_floor_sees_the_route_a_compute_only_layout_pays():
    """On the sequence-heavy mix, a whole-family layout solved compute-only sends most of a
    crowded GPU's sequences away: its bag floor sits below the best mixed partition's
    makespan, its routed floor above it, within 0.5 % of its own exact makespan."""
    comm = CommModel.cluster("nvlink")
    mixed, *fixed = _steps("seqheavy", 4, 5, comm)[:7]
    best = _exact(mixed, comm)
    g4 = fixed[2]  # the default solver's g4n32
    assert len(g4.layout.size) == 32 and g4.layout.even
    assert (
        makespan_floor(g4, _per_token(comm))
        < best
        < routed_floor(g4, MODEL, comm, _per_token(comm))
    )
    assert routed_floor(g4, MODEL, comm, _per_token(comm)) > 0.995 * _exact(g4, comm)


def _record_pricing(monkeypatch) -> list:
    """The steps auto prices exactly from now on (`_exact_key` recorded as it is called)."""
    priced: list = []
    exact_key = auto_solver._exact_key
    monkeypatch.setattr(auto_solver, "_exact_key",
                        lambda step, *a: priced.append(step) or exact_key(step, *a))  # fmt: skip
    return priced


@pytest.mark.parametrize(("mix", "factor", "seed"), [("seqheavy", 32, 5), ("mixres", 64, 5000)])
def test_auto_settles_its_candidates_by_bounds_without_pricing_them(mix, factor, seed, monkeypatch):
    """Bounds settle the candidates without an exact price. The sequence-heavy mix on 1,024
    GPUs: the mixed partition's routed floor lies above g4n256's floor before its solve,
    and its ceiling below the bag floors of g4n256 and g8n128 solved: it wins unpriced.
    The high-resolution mix on 2,048 GPUs: g4n512's ceiling lies below the mixed
    partition's routed floor, and it wins with neither priced. Without the routed floor
    more are priced; the plans are the same."""
    lengths = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(seed))
    comm = CommModel.cluster("nvlink")
    priced = _record_pricing(monkeypatch)
    plan = plan_routing(lengths, "auto", MODEL, comm=comm)
    assert priced == []
    assert plan.topology == "g4n512" if mix == "mixres" else "+" in plan.topology
    with_bounds = len(priced)
    priced.clear()
    monkeypatch.setattr(auto_solver, "routed_floor", lambda *a: 0.0)
    before = plan_routing(lengths, "auto", MODEL, comm=comm)
    assert len(priced) > with_bounds
    assert before.topology == plan.topology
    assert np.array_equal(before.sequences.bag, plan.sequences.bag)
    assert np.array_equal(before.chunks.dst_gpu, plan.chunks.dst_gpu)
    assert np.array_equal(before.chunks.length, plan.chunks.length)


def test_the_routed_ceiling_settles_what_the_ceiling_leaves_open(monkeypatch):
    """The high-resolution mix on 1,024 GPUs: the plain ceilings of g4n256 and the mixed
    partition leave their comparison open, and both were priced; their routed ceilings
    settle it with neither priced, and the plan is the same."""
    lengths = sample_lengths(scale_mix(parse_mix("mixres"), 32), np.random.default_rng(5000))
    comm = CommModel.cluster("nvlink")
    priced = _record_pricing(monkeypatch)
    plan = plan_routing(lengths, "auto", MODEL, comm=comm)
    assert plan.topology == "g4n256" and priced == []
    ceiling = auto_solver.makespan_ceiling

    def plain_only(step, model, comm, per_token, routed=False):
        return np.inf if routed else ceiling(step, model, comm, per_token)

    monkeypatch.setattr(auto_solver, "makespan_ceiling", plain_only)
    without = plan_routing(lengths, "auto", MODEL, comm=comm)
    assert len(priced) == 2
    assert without.topology == plan.topology
    assert np.array_equal(without.sequences.bag, plan.sequences.bag)
