"""knapformer.compat: the research code's balancer interface on top of ours.

One spawn of 4 gloo ranks (bags ``g1n2+g2n1``) runs two steps, the first planned from a
tensor of lengths and the second from a list; workers report, the test process asserts.
"""

from __future__ import annotations

import inspect
import json
import re

import numpy as np
import pytest
import torch

from knapformer.compat import (
    ORIGINAL_GAMMA,
    PLAN_VIEWS,
    SequenceBalancer,
    workload_estimator,
)
from knapformer.contract.legacy import LEGACY_KEYS, plan_from_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.dist_helpers import run_world
from knapformer.testing.log_lines import LogLines, capture

TOPOLOGY = "g1n2+g2n1"
WORLD = 4
TOKEN_DIM, HEADS, HEAD_DIM = 32, 2, 8


def _lengths(step: int) -> list[list[int]]:
    """Per-rank lengths of a step (the same on every process)."""
    rng = np.random.default_rng(10 + step)
    out = [rng.integers(1, 60, size=rng.integers(1, 6)).tolist() for _ in range(WORLD)]
    out[3] = [400, *out[3]]  # outweighs a GPU's share: greedy must split it over the 2-bag
    return out


def _attribute_error(fn) -> str:
    try:
        fn()
    except (AttributeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _step(
    bal: SequenceBalancer,
    rank: int,
    step: int,
    as_tensor: bool,
    lines: LogLines,
    heads: int = HEADS,
) -> dict:
    lens = _lengths(step)[rank]
    given = torch.tensor(lens) if as_tensor else lens  # int64, as the original's test gives
    plan = bal.plan_routing(given, TOKEN_DIM)
    printed = bal.print_imbalance()
    logged = lines.take()
    bal.nice_print()
    fields = lines.take()

    x = torch.randn(sum(lens), TOKEN_DIM, dtype=torch.float64)
    pos = torch.arange(sum(lens), dtype=torch.int64)
    chunk_lens, y, (y_pos,) = bal.route(x, [pos])
    q = torch.randn(y.shape[0], heads, HEAD_DIM, dtype=torch.float64)
    attn_lens, q2, _, _ = bal.pre_attn(q, q, q)
    attn_lens_again = bal.pre_attn(q, q, q)[0]
    post_lens, q_back = bal.post_attn(q2)
    back_lens, back, (back_pos,) = bal.reverse_route(y, [y_pos])
    return {
        "plan": plan,
        "printed": printed,
        "logged": logged,
        "fields": fields,
        "chunk_lens": chunk_lens,
        "attn_lens": attn_lens,
        "attn_lens_cached": attn_lens_again is attn_lens,
        "post_lens": post_lens,
        "back_lens": back_lens,
        "back_lens_is_given": back_lens is given,
        "equal_all": bool((back_lens == torch.tensor(lens)).all().item()),
        "round_trip": torch.equal(back, x) and torch.equal(back_pos, pos),
        "attention_round_trip": torch.equal(q_back, q),
        "summary": bal.get_routing_plan_summary(),
        "my_seq_lens": bal.gpu_id2seq_lens[bal.this_gpu_id],
        "balance_gpu_ids": bal.balance_gpu_ids,
        "views": {name: getattr(bal, name) for name in PLAN_VIEWS},
        "ulysses_gpus": bal.ulysses_bag.gpu_ids,
    }


# Every public method and attribute of the research code's SequenceBalancer once it has
# planned a step (read from its sequence_balancer.py).
ORIGINAL_MEMBERS = (
    "plan_routing", "get_routing_plan_summary", "nice_print", "print_imbalance",
    "turn_on_tracking", "turn_off_tracking", "print_tracking_results",
    "route", "reverse_route", "pre_attn", "post_attn",
    "bag_specs", "gamma", "this_gpu_id", "this_device", "parsed_bag_specs",
    "balance_process_group", "balance_gpu_ids", "bag_gpu_options",
    "bag_gpu_options2bag_ids", "bag_id2gpu_ids", "gpu_id2bag_id", "bag_id2process_group",
    "metrics", "local_seq_lens", "seq_id2gpu_id", "seq_id2seq_len", "seq_id2seq_workload",
    "gpu_id2seq_ids", "gpu_id2seq_lens", "gpu_id2seq_workloads", "gpu_id2total_workload",
    "per_gpu_capacity", "seq_id2assigned_bag_id", "bag_id2capacity",
    "bag_id2assigned_seq_ids", "bag_id2occupancy", "chunk_id2gpu_id", "chunk_id2chunk_len",
    "chunk_id2seq_id", "gpu_id2chunk_ids", "gpu_id2chunk_lens", "balance_chunk_id2gpu_id",
    "balance_gpu_id2chunk_ids", "balance_gpu_id2chunk_lens", "balance_gpu_id2seq_ids",
    "balance_chunk_id2chunk_len", "balance_gpu_id2total_workload", "orig_minmax_workload",
    "bala_minmax_workload", "ulysses_bag", "tracking", "tracked_per_gpu_capacity",
    "tracked_original_imbalance_ratio", "tracked_balanced_imbalance_ratio", "tracked_tflops",
)  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    lines = capture("knapformer.compat")
    bal = SequenceBalancer(TOPOLOGY)
    before = {
        "attribute": _attribute_error(lambda: bal.gpu_id2seq_lens),
        "summary": _attribute_error(bal.get_routing_plan_summary),
        "plan_view": _attribute_error(lambda: bal.gpu_id2total_workload),
        "bags": bal.bag_id2gpu_ids,
    }
    result = {
        "gamma": bal.gamma,
        "solver": bal.solver,
        "before": before,
        "steps": [_step(bal, rank, 0, True, lines), _step(bal, rank, 1, False, lines)],
        "missing": [name for name in ORIGINAL_MEMBERS if not hasattr(bal, name)],
    }
    bal.close()
    return result


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("compat"))


