"""Planner benchmark: the default solver vs greedy vs a plain-Python greedy baseline.

Run: ``python bench/planner.py [--steps 5] [--repeats 5]``. For every data mix and
topology row it samples ``--steps`` steps (fixed seeds), plans each with the three
solvers, and prints the median planning time (process CPU ms: a shared machine's other
load barely changes it), makespan / lower bound (worst step), max/min load after (worst
step) and the moved-token fraction (mean). Loads are the
Ulysses-exact per-GPU costs (`plan.stats`, docs/concepts.md), whatever rule a solver cut
its chunks by. Targets are checked against greedy and the baseline measured in the same
run. The plain-Python baseline is only timed up to 1,024 GPUs (at 4,096 it takes seconds
per step); "short" is a mix of many short sequences (128-px images with their prompts).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from footer import print_targets
from rich.console import Console
from rich.table import Table

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.greedy_python import greedy_plan_python

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
MIXES = {"short": "g32b64i128f1s0"}  # named mixes come from knapformer.planning.datamix
ROWS = (
    [
        (mix, topo, 1)
        for mix in ("lowres", "mixres", "joint", "short")
        for topo in ("g1n32", "g2n16", "g4n8", "g8n4")
    ]
    + [(mix, "g8n128", 32) for mix in ("lowres", "mixres", "joint")]
    + [(mix, "g8n512", 128) for mix in ("lowres", "mixres", "joint")]
)
BASELINE_UP_TO = 1024  # GPUs
SOLVERS = ("knapformer", "greedy", "python baseline")


def baseline_plan(lengths: list[np.ndarray], topo: Topology) -> tuple[float, RoutingPlan]:
    """Time the plain-Python baseline; convert its dicts to a plan (untimed) for stats."""
    as_lists = [x.tolist() for x in lengths]
    started = time.process_time()
    out = greedy_plan_python(as_lists, list(topo.bag_sizes), MODEL.token_dim, MODEL.gamma)
    elapsed = time.process_time() - started
    seqs = out["sequences"]
    chunks = out["chunks"]
    plan = RoutingPlan.build(
        topology=str(topo),
        gpus=list(range(topo.num_gpus)),
        bags=out["bags"],
        solver="python-greedy",
        sequences={
            name: np.array([s[name] for s in seqs.values()])
            for name in ("src_gpu", "length", "workload", "bag")
        },
        chunks={
            name: np.array([c[name] for c in chunks], dtype=np.int64)
            for name in ("seq", "src_gpu", "dst_gpu", "offset", "length")
        },
    )
    return elapsed, plan


def run_row(mix: str, topo_text: str, gpu_factor: int, steps: int, repeats: int) -> dict:
    topo = Topology.parse(topo_text)
    codes = scale_mix(parse_mix(MIXES.get(mix, mix)), gpu_factor)
    solvers = SOLVERS if topo.num_gpus <= BASELINE_UP_TO else SOLVERS[:2]
    times: dict[str, list[float]] = {s: [] for s in solvers}
    quality: dict[str, list[tuple[float, float, float]]] = {s: [] for s in solvers}
    for step in range(steps):
        lengths = sample_lengths(codes, np.random.default_rng(1000 + step))
        for solver in solvers:
            for _ in range(repeats):
                if solver == "python baseline":
                    elapsed, plan = baseline_plan(lengths, topo)
                else:
                    started = time.process_time()
                    plan = plan_routing(lengths, topo, MODEL, solver=solver)
                    elapsed = time.process_time() - started
                times[solver].append(elapsed * 1e3)
            st = plan.stats
            quality[solver].append((st.makespan_over_lb, st.max_min_after, st.moved_fraction))
    row = {
        "mix": mix,
        "topology": topo_text,
        "gpus": topo.num_gpus,
        "sequences": sum(len(x) for x in lengths),
    }
    for solver in solvers:
        q = np.array(quality[solver])
        row[solver] = {
            "ms": statistics.median(times[solver]),
            "mk_lb": float(q[:, 0].max()),
            "max_min": float(q[:, 1].max()),
            "moved": float(q[:, 2].mean()),
        }
    return row


def check_targets(rows: list[dict]) -> list[tuple[str, bool]]:
    """The Ulysses-cost issue's targets: default ≤ greedy + 0.001 (true makespan/LB) on
    every row; moved tokens at g1n32 ≤ ¼ of greedy's; 1,024 GPUs ≤ 30 ms and ≥ 20× the
    baseline; 4,096 GPUs ≤ 150 ms."""
    checks = []
    for row in rows:
        ours, greedy = row["knapformer"], row["greedy"]
        name = f"{row['mix']} {row['topology']}"
        checks.append(
            (
                f"{name}: makespan/LB {ours['mk_lb']:.4f} ≤ greedy {greedy['mk_lb']:.4f} + 0.001",
                ours["mk_lb"] <= greedy["mk_lb"] + 0.001,
            )
        )
        if row["topology"] == "g1n32":
            checks.append(
                (
                    f"{name}: moved {ours['moved']:.3f} ≤ ¼ of greedy {greedy['moved']:.3f}",
                    ours["moved"] <= greedy["moved"] / 4,
                )
            )
        if row["gpus"] == 1024:
            speedup = row["python baseline"]["ms"] / ours["ms"]
            checks.append((f"{name}: {speedup:.0f}× faster than baseline (≥ 20×)", speedup >= 20))
            checks.append((f"{name}: plans in {ours['ms']:.1f} ms (≤ 30 ms)", ours["ms"] <= 30))
        if row["gpus"] == 4096:
            checks.append((f"{name}: plans in {ours['ms']:.1f} ms (≤ 150 ms)", ours["ms"] <= 150))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="sampled steps per row")
    parser.add_argument("--repeats", type=int, default=5, help="timed plans per step")
    args = parser.parse_args()
    console = Console(width=160)
    rows = []
    with console.status("planning...") as status:
        for mix, topo, factor in ROWS:
            status.update(f"planning {mix} {topo}")
            rows.append(run_row(mix, topo, factor, args.steps, args.repeats))
    table = Table(
        title=f"Planner benchmark (median of {args.steps}×{args.repeats} plans per "
        "solver; quality: worst step, moved: mean)"
    )
    for col in ("mix", "topology", "seqs"):
        table.add_column(col)
    for solver in SOLVERS:
        for col in ("ms", "mk/LB", "max/min", "moved"):
            table.add_column(f"{solver}\n{col}", justify="right")
    for row in rows:
        cells = [row["mix"], f"{row['topology']} ({row['gpus']} GPUs)", str(row["sequences"])]
        for solver in SOLVERS:
            r = row.get(solver)
            if r is None:  # the baseline is not run at this size
                cells += ["–"] * 4
                continue
            cells += [
                f"{r['ms']:.2f}",
                f"{r['mk_lb']:.4f}",
                f"{r['max_min']:.3f}",
                f"{r['moved']:.3f}",
            ]
        table.add_row(*cells)
    console.print(table)
    return print_targets(console, check_targets(rows))


if __name__ == "__main__":
    raise SystemExit(main())
