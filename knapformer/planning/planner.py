"""The planner: a pure, deterministic function from sequence lengths to a `RoutingPlan`.

Every rank computes the same plan from the same gathered lengths, so nothing here may
depend on process state. Two solvers place sequences in a fixed topology's bags;
``topology="auto"`` chooses each step's bags as well (knapformer/planning/auto.py, which
solves the whole-family layouts with the solver chosen here):

``"greedy"`` — the published algorithm. Per-GPU capacity C = total load / #GPUs, a bag
of g GPUs has capacity g*C. Sequences are taken by workload, largest first; candidate
bags are those with capacity >= the workload and g <= the length (if none: the bags of
the largest size); the sequence goes to the candidate with the lowest occupancy
(load / capacity). A sequence in a bag of g GPUs is split into g chunks of L // g tokens,
the remainder going to one chunk chosen round-robin.

``"knapformer"`` (default) — balance like greedy, move far fewer tokens. Its per-GPU
capacity is the lower bound on the makespan (at least greedy's mean load; larger when one
sequence outweighs the mean, and then every GPU under it keeps its own work).
1. *heavy* sequences (more than a quarter of a GPU's capacity; in a step of at most 128
   sequences, every sequence) are placed one by one, largest first, in their home bag
   (the bag holding their source GPU) when it has room, else like greedy;
2. every other sequence stays in its home bag while the bag has room — decided for all
   sequences at once with a sorted cumulative sum per bag (largest stay home);
3. the rest (the *pool*, usually a few percent) is placed largest first: home when it
   still fits, else the least-occupied candidate bag, so the smallest sequences even
   out the last gaps as in greedy (a pool of more than 4,096, in one bag size without a
   token cap, is first poured into the bags' room at one water level, all but its
   4,096 lightest);
4. a local search moves or swaps sequences between the most-loaded bag and the
   least-loaded ones until the makespan is within 0.08 % of the lower bound, or no
   exchange helps; if it ends more than 0.1 % above the bound, greedy is solved too and
   the better makespan kept (so it is never worse than greedy's beyond 0.1 % of the bound).
   A small round scores every (leaving, returning) pair at once; a large one only the two
   members per partner nearest the ideal exchange (the best one is always among them).
   A step of more than 512 bags (one size, no token cap) first runs wide rounds: every
   bag above the stopping load paired with one of as many least-loaded bags at once.
In a multi-GPU bag the default solver spreads the bag's tokens evenly: each chunk takes
L // g tokens and the L % g remainder tokens go one each to the next GPUs of a cycle
through the bag's sequences, so every GPU of a bag ends within one token of the others.
Under Ulysses a GPU's cost is the linear part of its own tokens plus 1/g of the
attention of every sequence of its bag (docs/concepts.md), so every GPU of a bag then
computes the bag's load / g to within one token's linear cost, and the bag-level scores
above are the real per-GPU loads. An optional ``max_tokens_per_gpu`` is a hard cap on
the tokens each GPU holds after routing (`KnapformerError` when a sequence fits nowhere).

Heterogeneous GPUs: with ``gpu_speed`` (relative speeds, e.g. learnt from measured
compute) a bag runs at the speed of its slowest GPU, and its capacity is its GPU count
times that speed; both solvers then balance modelled *times*.

Speed: a plan is made every training step, for ~100 sequences (32 GPUs) up to ~130,000
(4,096 GPUs). Per-sequence work is a fixed number of numpy calls; per-bag state that is
read item by item (occupancies, heaps) is kept in Python lists, where numpy's per-call
overhead would dominate; static per-topology arrays are cached. The two solvers are in
knapformer/planning/fixed.py (their local search in levelling.py), the solve state they
and auto share in bags.py, their tuning constants in tuning.py (docs/planning.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from knapformer import __version__
from knapformer.contract.limits import (
    MAX_GPU_SPEED,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    MIN_GPU_SPEED,
    check_count,
)
from knapformer.contract.plan import Chunks, Measurements, RoutingPlan
from knapformer.contract.topology import Topology, as_topology, consecutive_bags
from knapformer.errors import KnapformerError
from knapformer.planning.auto import solve_auto
from knapformer.planning.bags import (
    BagShape,
    Step,
    bag_shape,
)
from knapformer.planning.chunks import StepChunks
from knapformer.planning.collector import collector_paused
from knapformer.planning.communication import CommModel
from knapformer.planning.fixed import solve_default, solve_greedy
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES, allowed_sizes
from knapformer.planning.workload import WorkloadModel

DEFAULT_SOLVER = "knapformer"
AUTO = "auto"  # the topology that lets the planner choose each step's bags
SOLVERS = ("knapformer", "greedy")


@collector_paused()
def plan_routing(
    lengths_per_gpu: Sequence[ArrayLike],
    topology: Topology | str,
    model: WorkloadModel,
    solver: str = DEFAULT_SOLVER,
    max_tokens_per_gpu: int | None = None,
    gpus: Sequence[int] | None = None,
    step: int | None = None,
    run: str | None = None,
    gpu_speed: ArrayLike | None = None,
    *,
    comm: CommModel | None = None,
    group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
    min_group: int | None = None,
    max_group: int | None = None,
    cross_node: bool = False,
) -> RoutingPlan:
    """Plan one step.

    ``lengths_per_gpu[i]`` holds the sequence lengths (tokens) on GPU ``gpus[i]``, in the
    order they are packed there. Sequence ids are assigned in that order, GPU by GPU.
    ``gpu_speed`` (num_gpus,): relative speed of each GPU (1 = nominal; a bag runs at the
    speed of its slowest GPU); work is given in proportion. Recorded in the plan.

    ``topology="auto"`` chooses the step's bags too (`solve_auto`): aligned groups of
    ``group_sizes`` (bounded by ``min_group`` / ``max_group``; within a node of
    ``comm.node_size`` GPUs unless ``cross_node``), minimising the modelled step time with
    communication (``comm``, default `CommModel`). The plan's ``topology`` is the step's
    partition, its ``policy`` "auto", and ``solver_options`` hold ``comm`` and the sizes.
    """
    started = time.perf_counter()
    check_solver(solver, max_tokens_per_gpu)
    auto = isinstance(topology, str) and topology.strip() == AUTO
    if auto:
        comm = comm or CommModel()
        group = _auto_group(len(lengths_per_gpu), comm, group_sizes, min_group, max_group,
                            cross_node)  # fmt: skip
    else:
        group = _fixed_group(as_topology(topology), len(lengths_per_gpu))
    problem = StepProblem.build(lengths_per_gpu, group.shape, model, gpus, gpu_speed,
                                max_tokens_per_gpu, auto)  # fmt: skip
    solve_fixed = problem.fixed_solver(solver)
    options: dict = {} if max_tokens_per_gpu is None else {"max_tokens_per_gpu": max_tokens_per_gpu}
    if auto:
        solved = solve_auto(*problem.solver_args(), solve_fixed, model, comm, group.sizes,
                            group.node_size, group.num_gpus)  # fmt: skip
        topology_name, bags = solved.layout.shape.topology, _chosen_bags(solved, problem.gpus)
        options |= {"comm": comm.as_options(), "group_sizes": list(group.sizes)}
    else:
        solved = solve_fixed(group.shape)
        topology_name, bags = str(group.topology), group.topology.bags(problem.gpus)
    plan = _build_plan(problem, solved, model, gpus is None, step, run, topology_name, bags,
                       solver, options, auto)  # fmt: skip
    plan.measurements = Measurements(plan_ms=(time.perf_counter() - started) * 1e3)
    return plan


def _chosen_bags(solved: Step, gpus: list[int]) -> list[list[int]]:
    """The GPU ranks of each bag of the partition auto chose, in position order."""
    return consecutive_bags(gpus, solved.layout.shape.size.tolist())


@dataclass(frozen=True)
class _Group:
    """The balance group a step is planned on: its GPU count, the bag shape its positions
    are read in, and either the fixed topology or auto's allowed sizes."""

    num_gpus: int
    shape: BagShape
    topology: Topology | None = None
    sizes: tuple[int, ...] = ()
    node_size: int = 0


