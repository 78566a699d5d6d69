"""Regenerate the sample plans in this folder from the planner with fixed seeds.

Run: ``python sample_plans/make_samples.py``. Plan contents (sequences, bags, chunks)
are reproducible; the recorded planning time (``measurements.plan_ms``) is measured
and differs from run to run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knapformer.contract.legacy import plan_to_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import write_json, write_jsonl
from knapformer.planning.datamix import MIXED8, parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

HERE = Path(__file__).resolve().parent
MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
T0 = 1_790_000_000.0  # fixed wall-clock stamp so files only change when plans change


def one_plan(mix: str, topology: str, seed: int, step: int, run: str) -> RoutingPlan:
    rng = np.random.default_rng(seed)
    plan = plan_routing(sample_lengths(parse_mix(mix), rng), topology, MODEL, step=step, run=run)
    plan.time = T0 + step
    return plan


def main() -> None:
    write_json(
        HERE / "mixed8_g1n2+g2n1+g4n1.json",
        one_plan(MIXED8, "g1n2+g2n1+g4n1", 8, 0, "mixed8"),
        indent=1,
    )
    for topo in ("g8n4", "g4n8"):
        write_json(HERE / f"joint32_{topo}.json", one_plan("joint", topo, 32, 0, f"joint32-{topo}"))
    write_json(HERE / "lowres32_g1n32.json", one_plan("lowres", "g1n32", 132, 0, "lowres32-g1n32"))

    rng = np.random.default_rng(50)
    topo = "g1n8+g2n4+g4n2+g8n1"
    steps = []
    for step in range(50):
        plan = plan_routing(
            sample_lengths(parse_mix("joint"), rng), topo, MODEL, step=step, run="joint32-mixed"
        )
        plan.time = T0 + step
        steps.append(plan)
    write_jsonl(HERE / "joint32_50steps.jsonl", steps)

    legacy = plan_to_legacy(one_plan(MIXED8, "g1n2+g2n1+g4n1", 9, 0, "legacy"))
    write_json(HERE / "legacy_mixed8.json", legacy, indent=1)
    print(f"wrote sample plans to {HERE}")


if __name__ == "__main__":
    main()
