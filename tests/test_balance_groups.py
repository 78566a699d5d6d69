"""The balance groups: a layout that validates itself where it is made (no process group
needed), the sub-groups made from it on real gloo processes, looked up by their ranks,
what they cost (the communicators a rank holds, a bag that spans its balance group using
that group), and the profiler names of the balancer's phases."""

from __future__ import annotations

import pytest
import torch

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.runtime.groups import SHARE_ENV, BalanceLayout, Communicators, share_options
from knapformer.testing.dist_helpers import run_world


def test_a_layout_that_cannot_exist_cannot_be_made_and_says_every_factor():
    topo = Topology.parse("g1n2+g2n1")
    with pytest.raises(KnapformerError) as err:
        BalanceLayout(topo, tuple(range(6)), 0)
    assert "replicas(1) * topology gpus(4) = 4 != world_size(6)" in str(err.value)
    assert "world size 6 does not fit topology g1n2+g2n1" in str(err.value)
    with pytest.raises(KnapformerError, match="rank 9 is not in the process group"):
        BalanceLayout(topo, tuple(range(4)), 9)
    with pytest.raises(KnapformerError, match="repeat a rank"):
        BalanceLayout(topo, (0, 1, 1, 2), 0)


def test_derived_properties_of_a_replicated_layout():
    layout = BalanceLayout(Topology.parse("g1n2+g2n1"), tuple(range(8, 16)), 13)
    assert layout.num_replicas == 2 and layout.replicated and layout.gpus_per_replica == 4
    assert layout.replicas == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.group_ranks == [12, 13, 14, 15]
    assert layout.bags == [[8], [9], [10, 11], [12], [13], [14, 15]]
    assert layout.my_bag == [13]
    single = BalanceLayout(Topology.parse("g4n1"), (0, 1, 2, 3), 2)
    assert not single.replicated and single.my_bag == [0, 1, 2, 3]


def _auto(gpus: int, sizes: tuple[int, ...], rank: int = 0) -> BalanceLayout:
    return BalanceLayout(None, tuple(range(gpus)), rank, group_sizes=sizes)


def test_the_communicators_a_rank_holds_for_each_topology_option():
    def fixed(topology: str, gpus: int, rank: int = 0) -> Communicators:
        return BalanceLayout(Topology.parse(topology), tuple(range(gpus)), rank).communicators()

    assert fixed("g1n4", 4) == Communicators(balance=0, bags=0, reused=0)
    assert fixed("g2n2", 4) == Communicators(balance=0, bags=1, reused=0)
    assert fixed("g1n2+g2n1", 4, rank=0).total == 0 and fixed("g1n2+g2n1", 4, rank=3).total == 1
    # the bag is the whole job: it runs on the job's own group
    assert fixed("g4n1", 4) == Communicators(balance=0, bags=0, reused=1)
    # two replicas: each its balance group, which its one bag uses
    assert fixed("g4n1", 8, rank=5) == Communicators(balance=1, bags=0, reused=1)
    # auto: one group of each size above 1, the largest being the job's own when it spans it
    assert _auto(8, (1, 2, 4)).communicators() == Communicators(balance=0, bags=2, reused=0)
    assert _auto(8, (1, 2, 4, 8)).communicators(rank=7) == Communicators(0, 2, 1)
    assert _auto(1024, (1, 2, 4, 8)).communicators(rank=1000).total == 3
    assert _auto(8, (1, 2, 4, 8)).communicators().without_reuse == 3


def test_nccl_sharing_is_asked_for_on_nccl_only_and_only_when_turned_on(monkeypatch):
    monkeypatch.delenv(SHARE_ENV, raising=False)
    assert share_options("gloo") is None and share_options("nccl") is None  # off by default
    monkeypatch.setenv(SHARE_ENV, "0")
    assert share_options("nccl") is None and share_options("cpu:gloo,cuda:nccl") is None
    monkeypatch.setenv(SHARE_ENV, "1")
    has_nccl = hasattr(torch.distributed, "ProcessGroupNCCL")
    assert (share_options("nccl") is not None) == has_nccl
    assert share_options("gloo") is None


# ------------------------------------------------------------------- on gloo
def _groups_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer("g1n2+g2n1")  # world 8: two replicas
    groups = bal.groups
    out: dict = {"my_bag": groups.my_bag}
    bag = groups.bag_group(groups.my_bag)
    out["bag_ranks"] = None if bag is None else dist.get_process_group_ranks(bag)
    other = next(b for b in groups.layout.bags if rank not in b and len(b) > 1)
    try:
        groups.bag_group(other)
    except KnapformerError as err:
        out["other"] = str(err)
    out["balance_ranks"] = dist.get_process_group_ranks(groups.group)
    owned = list(groups.owned())
    bal.close()
    gone = 0
    for group in owned:
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError, RuntimeError):
            gone += 1
    out["owned"], out["gone"] = len(owned), gone
    return out


