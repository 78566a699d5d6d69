"""Routing tables without processes: simulate every rank's exchanges in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.router import RoutingTables, _from_bytes, _to_bytes, token_ranges

CPU = torch.device("cpu")


def _plan(topology: str, lengths, gpus=None):
    return plan_routing(lengths, topology, WorkloadModel(64), gpus=gpus)


def _token_ids(plan, rank):
    """(sequence id, position) of every packed token on ``rank``, as seq * 10_000 + pos."""
    seqs = np.flatnonzero(plan.sequences.src_gpu == rank)
    return np.concatenate(
        [s * 10_000 + np.arange(plan.sequences.length[s]) for s in seqs] or [np.zeros(0, int)]
    )


def _simulate_route(plan, tables):
    """What every rank holds after route: the all-to-all done by hand."""
    gpus = plan.gpus
    sent = {}
    for i, r in enumerate(gpus):
        x = _token_ids(plan, r)
        t = tables[r]
        if t.send_index is not None:
            x = x[t.send_index.numpy()]
        bounds = np.cumsum([0, *t.send_splits])
        for j in range(len(gpus)):
            sent[(i, j)] = x[bounds[j] : bounds[j + 1]]
    return {q: np.concatenate([sent[(i, j)] for i in range(len(gpus))]) for j, q in enumerate(gpus)}


CASES = [
    ("g1n2+g2n1+g4n1", [[0, 1, 3, 260, 12], [], [30, 31], [7], [2, 50], [9, 9, 9], [], [100]]),
    ("g8n1", [[3], [], [], [], [], [], [], [5, 0]]),
    ("g2n2", [[40], [], [3, 3, 1], [0]]),
    ("g1n4", [[41], [], [], []]),
]


@pytest.mark.parametrize(("topology", "lengths"), CASES)
def test_tables_deliver_every_chunk_to_its_gpu_in_chunk_order(topology, lengths):
    gpus = [10 + 2 * i for i in range(len(lengths))]  # ranks that are not 0..n-1
    plan = _plan(topology, lengths, gpus)
    tables = {r: RoutingTables.build(plan, r, CPU) for r in gpus}
    held = _simulate_route(plan, tables)
    c = plan.chunks
    for r in gpus:
        mine = np.flatnonzero(c.dst_gpu == r)
        expect = np.concatenate(
            [c.seq[i] * 10_000 + c.offset[i] + np.arange(c.length[i]) for i in mine]
            or [np.zeros(0, int)]
        )
        assert np.array_equal(held[r], expect), r
        assert tables[r].chunk_lens == c.length[mine].tolist()
        assert tables[r].local_lens == lengths[gpus.index(r)]
        moved = (c.src_gpu == r) & (c.dst_gpu != r)
        own = gpus.index(r)
        assert sum(s for j, s in enumerate(tables[r].send_splits) if j != own) == int(
            c.length[moved].sum()
        )
        if tables[r].restore_index is not None:  # restore undoes the send permutation
            idx = tables[r].send_index[tables[r].restore_index]
            assert torch.equal(idx, torch.arange(len(idx)))

    # Ulysses: shards arriving from the bag's GPUs are reordered into whole sequences
    for bag in plan.bags:
        if len(bag) == 1:
            assert all(tables[r].bag is None for r in bag)
            continue
        first = tables[bag[0]].bag
        assert first is not None and first.size == len(bag)
        arrived = np.concatenate([held[r] for r in bag])
        whole = arrived[first.to_sequences.numpy()]
        seqs = np.flatnonzero(
            (plan.sequences.bag == plan.bags.index(bag)) & (plan.sequences.length > 0)
        )
        expect = np.concatenate([s * 10_000 + np.arange(plan.sequences.length[s]) for s in seqs])
        assert np.array_equal(whole, expect)
        assert first.seq_lens == plan.sequences.length[seqs].tolist()
        assert first.tokens_per_gpu == [len(held[r]) for r in bag]


def test_nothing_moves_means_no_permutation():
    plan = _plan("g1n2", [[5, 6], [7]])
    t = RoutingTables.build(plan, 0, CPU)
    assert t.send_index is None and t.send_splits == [11, 0] and t.recv_splits == [11, 0]


def test_ranges_and_byte_packing_round_trip():
    assert token_ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]
    rows = 4
    tensors = [
        torch.randn(rows, 3),
        torch.arange(rows, dtype=torch.int64) + (1 << 62),
        torch.tensor([True, False, True, True]),
        torch.randn(rows, 2, 2).to(torch.bfloat16),
    ]
    buf = _to_bytes(tensors, rows)
    assert buf.dtype == torch.uint8 and buf.shape == (rows, 12 + 8 + 1 + 8)
    back = _from_bytes(buf[[2, 0]], [(t.dtype, t.shape[1:]) for t in tensors])
    for t, b in zip(tensors, back, strict=True):
        assert b.dtype == t.dtype and torch.equal(b, t[[2, 0]])


def test_byte_packing_takes_any_strides():
    """Gradients arrive with any strides: `y.sum()`'s is expanded (stride 0), empty on a
    rank that holds no samples, where an empty tensor counts as contiguous."""
    cases = {
        "empty expanded": torch.ones(()).expand(0, 4),
        "expanded": torch.tensor(2.5).expand(3, 4),
        "one row expanded": torch.tensor(1.5).expand(1, 1),
        "transposed": torch.arange(12.0).reshape(4, 3).t(),
        "strided": torch.arange(24.0).reshape(3, 8)[:, ::2],
    }
    for name, t in cases.items():
        rows = t.shape[0]
        (back,) = _from_bytes(_to_bytes([t], rows), [(t.dtype, t.shape[1:])])
        assert torch.equal(back, t), name


# ------------------------------------------------------- a rank with no samples (gloo)
D_MODEL, HEADS = 16, 4


def _lengths_with_an_empty_rank() -> list[list[int]]:
    return [[37, 5, 11], [], [9, 3], [20]]


def _empty_rank_worker(rank: int, world: int, topology: str) -> dict:
    import torch.distributed as dist

    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer

    lengths = _lengths_with_an_empty_rank()
    x_all = torch.randn(sum(map(sum, lengths)), D_MODEL, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)  # fmt: skip
    start = sum(sum(x) for x in lengths[:rank])
    x = x_all[start : start + sum(lengths[rank])]
    torch.manual_seed(0)
    model = ToyDiT(D_MODEL, HEADS, 2).double()
    with SequenceBalancer(topology) as bal:
        bal.plan_routing(lengths[rank], token_dim=D_MODEL)
        y = model(x, lengths[rank], balancer=bal)
        y.sum().backward()  # on the empty rank: an expanded (0, d) gradient
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
    return {"out": y.detach(), "grad": flat}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", ["g2n2", "g1n2+g2n1"])
def test_a_rank_without_samples_trains_with_a_plain_sum_loss(tmp_path, topology):
    from knapformer.local.models import ToyDiT
    from knapformer.testing.dist_helpers import run_world

    lengths = _lengths_with_an_empty_rank()
    results = run_world(_empty_rank_worker, 4, tmp_path, topology)
    x_all = torch.randn(sum(map(sum, lengths)), D_MODEL, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)  # fmt: skip
    torch.manual_seed(0)
    model = ToyDiT(D_MODEL, HEADS, 2).double()
    ref = model(x_all, [n for per in lengths for n in per])
    ref.sum().backward()
    ref_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    start = 0
    for rank, res in enumerate(results):
        rows = sum(lengths[rank])
        torch.testing.assert_close(res["out"], ref.detach()[start : start + rows])
        torch.testing.assert_close(res["grad"], ref_grad, rtol=1e-9, atol=1e-10)
        start += rows
    assert results[1]["out"].shape == (0, D_MODEL)
