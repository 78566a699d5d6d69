"""Per-step topology (``topology="auto"``) against every fixed layout of the family.

Run: ``python bench/auto_topology.py [--steps 3] [--repeats 5]``. For the mixes ``lowres``,
``mixres``, ``joint`` and ``video`` (knapformer/planning/datamix.py) on 32 and 1,024 GPUs
(d = 3072, γ = 0.4, bf16, 57 layers, nodes of 8), it samples ``--steps`` steps (fixed
seeds), plans each with every fixed layout gXnY (X in 1, 2, 4, 8: the planner's default
solver, compute-only, as users run it today) and with ``auto`` (which is told the cluster),
and prints the modelled forward step time (knapformer/planning/communication.py): the
slowest GPU's compute + communication (Ulysses and routing), means over the steps, per
cluster class (NVLink node + InfiniBand, InfiniBand only, PCIe). Beside them, the
*partition floor* (knapformer/planning/partitions.py, `partition_floor`): a lower bound
on what any partition of the allowed sizes could reach for the step (compute + Ulysses,
no routing, groups as if divisible), and the gain over g8 it would give: what the target
below could at best be. Targets, checked against the fixed layouts planned in the same run:

- auto is never slower than the best fixed layout chosen in hindsight for the mix;
- with NVLink, auto is >= 5 % faster than the paper's default g8 (g8n4, g8n128) on
  ``joint`` and ``video``;
- auto plans in <= 30 ms at 1,024 GPUs (median over the mixes' steps, NVLink). The
  machine this runs on is shared, so the time is the process's CPU time
  (``time.process_time``), which other people's load barely changes; the wall time and the
  fixed-layout g8 plan's CPU time (the baseline, measured in the same run) are printed
  beside it;
- straggler-aware: with one GPU at half speed (the last of the group, inside a g8 bag of
  the healthy plan's largest groups) on ``joint``, 32 and 1,024 GPUs, NVLink, auto told
  the learnt speeds recovers >= 60 % of what the slow GPU costs: (slow, speeds unknown -
  slow, speeds learnt) / (slow, speeds unknown - healthy), each the modelled step of the
  plan run at the true speeds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from footer import print_load, print_targets
from rich.console import Console
from rich.table import Table

from knapformer.planning.communication import CLUSTERS, CommModel, plan_cost
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES, layout_floor
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
MIXES = ("lowres", "mixres", "joint", "video")
SCALES = (1, 32)  # 32 and 1,024 GPUs
GAIN_MIXES = ("joint", "video")
GAIN = 0.05
PLAN_MS = 30.0
SLOW_SPEED = 0.5  # the straggler's speed
RECOVERED = 0.60  # of what the straggler costs, auto with learnt speeds wins back at least


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="sampled steps per mix")
    parser.add_argument("--repeats", type=int, default=5, help="timed plans per step")
    args = parser.parse_args()
    console = Console(width=200)
    checks: list[tuple[str, bool]] = []
    timing: dict[str, dict[str, list[float]]] = {}
    for cluster in CLUSTERS:
        comm = CommModel.cluster(cluster)
        table = Table(
            title=f"{cluster}: {comm.intra_gbs:g} GB/s in a node, {comm.inter_gbs:g} GB/s "
            f"across · {comm.tflops:g} TFLOP/s · modelled forward ms per step = compute + "
            f"communication of the slowest GPU, mean of {args.steps} steps",
            title_justify="left",
        )
        for name in ("mix", "GPUs", "auto", "auto bags (last step)", "g1", "g2", "g4", "g8",
                     "best fixed", "vs best", "vs g8", "floor", "floor vs g8"):  # fmt: skip
            table.add_column(name, justify="left" if name in ("mix", "auto bags (last step)")
                             else "right")  # fmt: skip
        for mix in MIXES:
            for factor in SCALES:
                timed = cluster == "nvlink" and factor > 1
                codes = scale_mix(parse_mix(mix), factor)
                n = sum(c.gpus for c in codes)
                g8 = f"g8n{n // 8}"
                fixed = {f"g{g}n{n // g}": [] for g in DEFAULT_GROUP_SIZES}
                auto, floors = [], []
                last = ""
                for step in range(args.steps):
                    lengths = sample_lengths(codes, np.random.default_rng(1000 + step))
                    for topo, costs in fixed.items():
                        costs.append(plan_cost(plan_routing(lengths, topo, MODEL), comm))
                    plan = plan_routing(lengths, "auto", MODEL, comm=comm)
                    if timed:
                        times = timing.setdefault(mix, {"auto": [], "wall": [], g8: []})
                        times["auto"].append(_cpu_ms(args.repeats, lengths, "auto", comm))
                        times["wall"].append(plan.measurements.plan_ms)
                        times[g8].append(_cpu_ms(args.repeats, lengths, g8, None))
                    auto.append(plan_cost(plan, comm))
                    floors.append(_floor_ms(plan, comm))
                    last = plan.topology
                mean = {k: float(np.mean([c.step_ms for c in v])) for k, v in fixed.items()}
                parts = {k: _parts(v) for k, v in fixed.items()}
                auto_ms = float(np.mean([c.step_ms for c in auto]))
                floor_ms = float(np.mean(floors))
                best = min(mean, key=mean.get)
                table.add_row(
                    mix, f"{n:,}", _parts(auto), last,
                    *(parts[k] for k in fixed), f"{best}",
                    f"{auto_ms / mean[best] - 1:+.1%}", f"{auto_ms / mean[g8] - 1:+.1%}",
                    f"{floor_ms:.1f}", f"{floor_ms / mean[g8] - 1:+.1%}",
                )  # fmt: skip
                checks.append((
                    f"{cluster} {mix} {n:,} GPUs: auto {auto_ms:.1f} ms ≤ best fixed {best} "
                    f"{mean[best]:.1f} ms", auto_ms <= mean[best],
                ))  # fmt: skip
                if cluster == "nvlink" and mix in GAIN_MIXES:
                    checks.append((
                        f"nvlink {mix} {n:,} GPUs: auto {auto_ms:.1f} ms ≥ {GAIN:.0%} faster than "
                        f"{g8} {mean[g8]:.1f} ms ({1 - auto_ms / mean[g8]:.1%}: {GAIN:.0%} needs ≤ "
                        f"{(1 - GAIN) * mean[g8]:.1f} ms; no partition goes below the floor "
                        f"{floor_ms:.1f} ms, so at most {1 - floor_ms / mean[g8]:.1%} is possible)",
                        auto_ms <= (1 - GAIN) * mean[g8],
                    ))  # fmt: skip
        console.print(table)
    console.print(
        "cells: step ms (compute + communication); fixed layouts are planned compute-only "
        "(as users run them), auto with the cluster's figures; floor: the least any "
        "partition of the allowed sizes could reach (compute + Ulysses, no routing)"
    )
    plan_table = Table(
        title=f"planning time at 1,024 GPUs (NVLink), median of {args.steps} steps × "
        f"{args.repeats} plans: process CPU ms (wall ms of one plan beside it)",
        title_justify="left",
    )
    for name in ("mix", "auto CPU ms", "auto wall ms", "g8 fixed CPU ms (baseline)", "auto / g8"):
        plan_table.add_column(name, justify="left" if name == "mix" else "right")
    every = []
    for mix, times in timing.items():
        auto_cpu, base = statistics.median(times["auto"]), statistics.median(times["g8n128"])
        every += times["auto"]
        plan_table.add_row(mix, f"{auto_cpu:.1f}", f"{statistics.median(times['wall']):.1f}",
                           f"{base:.1f}", f"{auto_cpu / base:.1f}×")  # fmt: skip
    console.print(plan_table)
    checks += _straggler_checks(console, args.steps)
    print_load(console)
    median = statistics.median(every)
    checks.append((f"auto plans in {median:.1f} ms of CPU at 1,024 GPUs (median over every "
                   f"mix and step, ≤ {PLAN_MS:g} ms)", median <= PLAN_MS))  # fmt: skip
    return print_targets(console, checks)


def _straggler_checks(console: Console, steps: int) -> list[tuple[str, bool]]:
    """The straggler-aware target: one GPU at ``SLOW_SPEED`` on joint, NVLink."""
    comm = CommModel.cluster("nvlink")
    table = Table(
        title=f"one GPU at {SLOW_SPEED:g}× speed (the last), joint, NVLink · modelled forward "
        f"ms at the true speeds, mean of {steps} steps",
        title_justify="left",
    )
    for name in ("GPUs", "healthy", "slow, speeds unknown", "slow, speeds learnt",
                 "auto bags (learnt, last step)", "recovered"):  # fmt: skip
        table.add_column(name, justify="left" if name.startswith("auto") else "right")
    checks = []
    for factor in SCALES:
        codes = scale_mix(parse_mix("joint"), factor)
        n = sum(c.gpus for c in codes)
        speed = np.ones(n)
        speed[-1] = SLOW_SPEED
        healthy, unknown, learnt, last = [], [], [], ""
        for step in range(steps):
            lengths = sample_lengths(codes, np.random.default_rng(1000 + step))
            blind = plan_routing(lengths, "auto", MODEL, comm=comm)
            told = plan_routing(lengths, "auto", MODEL, comm=comm, gpu_speed=speed)
            healthy.append(plan_cost(blind, comm).step_ms)
            unknown.append(_at_speed(blind, speed, comm))
            learnt.append(_at_speed(told, speed, comm))
            last = told.topology
        h, u, le = (float(np.mean(x)) for x in (healthy, unknown, learnt))
        share = (u - le) / (u - h) if u > h else 1.0
        table.add_row(f"{n:,}", f"{h:.1f}", f"{u:.1f}", f"{le:.1f}", last, f"{share:.0%}")
        checks.append((
            f"nvlink joint {n:,} GPUs, one GPU at {SLOW_SPEED:g}×: auto with learnt speeds "
            f"recovers {share:.0%} of what the slow GPU costs (≥ {RECOVERED:.0%}: unknown "
            f"{u:.1f} ms, learnt {le:.1f} ms, healthy {h:.1f} ms)", share >= RECOVERED,
        ))  # fmt: skip
    console.print(table)
    return checks


def _at_speed(plan, speed: np.ndarray, comm: CommModel) -> float:
    """Modelled forward ms of ``plan`` run at ``speed`` (whatever speeds it was planned for)."""
    run = plan.model_copy(update={"gpu_speed": speed.tolist()})
    run._stats = None  # derived loads follow the speeds: not the planned ones' cache
    return plan_cost(run, comm).step_ms


def _cpu_ms(repeats: int, lengths, topology: str, comm: CommModel | None) -> float:
    """Median process CPU milliseconds of one plan over ``repeats`` plans."""
    times = []
    for _ in range(repeats):
        started = time.process_time()
        plan_routing(lengths, topology, MODEL, comm=comm)
        times.append((time.process_time() - started) * 1e3)
    return statistics.median(times)


def _floor_ms(plan, comm: CommModel) -> float:
    """The partition floor of ``plan``'s step under ``comm``, in forward ms (all layers)."""
    seqs = plan.sequences
    per_token = {g: comm.ulysses_per_token(MODEL.token_dim, g) for g in DEFAULT_GROUP_SIZES}
    floor = layout_floor(seqs.workload, seqs.length, len(plan.gpus), DEFAULT_GROUP_SIZES,
                         per_token)  # fmt: skip
    return float(comm.ms_of(floor.partitions)) * comm.layers


def _parts(costs) -> str:
    step = np.mean([c.step_ms for c in costs])
    compute = np.mean([c.compute_ms for c in costs])
    comm = np.mean([c.comm_ms for c in costs])
    return f"{step:.1f} ({compute:.0f}+{comm:.1f})"


if __name__ == "__main__":
    raise SystemExit(main())