@pytest.mark.timeout(300)
def test_bag_groups_are_made_up_front_and_looked_up_by_their_ranks(tmp_path):
    results = run_world(_groups_worker, 8, tmp_path)
    for rank, r in enumerate(results):
        bag = r["my_bag"]
        assert rank in bag
        assert r["bag_ranks"] == (bag if len(bag) > 1 else None), r
        assert "no process group was created for bag" in r["other"], r
        assert r["balance_ranks"] == list(range(4 * (rank // 4), 4 * (rank // 4) + 4))
        # close() destroyed every sub-group this rank belonged to
        assert r["owned"] == 1 + (len(bag) > 1) and r["gone"] == r["owned"], r


AUTO_LENGTHS = [[400, 3], [5], [6, 2], [4]]  # the long sequence takes the 4-GPU group


def _reuse_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from knapformer.planning.communication import CommModel
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.testing.toy_world import D_MODEL, toy_data, toy_model

    comm = CommModel(intra_gbs=3000.0, inter_gbs=750.0)  # splitting pays at this width
    bal = SequenceBalancer("auto", node_size=4, comm=comm)
    groups = bal.groups
    out: dict = {"owned": len(list(groups.owned())), "count": groups.layout.communicators()}
    out["whole_is_world"] = groups.bag_group([0, 1, 2, 3]) is dist.group.WORLD
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    out["pair"] = dist.get_process_group_ranks(groups.bag_group(pair))
    out["bags"] = bal.plan_routing(AUTO_LENGTHS[rank], token_dim=D_MODEL).bags
    x, w = toy_data(AUTO_LENGTHS)
    start = sum(sum(n) for n in AUTO_LENGTHS[:rank])
    rows = slice(start, start + sum(AUTO_LENGTHS[rank]))
    model = toy_model()
    y = model(x[rows], AUTO_LENGTHS[rank], balancer=bal)
    (y * w[rows]).sum().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    out["out"], out["grad"] = y.detach(), flat
    bal.close()
    return out


@pytest.mark.timeout(300)
def test_a_group_that_spans_the_balance_group_reuses_it_and_still_routes(tmp_path):
    from knapformer.testing.toy_world import toy_reference

    results = run_world(_reuse_worker, 4, tmp_path)
    ref_out, ref_grad = toy_reference(AUTO_LENGTHS)
    start = 0
    for rank, r in enumerate(results):
        # sizes 1, 2, 4 on 4 ranks: its pair is made, the group of 4 is the job's own
        assert r["count"] == Communicators(balance=0, bags=1, reused=1), r["count"]
        assert r["owned"] == r["count"].total == 1 and r["whole_is_world"]
        assert r["pair"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["bags"] == [[0, 1, 2, 3]]  # Ulysses ran on the reused group
        rows = sum(AUTO_LENGTHS[rank])
        torch.testing.assert_close(r["out"], ref_out[start : start + rows], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(r["grad"], ref_grad, rtol=1e-9, atol=1e-10)
        start += rows


# ------------------------------------------------------------------ profiler
PHASES = ("plan", "route", "pre_attn", "post_attn", "reverse_route")
WAITS = ("all_gather", "all_to_all", "barrier")


def _profiled_worker(rank: int, world: int, ahead: bool) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer

    torch.manual_seed(0)
    model = ToyDiT(16, 4, 1)
    mine = [7 + 5 * rank, 3]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bal = SequenceBalancer("g2n1", plan_ahead=ahead)
        for _ in range(2):
            bal.plan_routing(mine, token_dim=16)
            model(torch.randn(sum(mine), 16), mine, balancer=bal).sum().backward()
        bal.finish()
        bal.close()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("knapformer.")})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_a_profiler_sees_the_phases_of_a_step_by_name(tmp_path, ahead):
    for names in run_world(_profiled_worker, 2, tmp_path, ahead):
        expected = {f"knapformer.{p}" for p in PHASES}
        expected |= {f"knapformer.wait.{w}" for w in WAITS}
        if ahead:  # the training thread waits for the plan-ahead thread, which gathers
            expected = (expected - {"knapformer.wait.all_gather"}) | {"knapformer.wait.plan_ahead"}
        assert expected <= set(names), (sorted(expected - set(names)), names)


def test_phases_are_not_marked_without_a_profiler():
    from contextlib import nullcontext

    from knapformer.runtime.marks import mark

    assert isinstance(mark("knapformer.route"), nullcontext)
