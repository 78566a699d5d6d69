"""Write a copy of a plan with the destinations of two chunks of one sequence swapped.

The copy is still a valid plan (both chunks stay in their sequence's bag), but not the
one the planner makes, so ``knapformer replay`` must report the difference.

Run: ``python docs/examples/swap_chunks.py PLAN [--step N] OUT.json`` (docs/debugging.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from knapformer.contract.plan_io import read_plans, select_step, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan")
    parser.add_argument("out")
    parser.add_argument("--step", type=int, default=None, help="default: the last plan")
    args = parser.parse_args()
    plan = select_step(read_plans(args.plan, on_error="raise"), args.step).plan
    dst = np.array(plan.chunks.dst_gpu)
    split = np.flatnonzero(np.bincount(plan.chunks.seq) > 1)
    if split.size == 0:
        raise SystemExit(f"no sequence of {args.plan} is split into chunks")
    a, b = np.flatnonzero(plan.chunks.seq == split[0])[:2]
    dst[[a, b]] = dst[[b, a]]
    edited = plan.model_copy(update={"chunks": plan.chunks.model_copy(update={"dst_gpu": dst})})
    write_json(args.out, edited.validated())
    print(f"swapped the GPUs of chunks {a} and {b} (sequence {split[0]}): wrote {args.out}")


if __name__ == "__main__":
    main()