def test_constructor_has_the_original_signature_and_defaults():
    params = inspect.signature(SequenceBalancer).parameters
    positional = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == ["bag_specs", "gamma"]
    assert params["gamma"].default == 1.0 == ORIGINAL_GAMMA
    assert params["solver"].default == "greedy"
    assert all(p.kind is p.KEYWORD_ONLY for p in params.values() if p not in positional)


def test_workload_estimator_weighs_attention_fully_by_default():
    lengths = np.array([1, 256, 4096])
    ours = [workload_estimator(int(n), 3072) for n in lengths]
    np.testing.assert_array_equal(ours, WorkloadModel(3072, gamma=1.0).workload(lengths))
    assert ours[-1] > float(WorkloadModel(3072).workload(4096))  # our default γ is lower
    assert workload_estimator(4096, 3072, gamma=0.4) == float(WorkloadModel(3072).workload(4096))


def test_defaults_plan_like_the_original(gloo_results):
    for res in gloo_results:
        assert res["gamma"] == 1.0 and res["solver"] == "greedy"
    for step in (0, 1):
        expected = plan_routing(
            _lengths(step), TOPOLOGY, WorkloadModel(TOKEN_DIM, 1.0), solver="greedy"
        )
        for res in gloo_results:
            plan = res["steps"][step]["plan"]
            assert plan.gamma == 1.0 and plan.solver == "greedy"
            assert np.array_equal(plan.sequences.bag, expected.sequences.bag)
            for column in ("seq", "dst_gpu", "offset", "length"):
                assert np.array_equal(
                    getattr(plan.chunks, column), getattr(expected.chunks, column)
                ), column


def _chunks_to(plan: RoutingPlan, rank: int) -> list[int]:
    mine = plan.chunks.dst_gpu == rank
    return plan.chunks.length[mine].tolist()  # chunks are ordered by sequence, then offset


def _bag_sequences(plan: RoutingPlan, rank: int) -> list[int]:
    bag = next(b for b, members in enumerate(plan.bags) if rank in members)
    return plan.sequences.length[plan.sequences.bag == bag].tolist()


