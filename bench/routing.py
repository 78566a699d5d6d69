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

``--pack-only`` measures instead, in this one process on one CPU thread, the router's
work around its all-to-all: route packing (tokens of bf16 or fp32 and their int64
positions written straight into one send buffer, in send order) against a plain
``index_select`` gather of the same bytes with the same index (one tensor already
holding them, moved as the same words), measured in the same run, in turn, for several
sizes; and the packing it replaced (concatenate, then gather). A PASS/FAIL line per size
and dtype: packing runs at ≥ 0.8x the gather's speed.

    .venv/bin/python bench/routing.py [--length-scale 0.125] [--iters 5]
    .venv/bin/python bench/routing.py --pack-only [--pack-tokens 4096,16384,32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist

from knapformer.local.launcher import launch
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.router import RoutingTables, as_words, pack_rows, unpack_rows

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


# ------------------------------------------------------------------ --pack-only
PACK_TOPOLOGY = "g1n2+g2n1+g4n1"
PACK_DIM = 3072
PACK_TARGET = 0.8  # route pack's speed as a share of a plain gather of the same bytes


def busiest_sender(tokens: int, device: torch.device) -> tuple[RoutingTables, int]:
    """Routing tables of the rank that reorders the most rows, in a plan of 8 GPUs that
    each hold ``tokens`` tokens in 2-16 sequences of random lengths."""
    rng = np.random.default_rng(tokens)
    per_gpu = []
    for _ in range(8):
        cuts = rng.choice(np.arange(1, tokens), size=int(rng.integers(1, 16)), replace=False)
        per_gpu.append(np.diff(np.concatenate([[0], np.sort(cuts), [tokens]])))
    plan = plan_routing(per_gpu, PACK_TOPOLOGY, WorkloadModel(PACK_DIM))
    best, best_moved = None, 0
    for rank in range(8):
        tables = RoutingTables.build(plan, rank, device)
        if tables.send_index is None:
            continue
        index = tables.send_index.cpu()
        moved = int((index != torch.arange(len(index))).sum())
        if moved > best_moved:
            best, best_moved = (tables, rank), moved
    if best is None:
        raise RuntimeError(f"no rank reorders its rows in the {tokens}-token plan")
    return best


@dataclass
class PackCase:
    """The send side of `busiest_sender`'s rank: tokens ``x (rows, dim)`` of one dtype and
    their int64 positions, packed the way ``route`` packs them, and the same bytes as one
    plain tensor (``plain``, viewed as the words the packer moves) for the baseline."""

    tokens: int
    rank: int
    x: torch.Tensor
    pos: torch.Tensor
    send: torch.Tensor
    restore: torch.Tensor

    @classmethod
    def make(cls, tokens: int, dtype: torch.dtype, dim: int, device) -> PackCase:
        tables, rank = busiest_sender(tokens, device)
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tables.num_local, dim, device=device, generator=gen).to(dtype)
        pos = torch.arange(tables.num_local, device=device, dtype=torch.int64)
        return cls(tokens, rank, x, pos, tables.send_index, tables.restore_index)

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def specs(self) -> list[tuple[torch.dtype, torch.Size]]:
        return [(self.x.dtype, self.x.shape[1:]), (self.pos.dtype, self.pos.shape[1:])]

    @cached_property
    def sent(self) -> torch.Tensor:
        """What ``route`` sends: ``(rows, bytes per row)`` uint8, in send order."""
        return pack_rows([self.x, self.pos], self.rows, take=self.send)

    @cached_property
    def plain(self) -> torch.Tensor:
        (words,) = as_words([self.sent.clone()])
        return words

    @property
    def nbytes(self) -> int:
        return self.sent.numel()

    def exact(self) -> bool:
        """Whether unpacking in the packed order gives ``x`` and ``pos`` back bit-exact."""
        back = unpack_rows(self.sent, self.specs, take=self.restore)
        return torch.equal(back[0], self.x) and torch.equal(back[1], self.pos)

    def phases(self) -> dict[str, Callable[[], object]]:
        """The router's work around its all-to-all, and the baseline (the first)."""
        x, pos, rows, specs = self.x, self.pos, self.rows, self.specs
        return {
            "index_select gather": lambda: self.plain.index_select(0, self.send),
            "route pack": lambda: pack_rows([x, pos], rows, take=self.send),
            "route unpack": lambda: unpack_rows(self.sent, specs),
            "reverse pack": lambda: pack_rows([x, pos], rows),
            "reverse unpack": lambda: unpack_rows(self.sent, specs, take=self.restore),
        }

    def two_passes(self) -> torch.Tensor:
        """Route packing as it was before: concatenate the bytes, then gather them."""
        parts = [self.x.view(torch.uint8), self.pos.view(torch.uint8).reshape(self.rows, 8)]
        return torch.cat(parts, dim=1).index_select(0, self.send)


