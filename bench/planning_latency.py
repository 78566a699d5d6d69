"""Planning latency: process CPU ms of one ``plan_routing`` call, fixed g8 and auto, from 32
to 4,096 GPUs, with the plan-ahead slack beside it.

Run: ``python bench/planning_latency.py [--steps 3] [--quick]``. For every mix (lowres,
mixres, joint, video and seqheavy, the sequence-heavy mix of
`knapformer.planning.datamix`: one GPU in 32 holds 384 short text-image samples) scaled
to each GPU count, it samples ``--steps`` steps (seeds 5000.., not the quality benches'
1000..) and times one plan per step and policy as process CPU time
(``time.process_time``: a shared machine's other load barely changes it; one core).
Each row prints the median over the steps, the modelled step of the auto plan (forward +
backward, 3x the modelled forward: `plan_cost`, NVLink) and the plan-ahead slack: what
is left of that step on the training thread once the next step's plan is made
(``SequenceBalancer(..., plan_ahead=True)`` plans while the GPUs compute).

Target, one PASS/FAIL line per row and policy (exit 1 on a miss): median ≤ 30 ms.
``--quick`` (for the test): 32 GPUs, one step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from footer import print_load, print_targets
from rich.console import Console
from rich.table import Table

from knapformer.planning.communication import CommModel, plan_cost
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
COMM = CommModel()  # NVLink nodes of 8 GPUs
MIXES = ("lowres", "mixres", "joint", "video", "seqheavy")
FACTORS = (1, 4, 32, 128)  # each mix is on 32 GPUs: 32, 128, 1,024 and 4,096 GPUs
PLAN_MS = 30.0
BACKWARD = 3.0  # a training step's FLOPs: forward + backward (2x forward)
SEED = 5000


def time_row(mix: str, factor: int, steps: int) -> dict:
    """Median CPU ms per policy of one mix on 32 x ``factor`` GPUs, and the auto plan's
    modelled step (median, ms)."""
    codes = scale_mix(parse_mix(mix), factor)
    num_gpus = sum(c.gpus for c in codes)
    policies = {"g8": f"g8n{num_gpus // 8}", "auto": "auto"}
    cpu: dict[str, list[float]] = {p: [] for p in policies}
    step_ms, sequences = [], 0
    for step in range(steps):
        lengths = sample_lengths(codes, np.random.default_rng(SEED + step))
        sequences = sum(len(x) for x in lengths)
        for policy, topology in policies.items():
            comm = COMM if topology == "auto" else None
            started = time.process_time()
            plan = plan_routing(lengths, topology, MODEL, comm=comm)
            cpu[policy].append((time.process_time() - started) * 1e3)
            if policy == "auto":
                step_ms.append(BACKWARD * plan_cost(plan, COMM).step_ms)
    row = {p: statistics.median(v) for p, v in cpu.items()}
    return row | {"mix": mix, "gpus": num_gpus, "sequences": sequences,
                  "step_ms": statistics.median(step_ms)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="sampled steps per row")
    parser.add_argument("--quick", action="store_true", help="32 GPUs, one step (for tests)")
    args = parser.parse_args()
    steps, factors = (1, FACTORS[:1]) if args.quick else (args.steps, FACTORS)
    console = Console(width=140)
    table = Table(
        title=f"planning latency: process CPU ms of one plan, median of {steps} step(s), one "
        f"core · modelled step: auto plan's forward + backward, NVLink · plan-ahead slack: "
        "step − auto plan",
        title_justify="left",
    )
    for name in ("mix", "GPUs", "sequences", "g8 ms", "auto ms", "step ms", "slack ms",
                 "slack"):  # fmt: skip
        table.add_column(name, justify="left" if name == "mix" else "right")
    checks = []
    time_row("joint", 1, 1)  # warm-up: imports and caches are not a step's cost
    for factor in factors:
        for mix in MIXES:
            row = time_row(mix, factor, steps)
            slack = row["step_ms"] - row["auto"]
            table.add_row(
                mix, f"{row['gpus']:,}", f"{row['sequences']:,}", f"{row['g8']:.1f}",
                f"{row['auto']:.1f}", f"{row['step_ms']:.0f}", f"{slack:.0f}",
                f"{slack / row['step_ms']:.1%}",
            )  # fmt: skip
            for policy in ("g8", "auto"):
                checks.append((
                    f"{mix} {row['gpus']:,} GPUs {policy}: plans in {row[policy]:.1f} ms of "
                    f"CPU (≤ {PLAN_MS:g} ms)", row[policy] <= PLAN_MS,
                ))  # fmt: skip
    console.print(table)
    print_load(console)
    return print_targets(console, checks)


if __name__ == "__main__":
    raise SystemExit(main())
