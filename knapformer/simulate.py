"""Offline what-if simulation: sample a data mix for some steps and plan each step with
several topologies and solvers, no process group involved.

Every topology and solver sees the *same* sampled lengths at a step, so their figures
compare like with like. Step time is modelled as the makespan (largest per-GPU
workload): without balancing every GPU computes its own sequences alone; with
balancing each GPU computes workload / g of every sequence of its bag of g GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from knapformer.datamix import DataCode, mix_gpus, sample_lengths
from knapformer.plan import RoutingPlan
from knapformer.planner import DEFAULT_SOLVER, SOLVERS, plan_routing
from knapformer.topology import Topology, as_topology
from knapformer.workload import WorkloadModel


def check_fits(topology: Topology | str, codes: Sequence[DataCode]) -> Topology:
    """The topology, if its GPU count equals the mix's; else a ValueError naming both."""
    topo = as_topology(topology)
    need = mix_gpus(codes)
    if topo.num_gpus != need:
        raise ValueError(
            f"topology {topo} has {topo.num_gpus} GPUs but the data mix fills {need}; "
            f"give topologies of {need} GPUs"
        )
    return topo


@dataclass
class TopologySummary:
    """Figures of one (topology, solver) over all simulated steps.

    Per-step figures are means over steps except where the name says ``max``.
    ``speedup`` is total makespan before / total makespan after (a step-time ratio).
    Communication counts the balancing all-to-alls (route and reverse_route): every
    moved token travels twice, ``token_dim * dtype_bytes`` bytes each way.
    """

    topology: str
    solver: str
    steps: int = 0
    makespan_before: list[float] = field(default_factory=list)
    makespan_after: list[float] = field(default_factory=list)
    imbalance_before: list[float] = field(default_factory=list)
    imbalance_after: list[float] = field(default_factory=list)
    moved_tokens: list[int] = field(default_factory=list)
    total_tokens: list[int] = field(default_factory=list)
    max_tokens_per_gpu: int = 0
    max_tokens_per_gpu_before: int = 0
    plan_ms: list[float] = field(default_factory=list)
    bytes_per_token: int = 0

    def add(self, plan: RoutingPlan) -> None:
        stats = plan.stats
        self.steps += 1
        self.makespan_before.append(stats.makespan_before)
        self.makespan_after.append(stats.makespan_after)
        self.imbalance_before.append(stats.imbalance_before)
        self.imbalance_after.append(stats.imbalance_after)
        self.moved_tokens.append(stats.moved_tokens)
        self.total_tokens.append(stats.total_tokens)
        self.max_tokens_per_gpu = max(self.max_tokens_per_gpu, int(stats.tokens_after.max()))
        self.max_tokens_per_gpu_before = max(
            self.max_tokens_per_gpu_before, int(stats.tokens_before.max())
        )
        if plan.measurements is not None and plan.measurements.plan_ms is not None:
            self.plan_ms.append(plan.measurements.plan_ms)

    @property
    def mean_makespan_before(self) -> float:
        return float(np.mean(self.makespan_before))

    @property
    def mean_makespan_after(self) -> float:
        return float(np.mean(self.makespan_after))

    @property
    def speedup(self) -> float:
        after = float(np.sum(self.makespan_after))
        return float(np.sum(self.makespan_before)) / after if after > 0 else 1.0

    @property
    def mean_imbalance_before(self) -> float:
        return float(np.mean(self.imbalance_before))

    @property
    def mean_imbalance_after(self) -> float:
        return float(np.mean(self.imbalance_after))

    @property
    def worst_imbalance_after(self) -> float:
        return float(np.max(self.imbalance_after))

    @property
    def mean_moved_tokens(self) -> float:
        return float(np.mean(self.moved_tokens))

    @property
    def moved_fraction(self) -> float:
        total = float(np.sum(self.total_tokens))
        return float(np.sum(self.moved_tokens)) / total if total else 0.0

    @property
    def comm_bytes(self) -> float:
        """Mean bytes per step over all GPUs of route + reverse_route."""
        return 2.0 * self.mean_moved_tokens * self.bytes_per_token

    @property
    def mean_plan_ms(self) -> float:
        return float(np.mean(self.plan_ms)) if self.plan_ms else float("nan")


@dataclass
class SimulationResult:
    summaries: list[TopologySummary]
    steps: int
    num_gpus: int

    def get(self, topology: str, solver: str = DEFAULT_SOLVER) -> TopologySummary:
        key = str(as_topology(topology))
        for summary in self.summaries:
            if summary.topology == key and summary.solver == solver:
                return summary
        raise KeyError(f"no simulation of topology {topology} with solver {solver}")


def simulate(
    codes: Sequence[DataCode],
    topologies: Sequence[Topology | str],
    steps: int = 10,
    token_dim: int = 3072,
    gamma: float = 0.4,
    solvers: Sequence[str] = SOLVERS,
    seed: int = 0,
    dtype_bytes: int = 2,
    on_plan: Callable[[RoutingPlan], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Plan ``steps`` sampled steps of the mix with every topology and solver.

    ``on_plan`` receives every plan (e.g. to record it; ``run`` names topology and
    solver, ``step`` is the simulated step); ``on_step(i)`` is called after step i.
    """
    if steps <= 0:
        raise ValueError(f"--steps must be positive, got {steps}")
    if dtype_bytes <= 0:
        raise ValueError(f"dtype size must be positive, got {dtype_bytes}")
    for solver in solvers:
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose from {', '.join(SOLVERS)}")
    if not topologies:
        raise ValueError("give at least one topology")
    topos = [check_fits(t, codes) for t in topologies]
    model = WorkloadModel(token_dim=token_dim, gamma=gamma)
    summaries = {
        (str(t), s): TopologySummary(str(t), s, bytes_per_token=token_dim * dtype_bytes)
        for t in topos
        for s in solvers
    }
    rng = np.random.default_rng(seed)
    for step in range(steps):
        lengths = sample_lengths(codes, rng)
        for (topo, solver), summary in summaries.items():
            plan = plan_routing(
                lengths, topo, model, solver=solver, step=step, run=f"{topo}/{solver}"
            )
            summary.add(plan)
            if on_plan is not None:
                on_plan(plan)
        if on_step is not None:
            on_step(step)
    return SimulationResult(list(summaries.values()), steps, mix_gpus(codes))
