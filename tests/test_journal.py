"""The step journal (knapformer/runtime/journal.py): a ring buffer of the balancer's
collectives, what an entry says, its dump, and the plan hash ranks compare."""

from __future__ import annotations

import json

import torch

from knapformer.contract.plan_io import read_plans
from knapformer.runtime.journal import Entry, Journal, in_backward, plan_hash


def test_the_ring_keeps_the_latest_entries_in_order():
    journal = Journal(rank=3, size=4)
    journal.start_step(7, plan=99)
    for phase in ("gather", "route", "pre_attn", "post_attn", "reverse_route", "allreduce"):
        Journal.leave(journal.enter(phase, bag=1 if "attn" in phase else -1))
    kept = journal.entries()
    assert [e.phase for e in kept] == ["pre_attn", "post_attn", "reverse_route", "allreduce"]
    assert [e.seq for e in kept] == [2, 3, 4, 5] and journal.count == 6
    assert all(e.step == 7 and e.plan == 99 and e.left >= e.entered for e in kept)
    assert journal.latest is kept[-1] and journal.latest_side is None


def test_the_plan_ahead_thread_keeps_its_own_latest_and_step():
    journal = Journal(rank=0)
    journal.start_step(2, plan=1)
    main = journal.enter("route")
    side = journal.enter("plan_ahead", side=True, step=3)
    assert journal.latest is main and journal.latest_side is side
    assert (side.step, side.side, side.left) == (3, True, None)  # still inside it


def test_an_entry_knows_whether_it_ran_in_the_backward_pass():
    journal = Journal(rank=0)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(journal.enter("route").backward)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(journal.enter("route").backward)
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not in_backward()


def test_a_dump_is_json_that_names_its_entries_and_groups(tmp_path):
    journal = Journal(rank=5, size=8)
    journal.call = "pre_attn"
    Journal.leave(journal.enter("gather"))
    journal.enter("pre_attn", bag=2)
    path = journal.dump(tmp_path / "journal" / "rank5.json", groups=[{"role": "balance"}])
    data = json.loads(path.read_text())
    assert data["rank"] == 5 and data["call"] == "pre_attn" and data["count"] == 2
    assert data["groups"] == [{"role": "balance"}]
    entries = [Entry.from_dict(e) for e in data["entries"]]
    assert [(e.phase, e.bag, e.left is None) for e in entries] == [
        ("gather", -1, False),
        ("pre_attn", 2, True),
    ]
    assert list(tmp_path.joinpath("journal").iterdir()) == [path]  # no scratch file left


def test_the_plan_hash_is_the_same_for_the_same_plan_and_differs_otherwise(steps50_path):
    plans = read_plans(steps50_path).plans
    first, again = plans[0], read_plans(steps50_path).plans[0]
    assert plan_hash(first) == plan_hash(again)
    assert plan_hash(first) != plan_hash(plans[1])
    assert 0 <= plan_hash(first) < 2**32
