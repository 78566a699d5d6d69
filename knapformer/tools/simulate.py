"""Offline what-if simulation: sample a data mix for some steps and plan each step with
several topologies and solvers, no process group involved.

Every topology and solver sees the *same* sampled lengths at a step, so their figures
compare like with like. Step time is modelled as the makespan (largest per-GPU
workload): without balancing every GPU computes its own sequences alone; with
balancing each GPU computes workload / g of every sequence of its bag of g GPUs. Beside
it, the modelled milliseconds of `knapformer.planning.communication.plan_cost` under one
`CommModel`: compute and communication (Ulysses + route) of the slowest GPU, all layers.

The topology ``"auto"`` lets the planner choose every step's partition (aligned groups
inside nodes of ``comm.node_size`` GPUs), priced with the same `CommModel`.

Each (topology, solver) is one run named ``<topology>-<solver>`` (`run_name`): its plans
share step numbers with the other runs, so they are written to separate files,
one run per folder of ``OUT`` (`run_files`), the layout the dashboard picks runs from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from knapformer.contract.limits import check_option
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.runfiles import RUNS_LAYOUT, run_file, writable_folder
from knapformer.contract.topology import Topology, as_topology
from knapformer.errors import KnapformerError, OptionError
from knapformer.planning.communication import CommModel, plan_cost
from knapformer.planning.datamix import DataCode, mix_gpus, sample_lengths
from knapformer.planning.partitions import allowed_sizes
from knapformer.planning.planner import AUTO, DEFAULT_SOLVER, SOLVERS, check_solver, plan_routing
from knapformer.planning.workload import WorkloadModel


def _is_auto(topology: Topology | str) -> bool:
    return isinstance(topology, str) and topology.strip() == AUTO


def check_fits(
    topology: Topology | str, codes: Sequence[DataCode], comm: CommModel | None = None
) -> Topology | str:
    """The topology (``"auto"`` when the mix's GPUs cut into nodes of ``comm.node_size``),
    if its GPU count equals the mix's; else a `KnapformerError` naming both."""
    need = mix_gpus(codes)
    if _is_auto(topology):
        allowed_sizes(need, int((comm or CommModel()).node_size))  # names what does not fit
        return AUTO
    topo = as_topology(topology)
    if topo.num_gpus != need:
        raise KnapformerError(
            f"topology {topo} has {topo.num_gpus} GPUs but the data mix fills {need}; "
            f"give topologies of {need} GPUs"
        )
    return topo


def run_name(topology: Topology | str, solver: str) -> str:
    """The run of one topology and solver: its plans' ``run`` and its folder in a folder of
    runs (`run_files`)."""
    return f"{AUTO if _is_auto(topology) else as_topology(topology)}-{solver}"


def check_options(
    codes: Sequence[DataCode],
    topologies: Sequence[Topology | str],
    steps: int,
    solvers: Sequence[str],
    dtype_bytes: int = 2,
    seed: int = 0,
    comm: CommModel | None = None,
) -> list[Topology | str]:
    """The parsed topologies (``"auto"`` as such), once all options are valid; else a
    `KnapformerError` naming the value."""
    for name, value in (("steps", steps), ("seed", seed), ("dtype_bytes", dtype_bytes)):
        check_option(name, value)
    for solver in solvers:
        check_solver(solver, None)
    if not topologies:
        raise OptionError("give at least one `topology`")
    return [check_fits(t, codes, comm) for t in topologies]


def run_files(out: str | Path, runs: Sequence[str]) -> dict[str, Path]:
    """Run name -> its plan file in ``out`` (`knapformer.contract.runfiles.run_file`), after making
    sure plans can be written there.

    Creates ``out`` (and its parents) and writes a probe file in it, so that a bad folder
    fails before a long simulation rather than after; the run folders are created by the
    writer. Raises `KnapformerError` naming the path when ``out`` or a run folder is unusable.
    """
    out = Path(out)
    if out.suffix.lower() in (".json", ".jsonl") and not out.is_dir():
        raise OptionError(
            f"`out` is a folder (one {RUNS_LAYOUT} per run, named <topology>-<solver>), "
            f"not a plan file: {str(out)!r}"
        )
    writable_folder(out, "`out`")
    files = {}
    for run in runs:
        path = run_file(out, run)
        folder = path.parent
        if folder.exists() and not folder.is_dir():
            raise KnapformerError(
                f"{str(folder)!r} exists and is not a folder; cannot write run {run}"
            )
        if path.is_dir():
            raise KnapformerError(f"{str(path)!r} is a folder; cannot write run {run}")
        files[run] = path
    return files


@dataclass
class TopologySummary:
    """Figures of one (topology, solver) over all simulated steps.

    Per-step figures are means over steps except where the name says ``max``.
    ``speedup`` is total makespan before / total makespan after (a step-time ratio).
    Communication counts the balancing all-to-alls (route and reverse_route): every
    moved token travels twice, ``token_dim * dtype_bytes`` bytes each way. ``step_ms``,
    ``compute_ms``, ``comm_ms``: the modelled step (`plan_cost`) and the slowest GPU's
    compute and communication; ``partitions``: each step's topology (auto's change).
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
    step_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    comm_ms: list[float] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)

    def add(self, plan: RoutingPlan, comm: CommModel | None = None) -> None:
        stats = plan.stats
        cost = plan_cost(plan, comm or CommModel())
        self.step_ms.append(cost.step_ms)
        self.compute_ms.append(cost.compute_ms)
        self.comm_ms.append(cost.comm_ms)
        self.partitions.append(plan.topology)
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
    def mean_step_ms(self) -> float:
        return float(np.mean(self.step_ms))

    @property
    def mean_compute_ms(self) -> float:
        return float(np.mean(self.compute_ms))

    @property
    def mean_comm_ms(self) -> float:
        return float(np.mean(self.comm_ms))

    @property
    def mean_plan_ms(self) -> float:
        return float(np.mean(self.plan_ms)) if self.plan_ms else float("nan")


@dataclass
class SimulationResult:
    summaries: list[TopologySummary]
    steps: int
    num_gpus: int

    def get(self, topology: str, solver: str = DEFAULT_SOLVER) -> TopologySummary:
        key = AUTO if _is_auto(topology) else str(as_topology(topology))
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
    comm: CommModel | None = None,
) -> SimulationResult:
    """Plan ``steps`` sampled steps of the mix with every topology and solver.

    ``comm`` (default `CommModel`, its ``dtype_bytes`` set to ``dtype_bytes``) prices every
    plan and the choices of ``"auto"``. ``on_plan`` receives every plan (e.g. to record it;
    ``run`` is `run_name` of its topology and solver, ``step`` the simulated step);
    ``on_step(i)`` is called after step i.
    """
    topos = check_options(codes, topologies, steps, solvers, dtype_bytes, seed, comm)
    comm = (comm or CommModel()).with_(dtype_bytes=dtype_bytes)
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
            extra = {"comm": comm} if topo == AUTO else {}
            plan = plan_routing(
                lengths, topo, model, solver=solver, step=step, run=run_name(topo, solver), **extra
            )
            summary.add(plan, comm)
            if on_plan is not None:
                on_plan(plan)
        if on_step is not None:
            on_step(step)
    return SimulationResult(list(summaries.values()), steps, mix_gpus(codes))
