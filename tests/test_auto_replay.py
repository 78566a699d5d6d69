"""Plans of topology="auto" offline: `knapformer replay` re-plans them with their own
options and executes them in their own bags; the legacy export follows each step's bags."""

from __future__ import annotations

import json

import numpy as np
from in_process import run_here

from knapformer.contract.legacy import plan_from_legacy, plan_to_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import write_json
from knapformer.planning.communication import CommModel
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.replay import bag_sizes, default_heads, replay

MODEL = WorkloadModel(32, 0.4)
# Fast links at a tiny width, nodes of 4: long sequences get groups, short ones stay home.
COMM = CommModel(intra_gbs=3000.0, inter_gbs=750.0, node_size=4)
SHORT = [[13, 27, 9], [31, 5], [22, 18, 7], [0, 36], [], [25, 11], [14, 30, 6], [19]]


def _with(extra: dict[int, list[int]]) -> list[list[int]]:
    return [extra.get(r, []) + s for r, s in enumerate(SHORT)]


STEPS = [SHORT, _with({2: [1200]}), _with({0: [400], 7: [250]}), _with({5: [300], 2: [150]})]


def _plans(gpus: list[int] | None = None) -> list[RoutingPlan]:
    return [
        plan_routing(lengths, "auto", MODEL, comm=COMM, gpus=gpus, step=step, run="auto")
        for step, lengths in enumerate(STEPS)
    ]


def test_an_auto_plan_replays_with_its_own_options_in_its_own_bags():
    plan = _plans(gpus=list(range(8, 16)))[2]  # a second replica's ranks
    assert plan.bags == [[8, 9, 10, 11], [12, 13], [14], [15]]  # rank order, mixed sizes
    # The default links would not split these sequences: only the plan's own comm does.
    assert plan_routing(STEPS[2], "auto", MODEL).topology == "g1n8"
    assert bag_sizes(plan) == [1, 2, 4] and default_heads(plan) == 4
    result = replay(plan, dim=32, heads=8, start_method="fork")
    assert result.replanned and result.plan_difference is None, result.first_problem
    assert result.ok, result.first_problem
    # Ulysses ran in the plan's bags: the groups of 4 and of 2 exchanged, single GPUs did not.
    ulysses = {r.rank: r.timings_ms.get("pre_attn") for r in result.ranks}
    assert all(ulysses[r] is not None for r in range(6))
    assert ulysses[6] is None and ulysses[7] is None


def test_a_changed_auto_plan_is_named():
    plan = _plans()[1]
    # Recorded with other links: the re-plan with those links differs from this routing.
    data = json.loads(plan.model_dump_json())
    data["solver_options"]["comm"]["intra_gbs"] = 300.0
    data["solver_options"]["comm"]["inter_gbs"] = 50.0
    changed = RoutingPlan.model_validate(data)
    result = replay(changed, dim=32, heads=8, start_method="fork")
    assert not result.ok and result.routing_errors == []
    assert result.plan_difference.startswith("topology: recorded 'g4n2', planned 'g1n8'")


def test_cli_replays_an_auto_plan(tmp_path):
    path = tmp_path / "plan.json"
    write_json(path, _plans()[3])
    proc = run_here("replay", str(path), "--dim", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "g1n4+g4n1" in proc.stdout and "identical plan" in proc.stdout
    assert "verdict: OK" in proc.stdout


def test_legacy_export_follows_each_steps_bags():
    plans = _plans()
    assert len({p.topology for p in plans}) == len(plans)
    for plan in plans:
        legacy = plan_to_legacy(plan)
        bags = {int(b): gpus for b, gpus in legacy["bag_id2gpu_ids"].items()}
        assert [bags[b] for b in sorted(bags)] == plan.bags
        for gpu, bag in legacy["gpu_id2bag_id"].items():
            assert int(gpu) in plan.bags[bag]
        # Every chunk goes to a GPU of its sequence's bag of this step.
        seq_bag = plan.sequences.bag
        for chunk, gpu in legacy["balance_chunk_id2gpu_id"].items():
            seq = legacy["chunk_id2seq_id"][chunk]
            assert gpu in plan.bags[int(seq_bag[seq])]
        back = plan_from_legacy(json.loads(json.dumps(legacy)))
        assert back.bags == plan.bags and back.topology == plan.topology
        assert np.array_equal(back.sequences.bag, plan.sequences.bag)
        np.testing.assert_allclose(back.stats.load_after, plan.stats.load_after, rtol=1e-12)
