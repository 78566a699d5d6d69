"""Benchmark: SequenceBalancer.route + reverse_route vs. all-gathering the batch.

Eight gloo processes on the CPU. Every rank holds the sequences of four GPUs of one
step of the `joint` mix (lengths scaled down), hidden size d = 256, float32. Both
methods carry out the same plan (topology g1n2+g2n1+g4n1 by default):

- **knapformer**: one all-to-all that moves only the chunks whose destination differs
  from their source (`route`), and one back (`reverse_route`);
- **all-gather** (the batch-level alternative): every rank all-gathers every rank's
  padded tokens and index-selects the chunks it was given; back again the same way.

Bytes are what each rank sends to other ranks (all-gather: its padded buffer to each
of the other ranks). Times are the slowest rank's, median over the timed iterations.

    .venv/bin/python bench/routing.py [--length-scale 0.125] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from knapformer.local.launcher import launch

WORLD = 8
GPUS_PER_RANK = 4  # the joint mix is defined on 32 GPUs; each rank takes four


def _lengths(length_scale: float, seed: int) -> list[np.ndarray]:
    from knapformer.planning.datamix import parse_mix, sample_lengths

    per_gpu = sample_lengths(parse_mix("joint"), np.random.default_rng(seed), length_scale)
    return [
        np.concatenate(per_gpu[r * GPUS_PER_RANK : (r + 1) * GPUS_PER_RANK]) for r in range(WORLD)
    ]


def _slowest_ms(began: float) -> float:
    ms = torch.tensor([(time.perf_counter() - began) * 1e3], dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _allgather_rows(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, int]:
    """All ranks' rows of ``x`` (padded to the longest); returns (all rows, bytes sent)."""
    longest = max(counts)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    rows = torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])
    return rows, (len(counts) - 1) * padded.numel() * padded.element_size()


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """One rank of the benchmark; rank 0 returns the results, the others None."""
    from knapformer.runtime.balancer import SequenceBalancer

    lengths = _lengths(args.length_scale, args.seed)
    bal = SequenceBalancer(args.topology)
    plan = bal.plan_routing(lengths[rank], token_dim=args.dim)
    t = bal.tables
    x = torch.randn(
        int(lengths[rank].sum()), args.dim, generator=torch.Generator().manual_seed(rank)
    )
    row_bytes = args.dim * x.element_size()

    # Index tables of the all-gather baseline: rows of the gathered batch this rank
    # takes (same order as route's output), and where its own rows sit in the batch.
    counts = [int(ln.sum()) for ln in lengths]
    rank_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    seq_len = plan.sequences.length
    seq_src = plan.sequences.src_gpu
    seq_start = np.zeros(len(seq_len), dtype=np.int64)
    for r in range(WORLD):
        ids = np.flatnonzero(seq_src == r)
        seq_start[ids] = rank_start[r] + np.cumsum(seq_len[ids]) - seq_len[ids]
    mine = np.flatnonzero(plan.chunks.dst_gpu == rank)
    starts = seq_start[plan.chunks.seq[mine]] + plan.chunks.offset[mine]
    take = torch.from_numpy(
        np.concatenate(
            [np.arange(s, s + n) for s, n in zip(starts, plan.chunks.length[mine], strict=True)]
        )
        if len(mine)
        else np.zeros(0, dtype=np.int64)
    )
    chunk_counts = [0] * WORLD
    for r in range(WORLD):
        chunk_counts[r] = int(plan.chunks.length[plan.chunks.dst_gpu == r].sum())
    # after the reverse all-gather the rows are grouped by holder; find this rank's own
    holder_start = np.concatenate([[0], np.cumsum(chunk_counts)[:-1]])
    back_index = np.empty(counts[rank], dtype=np.int64)
    own = np.flatnonzero(plan.chunks.src_gpu == rank)
    for c in own.tolist():
        dst = int(plan.chunks.dst_gpu[c])
        before = plan.chunks.length[
            (plan.chunks.dst_gpu == dst) & (np.arange(len(plan.chunks.seq)) < c)
        ].sum()
        s = int(seq_start[plan.chunks.seq[c]] - rank_start[rank] + plan.chunks.offset[c])
        n = int(plan.chunks.length[c])
        back_index[s : s + n] = holder_start[dst] + before + np.arange(n)
    back = torch.from_numpy(back_index)

    # Correctness first: both methods deliver the same rows.
    _, routed, _ = bal.route(x)
    gathered, _ = _allgather_rows(x, counts)
    assert torch.equal(routed, gathered.index_select(0, take)), "baseline disagrees"
    back_rows, _ = _allgather_rows(routed, chunk_counts)
    assert torch.equal(back_rows.index_select(0, back), x)

    times: dict[str, list[float]] = {k: [] for k in ("kf_route", "kf_rev", "ag_route", "ag_rev")}
    for it in range(args.warmup + args.iters):
        dist.barrier()
        began = time.perf_counter()
        _, routed, _ = bal.route(x)
        kf_route = _slowest_ms(began)
        dist.barrier()
        began = time.perf_counter()
        _, home, _ = bal.reverse_route(routed)
        kf_rev = _slowest_ms(began)
        dist.barrier()
        began = time.perf_counter()
        gathered, ag_bytes_route = _allgather_rows(x, counts)
        taken = gathered.index_select(0, take)
        del gathered
        ag_route = _slowest_ms(began)
        dist.barrier()
        began = time.perf_counter()
        rows, ag_bytes_rev = _allgather_rows(taken, chunk_counts)
        home2 = rows.index_select(0, back)
        del rows
        ag_rev = _slowest_ms(began)
        if it >= args.warmup:
            for key, val in zip(times, (kf_route, kf_rev, ag_route, ag_rev), strict=True):
                times[key].append(val)
    assert torch.equal(home, x) and torch.equal(home2, x)

    kf_bytes = (
        sum(s for j, s in enumerate(t.send_splits) if j != rank)
        + sum(s for j, s in enumerate(t.recv_splits) if j != rank)
    ) * row_bytes
    sent = torch.tensor([kf_bytes, ag_bytes_route + ag_bytes_rev], dtype=torch.float64)
    dist.all_reduce(sent)
    if rank != 0:
        return None
    return {
        "ms": {k: statistics.median(v) for k, v in times.items()},
        "bytes": (sent / WORLD).tolist(),  # mean per rank
        "tokens": sum(counts),
        "moved": int(plan.stats.moved_tokens),
        "imbalance": (plan.stats.imbalance_before, plan.stats.imbalance_after),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="g1n2+g2n1+g4n1")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--length-scale", type=float, default=0.125)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    res = launch(_worker, WORLD, (args,), group_timeout_s=300)[0]

    from rich.console import Console
    from rich.table import Table

    ms, (kf_b, ag_b) = res["ms"], res["bytes"]
    kf_t, ag_t = ms["kf_route"] + ms["kf_rev"], ms["ag_route"] + ms["ag_rev"]
    table = Table(
        title=(
            f"route + reverse_route, gloo world {WORLD}, joint mix x{args.length_scale} "
            f"({res['tokens']:,} tokens, d={args.dim}, fp32), {args.topology}; "
            f"moved {res['moved']:,} tokens; imbalance {res['imbalance'][0]:.2f} -> "
            f"{res['imbalance'][1]:.2f}"
        )
    )
    for col in ("method", "route ms", "reverse ms", "total ms", "MB sent / rank", "vs all-gather"):
        table.add_column(col, justify="right" if col != "method" else "left")
    table.add_row(
        "all-gather + index_select",
        f"{ms['ag_route']:.1f}",
        f"{ms['ag_rev']:.1f}",
        f"{ag_t:.1f}",
        f"{ag_b / 1e6:.1f}",
        "1.00x time, 1.00x bytes",
    )
    table.add_row(
        "knapformer all-to-all",
        f"{ms['kf_route']:.1f}",
        f"{ms['kf_rev']:.1f}",
        f"{kf_t:.1f}",
        f"{kf_b / 1e6:.1f}",
        f"{kf_t / ag_t:.2f}x time, {kf_b / ag_b:.3f}x bytes",
    )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
