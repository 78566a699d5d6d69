"""Planning latency of this tree against an earlier revision, measured in the same minutes.

Run: ``python bench/planning_versions.py --base REV [--gpus 4096] [--pairs 5] [--steps 3]``.
A shared machine's speed drifts by tens of percent from one hour to the next, so a figure
from an earlier run is no baseline. This bench checks ``REV`` out into a temporary git
worktree and plans the same steps (seeds 5000.., as `bench/planning_latency.py`) in
fresh processes of each tree in turn, base, this, base, this ... (``--pairs`` of each,
5 by default). A process times, per mix and policy (fixed g8 and auto, NVLink), ``plan_routing`` and
rank 0's routing tables as process CPU ms (one core; after one warm-up plan), and the
median over its steps. The table prints, per row, the median over the processes of
each tree and their ratio, the least and its ratio (a process's figure swings with the
allocator's state: whether its step-sized temporaries fault in fresh pages; the least is
the code's cost with the fewest faults), and whether the two trees made the same plans (a
digest of every plan's bags and chunk columns). No targets: the figures say how a change
moved the time; `bench/planning_latency.py` holds the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from footer import print_load
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
MIXES = ("lowres", "mixres", "joint", "video", "seqheavy")

# What one process of one tree runs: every mix and policy, the steps' CPU ms and digests.
CHILD = """
import hashlib, json, statistics, sys, time
import numpy as np, torch
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.router import RoutingTables

model, comm, cpu = WorkloadModel(token_dim=3072, gamma=0.4), CommModel(), torch.device("cpu")
mixes, factor, steps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])

def digest(plan, into):
    into.update(str(plan.topology).encode())
    into.update(np.asarray(plan.sequences.bag, dtype=np.int64).tobytes())
    for name in ("seq", "src_gpu", "dst_gpu", "offset", "length"):
        into.update(np.asarray(getattr(plan.chunks, name), dtype=np.int64).tobytes())

out = {}
for mix in mixes:
    codes = scale_mix(parse_mix(mix), factor)
    gpus = sum(c.gpus for c in codes)
    for policy, topology in (("g8", f"g8n{gpus // 8}"), ("auto", "auto")):
        kw = {"comm": comm} if topology == "auto" else {}
        runs = [sample_lengths(codes, np.random.default_rng(5000 + s)) for s in range(steps)]
        plan_routing(runs[0], topology, model, **kw)  # warm-up: caches are not a step's cost
        ms, h = [], hashlib.sha256()
        for lengths in runs:
            started = time.process_time()
            plan = plan_routing(lengths, topology, model, **kw)
            RoutingTables.build(plan, plan.gpus[0], cpu)
            ms.append((time.process_time() - started) * 1e3)
            digest(plan, h)
        out[f"{mix} {gpus} {policy}"] = [statistics.median(ms), h.hexdigest()]
print(json.dumps(out))
"""


def run_tree(tree: Path, mixes: list[str], factor: int, steps: int) -> dict:
    """One fresh process planning in ``tree`` (its ``knapformer`` first on the path)."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(mixes), str(factor), str(steps)],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"planning in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def checkout(rev: str, into: Path) -> Path:
    """``rev`` checked out (detached) into a new worktree under ``into``."""
    tree = into / "base"
    done = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev],
                          cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"cannot check out {rev!r}: {done.stderr.strip()}")
    return tree


def measure(base: Path, mixes: list[str], factor: int, steps: int, pairs: int, say) -> dict:
    """{row: {"base": [ms per process], "this": [...], "same": bool}}, base and this in turn."""
    rows: dict[str, dict] = {}
    for pair in range(pairs):
        for side, tree in (("base", base), ("this", ROOT)):
            say(f"pair {pair + 1} of {pairs}: {side}")
            for row, (ms, digest) in run_tree(tree, mixes, factor, steps).items():
                entry = rows.setdefault(row, {"base": [], "this": [], "digests": set()})
                entry[side].append(ms)
                entry["digests"].add(digest)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--gpus", type=int, default=4096, help="GPUs (a multiple of 32)")
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated mixes")
    parser.add_argument("--pairs", type=int, default=5, help="processes of each tree")
    parser.add_argument("--steps", type=int, default=3, help="sampled steps per process")
    args = parser.parse_args()
    if args.gpus % 32 or args.gpus <= 0:
        parser.error("--gpus must be a positive multiple of 32 (each mix is on 32 GPUs)")
    console = Console(width=120)
    progress = Console(stderr=True)  # the pairs as they run, on a terminal only
    mixes = args.mixes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.base, Path(tmp))
        try:
            rows = measure(base, mixes, args.gpus // 32, args.steps, args.pairs,
                           lambda text: progress.is_terminal and progress.print(text))  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False)  # fmt: skip
    table = Table(
        title=f"planning: process CPU ms (plan_routing + rank 0's routing tables), median of "
        f"{args.steps} step(s) a process; median and least of {args.pairs} processes a tree, "
        f"run in turn · base: {args.base}",
        title_justify="left",
    )
    for name in ("mix", "GPUs", "policy", "base ms", "this ms", "ratio", "base least",
                 "this least", "ratio ", "same plans"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("mix", "policy") else "right")
    for row, entry in rows.items():
        mix, gpus, policy = row.split()
        figures = []
        for pick in (statistics.median, min):
            old, new = pick(entry["base"]), pick(entry["this"])
            figures += [f"{old:.1f}", f"{new:.1f}", f"{new / old:.2f}"]
        same = "yes" if len(entry["digests"]) == 1 else "NO"
        table.add_row(mix, f"{int(gpus):,}", policy, *figures, same)
    console.print(table)
    print_load(console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