def _paired_ms(fns: dict[str, Callable[[], object]], warmup: int, repeats: int):
    """Milliseconds of each function, run in turn (A B C A B C ...) so that a machine
    whose speed drifts slows all of them alike; lists of ``repeats`` figures."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for it in range(warmup + repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            if it >= warmup:
                times[name].append((time.perf_counter() - began) * 1e3)
    return times


def _pack_figures(tokens: int, dtype: torch.dtype, dim: int, repeats: int):
    """One row of the --pack-only table (from MB on) and route pack's ratio to a gather."""
    case = PackCase.make(tokens, dtype, dim, torch.device("cpu"))
    assert case.exact(), f"packing {tokens} tokens of {dtype} is not bit-exact"
    phases = case.phases()
    fns = {k: phases[k] for k in ("index_select gather", "route pack", "reverse unpack")}
    ms = _paired_ms({**fns, "two": case.two_passes}, 2, repeats)
    gather = ms["index_select gather"]

    def ratio(key: str) -> float:
        return statistics.median(g / t for g, t in zip(gather, ms[key], strict=True))

    cells = [
        f"{case.nbytes / 1e6:.1f}", f"{statistics.median(gather):.2f}",
        f"{statistics.median(ms['route pack']):.2f}", f"{ratio('route pack'):.2f}x",
        f"{ratio('two'):.2f}x", f"{ratio('reverse unpack'):.2f}x",
    ]  # fmt: skip
    return cells, ratio("route pack")


def pack_only(args: argparse.Namespace) -> int:
    """The CPU ratio of route packing to a plain gather of the same bytes; exit status 1
    when a ratio is below the target."""
    from footer import print_load, print_targets
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)  # one core: the figure of one rank's host, not of the machine
    table = Table(
        title=f"route packing on the CPU, one thread: tokens of d = {args.pack_dim} + int64 "
        f"positions, the busiest sender of an 8-GPU {PACK_TOPOLOGY} plan; ms median of "
        f"{args.pack_repeats}, ratio: gather time / ours, median of the paired runs"
    )
    cols = ("tokens/GPU", "dtype", "MB", "gather ms", "pack ms", "pack vs gather")
    for col in (*cols, "two passes (before)", "reverse unpack vs gather"):
        table.add_column(col, justify="right")
    checks = []
    for tokens in args.pack_tokens:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            cells, pack = _pack_figures(tokens, dtype, args.pack_dim, args.pack_repeats)
            table.add_row(f"{tokens:,}", name, *cells)
            said = f"route pack {pack:.2f}x a gather at {tokens:,} tokens {name}"
            checks.append((f"{said} (≥ {PACK_TARGET}x)", pack >= PACK_TARGET))
    console = Console(width=140)
    console.print(table)
    print_load(console)
    return print_targets(console, checks)


def _sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="g1n2+g2n1+g4n1")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--length-scale", type=float, default=0.125)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pack-only", action="store_true", help="route packing vs a gather")
    parser.add_argument("--pack-tokens", type=_sizes, default=[4096, 16384, 32768])
    parser.add_argument("--pack-dim", type=int, default=PACK_DIM)
    parser.add_argument("--pack-repeats", type=int, default=15)
    args = parser.parse_args()
    if args.pack_only:
        return pack_only(args)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