def _fixed_group(topo: Topology, given: int) -> _Group:
    if given != topo.num_gpus:
        raise KnapformerError(
            f"topology {topo} has {topo.num_gpus} GPUs but lengths were given for {given} GPUs"
        )
    return _Group(topo.num_gpus, bag_shape(topo.bag_sizes), topology=topo)


def _auto_group(num_gpus, comm, group_sizes, min_group, max_group, cross_node) -> _Group:
    if num_gpus == 0:
        raise KnapformerError("topology 'auto' needs the lengths of at least one GPU")
    sizes, node_size = allowed_sizes(
        num_gpus, int(comm.node_size), tuple(group_sizes), min_group, max_group, cross_node
    )
    shape = bag_shape((sizes[0],) * (num_gpus // sizes[0]))  # positions only
    return _Group(num_gpus, shape, sizes=tuple(sizes), node_size=node_size)


@dataclass(frozen=True)
class StepProblem:
    """What every solve of a step reads, built once and never changed (docs/planning.md,
    "The step problem"): each sequence's tokens, workload and source GPU position, the
    GPUs' learnt speeds (None: nominal), the token cap and the group's ranks."""

    lengths: np.ndarray
    workload: np.ndarray
    src_pos: np.ndarray
    speed: np.ndarray | None
    max_tokens: int | None
    gpus: list[int]

    @classmethod
    def build(cls, lengths_per_gpu, shape, model, gpus, gpu_speed, max_tokens, auto):
        num_gpus = len(shape.positions)
        ranks = list(range(num_gpus)) if gpus is None else [int(g) for g in gpus]
        if auto and len(ranks) != num_gpus:
            raise KnapformerError(f"{len(ranks)} GPU ranks were given for {num_gpus} GPUs")
        speed = check_speed(gpu_speed, num_gpus)
        lengths, src_pos = _flatten(lengths_per_gpu, shape)
        workload = model.workload(lengths)
        with np.errstate(over="ignore"):
            total = float(workload.sum())
        if not np.isfinite(total):
            raise KnapformerError(
                f"the workloads of the step sum to {total} under {model}: loads cannot be balanced"
            )
        return cls(lengths, workload, src_pos, speed, max_tokens, ranks)

    def solver_args(self) -> tuple:
        """(lengths, workload, src_pos, speed, max_tokens): what the solvers take."""
        return self.lengths, self.workload, self.src_pos, self.speed, self.max_tokens

    def fixed_solver(self, solver: str):
        """``solve(shape) -> Step``: ``solver`` on a fixed layout of this step (auto solves
        the whole-family layouts with it too)."""
        solve = solve_greedy if solver == "greedy" else solve_default
        return lambda shape: solve(shape, *self.solver_args())


def _build_plan(problem, solved, model, positions_are_ranks, step, run, topology_name, bags,
                solver, options, auto) -> RoutingPlan:  # fmt: skip
    """The `RoutingPlan` of a solved step (columns, not validated: the hot path). Its
    chunk table is derived (`StepChunks`): made whole only when a reader reads it; a
    rank's router reads its own rows (`RoutingPlan.rank_chunks`)."""
    src_pos, speed = problem.src_pos, problem.speed
    ranks = None if positions_are_ranks else np.asarray(problem.gpus, dtype=np.int64)
    src_gpu = src_pos if ranks is None else ranks[src_pos]
    if solved.chunks:  # auto priced this layout: its table is made already
        chunk_seq, chunk_pos, chunk_off, chunk_len = solved.chunks
        chunk_src = src_pos[chunk_seq]
        if ranks is not None:
            chunk_src, chunk_pos = ranks[chunk_src], ranks[chunk_pos]
        chunks = {"seq": chunk_seq, "src_gpu": chunk_src, "dst_gpu": chunk_pos,
                  "offset": chunk_off, "length": chunk_len}  # fmt: skip
    else:
        chunks = Chunks.derived(StepChunks(solved, ranks))
    return RoutingPlan.build(
        planner_version=__version__,
        step=step,
        time=time.time(),
        run=run,
        topology=topology_name,
        gpus=problem.gpus,
        bags=bags,
        token_dim=model.token_dim,
        gamma=model.gamma,
        scale=model.scale,
        workload_unit=model.unit,
        gpu_speed=None if speed is None else speed.tolist(),
        solver=solver,
        **({"policy": AUTO} if auto else {}),
        solver_options=options,
        sequences={
            "src_gpu": src_gpu,
            "length": problem.lengths,
            "workload": problem.workload,
            "bag": solved.bag,
        },
        chunks=chunks,
    )


def check_solver(solver: str, max_tokens_per_gpu: int | None) -> None:
    """A `KnapformerError` for a solver not in `SOLVERS` or a token cap that is not positive."""
    if solver not in SOLVERS:
        raise KnapformerError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu <= 0:
        raise KnapformerError(f"max_tokens_per_gpu must be positive, got {max_tokens_per_gpu}")


def check_speed(gpu_speed: ArrayLike | None, num_gpus: int) -> np.ndarray | None:
    """``gpu_speed`` as a (num_gpus,) float array, or None when every GPU is nominal; a
    `KnapformerError` naming the values for a wrong count or a speed that is not a finite
    positive number."""
    if gpu_speed is None:
        return None
    speed = np.asarray(gpu_speed, dtype=np.float64).reshape(-1)
    if speed.size != num_gpus:
        raise KnapformerError(
            f"gpu_speed has {speed.size} values for {num_gpus} GPUs: it must hold {num_gpus} "
            f"finite positive speeds, one per GPU, got {speed.tolist()}"
        )
    # The bounds a plan file may hold: a plan planned outside them would not read back.
    if not (
        np.isfinite(speed).all() and ((speed >= MIN_GPU_SPEED) & (speed <= MAX_GPU_SPEED)).all()
    ):
        raise KnapformerError(
            f"gpu_speed values must lie in {MIN_GPU_SPEED:g}..{MAX_GPU_SPEED:g} "
            f"(knapformer.contract.limits), got {speed.tolist()}"
        )
    return None if (speed == 1.0).all() else speed


def _flatten(
    lengths_per_gpu: Sequence[ArrayLike], shape: BagShape
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-GPU lengths; returns (lengths, source GPU position) per sequence."""
    try:  # one C-level pass for the usual input: one flat list or array per GPU
        lengths = np.concatenate(lengths_per_gpu)
        counts = list(map(len, lengths_per_gpu))
    except (ValueError, TypeError):  # scalars or nested parts: flatten each
        parts = [np.asarray(part).reshape(-1) for part in lengths_per_gpu]
        lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        counts = [p.size for p in parts]
    if lengths.ndim != 1:
        parts = [np.asarray(part).reshape(-1) for part in lengths_per_gpu]
        lengths, counts = np.concatenate(parts), [p.size for p in parts]
    src_pos = np.repeat(shape.positions, counts)
    if lengths.size == 0:
        return lengths.astype(np.int64), src_pos
    if lengths.dtype.kind not in "iu" and (
        lengths.dtype.kind != "f" or np.any(np.mod(lengths, 1) != 0)
    ):
        bad = int(src_pos[np.flatnonzero(np.mod(lengths.astype(float), 1) != 0)[0]])
        raise KnapformerError(f"lengths on GPU position {bad} must be whole numbers of tokens")
    check_count(lengths.size, MAX_SEQUENCES, "the sequences of a step")
    # Bounded before the cast: a uint64 beyond int64 would wrap around to a negative.
    if lengths.max() > MAX_SEQ_LENGTH:
        bad = int(np.argmax(lengths))
        raise KnapformerError(
            f"lengths on GPU position {int(src_pos[bad])} include {lengths[bad]:,} tokens; a "
            f"sequence holds at most {MAX_SEQ_LENGTH:,} (knapformer.contract.limits)"
        )
    if lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise KnapformerError(
            f"lengths on GPU position {int(src_pos[bad])} include a negative value {lengths[bad]}"
        )
    return lengths.astype(np.int64, copy=False), src_pos
