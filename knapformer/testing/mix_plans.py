"""Consecutive real plans of a named data mix, for tests and benches that need many."""

from __future__ import annotations

import numpy as np

from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)


def make_plans(n: int, seed: int = 0, mix: str = "joint", factor: int = 1) -> list:
    """``n`` consecutive plans (steps 0..n-1) of ``mix`` scaled to ``factor`` times its GPUs."""
    codes = scale_mix(parse_mix(mix), factor)
    gpus = sum(c.gpus for c in codes)
    topo = f"g1n{gpus // 2}+g2n{gpus // 4}"  # mixes have a multiple of 4 GPUs
    rng = np.random.default_rng(seed)
    return [plan_routing(sample_lengths(codes, rng), topo, MODEL, step=i) for i in range(n)]
