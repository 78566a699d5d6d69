"""Benchmark: time the training thread spends in ``plan_routing``, synchronous vs planning
ahead (``SequenceBalancer(..., plan_ahead=True)`` + ``prefetch``).

Eight gloo processes on the CPU, topology g1n2+g2n1+g4n1. Every step holds the `joint`
mix on 32 x ``--copies`` GPUs' worth of data (by default over 20,000 sequences per
plan, lengths x ``--length-scale``), spread over the 8 ranks. A step is what training
does: ``plan_routing``, ``prefetch`` of the next step's lengths (ahead only), ``route``,
the model (a sleep of ``--compute-ms`` standing in for GPU work: the host is idle while
the GPU computes), ``reverse_route`` and the gradient all-reduce. Both runs in the same
session, the synchronous one first; figures are the slowest rank's, median over the
timed steps. Target, printed PASS or FAIL (exit 1 when missed): ahead, the training
thread spends ≤ 10 % of the synchronous path's time in ``plan_routing``.

    .venv/bin/python bench/plan_ahead.py [--copies 232] [--steps 8] [--compute-ms 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from footer import print_targets

from knapformer.local.launcher import launch

WORLD = 8
TOPOLOGY = "g1n2+g2n1+g4n1"
DIM = 16
AHEAD_SHARE = 0.10  # target: ahead, at most this share of the synchronous plan_routing time


def _lengths(copies: int, length_scale: float, step: int, rank: int) -> np.ndarray:
    """This rank's lengths of one step: its eighth of the joint mix's GPUs x ``copies``."""
    from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix

    codes = scale_mix(parse_mix("joint"), copies)
    per_gpu = sample_lengths(codes, np.random.default_rng([step, 7]), length_scale)
    share = len(per_gpu) // WORLD
    return np.concatenate(per_gpu[rank * share : (rank + 1) * share])


def _slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _run(rank: int, args, ahead: bool) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer(TOPOLOGY, plan_ahead=ahead)
    total = args.warmup + args.steps
    batches = [_lengths(args.copies, args.length_scale, s, rank) for s in range(total + 1)]
    plan_ms, prefetch_ms, step_ms, sequences = [], [], [], 0
    grads = torch.zeros(1 << 16)
    for step in range(total):
        began = time.perf_counter()
        plan = bal.plan_routing(batches[step], token_dim=DIM)
        planned = time.perf_counter()
        bal.prefetch(batches[step + 1], token_dim=DIM)  # nothing without plan_ahead
        prefetched = time.perf_counter()
        x = torch.ones(int(batches[step].sum()), DIM)
        _, y, _ = bal.route(x)
        time.sleep(args.compute_ms / 1e3)  # the GPU computes; the host waits
        bal.reverse_route(y)
        bal.all_reduce(grads)
        done = time.perf_counter()
        if step >= args.warmup:
            plan_ms.append((planned - began) * 1e3)
            prefetch_ms.append((prefetched - planned) * 1e3)
            step_ms.append((done - began) * 1e3)
        sequences = len(plan.sequences)
    bal.finish()
    bal.close()
    slowest = [_slowest([p, f, s]) for p, f, s in zip(plan_ms, prefetch_ms, step_ms, strict=True)]
    return {
        "plan_ms": statistics.median(s[0] for s in slowest),
        "prefetch_ms": statistics.median(s[1] for s in slowest),
        "step_ms": statistics.median(s[2] for s in slowest),
        "sequences": sequences,
        "tokens": int(_slowest([float(sum(int(b.sum()) for b in batches[:1]))])[0]),
    }


def _worker(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(1)
    sync = _run(rank, args, ahead=False)
    ahead = _run(rank, args, ahead=True)
    return {"sync": sync, "ahead": ahead} if rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=232, help="joint mix x this many")
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=400.0)
    args = parser.parse_args()
    res = launch(_worker, WORLD, (args,), group_timeout_s=600)[0]

    from rich.console import Console
    from rich.table import Table

    sync, ahead = res["sync"], res["ahead"]
    table = Table(
        title=(
            f"plan_routing on the training thread, gloo world {WORLD}, {TOPOLOGY}, "
            f"{sync['sequences']:,} sequences a plan (joint mix x{args.copies}, lengths "
            f"x{args.length_scale:g}), compute {args.compute_ms:g} ms a step; slowest rank, "
            f"median of {args.steps} steps"
        )
    )
    for col in ("path", "plan_routing ms", "prefetch ms", "step ms", "plan_routing vs sync"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for name, r in (("synchronous", sync), ("ahead", ahead)):
        table.add_row(
            name,
            f"{r['plan_ms']:.1f}",
            f"{r['prefetch_ms']:.2f}" if name == "ahead" else "-",
            f"{r['step_ms']:.1f}",
            f"{100 * r['plan_ms'] / sync['plan_ms']:.2f} %",
        )
    console = Console(width=160)
    console.print(table)
    share = ahead["plan_ms"] / sync["plan_ms"]
    target = f"ahead spends {share:.2%} of synchronous' plan_routing time (≤ {AHEAD_SHARE:.0%})"
    return print_targets(console, [(target, share <= AHEAD_SHARE)])


if __name__ == "__main__":
    raise SystemExit(main())
