"""Which rank is slow, and in which phase? Reads the per-rank times a recording carries.

Run: ``python docs/examples/rank_times.py PLANS.jsonl [--phase forward_backward]
[--step N]`` (docs/debugging.md walks through its output). Needs plans recorded with
measured times (``PlanRecorder``; ``knapformer demo`` records them).
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.table import Table

from knapformer import read_plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans")
    parser.add_argument("--phase", default="forward_backward", help="phase to rank GPUs by")
    parser.add_argument("--step", type=int, default=None, help="step to break down by phase")
    args = parser.parse_args()
    plans = [r.plan for r in read_plans(args.plans).records if r.plan.measurements]
    timed = [p for p in plans if args.phase in p.measurements.per_rank_ms]
    if not timed:
        raise SystemExit(f"no plan of {args.plans} carries times of phase {args.phase!r}")
    console = Console(highlight=False)
    console.print(run_table(timed, args.phase))
    if args.step is not None:
        plan = next((p for p in timed if p.step == args.step), None)
        if plan is None:
            raise SystemExit(f"step {args.step} carries no times of phase {args.phase!r}")
        console.print(step_table(plan))


def run_table(plans: list, phase: str) -> Table:
    """Per GPU over the run: its time in ``phase`` relative to the step's median GPU, and
    how often it was the slowest."""
    times = np.array([p.measurements.per_rank_ms[phase] for p in plans])  # (steps, gpus)
    relative = times / np.median(times, axis=1, keepdims=True)
    slowest = np.bincount(times.argmax(axis=1), minlength=times.shape[1])
    loads = np.array([p.stats.load_after / p.stats.mean_load for p in plans])
    plan = plans[-1]
    table = Table(title=f"{phase} over {len(plans)} steps, per GPU", title_justify="left")
    for name in ("GPU", "bag", "load / mean", "time / median GPU", "slowest in"):
        table.add_column(name, justify="left" if name == "bag" else "right")
    for i, gpu in enumerate(plan.gpus):
        table.add_row(
            str(gpu),
            plan.bag_label(int(plan.stats.gpu_bag[i])),
            f"{np.median(loads[:, i]):.3f}",
            f"{np.median(relative[:, i]):.3f}",
            f"{slowest[i]} steps",
        )
    return table


def step_table(plan) -> Table:
    """Every recorded phase of one step, ms per GPU."""
    per_rank = plan.measurements.per_rank_ms
    table = Table(title=f"step {plan.step}: ms per phase", title_justify="left")
    table.add_column("GPU", justify="right")
    table.add_column("bag")
    for name in per_rank:
        table.add_column(name, justify="right")
    for i, gpu in enumerate(plan.gpus):
        label = plan.bag_label(int(plan.stats.gpu_bag[i]))
        table.add_row(str(gpu), label, *(f"{per_rank[name][i]:.1f}" for name in per_rank))
    return table


if __name__ == "__main__":
    main()
