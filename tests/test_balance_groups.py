"""The balance groups: a layout that validates itself where it is made (no process group
needed), the sub-groups made from it on real gloo processes, looked up by their ranks,
and the profiler names of the balancer's phases."""

from __future__ import annotations

import pytest
import torch

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.runtime.groups import BalanceLayout
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
