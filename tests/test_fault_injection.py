"""Fault injection (`knapformer.local.slowdown`), on real gloo processes: every kind of
slow rank loses its time where that fault would, and the measurements put it there
(compute for gpu, host work for host, garbage collection for gc, the data wait for
input, the token exchanges for link), so each verdict has the evidence it is decided by."""

from __future__ import annotations

import pytest
import torch

from knapformer.contract.phases import EXCHANGES, host_ms
from knapformer.testing.dist_helpers import run_world

WORLD, TOPOLOGY, D, HEADS, STEPS, SLOW = 4, "g1n2+g2n1", 32, 4, 4, 1
KINDS = ("gpu", "host", "gc", "input", "link")
pytestmark = pytest.mark.timeout(300)


def _worker(rank: int, world: int) -> dict:
    """Per kind: STEPS steps of a ToyDiT as the demo trains it (the batch timed as
    ``data``); rank SLOW is a `SlowBalancer` of that kind with factor 3. Returns each
    rank's timings of the steps after the first, and what the slow rank lost in them."""
    from knapformer.local.models import ToyDiT
    from knapformer.local.slowdown import SlowBalancer
    from knapformer.runtime.balancer import SequenceBalancer

    out = {}
    for kind in KINDS:
        if rank == SLOW:
            bal = SlowBalancer(TOPOLOGY, slow_factor=3.0, slow_kind=kind, time_gc=True)
        else:
            bal = SequenceBalancer(TOPOLOGY, time_gc=True)
        torch.manual_seed(0)
        model = ToyDiT(D, HEADS, 1)
        timings, lost = [], []
        for step in range(STEPS):
            with bal.timed("data"):
                if rank == SLOW:
                    bal.wait_for_input()
                lengths = [5 + (3 * rank + step) % 7, 20 + rank]
                x = torch.randn(sum(lengths), D)
            before = bal.lost_ms if rank == SLOW else 0.0
            bal.plan_routing(lengths, token_dim=D)
            if step >= 2:  # the step before has ended: its timings are final
                timings.append(bal.previous_timings)
            model(x, lengths, bal).square().mean().backward()
            if rank == SLOW:
                bal.lag()
                lost.append(bal.lost_ms - before)
            bal.all_reduce(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        bal.close()
        out[kind] = {"timings": timings, "lost": lost}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("faults"))


@pytest.mark.parametrize("kind", KINDS)
def test_the_lost_time_lands_in_the_phase_of_its_kind(results, kind):
    slow = results[SLOW][kind]
    assert len(slow["timings"]) == STEPS - 2
    for k, t in enumerate(slow["timings"]):
        # What step k+1 lost is timed in step k+1: the late batch too, as the data wait
        # that ends it (the batch of the step after).
        lost = slow["lost"][k + 1]
        assert lost > 0
        exchanges = sum(t.get(p, 0.0) for p in EXCHANGES)
        host = float(host_ms({p: [v] for p, v in t.items()}, 1)[0])
        where = {
            "gpu": t["compute"], "host": host, "gc": t.get("gc", 0.0), "input": t["data"],
            "link": exchanges,
        }  # fmt: skip
        # time.sleep and the CPU burn take at least what they were asked for
        assert where[kind] >= 0.95 * lost, (kind, where, lost)
        if kind != "gpu":  # and none of it is taken for compute
            assert t["compute"] < t["step"] - 0.95 * lost


def test_the_peers_of_a_slow_rank_do_no_host_work_of_their_own(results):
    for kind in KINDS:
        for rank in range(WORLD):
            if rank != SLOW:
                assert all("host" not in t for t in results[rank][kind]["timings"])
