"""Planning latency: process CPU ms a rank pays to plan a step, fixed g8 and auto, 32 to 4,096 GPUs.

What a rank pays is ``plan_routing`` and its own routing tables; beside it, the whole
chunk table's cost (a reader's) and the plan-ahead slack.

Run: ``python bench/planning_latency.py [--steps 3] [--quick]``. For every mix (lowres,
mixres, joint, video and seqheavy, the sequence-heavy mix of
`knapformer.planning.datamix`: one GPU in 32 holds 384 short text-image samples) scaled
to each GPU count, it samples ``--steps`` steps (seeds 5000.., not the quality benches'
1000..) and times, per step and policy, as process CPU time (``time.process_time``: a
shared machine's other load barely changes it; one core):

- *ms*: what one rank's training thread pays: ``plan_routing`` plus rank 0's
  `RoutingTables` (what ``SequenceBalancer.plan_routing`` builds; the router reads only
  that rank's rows of the chunk table), of which *rank ms* is the tables;
- *table ms*: then making the plan's whole chunk table, as a reader of the plan does (the
  recorder writing it, validation, statistics): not on a rank's path, since a plan the
  planner makes derives its table when first read. Auto makes the table of a layout it
  prices exactly while pricing it, so where it priced its choice that table is in its
  *ms* already (0 here);
- *faults*: the minor page faults of the plan and the tables (``ru_minflt``): memory the
  kernel hands out zeroed, whose cost is inside *ms* (glibc gives the top of its heap
  back after a plan, and the next plan's step-sized temporaries take it again).

Each row prints the medians over the steps, the modelled step of the auto plan (forward
+ backward, 3x the modelled forward: `plan_cost`, NVLink) and the plan-ahead slack: what
is left of that step on the training thread once the next step's plan is made
(``SequenceBalancer(..., plan_ahead=True)`` plans while the GPUs compute).

Target, one PASS/FAIL line per row and policy (exit 1 on a miss): median *ms* (plan and
rank 0's tables) ≤ 30 ms. ``--quick`` (for the test): 32 GPUs, one step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np
import torch
from footer import print_load, print_targets
from rich.console import Console
from rich.table import Table

from knapformer.planning.communication import CommModel, plan_cost
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.router import RoutingTables

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
COMM = CommModel()  # NVLink nodes of 8 GPUs
MIXES = ("lowres", "mixres", "joint", "video", "seqheavy")
FACTORS = (1, 4, 32, 128)  # each mix is on 32 GPUs: 32, 128, 1,024 and 4,096 GPUs
PLAN_MS = 30.0
BACKWARD = 3.0  # a training step's FLOPs: forward + backward (2x forward)
SEED = 5000
CPU = torch.device("cpu")


def time_row(mix: str, factor: int, steps: int) -> dict:
    """Median CPU ms per policy of one mix on 32 x ``factor`` GPUs (`time_plan`'s three
    figures), and the auto plan's modelled step (median, ms)."""
    codes = scale_mix(parse_mix(mix), factor)
    num_gpus = sum(c.gpus for c in codes)
    policies = {"g8": f"g8n{num_gpus // 8}", "auto": "auto"}
    cpu: dict[str, list[tuple[float, float, float, int]]] = {p: [] for p in policies}
    step_ms, sequences = [], 0
    for step in range(steps):
        lengths = sample_lengths(codes, np.random.default_rng(SEED + step))
        sequences = sum(len(x) for x in lengths)
        for policy, topology in policies.items():
            plan, *figures = time_plan(lengths, topology)
            cpu[policy].append(tuple(figures))
            if policy == "auto":
                step_ms.append(BACKWARD * plan_cost(plan, COMM).step_ms)
    row = {}
    for policy, figures in cpu.items():
        for name, values in zip(("", " rank", " table", " faults"), zip(*figures, strict=True),
                                strict=True):  # fmt: skip
            row[policy + name] = statistics.median(values)
    return row | {"mix": mix, "gpus": num_gpus, "sequences": sequences,
                  "step_ms": statistics.median(step_ms)}  # fmt: skip


def time_plan(lengths, topology: str) -> tuple:
    """(plan, CPU ms of planning and rank 0's routing tables, of the tables alone, of
    making the whole chunk table afterwards, minor page faults of the plan and tables)."""
    comm = COMM if topology == "auto" else None
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.process_time()
    plan = plan_routing(lengths, topology, MODEL, comm=comm)
    planned = time.process_time()
    RoutingTables.build(plan, plan.gpus[0], CPU)
    tabled = time.process_time()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    len(plan.chunks.seq)  # a reader's first read makes the whole table
    whole = time.process_time()
    return plan, (tabled - started) * 1e3, (tabled - planned) * 1e3, (whole - tabled) * 1e3, faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="sampled steps per row")
    parser.add_argument("--quick", action="store_true", help="32 GPUs, one step (for tests)")
    args = parser.parse_args()
    steps, factors = (1, FACTORS[:1]) if args.quick else (args.steps, FACTORS)
    console = Console(width=140)
    table = Table(
        title=f"planning latency: process CPU ms a rank pays to plan (plan_routing + rank 0's "
        f"routing tables; rank: the tables alone), median of {steps} step(s), one core · "
        "table: making the whole chunk table after (a reader's cost) · faults: minor page "
        "faults of the plan and tables · modelled step: auto plan's forward + backward, "
        "NVLink · plan-ahead slack: step − auto ms",
        title_justify="left",
    )
    for name in ("mix", "GPUs", "sequences", "g8 ms", "rank", "table", "faults", "auto ms",
                 "rank ", "table ", "faults ", "step ms", "slack ms", "slack"):  # fmt: skip
        table.add_column(name, justify="left" if name == "mix" else "right")
    checks = []
    time_row("joint", 1, 1)  # warm-up: imports and caches are not a step's cost
    for factor in factors:
        for mix in MIXES:
            row = time_row(mix, factor, steps)
            slack = row["step_ms"] - row["auto"]
            figures = [f"{row[p + name]:.1f}" if name != " faults" else f"{row[p + name]:,.0f}"
                       for p in ("g8", "auto")
                       for name in ("", " rank", " table", " faults")]  # fmt: skip
            table.add_row(
                mix, f"{row['gpus']:,}", f"{row['sequences']:,}", *figures,
                f"{row['step_ms']:.0f}", f"{slack:.0f}", f"{slack / row['step_ms']:.1%}",
            )  # fmt: skip
            for policy in ("g8", "auto"):
                checks.append((
                    f"{mix} {row['gpus']:,} GPUs {policy}: plans in {row[policy]:.1f} ms of "
                    f"CPU with rank 0's tables (≤ {PLAN_MS:g} ms)", row[policy] <= PLAN_MS,
                ))  # fmt: skip
    console.print(table)
    print_load(console)
    return print_targets(console, checks)


if __name__ == "__main__":
    raise SystemExit(main())
