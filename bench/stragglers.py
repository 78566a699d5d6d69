"""Benchmark: a slow rank, found and balanced away.

The live demo at world size 8 (topology g1n2+g2n1+g4n1) with ``--slow-rank 5
--slow-factor 2`` (`knapformer.local.slowdown`: rank 5 sleeps as long again as it
computes), once with the ``modelled`` cost model and once with ``history``, in the same
session. For each run:

- the step at which `knapformer stragglers` (`knapformer.stragglers.analyse` over the
  plans recorded so far) first names rank 5, and the other ranks it names then or later;
- the median step time (the balancer's ``step``: from one ``plan_routing`` to the next,
  the slowest rank) over the last half of the run, and the speed-up of history over
  modelled (modelled's step time / history's);
- rank 5's share of the tokens over the last half.

The machine's few cores are shared by the 8 workers, so the model is sized for compute
to outweigh per-step overheads (``--head-dim``): sleeping is the slowdown that shows.

    .venv/bin/python bench/stragglers.py [--steps 32] [--head-dim 64] [--length-scale 0.03125]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from knapformer.local.demo import DemoConfig, run_demo
from knapformer.plan_io import read_plans

WORLD, SLOW_RANK, SLOW_FACTOR = 8, 5, 2.0


def first_named(plans) -> tuple[int | None, set[int]]:
    """The step after whose recording the straggler analysis first names the slow rank,
    and every other rank it names from then on."""
    from knapformer.measured import measure
    from knapformer.stragglers import analyse

    figures, first, others = [], None, set()
    for plan in plans:
        measured = measure(plan)
        if measured is None:
            continue
        figures.append(measured.figures())
        named = {r.rank for r in analyse(figures).named}
        if first is None and SLOW_RANK in named:
            first = plan.step
        if first is not None:
            others |= named - {SLOW_RANK}
    return first, others


def run(cost_model: str, args, out: Path) -> dict:
    cfg = DemoConfig(
        steps=args.steps,
        world_size=WORLD,
        out=out / cost_model,
        slow_rank=SLOW_RANK,
        slow_factor=SLOW_FACTOR,
        cost_model=cost_model,
        head_dim=args.head_dim,
        length_scale=args.length_scale,
        run=f"stragglers-{cost_model}",
    )
    began = time.perf_counter()
    run_demo(cfg)
    seconds = time.perf_counter() - began
    plans = read_plans(out / cost_model / "plans.jsonl", on_error="raise").plans
    last_half = [p for p in plans[len(plans) // 2 :] if "step" in p.measurements.per_rank_ms]
    step_ms = statistics.median(max(p.measurements.per_rank_ms["step"]) for p in last_half)
    tokens = np.array([p.stats.tokens_after for p in last_half], dtype=np.float64)
    share = (tokens / tokens.sum(axis=1, keepdims=True)).mean(axis=0)
    first, others = first_named(plans)
    return {
        "step_ms": step_ms,
        "first": first,
        "others": others,
        "share": share[SLOW_RANK] / share.mean(),
        "speed": plans[-1].gpu_speed,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="knapformer-stragglers-") as tmp:
        results = {cm: run(cm, args, Path(tmp)) for cm in ("modelled", "history")}

    from rich.console import Console
    from rich.table import Table

    base = results["modelled"]["step_ms"]
    table = Table(
        title=(
            f"demo, world {WORLD}, --slow-rank {SLOW_RANK} --slow-factor {SLOW_FACTOR:g}, "
            f"{args.steps} steps (head dim {args.head_dim}, lengths x{args.length_scale:g})"
        )
    )
    for col in (
        "cost model",
        "rank 5 first named at step",
        "other ranks named",
        "median step ms (last half)",
        "speed-up vs modelled",
        "rank 5 tokens / mean",
        "rank 5 speed learnt",
    ):
        table.add_column(col, justify="left" if col == "cost model" else "right")
    for name, r in results.items():
        speed = "-" if r["speed"] is None else f"{r['speed'][SLOW_RANK]:.2f}"
        table.add_row(
            name,
            "never" if r["first"] is None else str(r["first"]),
            ", ".join(map(str, sorted(r["others"]))) or "none",
            f"{r['step_ms']:,.0f}",
            f"{base / r['step_ms']:.2f}x",
            f"{r['share']:.2f}",
            speed,
        )
    Console(width=170).print(table)
    took = ", ".join(f"{n} {r['seconds']:.0f} s" for n, r in results.items())
    print(f"runs took {took}")


if __name__ == "__main__":
    main()
