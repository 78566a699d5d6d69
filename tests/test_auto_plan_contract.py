"""`validate` refuses every auto plan (``policy: "auto"``) that `replay` cannot run: its
group sizes, bag sizes and alignment are checked against the plan's own options
(`knapformer.contract.alignment`), and its cluster figures like the options that set
them; each error names the field (issue 35: ``group_sizes`` [3], a 3-GPU bag and
unaligned bags validated, then replay failed or said MISMATCH, one failure speaking of
"the GPU count of a topology is 16,391")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.contract.alignment import auto_layout_problem, is_aligned
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import parse_plan_record
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.replay import check_options

MODEL = WorkloadModel(3072)
LENGTHS = [[6000, 2000], [2000], [1700, 5], [1200]]  # auto makes g2n2: [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def auto_plan() -> dict:
    plan = plan_routing(LENGTHS, "auto", MODEL, step=0)
    assert plan.policy == "auto" and plan.bags == [[0, 1], [2, 3]]
    return json.loads(plan.model_dump_json())


def _ranks_renamed(record: dict, rename: dict[int, int]) -> dict:
    """``record`` with GPU ranks renamed (``gpus`` keeps its order, so a bag's positions
    change), its sequences and chunks put back in canonical order."""
    out = json.loads(json.dumps(record))
    new = lambda ranks: [rename.get(r, r) for r in ranks]  # noqa: E731
    out["bags"] = [new(b) for b in record["bags"]]
    seqs, chunks = record["sequences"], record["chunks"]
    src = np.asarray(new(seqs["src_gpu"]))
    order = np.argsort([out["gpus"].index(r) for r in src], kind="stable")
    seq_id = np.empty(len(order), dtype=int)
    seq_id[order] = np.arange(len(order))
    out["sequences"] = {k: [v[i] for i in order] for k, v in seqs.items()}
    out["sequences"]["src_gpu"] = [int(src[i]) for i in order]
    moved = {
        "seq": [int(seq_id[s]) for s in chunks["seq"]],
        "src_gpu": new(chunks["src_gpu"]),
        "dst_gpu": new(chunks["dst_gpu"]),
        "offset": chunks["offset"],
        "length": chunks["length"],
    }
    rows = sorted(range(len(moved["seq"])), key=lambda i: (moved["seq"][i], moved["offset"][i]))
    out["chunks"] = {k: [v[i] for i in rows] for k, v in moved.items()}
    return out


def _edited(record: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(record))
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


GROUP_SIZES, COMM = ("solver_options", "group_sizes"), ("solver_options", "comm")
CASES = {
    "group-size-3": (GROUP_SIZES, [3], "solver_options.group_sizes: 3 is not a power of two"),
    "group-size-16384": (
        GROUP_SIZES,
        [1, 2, 4, 16384],
        "solver_options.group_sizes: 16,384 does not divide the 4 GPUs",
    ),
    "bag-size-not-allowed": (
        GROUP_SIZES,
        [1, 4],
        "bags[0] holds 2 GPUs; an auto plan's bags have the sizes of "
        "solver_options.group_sizes [1, 4]",
    ),
    "node-6": (
        (*COMM, "node_size"),
        6,
        "solver_options.comm.node_size: node_size 6 is not a power of two",
    ),
    "node-fraction": ((*COMM, "node_size"), 8.5, "node_size must be a whole number, got 8.5"),
    "node-huge": ((*COMM, "node_size"), 2.0**70, "node_size is 1,180,591,620,717,411,303,424"),
    "tflops-1e308": ((*COMM, "tflops"), 1e308, "tflops is 1e+308 TFLOP/s; it must lie in"),
    "gbs-subnormal": ((*COMM, "inter_gbs"), 5e-324, "inter_gbs is 4.94066e-324 GB/s"),
    "comm-unknown-key": ((*COMM, "bandwidth"), 1.0, "solver_options.comm.bandwidth"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_auto_plan_replay_cannot_run_is_refused_naming_the_field(
    auto_plan, case, tmp_path, capsys
):
    path, value, expected = CASES[case]
    record = _edited(auto_plan, path, value)
    with pytest.raises(ValueError) as refused:
        parse_plan_record(record)
    assert expected in str(refused.value), str(refused.value)
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(record))
    for command in (["validate", str(file)], ["replay", str(file)]):
        assert main(command) == 1
        out, err = capsys.readouterr()
        assert expected in out + err and "Traceback" not in out + err
        assert "GPU count of a topology" not in out + err


def test_unaligned_bags_are_refused_and_aligned_renamings_are_not(auto_plan, tmp_path, capsys):
    unaligned = _ranks_renamed(auto_plan, {1: 2, 2: 1})  # bags [[0, 2], [1, 3]]
    assert unaligned["bags"] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"bags\[0\] is not aligned \(positions 0, 2 in gpus\)"):
        parse_plan_record(unaligned)
    fixed = {**unaligned, "policy": "fixed", "topology": "g2n2", "solver_options": {}}
    with pytest.raises(ValueError, match=r"bags\[0\] \[0, 2\] is not a bag of topology 'g2n2'"):
        parse_plan_record(fixed)  # the runtime makes groups [0, 1] and [2, 3] only
    (tmp_path / "fixed.json").write_text(json.dumps(fixed))
    assert main(["replay", str(tmp_path / "fixed.json")]) == 1  # before: a worker's error
    assert "is not a bag of topology 'g2n2'" in capsys.readouterr().err
    swapped = _ranks_renamed(auto_plan, {0: 2, 1: 3, 2: 0, 3: 1})  # bags [[2, 3], [0, 1]]
    assert parse_plan_record(swapped).bags == [[2, 3], [0, 1]]
    reversed_bag = _edited(auto_plan, ("bags",), [[1, 0], [2, 3]])
    reversed_bag = _ranks_renamed(reversed_bag, {})
    with pytest.raises(ValueError, match=r"bags\[0\] is not aligned \(positions 1, 0"):
        parse_plan_record(reversed_bag)


def test_bags_the_planner_could_not_have_chosen_are_refused_without_group_sizes():
    plan = plan_routing([[600], [9], [170], [2]], "g1n1+g3n1", MODEL, step=0)
    record = json.loads(plan.model_dump_json())
    record["policy"] = "auto"
    with pytest.raises(ValueError, match="bag size: 3 is not a power of two"):
        parse_plan_record(record)
    six = json.loads(plan_routing([[9]] * 6, "g2n3", MODEL, step=0).model_dump_json())
    six["policy"] = "auto"
    with pytest.raises(ValueError, match="gpus: 6 GPUs, fewer than a node of 8, are not a power"):
        parse_plan_record(six)
    six["solver_options"] = {"comm": {"node_size": 2}, "group_sizes": [1, 2, 4]}
    with pytest.raises(ValueError, match="group_sizes: 4 does not divide the 6 GPUs"):
        parse_plan_record(six)
    six["solver_options"]["group_sizes"] = [2]
    assert parse_plan_record(six).bags == [[0, 1], [2, 3], [4, 5]]


def test_replay_of_a_plan_built_in_python_names_the_field(auto_plan):
    plan = RoutingPlan.model_validate(auto_plan)
    broken = plan.model_copy(update={"solver_options": {**plan.solver_options, "group_sizes": [3]}})
    with pytest.raises(
        ValueError, match=r"plan cannot be replayed: solver_options\.group_sizes: 3"
    ):
        check_options(broken)
    assert check_options(plan) == (32, 4)


def test_plans_the_planner_makes_in_every_layout_are_aligned():
    rng = np.random.default_rng(3)
    for num_gpus, node in ((4, 8), (8, 8), (16, 4), (8, 2)):
        from knapformer.planning.communication import CommModel

        comm = CommModel(node_size=node)
        for _ in range(4):
            lengths = [
                list(rng.integers(1, 9000, size=rng.integers(1, 4))) for _ in range(num_gpus)
            ]
            plan = plan_routing(lengths, "auto", MODEL, comm=comm, cross_node=True)
            validated = RoutingPlan.model_validate(json.loads(plan.model_dump_json()), strict=True)
            assert validated.bags == plan.bags
            positions = [[plan.gpus.index(r) for r in bag] for bag in plan.bags]
            assert all(is_aligned(p) for p in positions)
            members = np.array([p for bag in positions for p in bag])
            sizes = np.array([len(bag) for bag in positions])
            recorded = plan.solver_options["group_sizes"]
            assert auto_layout_problem(members, sizes, num_gpus, recorded, node) is None


def test_the_alignment_predicate():
    assert is_aligned([0]) and is_aligned([4, 5, 6, 7]) and is_aligned([2, 3])
    assert not is_aligned([1, 2]) and not is_aligned([0, 1, 2]) and not is_aligned([5, 4])
    assert not is_aligned([0, 2])


def test_a_legacy_summary_of_an_auto_step_reads_as_the_planners_choice():
    """A legacy summary has no policy: bags where the topology would not lay them were
    chosen for the step, so they are read (and replayed) as an auto plan's."""
    from conftest import SAMPLES, auto_plan_record

    from knapformer.contract.legacy import plan_from_legacy, plan_to_legacy
    from knapformer.contract.plan import layout_problem

    plan = RoutingPlan.model_validate(auto_plan_record())
    assert plan.bags[0] == [0, 1, 2, 3] and plan.topology == "g1n4+g4n1"  # 4-GPU bag first
    back = plan_from_legacy(json.loads(json.dumps(plan_to_legacy(plan))))
    assert back.policy == "auto" and back.bags == plan.bags and layout_problem(back) is None
    legacy = json.loads((SAMPLES / "legacy_mixed8.json").read_text())
    assert plan_from_legacy(legacy).policy is None  # the research code's fixed layout
