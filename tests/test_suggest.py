"""Topology suggestion: enumeration, the cost (planning/communication.py's), the ranking of
fixed topologies and auto."""

from __future__ import annotations

import pytest

from knapformer.cli import main
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel, plan_cost
from knapformer.planning.datamix import parse_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.suggest import StepCost, enumerate_topologies, fit_mix, suggest


def test_enumeration_fits_and_is_bounded():
    topos = enumerate_topologies(32, max_bag=8)
    names = {str(t) for t in topos}
    assert len(names) == len(topos)  # no duplicates
    assert all(t.num_gpus == 32 for t in topos)
    assert all(s in (1, 2, 4, 8) for t in topos for s in t.bag_sizes)
    assert {"g1n32", "g2n16", "g4n8", "g8n4", "g1n16+g4n2+g8n1"} <= names
    assert all(len(set(t.bag_sizes)) <= 3 for t in topos)
    assert len(topos) < 200
    assert all(t.max_bag_size <= 4 for t in enumerate_topologies(32, max_bag=4))
    # A GPU count that eighths do not divide still gets its homogeneous layouts.
    assert {"g1n6", "g2n3"} <= {str(t) for t in enumerate_topologies(6, max_bag=8)}
    with pytest.raises(ValueError, match="power of two"):
        enumerate_topologies(32, max_bag=3)


def test_cost_model_by_hand():
    # One sequence of 1000 tokens on GPU 0, one bag of 2 GPUs: 500 tokens each.
    d = 8
    plan = plan_routing([[1000], []], "g2n1", WorkloadModel(d, gamma=0.5))
    comm = CommModel(tflops=1.0, intra_gbs=1.0, inter_gbs=1.0, layers=3)
    c = StepCost.of(plan, comm)
    work = (24 * 1000 * d * d + 0.5 * 4 * 1000**2 * d) / 1e12
    compute_ms = work / 2 / 1.0 * 1e3
    ulysses_ms = 4 * (1 / 2) * 500 * d * 2 / 1e9 * 1e3  # 4 all-to-alls, half the rows leave
    route_ms = 500 * d * 2 / 1e9 * 1e3  # GPU 0 sends 500 tokens on route, GPU 1 sends them back
    assert c.compute_ms == pytest.approx(3 * compute_ms)
    assert c.ulysses_ms == pytest.approx(3 * ulysses_ms)
    assert c.routing_ms == pytest.approx(route_ms)
    assert c.step_ms == pytest.approx(3 * (compute_ms + ulysses_ms) + route_ms)
    assert c.unbalanced_ms == pytest.approx(3 * work * 1e3)
    # One home for the cost: the same figures as plan_cost's.
    assert c.step_ms == pytest.approx(plan_cost(plan, comm).step_ms)


def test_joint_ranks_multi_gpu_bags_above_single_gpu_bags():
    ranked = suggest(parse_mix("joint"), 32, steps=2, auto=False)
    names = [str(s.topology) for s in ranked]
    assert len(names) == len(enumerate_topologies(32))
    assert ranked[0].topology.max_bag_size > 1
    single = ranked[names.index("g1n32")]
    assert names.index("g8n4") < names.index("g1n32") and names.index("g4n8") < names.index("g1n32")
    assert single.step_ms > 1.5 * ranked[0].step_ms
    assert ranked[0].speedup > 1.5
    assert [s.step_ms for s in ranked] == sorted(s.step_ms for s in ranked)
    assert "load 2." in ranked[names.index("g1n32")].reasons(ranked[0])


def test_bigger_bags_are_not_free():
    # lowres: every sequence is small, so splitting it only adds Ulysses traffic.
    ranked = suggest(parse_mix("lowres"), 32, steps=2)
    assert str(ranked[0].topology) == "g1n32"
    # auto keeps every GPU alone too, and ties rank the fixed layout first
    auto = next(s for s in ranked if s.auto)
    assert auto.partitions == {"g1n32": 2} and auto.step_ms == pytest.approx(ranked[0].step_ms)
    g8n4 = next(s for s in ranked if str(s.topology) == "g8n4")
    assert g8n4.ulysses_ms > 0 and g8n4.step_ms > ranked[0].step_ms
    # Halving the node's bandwidth doubles the Ulysses time of groups inside a node.
    slow = suggest(parse_mix("lowres"), 32, steps=2, comm=CommModel(intra_gbs=150.0),
                   topologies=[Topology.parse("g8n4")], auto=False)[0]  # fmt: skip
    assert slow.ulysses_ms == pytest.approx(2 * g8n4.ulysses_ms)


@pytest.mark.parametrize("cluster", ["nvlink", "pcie"])
def test_auto_is_ranked_and_never_slower_than_a_fixed_topology(cluster):
    comm = CommModel.cluster(cluster)
    ranked = suggest(parse_mix("joint"), 32, steps=2, comm=comm)
    auto = next(s for s in ranked if s.auto)
    fixed = [s for s in ranked if not s.auto]
    assert len(fixed) == len(enumerate_topologies(32))
    # Per step, auto's modelled time is at most any fixed layout's of its family (gXnY).
    for s in fixed:
        if len(set(s.topology.bag_sizes)) == 1:
            for a, f in zip(auto.costs, s.costs, strict=True):
                assert a.step_ms <= f.step_ms * (1 + 1e-9), (s.name, cluster)
    assert auto.step_ms < next(s for s in fixed if s.name == "g8n4").step_ms
    assert sum(auto.partitions.values()) == 2 and "chose " in auto.reasons(ranked[0])
    # compute and communication apart, adding up to the step of the slowest GPU
    for c in auto.costs:
        assert c.step_ms == pytest.approx(c.compute_ms + c.ulysses_ms + c.routing_ms)


def test_mix_is_repeated_for_a_multiple_of_its_gpus():
    assert sum(c.gpus for c in fit_mix(parse_mix("joint"), 64)) == 64
    with pytest.raises(KnapformerError, match="gpus 48 must be a multiple of 32"):
        fit_mix(parse_mix("joint"), 48)


def test_cli_names_its_own_flag_in_option_errors(capsys):
    assert main(["suggest", "--data-codes", "joint", "--gpus", "48"]) == 1
    err = capsys.readouterr().err
    assert err == "error: the data mix fills 32 GPUs; --gpus 48 must be a multiple of 32\n"


def test_cli_ranking(capsys):
    code = main(["suggest", "--data-codes", "joint", "--gpus", "32", "--steps", "1", "--top", "3",
                 "--intra-gbs", "200", "--cluster", "infiniband"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "infiniband: 200 GB/s in a node of 8, 50 GB/s across" in out and "suggested:" in out
    rows = [line.split("│")[2].strip() for line in out.splitlines() if line.count("│") > 3]
    assert "g1n32" in rows and "auto" in rows  # the baseline and auto are always listed
    code = main(["suggest", "--data-codes", "joint", "--gpus", "32", "--steps", "1", "--no-auto"])
    assert code == 0 and "│ auto " not in capsys.readouterr().out
    assert main(["suggest", "--data-codes", "joint", "--gpus", "32", "--intra-gbs", "0"]) == 1
    assert "--intra-gbs is 0 GB/s; it must lie in 0.001..1e+06" in capsys.readouterr().err
    assert main(["suggest", "--data-codes", "joint", "--gpus", "32", "--cluster", "x"]) == 1
    assert "unknown cluster 'x'" in capsys.readouterr().err
