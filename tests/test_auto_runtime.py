"""SequenceBalancer(topology="auto") on 8 real gloo ranks cut into nodes of 4: each step's
plan picks its own partition, and route, the Ulysses exchanges and reverse route run in
that step's bags, exactly (outputs and parameter gradients equal the unbalanced model's).

The step lengths are chosen so that the partition must change at every step: short
sequences only (every GPU alone), one long sequence (groups of 4), a long one and a
medium one (a mixed partition whose bags are not smallest-first in rank order), and back.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from knapformer.planning.communication import CommModel
from knapformer.testing.dist_helpers import run_world
from knapformer.testing.toy_world import D_MODEL, toy_data, toy_model, toy_reference

WORLD, NODE = 8, 4
# Links fast enough that splitting a long sequence pays at this tiny token width.
COMM = CommModel(intra_gbs=3000.0, inter_gbs=750.0)
SHORT = [[13, 27, 9], [31, 5], [22, 18, 7], [0, 36], [], [25, 11], [14, 30, 6], [19]]


def _with(extra: dict[int, list[int]]) -> list[list[int]]:
    """SHORT with ``extra`` sequences put first on some ranks."""
    return [extra.get(r, []) + s for r, s in enumerate(SHORT)]


STEPS = [
    SHORT,  # g1n8
    _with({2: [1200]}),  # g4n2
    _with({0: [400], 7: [250]}),  # g1n2+g2n1+g4n1 as [0..3] [4, 5] [6] [7]
    _with({5: [300], 2: [150]}),  # g1n4+g4n1 as [0] [1] [2] [3] [4..7]
    SHORT,
]


def _rows(lengths: list[list[int]], rank: int) -> slice:
    start = sum(sum(x) for x in lengths[:rank])
    return slice(start, start + sum(lengths[rank]))


def _step(bal, lengths: list[list[int]], rank: int) -> dict:
    plan = bal.plan_routing(lengths[rank], token_dim=D_MODEL).validated()
    res: dict = {"topology": plan.topology, "bags": plan.bags, "policy": plan.policy}
    res["my_bag"] = bal.my_bag
    res["ulysses_group"] = None if bal.tables.bag is None else bal.tables.bag.size
    x, w = toy_data(lengths)
    rows = _rows(lengths, rank)
    # route -> reverse_route is the identity, features bit-exact
    ids = torch.arange(rows.start, rows.stop, dtype=torch.int64) + (1 << 40)
    _, y, routed_ids = bal.route(x[rows], ids)
    _, back, back_ids = bal.reverse_route(y, routed_ids)
    res["identity"] = torch.equal(back, x[rows]) and torch.equal(back_ids, ids)
    model = toy_model()
    out = model(x[rows], lengths[rank], balancer=bal)
    (out * w[rows]).sum().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)  # each rank holds the gradient of its own tokens
    res["out"], res["grad"] = out.detach(), flat
    return res


def _errors(rank: int) -> dict[str, str]:
    """Mistakes every rank makes alike, or ranks that disagree: all raise, none hangs."""
    from knapformer.errors import KnapformerError
    from knapformer.runtime.balancer import SequenceBalancer

    msgs: dict[str, str] = {}
    cases = {
        "node_differs": lambda: SequenceBalancer("auto", node_size=4 if rank else 8),
        "fixed_with_bounds": lambda: SequenceBalancer("g4n2", min_group=2),
        "no_size_left": lambda: SequenceBalancer("auto", node_size=4, min_group=8),
        "bad_node": lambda: SequenceBalancer("auto", node_size=3),
        "bad_comm": lambda: SequenceBalancer("auto", comm="token-ring"),
    }
    for key, make in cases.items():
        try:
            make().close()
        except KnapformerError as err:
            msgs[key] = str(err)
    return msgs


def _worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    results: dict = {"errors": _errors(rank)}
    recorded: list = []

    class Recorder:  # a sink, as a PlanRecorder is
        def record(self, plan):
            recorded.append((plan.step, plan.topology))

        def close(self):
            pass

    bal = SequenceBalancer("auto", node_size=NODE, comm=COMM, recorder=Recorder(), run="auto")
    results["owned"] = len(list(bal.groups.owned()))
    results["first_bag"] = bal.my_bag

    # No process group may be made once the balancer exists: steps only look bags up.
    made: list = []
    real = dist.new_group

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    dist.new_group = counting
    try:
        results["steps"] = [_step(bal, lengths, rank) for lengths in STEPS]
    finally:
        dist.new_group = real
    results["made_on_hot_path"] = len(made)
    try:  # a head count one of the allowed sizes does not divide (2 and 4 do not divide 6)
        n = bal.tables.num_chunk_tokens
        bal.pre_attn(*(torch.zeros(n, 6, 4),) * 3)
    except Exception as err:  # the message is what is checked
        results["heads"] = f"{type(err).__name__}: {err}"
    bal.finish()
    bal.close()
    results["recorded"] = recorded

    # Planning ahead makes the same plans (the side thread plans with the same options).
    ahead = SequenceBalancer("auto", node_size=NODE, comm=COMM, plan_ahead=True)
    ahead.prefetch(STEPS[0][rank], D_MODEL)
    bags = []
    for i, lengths in enumerate(STEPS):
        if i + 1 < len(STEPS):
            ahead.prefetch(STEPS[i + 1][rank], D_MODEL)
        plan = ahead.plan_routing(lengths[rank], D_MODEL)
        x, _ = toy_data(lengths)
        rows = _rows(lengths, rank)
        _, y, _ = ahead.route(x[rows])
        _, back, _ = ahead.reverse_route(y)
        bags.append((plan.bags, torch.equal(back, x[rows])))
    ahead.finish()
    ahead.close()
    results["ahead"] = bags
    return results


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_auto_topology_is_exact_and_changes_every_step(tmp_path):
    results = run_world(_worker, WORLD, tmp_path)
    topologies = [r["topology"] for r in results[0]["steps"]]
    # The partition changes at every step.
    assert all(a != b for a, b in pairwise(topologies)), topologies
    assert topologies == ["g1n8", "g4n2", "g1n2+g2n1+g4n1", "g1n4+g4n1", "g1n8"]
    mixed = results[0]["steps"][2]["bags"]
    assert mixed == [[0, 1, 2, 3], [4, 5], [6], [7]]  # rank order, not smallest-first
    for step, lengths in enumerate(STEPS):
        ref_out, ref_grad = toy_reference(lengths)
        for rank, res in enumerate(results):
            r, where = res["steps"][step], f"step {step} rank {rank}"
            assert r["policy"] == "auto" and r["bags"] == results[0]["steps"][step]["bags"]
            bag = next(b for b in r["bags"] if rank in b)
            assert r["my_bag"] == bag, where
            assert r["ulysses_group"] == (len(bag) if len(bag) > 1 else None), where
            assert r["identity"], f"{where}: reverse_route(route(x)) != x"
            torch.testing.assert_close(r["out"], ref_out[_rows(lengths, rank)], rtol=1e-9,
                                       atol=1e-10, msg=where)  # fmt: skip
            torch.testing.assert_close(r["grad"], ref_grad, rtol=1e-9, atol=1e-10, msg=where)
    for rank, res in enumerate(results):
        # Made once, at construction: this rank's group of 2 and group of 4 (nodes of 4:
        # no group of 8), nothing on the hot path.
        assert res["owned"] == 2 and res["made_on_hot_path"] == 0
        assert res["first_bag"] == [rank]
        assert res["recorded"] == list(enumerate(topologies))
        assert "2 GPUs" in res["heads"] or "4 GPUs" in res["heads"], res["heads"]
        assert "topology auto" in res["heads"]
        assert [b for b, _ in res["ahead"]] == [s["bags"] for s in res["steps"]]
        assert all(same for _, same in res["ahead"])
        errs = res["errors"]
        assert "node_size" in errs["node_differs"] and "differ across ranks" in errs["node_differs"]
        assert "min_group=2 is an option of topology='auto'" in errs["fixed_with_bounds"]
        assert "no group size is left" in errs["no_size_left"]
        assert "node_size must be a positive power of two, got 3" in errs["bad_node"]
        assert "unknown cluster 'token-ring'" in errs["bad_comm"]


def test_demo_config_takes_topology_auto():
    from knapformer.errors import KnapformerError
    from knapformer.local.config import DemoConfig

    cfg = DemoConfig(topology="auto", world_size=8, node_size=4)
    assert cfg.auto and cfg.parsed_topology == "auto"
    assert cfg.bag_sizes == (1, 2, 4) and cfg.model_dims == (4 * 16, 4)  # heads: every size
    assert DemoConfig(topology="auto", world_size=8).model_dims == (8 * 16, 8)
    for bad, said in (({"world_size": 6}, "power of two"), ({"node_size": 3}, "node_size")):
        with pytest.raises(KnapformerError, match=said):
            DemoConfig(topology="auto", **{"world_size": 8, **bad})
