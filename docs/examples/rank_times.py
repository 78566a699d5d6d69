"""Which rank is slow, and in which phase? Reads the per-rank times a recording carries.

Run: ``python docs/examples/rank_times.py PLANS [--step N]`` (docs/debugging.md walks
through its output). Needs plans recorded with measured times (``PlanRecorder``;
``knapformer demo`` records them). Prints each GPU's median ms per phase over the run,
then, with ``--step``, the ms of one step: the step, the compute in it, and the time
inside each collective (waiting for the others plus the transfer).
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.table import Table

from knapformer import read_plans
from knapformer.contract.phases import COLLECTIVE_PHASES
from knapformer.contract.runfiles import single_run

#: The phases shown, in this order when recorded: the whole step, what the rank computed,
#: the training loop's own forward + backward timing, then the collectives.
SHOWN = ("step", "compute", "forward_backward", *COLLECTIVE_PHASES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", help="a plan file or a run folder")
    parser.add_argument("--step", type=int, default=None, help="step to break down by phase")
    args = parser.parse_args()
    plans = [r.plan for r in read_plans(single_run(args.plans)).records]
    timed = [p for p in plans if p.measurements and p.measurements.compute_phase()]
    if not timed:
        raise SystemExit(f"no plan of {args.plans} carries measured times")
    phases = [name for name in SHOWN if name in timed[-1].measurements.per_rank_ms]
    median = {
        name: np.median([p.measurements.per_rank_ms[name] for p in timed], axis=0)
        for name in phases
    }
    console = Console(highlight=False)
    console.print(phase_table(f"median ms per phase over {len(timed)} steps", timed[-1], median))
    if args.step is not None:
        plan = next((p for p in timed if p.step == args.step), None)
        if plan is None:
            raise SystemExit(f"step {args.step} carries no measured times")
        per_rank = plan.measurements.per_rank_ms
        console.print(phase_table(f"step {plan.step}: ms per phase", plan, per_rank))


def phase_table(title: str, plan, ms: dict) -> Table:
    """One row per GPU of ``plan``: its bag and ``ms[phase][i]`` for each phase shown."""
    phases = [name for name in SHOWN if name in ms]
    table = Table(title=title, title_justify="left")
    table.add_column("GPU", justify="right")
    table.add_column("bag")
    for name in phases:
        table.add_column(name, justify="right")
    for i, gpu in enumerate(plan.gpus):
        label = plan.bag_label(int(plan.stats.gpu_bag[i]))
        table.add_row(str(gpu), label, *(f"{ms[name][i]:.1f}" for name in phases))
    return table


if __name__ == "__main__":
    main()