def test_lengths_are_the_originals_types_on_the_datas_device(gloo_results):
    split = 0
    for rank, res in enumerate(gloo_results):
        for step in res["steps"]:
            plan = step["plan"]
            # route: a tuple of ints, as the original returned
            assert type(step["chunk_lens"]) is tuple
            assert all(type(n) is int for n in step["chunk_lens"])
            assert list(step["chunk_lens"]) == _chunks_to(plan, rank)
            # pre_attn: the bag's whole sequences; post_attn: this rank's chunks
            for key in ("attn_lens", "post_lens", "back_lens"):
                assert step[key].device == torch.device("cpu"), key
            assert step["attn_lens"].dtype == step["post_lens"].dtype == torch.int32
            in_big_bag = len(next(b for b in plan.bags if rank in b)) > 1
            expected = _bag_sequences(plan, rank) if in_big_bag else _chunks_to(plan, rank)
            assert step["attn_lens"].tolist() == expected
            split += in_big_bag and len(expected) > 0
            assert step["post_lens"].tolist() == _chunks_to(plan, rank)
            assert step["attn_lens_cached"]  # one tensor per plan, not one per layer
            assert step["round_trip"] and step["attention_round_trip"]
            # reverse_route: the lengths given, and the original test's check works
            assert step["equal_all"]
            assert step["back_lens"].tolist() == _lengths(plan.step)[rank]
        tensor_step, list_step = res["steps"]
        assert tensor_step["back_lens_is_given"]  # the caller's own tensor, as before
        assert list_step["back_lens"].dtype == torch.int32
    assert split  # the Ulysses path returned lengths too


def test_summary_is_int_keyed_and_imports_to_the_same_routing(gloo_results):
    for res in gloo_results:
        for step in res["steps"]:
            summary, plan = step["summary"], step["plan"]
            for key, value in summary.items():
                if isinstance(value, dict):
                    assert all(type(k) is int for k in value), key
            assert summary["balance_gpu_ids"] == step["balance_gpu_ids"] == plan.gpus
            for saved in (summary, json.loads(json.dumps(summary))):
                imported = plan_from_legacy(saved)
                assert imported.topology == TOPOLOGY
                for column in ("src_gpu", "length", "bag"):
                    assert np.array_equal(
                        getattr(imported.sequences, column), getattr(plan.sequences, column)
                    )
                for column in ("seq", "src_gpu", "dst_gpu", "offset", "length"):
                    assert np.array_equal(
                        getattr(imported.chunks, column), getattr(plan.chunks, column)
                    )
                np.testing.assert_allclose(imported.sequences.workload, plan.sequences.workload)


def test_summary_fields_are_attributes_once_planned(gloo_results):
    for rank, res in enumerate(gloo_results):
        assert "plan_routing" in res["before"]["attribute"]
        assert "plan_routing" in res["before"]["summary"]
        assert "plan_routing" in res["before"]["plan_view"]
        assert res["before"]["bags"] == {0: [0], 1: [1], 2: [2, 3]}  # known up front
        assert res["missing"] == [], f"rank {rank} lacks the original's {res['missing']}"
        for step in res["steps"]:
            assert step["my_seq_lens"] == _lengths(step["plan"].step)[rank]


def test_plan_views_describe_the_plan(gloo_results):
    for rank, res in enumerate(gloo_results):
        for step in res["steps"]:
            plan, views, st = step["plan"], step["views"], step["plan"].stats
            assert views["seq_id2assigned_bag_id"] == dict(enumerate(plan.sequences.bag.tolist()))
            assert views["seq_id2gpu_id"] == dict(enumerate(plan.sequences.src_gpu.tolist()))
            assert views["local_seq_lens"].tolist() == step["my_seq_lens"]
            # occupancy x capacity is each bag's workload; the bags hold all of it
            bag_work = [views["bag_id2occupancy"][b] * views["bag_id2capacity"][b]
                        for b in range(len(plan.bags))]  # fmt: skip
            assert bag_work == pytest.approx(st.bag_load_after.tolist())
            assert sum(views["bag_id2capacity"].values()) == pytest.approx(st.total_load)
            lens_on = {g: sum(v) for g, v in views["balance_gpu_id2chunk_lens"].items()}
            assert list(lens_on.values()) == st.tokens_after.tolist()
            assert views["chunk_id2gpu_id"] == {
                c: g for g, ids in step["summary"]["gpu_id2chunk_ids"].items() for c in ids
            }
            assert views["orig_minmax_workload"][1] == pytest.approx(st.makespan_before)
            assert rank in step["ulysses_gpus"]
            for g, seqs in views["balance_gpu_id2seq_ids"].items():
                assert all(g in plan.bags[plan.sequences.bag[i]] for i in seqs)


