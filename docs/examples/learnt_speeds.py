"""The speeds the history cost model learnt, step by step, and the share of the tokens they
left one rank; then the same speeds recomputed from the recording alone.

Run: ``python docs/examples/learnt_speeds.py PLANS [--rank 5]`` on a run recorded with
``cost_model="history"`` (``knapformer demo --cost-model history``; docs/debugging.md
walks through its output).
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.table import Table

from knapformer import read_plans
from knapformer.contract.runfiles import single_run
from knapformer.planning.history import recorded_speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", help="a plan file or a run folder")
    parser.add_argument("--rank", type=int, default=5, help="the rank whose share is shown")
    args = parser.parse_args()
    plans = [r.plan for r in read_plans(single_run(args.plans)).records]
    table = Table(
        title=f"gpu_speed of each plan (GPUs in plan.gpus order); rank {args.rank}'s tokens",
        title_justify="left",
    )
    for name in ("step", "gpu_speed", f"rank {args.rank} speed", "its tokens ÷ mean GPU"):
        table.add_column(name, justify="left" if name == "gpu_speed" else "right")
    for plan in plans:
        i = plan.gpus.index(args.rank)
        tokens = plan.stats.tokens_after
        speed = plan.gpu_speed
        table.add_row(
            str(plan.step),
            "nominal" if speed is None else " ".join(f"{s:g}" for s in speed),
            "1" if speed is None else f"{speed[i]:g}",
            f"{tokens[i] / np.mean(tokens):.2f}",
        )
    console = Console(highlight=False)
    console.print(table)
    # Every rank fed the same gathered times to the same deterministic model, so the
    # recording alone gives the speeds back: what makes a run with learnt speeds replayable.
    again = recorded_speeds(plans)
    differ = [p.step for p in plans if again.get(p.step) != p.gpu_speed]
    console.print(
        "recomputed from the recorded compute times (knapformer.planning.history.recorded_speeds): "
        + (f"DIFFERENT at steps {differ}" if differ else f"the same at all {len(plans)} steps")
    )


if __name__ == "__main__":
    main()
