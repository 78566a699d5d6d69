"""One rank's chunks without the whole table: a plan the planner makes derives its chunk
table (`Chunks.derived`); `RoutingPlan.rank_chunks` and the routing tables read only the
rows of one rank, which must be exactly those rows of the whole table."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from knapformer.contract.chunk_rows import CHUNK_COLUMNS
from knapformer.contract.plan import Chunks, RoutingPlan
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.conditioning import sequence_tables
from knapformer.runtime.journal import plan_hash
from knapformer.runtime.plan_lines import line_pieces, reader_problem
from knapformer.runtime.router import RoutingTables

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
CPU = torch.device("cpu")
SHORT = np.array([0, 1, 3, 5, 7, 9, 2, 8])  # shorter than a bag of 8 (empty chunks dropped)


def _lengths(mix: str, seed: int, short: bool) -> list[np.ndarray]:
    lengths = sample_lengths(parse_mix(mix), np.random.default_rng(seed))
    if short:
        lengths[3] = np.concatenate([SHORT, lengths[3]])
    return lengths


# (mix, topology, solver, ranks are not 0..n-1, short sequences): every chunk rule —
# one bag size or several, even spread or round-robin, empty chunks, mapped ranks, and
# auto (whose table is made while pricing) — on 32 GPUs.
PLANS = [
    ("lowres", "g8n4", "knapformer", False, False),
    ("joint", "g8n4", "knapformer", True, True),
    ("video", "g4n8", "greedy", False, True),
    ("mixres", "g1n8+g2n4+g4n2+g8n1", "knapformer", True, True),
    ("seqheavy", "g1n4+g2n2+g4n1+g8n2+g4n1", "greedy", False, False),
    ("joint", "auto", "knapformer", False, True),
]


def _plan(mix, topology, solver, mapped, short, seed=7) -> RoutingPlan:
    gpus = [100 + 3 * i for i in range(32)] if mapped else None
    comm = CommModel() if topology == "auto" else None
    return plan_routing(_lengths(mix, seed, short), topology, MODEL, solver=solver, gpus=gpus,
                        comm=comm)  # fmt: skip


def _rows(plan: RoutingPlan, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"id": ids} | {name: getattr(plan.chunks, name)[ids] for name in CHUNK_COLUMNS}


def _as_dict(rows) -> dict[str, np.ndarray]:
    return {name: getattr(rows, name) for name in ("id", *CHUNK_COLUMNS)}


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{what}: column {name} differs"


@pytest.mark.parametrize("case", PLANS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in PLANS])
def test_every_ranks_chunks_are_its_rows_of_the_whole_table(case):
    derived, whole = _plan(*case), _plan(*case)  # the same plan twice: one read whole
    c = whole.chunks
    assert len(c) > 0 and len(derived.chunks) == len(c.seq)
    for rank in derived.gpus:
        concern = np.flatnonzero((c.src_gpu == rank) | (c.dst_gpu == rank))
        _assert_same(_as_dict(derived.rank_chunks(rank)), _rows(whole, concern), f"rank {rank}")
        sent, received = np.flatnonzero(c.src_gpu == rank), np.flatnonzero(c.dst_gpu == rank)
        _assert_same(_as_dict(derived.chunks_from(rank)), _rows(whole, sent), f"from {rank}")
        _assert_same(_as_dict(derived.chunks_to(rank)), _rows(whole, received), f"to {rank}")
    # The table read whole answers the same way from its columns.
    rank = derived.gpus[5]
    _assert_same(_as_dict(whole.rank_chunks(rank)), _as_dict(derived.rank_chunks(rank)), "whole")
    assert case[1] == "auto" or not derived.chunks.made  # no rank's rows made the table


@pytest.mark.parametrize("case", PLANS[:4], ids=[f"{c[0]}-{c[1]}" for c in PLANS[:4]])
def test_a_derived_table_writes_and_compares_as_one_given_whole(case):
    plan = _plan(*case)
    assert not plan.chunks.made
    columns = {name: getattr(_plan(*case).chunks, name) for name in CHUNK_COLUMNS}
    whole = plan.model_copy(update={"chunks": Chunks.model_construct(**columns)})
    text = plan.model_dump_json()
    assert plan.chunks.made  # writing made it
    assert text == whole.model_dump_json()  # byte-identical, field order included
    assert RoutingPlan.model_validate_json(text) == whole


def test_the_recorder_checks_and_writes_a_derived_plan_as_one_given_whole():
    plan, whole = _plan(*PLANS[1]), _plan(*PLANS[1])
    whole.time, whole.measurements = plan.time, plan.measurements
    assert reader_problem(plan) is None  # its check reads the columns: they are made
    assert json.loads(b"".join(line_pieces(plan))) == json.loads(whole.model_dump_json())


def test_a_derived_plan_pickles_with_its_table():
    plan = _plan(*PLANS[1])
    again = pickle.loads(pickle.dumps(plan))
    assert again.chunks.made
    assert again.model_dump_json() == plan.model_dump_json()


@pytest.mark.parametrize("case", PLANS[1:4], ids=[f"{c[0]}-{c[1]}" for c in PLANS[1:4]])
def test_routing_tables_of_a_derived_plan_equal_those_of_its_read_back_copy(case):
    plan = _plan(*case)
    read_back = RoutingPlan.model_validate_json(_plan(*case).model_dump_json())
    for rank in plan.gpus:
        mine, theirs = (
            RoutingTables.build(plan, rank, CPU),
            RoutingTables.build(read_back, rank, CPU),
        )
        for name in ("local_lens", "chunk_lens", "send_splits", "recv_splits"):
            assert getattr(mine, name) == getattr(theirs, name), (rank, name)
        for name in ("send_index", "restore_index"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (rank, name)
        assert (mine.bag is None) == (theirs.bag is None)
        if mine.bag is not None:
            assert mine.bag.seq_lens == theirs.bag.seq_lens
            assert mine.bag.tokens_per_gpu == theirs.bag.tokens_per_gpu
            assert torch.equal(mine.bag.to_sequences, theirs.bag.to_sequences)
            assert torch.equal(mine.bag.from_sequences, theirs.bag.from_sequences)
    assert not plan.chunks.made  # the router read each rank's rows only


def test_a_training_step_reads_no_whole_table():
    """What the balancer makes of a plan every step, on every rank: routing tables, the
    conditioning tables and the journal's plan hash (equal for equal plans)."""
    plan, again = _plan(*PLANS[1]), _plan(*PLANS[1])
    for rank in plan.gpus:
        RoutingTables.build(plan, rank, CPU)
        tables = sequence_tables(plan, rank, CPU)
        c = again.chunks  # read whole: the rows routed to the rank, chunk-id order
        mine = c.dst_gpu == rank
        assert tables.index.tolist() == np.repeat(c.seq[mine], c.length[mine]).tolist()
    assert plan_hash(plan) == plan_hash(again)
    assert not plan.chunks.made
    again.sequences.bag[0] = (again.sequences.bag[0] + 1) % len(again.bags)
    assert plan_hash(plan) != plan_hash(again)