def test_nice_print_logs_every_summary_field(gloo_results):
    for rank, res in enumerate(gloo_results):
        for step in res["steps"]:
            summary = step["summary"]
            assert step["fields"] == [f"rank {rank} {k}: {v}" for k, v in summary.items()]
            assert list(summary) == list(LEGACY_KEYS)


def _ratios(line: str) -> dict[int, float]:
    return {int(g): float(r) for g, r in re.findall(r"(\d+):(\d+\.\d+)", line.split(":", 2)[2])}


def test_print_imbalance_logs_the_current_plans_figures(gloo_results):
    for rank, res in enumerate(gloo_results):
        texts = []
        for step in res["steps"]:
            st, plan = step["plan"].stats, step["plan"]
            assert step["logged"] == step["printed"].splitlines()  # logged at INFO
            before, after, extremes = step["logged"]
            assert before.startswith(f"rank {rank} step {plan.step}:")
            for line, loads in ((before, st.load_before), (after, st.load_after)):
                ratios = _ratios(line)
                assert list(ratios) == plan.gpus
                np.testing.assert_allclose(list(ratios.values()), loads / st.mean_load, atol=5e-3)
            a, b = re.search(r"max/min workload (\S+) -> (\S+)$", extremes).groups()
            assert float(a) == pytest.approx(st.max_min_before, abs=1e-4)
            assert float(b) == pytest.approx(st.max_min_after, abs=1e-4)
            texts.append(step["printed"])
        assert texts[0] != texts[1]


def _auto_worker(rank: int, world: int) -> dict:
    lines = capture("knapformer.compat")
    bal = SequenceBalancer("auto")
    try:
        _ = bal.topology
        before = "no error"
    except KnapformerError as err:
        before = str(err)
    steps = []
    for step in range(2):
        out = _step(bal, rank, step, False, lines, heads=WORLD)  # every bag size divides it
        out |= {
            "topology": str(bal.topology),
            "bags": bal.bag_id2gpu_ids,
            "by_size": bal.bag_gpu_options2bag_ids,
            "groups": {b: g is not None for b, g in bal.bag_id2process_group.items()},
        }
        steps.append(out)
    bal.close()
    return {"before": before, "steps": steps}


def test_auto_topology_runs_and_its_views_follow_each_plan(tmp_path):
    """``SequenceBalancer("auto")``: the bags are unknown (a clear error) before the first
    plan, then every bag view is the latest plan's, and routing round-trips exactly."""
    results = run_world(_auto_worker, WORLD, tmp_path)
    for rank, res in enumerate(results):
        assert "topology 'auto'" in res["before"] and "plan_routing" in res["before"]
        for out in res["steps"]:
            plan = out["plan"]
            assert plan.policy == "auto" and out["topology"] == plan.topology
            assert out["bags"] == {b: list(g) for b, g in enumerate(plan.bags)}
            sizes = {g: [b for b, gpus in enumerate(plan.bags) if len(gpus) == g]
                     for g in sorted({len(gpus) for gpus in plan.bags})}  # fmt: skip
            assert out["by_size"] == sizes
            mine = next(b for b, gpus in enumerate(plan.bags) if rank in gpus)
            multi = {b: b == mine and len(gpus) > 1 for b, gpus in enumerate(plan.bags)}
            assert out["groups"] == multi
            assert out["round_trip"] and out["attention_round_trip"] and out["equal_all"]
