"""The planner: a pure, deterministic function from sequence lengths to a `RoutingPlan`.

Every rank computes the same plan from the same gathered lengths, so nothing here may
depend on process state. Two solvers:

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
   out the last gaps as in greedy;
4. a local search moves or swaps sequences between the most-loaded bag and the
   least-loaded ones until the makespan is within 0.08 % of the lower bound, or no
   exchange helps; if it ends more than 0.1 % above the bound, greedy is solved too and
   the better makespan kept (so it is never worse than greedy's beyond 0.1 % of the bound).
   A small round scores every (leaving, returning) pair at once; a large one only the two
   members per partner nearest the ideal exchange (the best one is always among them).
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
overhead would dominate; static per-topology arrays are cached.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

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
from knapformer.contract.plan import Measurements, RoutingPlan
from knapformer.contract.stats import lower_bound
from knapformer.contract.topology import Topology, as_topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel, communication_loads
from knapformer.planning.partitions import (
    DEFAULT_GROUP_SIZES,
    allowed_sizes,
    effective_workloads,
    mixed_partitions,
    partition_floor,
)
from knapformer.planning.workload import WorkloadModel

DEFAULT_SOLVER = "knapformer"
AUTO = "auto"  # the topology that lets the planner choose each step's bags
SOLVERS = ("knapformer", "greedy")
_HEAVY_FRACTION = 0.25  # of one GPU's capacity: placed before the bulk "stay home" pass
_EPS = 1e-12
_ONE_BY_ONE = 128  # steps of at most this many sequences are placed one by one
# Further from the lower bound than this fraction, greedy is solved as well and the
# better makespan kept: the result is then never worse than greedy's (which is >= the
# bound) by more than 0.1 % of the bound.
_FALLBACK_TOLERANCE = 1e-3
_LEVEL_TOLERANCE = 8e-4  # the local search stops this close to the bound (with margin)
_LEVEL_PARTNERS = 8  # least-loaded bags tried as exchange partners of the most-loaded one
# A search round scores every (leaving, returning) pair while there are at most this many;
# beyond, only the two candidates nearest the ideal exchange per partner.
_DENSE_CELLS = 8192


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

    ``topology="auto"`` chooses the step's bags too (`_solve_auto`): aligned groups of
    ``group_sizes`` (bounded by ``min_group`` / ``max_group``; within a node of
    ``comm.node_size`` GPUs unless ``cross_node``), minimising the modelled step time with
    communication (``comm``, default `CommModel`). The plan's ``topology`` is the step's
    partition, its ``policy`` "auto", and ``solver_options`` hold ``comm`` and the sizes.
    """
    started = time.perf_counter()
    auto = isinstance(topology, str) and topology.strip() == AUTO
    check_solver(solver, max_tokens_per_gpu)
    if auto:
        num_gpus = len(lengths_per_gpu)
        if num_gpus == 0:
            raise KnapformerError("topology 'auto' needs the lengths of at least one GPU")
        comm = comm or CommModel()
        sizes, node_size = allowed_sizes(
            num_gpus, int(comm.node_size), tuple(group_sizes), min_group, max_group, cross_node
        )
        shape = _bag_shape((sizes[0],) * (num_gpus // sizes[0]))  # positions only
    else:
        topo = as_topology(topology)
        num_gpus = topo.num_gpus
        shape = _bag_shape(topo.bag_sizes)
    if len(lengths_per_gpu) != num_gpus:
        raise KnapformerError(
            f"topology {topo} has {topo.num_gpus} GPUs but lengths were given for "
            f"{len(lengths_per_gpu)} GPUs"
        )
    gpu_ranks = list(range(num_gpus)) if gpus is None else [int(g) for g in gpus]
    if auto and len(gpu_ranks) != num_gpus:
        raise KnapformerError(f"{len(gpu_ranks)} GPU ranks were given for {num_gpus} GPUs")
    speed = check_speed(gpu_speed, num_gpus)

    lengths, src_pos = _flatten(lengths_per_gpu, shape)
    workload = model.workload(lengths)
    with np.errstate(over="ignore"):
        total = float(workload.sum())
    if not np.isfinite(total):
        raise KnapformerError(
            f"the workloads of the step sum to {total} under {model}: loads cannot be balanced"
        )
    options: dict = {} if max_tokens_per_gpu is None else {"max_tokens_per_gpu": max_tokens_per_gpu}
    if auto:
        step_state = _solve_auto(
            lengths, workload, src_pos, speed, max_tokens_per_gpu, solver, model, comm, sizes,
            node_size, num_gpus,
        )  # fmt: skip
        shape = step_state.layout.shape
        topology_name = str(Topology.from_bag_sizes(shape.size.tolist()))
        bags = [
            gpu_ranks[s : s + g]
            for s, g in zip(shape.start.tolist(), shape.size.tolist(), strict=True)
        ]
        options |= {"comm": comm.as_options(), "group_sizes": list(sizes)}
    elif solver == "greedy":
        step_state = _solve_greedy(shape, lengths, workload, src_pos, speed, max_tokens_per_gpu)
    else:
        step_state = _solve_default(shape, lengths, workload, src_pos, speed, max_tokens_per_gpu)
    if not auto:
        topology_name, bags = str(topo), topo.bags(gpu_ranks)

    chunk_seq, chunk_pos, chunk_off, chunk_len = step_state.chunks or _chunk_table(step_state)
    if gpus is None:  # positions are ranks
        src_gpu, chunk_src, chunk_dst = src_pos, src_pos[chunk_seq], chunk_pos
    else:
        ranks = np.asarray(gpu_ranks, dtype=np.int64)
        src_gpu, chunk_src, chunk_dst = ranks[src_pos], ranks[src_pos[chunk_seq]], ranks[chunk_pos]

    plan = RoutingPlan.build(
        planner_version=__version__,
        step=step,
        time=time.time(),
        run=run,
        topology=topology_name,
        gpus=gpu_ranks,
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
            "length": lengths,
            "workload": workload,
            "bag": step_state.bag,
        },
        chunks={
            "seq": chunk_seq,
            "src_gpu": chunk_src,
            "dst_gpu": chunk_dst,
            "offset": chunk_off,
            "length": chunk_len,
        },
    )
    plan.measurements = Measurements(plan_ms=(time.perf_counter() - started) * 1e3)
    return plan


# Auto (`_solve_auto`).
_AUTO_MOVES = 128  # exchanges of the refinement pass, per mixed partition
_AUTO_MOVES_LARGE = 24  # in a large step (where sequences are fine-grained)
_AUTO_PARTNERS = 8  # least-loaded bags tried per exchange (every bag up to _AUTO_ALL)
_AUTO_ALL = 64
_AUTO_ALL_SEQUENCES = 512
_AUTO_MEMBERS = 32  # members of a bag scored per exchange (a spread sample beyond)
_AUTO_STOP = 1e-4  # the refinement stops this close to the partition floor
_AUTO_POUR = 2048  # a larger pool is poured into the bags' room at once, not one by one
_TIE = 1e-9


def _solve_auto(lengths, workload, src_pos, speed, max_tokens, solver, model, comm, sizes,
                node_size, num_gpus) -> _Step:  # fmt: skip
    """Choose the step's partition into aligned groups and place the sequences in it,
    minimising the modelled step time: the slowest GPU's compute + Ulysses + route
    (`_modelled_makespan`).

    Candidates: the mixed partitions of `mixed_partitions`, each solved as one problem
    over all its bags (`_solve_mixed`), and the whole-family layouts gXnY, solved exactly
    as a fixed topology is (the chosen solver, compute-only): the step is then never
    slower than under the best fixed layout of the family. A fixed layout whose floor
    with Ulysses (max(total / N, largest sequence / g), a lower bound on its modelled
    time) cannot beat the best found is not solved. Ties (within 1e-9) go to the fewer
    moved tokens; a candidate that breaks the token cap is skipped. The returned step's
    layout is the chosen partition's (bags in position order).
    """
    scale = float(model.scale)
    per_token = {g: comm.ulysses_per_token(model.token_dim, g, scale) for g in sizes}
    eff = effective_workloads(workload, lengths, sizes, per_token)
    floor = partition_floor(eff, lengths, sizes, num_gpus)
    best: list = [None, None]  # step, (makespan, moved tokens)
    failure = None

    def consider(solve) -> None:
        nonlocal failure
        try:
            step = solve()
        except KnapformerError as err:
            failure = failure or err
            return
        step.chunks = _chunk_table(step)
        key = (_modelled_makespan(step, model, comm, speed), _moved_estimate(step))
        held = best[1]
        if (held is None or key[0] < held[0] * (1 - _TIE)
                or (key[0] <= held[0] * (1 + _TIE) and key[1] < held[1])):  # fmt: skip
            best[:] = [step, key]

    mixed = mixed_partitions(workload, lengths, src_pos, num_gpus, sizes, per_token, node_size, eff)
    # Variants only pay off where sequences are coarse (few per GPU); a large step solves one.
    for cand in mixed[: None if len(lengths) <= _AUTO_ALL_SEQUENCES else 1]:
        consider(lambda c=cand: _solve_mixed(
            c.bag_sizes, lengths, workload, src_pos, speed, max_tokens, per_token, floor,
            comm, model))  # fmt: skip
    whole = sorted(
        (max(float(eff[j].sum()) / num_gpus, float(eff[j].max(initial=0.0)) / g), g)
        for j, g in enumerate(sizes)
        if num_gpus % g == 0
    )
    for bound, g in whole:
        # Speeds change what a layout can reach: every layout is solved then.
        if speed is None and best[1] is not None and bound > best[1][0] * (1 + _TIE):
            continue
        shape = _bag_shape((g,) * (num_gpus // g))
        if solver == "greedy":
            consider(lambda s=shape: _solve_greedy(s, lengths, workload, src_pos, speed,
                                                   max_tokens))  # fmt: skip
        else:
            consider(lambda s=shape: _solve_default(s, lengths, workload, src_pos, speed,
                                                    max_tokens))  # fmt: skip
    if best[0] is None:
        raise failure or KnapformerError("topology 'auto' found no partition for the step")
    return best[0]


def _modelled_makespan(step: _Step, model: WorkloadModel, comm: CommModel, speed) -> float:
    """The largest per-GPU load of ``step`` (its chunk table made), communication included:
    what `plan_cost` gives the plan it becomes, computed before the plan exists."""
    layout, lengths, workload = step.layout, step.lengths, step.workload
    seq, pos, _, length = step.chunks
    n = len(layout.shape.bag_of_pos)
    share = np.where(lengths > 0, model.linear_share(lengths), 0.0)
    per_token = np.divide(workload * share, lengths, out=np.zeros(len(lengths)),
                          where=lengths > 0)  # fmt: skip
    linear = np.bincount(pos, weights=per_token[seq] * length, minlength=n)
    attention = np.bincount(step.bag, weights=workload * (1.0 - share), minlength=len(layout.size))
    compute = linear + (attention / layout.size)[layout.shape.bag_of_pos]
    if speed is not None:
        compute = compute / speed
    tokens = np.bincount(pos, weights=length, minlength=n)
    ulysses, route = communication_loads(
        comm, model.token_dim, float(model.scale), layout.size[layout.shape.bag_of_pos], tokens,
        step.src_pos[seq], pos, length,
    )  # fmt: skip
    return float((compute + ulysses + route).max(initial=0.0))


@dataclass(frozen=True)
class _Prices:
    """What a sequence costs in each bag of a mixed partition, per layer, in workload
    units: ``kappa`` (num_bags,) Ulysses per token; ``link`` (n, ...) via `route`: the route
    per moved token (both ends alike) between its source GPU and a bag, over the node link
    when the bag is in the source's node, else over the network."""

    kappa: np.ndarray
    bag_node: np.ndarray  # (num_bags,) node of each bag; -1: spans nodes
    src_node: np.ndarray  # (n,)
    intra: float
    inter: float

    @classmethod
    def of(cls, shape, src_pos, per_token, comm, model):
        node = int(comm.node_size)
        per_token_route = [
            float(comm.work_of(model.token_dim * comm.dtype_bytes / (gbs * 1e9), model.scale))
            / comm.layers
            for gbs in (comm.intra_gbs, comm.inter_gbs)
        ]
        bag_node = np.where(shape.size > node, -1, shape.start // node)
        return cls(np.array([per_token[int(g)] for g in shape.size]), bag_node,
                   np.where(src_pos >= 0, src_pos // node, -2), *per_token_route)  # fmt: skip

    def route(self, seqs, bags, home, size, lengths):
        """Per (sequence, bag) pair (broadcast): tokens that leave the source times the
        route per token: all of them away from home, (g-1)/g at home."""
        per = np.where(self.bag_node[bags] == self.src_node[seqs], self.intra, self.inter)
        moved = np.where(bags == home, (size[bags] - 1) / size[bags], 1.0) * lengths
        return per * moved


def _solve_mixed(bag_sizes, lengths, workload, src_pos, speed, max_tokens, per_token,
                 floor, comm, model) -> _Step:  # fmt: skip
    """One problem over all bags of a mixed partition, each sequence priced at the bag it
    is in (`_Prices`: ``W + k_g*L`` plus the route its receivers pay; its source GPU's bag
    pays the sending; a bag's per-GPU time is its priced load / its weight).

    Largest first, a sequence stays in its home bag while that keeps the bag under
    ``floor`` (`partition_floor`), else goes where the larger of its bag's and its home
    bag's per-GPU time ends lowest (LPT across sizes, among the least loaded bag of each
    size overall and in its source's node; a tie to the smaller group). In a large step
    only the heavy sequences go one by one: the others stay home in bulk, and a large
    remainder is poured into the bags' room at one water level (`_pour`).
    `_exchange_across` then evens out the top.
    """
    shape = _bag_shape(tuple(bag_sizes))
    layout = _BagLayout(shape, floor, max_tokens, _bag_speed(shape, speed), even=True)
    step = _Step.start(shape, lengths, workload, src_pos, layout)
    prices = _Prices.of(shape, src_pos, per_token, comm, model)
    empty = lengths == 0
    step.bag[empty] = step.home_bag[empty]
    load = np.zeros(len(shape.size))
    placed = np.flatnonzero(~empty)
    if len(placed) > _ONE_BY_ONE:
        # Only the heavy ones and the pool need the descending order (the bulk pass sorts
        # by home bag itself): sorting every sequence would cost more than the rest.
        heavy = workload[placed] > _HEAVY_FRACTION * floor
        load = _place_priced(_descending(workload, placed[heavy]), step, load, prices, floor)
        rest = placed[~heavy]
        load = _stay_home_priced(rest, step, load, prices, floor)
        pool = _descending(workload, rest[step.bag[rest] < 0])
        if len(pool) > _AUTO_POUR and max_tokens is None:
            load = _pour(pool, step, load, prices)
            pool = pool[step.bag[pool] < 0]
        order = pool
    else:
        order = _descending(workload, placed)
    _place_priced(order, step, load, prices, floor)
    _exchange_across(step, prices, floor, max_tokens)
    layout.load[:] = np.bincount(step.bag, weights=workload, minlength=len(shape.size))
    return step


def _place_priced(order, step: _Step, load: np.ndarray, prices: _Prices, level: float):
    """Place ``order`` one by one (see `_solve_mixed`); ``load`` (num_bags,): each bag's
    priced load so far. Returns the new loads."""
    layout = step.layout
    if order.size == 0:
        return load
    size, weight, kap = layout.size.tolist(), layout.weight.tolist(), prices.kappa.tolist()
    bag_node = prices.bag_node.tolist()
    class_size, class_of_bag = layout.class_size.tolist(), layout.shape.class_of_bag
    load = load.tolist()
    per = [x / w for x, w in zip(load, weight, strict=True)]
    # The least loaded bag of each size: overall, and in each node.
    heaps: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for b, p in enumerate(per):
        for key in ((class_of_bag[b], -2), (class_of_bag[b], bag_node[b])):
            heaps.setdefault(key, []).append((p, b))
    for heap in heaps.values():
        heapq.heapify(heap)
    heappush = heapq.heappush
    # Each bag's two heaps: a new entry goes to both when the bag's load grows.
    bag_heaps = [
        (heaps[(class_of_bag[b], -2)], heaps[(class_of_bag[b], bag_node[b])])
        for b in range(len(per))
    ]
    capped = layout.max_tokens is not None
    limit = level * (1 + _EPS)
    intra, inter = prices.intra, prices.inter
    heappop = heapq.heappop
    tries: dict[int, list] = {}  # per source node: (class, size, its two heaps) to try
    rows = zip(order.tolist(), step.workload[order].tolist(), step.lengths[order].tolist(),
               step.home_bag[order].tolist(), prices.src_node[order].tolist(),
               strict=True)  # fmt: skip
    chosen = []
    for seq, w, length, h, node in rows:
        room = layout.token_room(length).tolist() if capped else None
        at_home = h >= 0 and size[h] <= length and (room is None or room[h])
        if at_home:
            home_cost = w + kap[h] * length + 2 * intra * length * (size[h] - 1) / size[h]
            if (load[h] + home_cost) / weight[h] <= limit:
                b, cost, sent = h, home_cost, 0.0
                chosen.append(b)
                load[b] += cost
                per[b] = p = load[b] / weight[b]
                for heap in bag_heaps[b]:
                    heappush(heap, (p, b))
                if capped:
                    layout.add(b, 0.0, length, 0)
                continue
        b, lowest, cost, sent = -1, np.inf, 0.0, 0.0
        if at_home:
            b, lowest, cost = h, (load[h] + home_cost) / weight[h], home_cost
        tried = tries.get(node)
        if tried is None:
            tried = tries[node] = [
                (c, g, [heap for heap in (heaps.get((c, -2)), heaps.get((c, node))) if heap])
                for c, g in enumerate(class_size)
            ]
        for c, g, class_heaps in tried:
            if g > length and c > 0:
                break  # groups larger than the sequence (the smallest always may)
            for heap in class_heaps:
                if room is None:
                    while heap[0][0] != per[heap[0][1]]:  # `_live_top`, inlined
                        heappop(heap)
                    top = heap[0][1]
                else:
                    live = [e for e in heap if room[e[1]] and e[0] == per[e[1]]]
                    if not live:
                        continue
                    top = min(live)[1]
                if top == h:
                    continue
                route = (intra if bag_node[top] == node else inter) * length
                value = (load[top] + w + kap[top] * length + route) / weight[top]
                if h >= 0:
                    sender = (load[h] + route) / weight[h]
                    if sender > value:
                        value = sender
                if value < lowest:
                    b, lowest, cost, sent = top, value, w + kap[top] * length + route, route
        if b < 0:
            raise layout.infeasible(seq, length)
        chosen.append(b)
        load[b] += cost
        per[b] = p = load[b] / weight[b]
        for heap in bag_heaps[b]:
            heappush(heap, (p, b))
        if sent and h >= 0:
            load[h] += sent
            per[h] = p = load[h] / weight[h]
            for heap in bag_heaps[h]:
                heappush(heap, (p, h))
        if capped:
            layout.add(b, 0.0, length, 0)
    step.bag[order] = chosen
    return np.asarray(load)


def _stay_home_priced(seqs, step: _Step, load: np.ndarray, prices: _Prices, level: float):
    """Within each home bag, the largest of ``seqs`` stay while the bag's priced load stays
    under ``level`` per GPU (one vectorised pass, as `_stay_home_in_bulk`). Returns the new
    loads."""
    layout, lengths, home = step.layout, step.lengths, step.home_bag
    seqs = seqs[(home[seqs] >= 0) & (layout.size[np.maximum(home[seqs], 0)] <= lengths[seqs])]
    order = _by_home_heaviest_first(seqs, home, step.workload, len(layout.size))
    hb = home[order]
    cost = (step.workload[order] + prices.kappa[hb] * lengths[order]
            + 2 * prices.route(order, hb, hb, layout.size, lengths[order]))  # fmt: skip
    stays = _prefix_within_groups(cost, hb, (level * layout.weight - load)[hb])
    if layout.max_tokens is not None:
        token_room = layout.max_tokens * layout.size[hb] - layout.bag_tokens[hb]
        stays &= _prefix_within_groups(lengths[order].astype(np.float64), hb, token_room)
    step.bag[order[stays]] = hb[stays]
    if layout.max_tokens is not None:
        layout.add_many(hb[stays], np.zeros(int(stays.sum())), lengths[order[stays]])
    return load + np.bincount(hb[stays], weights=cost[stays], minlength=len(load))


def _pour(pool, step: _Step, load: np.ndarray, prices: _Prices) -> np.ndarray:
    """Pour many small sequences into the bags' room at one water level: bags of the
    smallest groups first (no Ulysses), each sequence where the running sum of the pool's
    costs puts its middle. The level is the least at which the whole pool fits. Sequences
    shorter than some group are left unplaced (placed one by one after). Returns the new
    loads (route priced over the network, on both ends)."""
    layout, lengths, workload = step.layout, step.lengths, step.workload
    pool = pool[lengths[pool] >= layout.class_size[-1]]
    if pool.size == 0:
        return load
    kappa = prices.kappa
    by_class = np.argsort(layout.size, kind="stable")  # bags, smallest groups first
    base = workload[pool].sum()
    # A bag's room in the pool's own units (cost without Ulysses): its priced room over the
    # pool's mean inflation in that group.
    inflation = 1.0 + (kappa[by_class] + prices.inter) * lengths[pool].sum() / base
    weight = layout.weight[by_class]
    held = load[by_class]

    def room(level: float) -> np.ndarray:
        return np.maximum(0.0, level * weight - held) / inflation

    lo, hi = 0.0, float((held.sum() + base * inflation.max()) / weight.sum()) + held.max()
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if room(mid).sum() >= base else (mid, hi)
    ends = np.cumsum(room(hi))
    cost = workload[pool]
    middle = np.cumsum(cost) - 0.5 * cost
    slot = np.minimum(np.searchsorted(ends, middle, side="right"), len(ends) - 1)
    bags = by_class[slot]
    step.bag[pool] = bags
    sent = prices.inter * lengths[pool]
    load = load + np.bincount(bags, weights=cost + kappa[bags] * lengths[pool] + sent,
                              minlength=len(load))  # fmt: skip
    home = step.home_bag[pool]
    return load + np.bincount(home[home >= 0], weights=sent[home >= 0], minlength=len(load))


def _exchange_across(step: _Step, prices: _Prices, floor: float, max_tokens) -> None:
    """Exchanges between bags of any sizes, each sequence re-priced at its new bag
    (`_Prices`): the most loaded bag moves one sequence to, or swaps one with, whichever of
    the least loaded bags (every bag in a step of at most ``_AUTO_ALL`` bags and
    ``_AUTO_ALL_SEQUENCES`` sequences, else ``_AUTO_PARTNERS``)
    evens the two out best, while that lowers the larger of the two and leaves the
    sequences' home bags (which pay the sending) below it (at most ``_AUTO_MOVES``
    exchanges; stops within ``_AUTO_STOP`` of ``floor``). All pairs of a move are scored
    in one vectorised pass."""
    layout = step.layout
    size, weight, kappa = layout.size, layout.weight, prices.kappa
    num_bags = len(size)
    if num_bags < 2:
        return
    lengths = step.lengths.astype(np.float64)
    workload, home = step.workload, step.home_bag
    all_seqs = np.arange(len(lengths))
    route = prices.route(all_seqs, step.bag, home, size, lengths)
    away = (step.bag != home) & (home >= 0)
    price = workload + kappa[step.bag] * lengths + np.where(away, route, 2 * route)
    load = np.bincount(step.bag, weights=price, minlength=num_bags)
    load += np.bincount(home[away], weights=route[away], minlength=num_bags)
    tokens = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    per = load / weight
    stop = floor * (1 + _AUTO_STOP)
    placed = np.flatnonzero(step.lengths > 0)
    # A stable sort of small ints is a radix sort (the same order, much faster).
    bag_key = step.bag[placed].astype(np.int16 if num_bags < 2**15 else np.int64)
    by_bag = placed[np.argsort(bag_key, kind="stable")]
    cuts = np.searchsorted(step.bag[by_bag], np.arange(num_bags + 1)).tolist()
    members = _LazyMembers(by_bag, cuts)  # each bag's list, made when first asked for
    small = num_bags <= _AUTO_ALL and len(lengths) <= _AUTO_ALL_SEQUENCES
    partners = num_bags - 1 if small else min(_AUTO_PARTNERS, num_bags - 1)
    samples: dict[int, np.ndarray] = {}  # each bag's `_spread_sample`, until it changes

    def sample(bag: int) -> np.ndarray:
        if bag not in samples:
            samples[bag] = _spread_sample(members[bag], workload, _AUTO_MEMBERS)
        return samples[bag]

    def priced(seq, bag):
        """(price in ``bag``, what its home bag pays for sending) of sequences ``seq``."""
        r = prices.route(seq, bag, home[seq], size, lengths[seq])
        there = bag == home[seq]
        return (workload[seq] + kappa[bag] * lengths[seq] + np.where(there, 2 * r, r),
                np.where(there | (home[seq] < 0), 0.0, r))  # fmt: skip

    for _ in range(_AUTO_MOVES if small else _AUTO_MOVES_LARGE):
        a = int(np.argmax(per))
        if per[a] <= stop or not members[a]:
            break
        lightest = _least(per, partners + 1)
        lightest = lightest[lightest != a][:partners]
        ma = sample(a)
        cols = [np.append(sample(b), -1) for b in lightest.tolist()]
        mb = np.concatenate(cols)
        b = np.repeat(lightest, [len(c) for c in cols])
        real = mb >= 0
        mbi = np.maximum(mb, 0)
        lj = np.where(real, lengths[mbi], 0.0)
        into_a = np.where(real, priced(mbi, np.full(len(mbi), a))[0], 0.0)
        out_b = np.where(real, price[mbi], 0.0)
        li = lengths[ma][:, None]
        into_b = priced(ma[:, None], b[None, :])[0]  # (len(ma), len(b)), broadcast
        new_a = per[a] + (into_a[None, :] - price[ma][:, None]) / weight[a]
        new_b = per[b][None, :] + (into_b - out_b[None, :]) / weight[b][None, :]
        ok = (li >= size[b][None, :]) & ((lj >= size[a]) | ~real)[None, :]
        if max_tokens is not None:
            ok &= np.ceil((tokens[b][None, :] + li - lj[None, :]) / size[b][None, :]) <= max_tokens
            ok &= np.ceil((tokens[a] - li + lj[None, :]) / size[a]) <= max_tokens
        value = np.where(ok, np.maximum(new_a, new_b), np.inf)
        i, j = divmod(int(value.argmin()), value.shape[1])
        if not value[i, j] < per[a] * (1 - _TIE):
            break
        dst, before = int(b[j]), per[a]
        undo = (load.copy(), tokens.copy(), price.copy())
        moves = [(int(ma[i]), a, dst), (int(mb[j]), dst, a)]
        touched = {a, dst}
        for seq, src, to in moves:
            if seq < 0:
                continue
            old_sent = priced(np.array([seq]), np.array([src]))[1][0]
            new_price, new_sent = (x[0] for x in priced(np.array([seq]), np.array([to])))
            load[src] -= price[seq]
            load[to] += new_price
            price[seq] = new_price
            tokens[src] -= lengths[seq]
            tokens[to] += lengths[seq]
            if home[seq] >= 0:
                load[home[seq]] += new_sent - old_sent
                touched.add(int(home[seq]))
        touched_list = list(touched)
        new_per = load[touched_list] / weight[touched_list]
        if new_per.max() >= before * (1 - _TIE):  # a home bag rose to the top: undo, stop
            load, tokens, price = undo
            break
        for seq, src, to in moves:
            if seq >= 0:
                step.bag[seq] = to
                members[src].remove(seq)
                members[to].append(seq)
                samples.pop(src, None)
                samples.pop(to, None)
        per[touched_list] = new_per
    if max_tokens is not None:
        layout.bag_tokens[:] = tokens.astype(np.int64)


class _LazyMembers(dict):
    """Bag -> its sequence ids (a list), cut from ``by_bag`` (ids sorted by bag; bag b's
    run is ``cuts[b]:cuts[b + 1]``) when first asked for: an exchange pass reads few bags."""

    def __init__(self, by_bag: np.ndarray, cuts: list[int]):
        super().__init__()
        self.by_bag, self.cuts = by_bag, cuts

    def __missing__(self, bag: int) -> list[int]:
        self[bag] = part = self.by_bag[self.cuts[bag] : self.cuts[bag + 1]].tolist()
        return part


def _least(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of ``np.argsort(values, kind="stable")`` without sorting them all:
    every value up to the k-th smallest, then a stable sort of those few."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= len(values):
        return np.argsort(values, kind="stable")
    some = np.flatnonzero(values <= np.partition(values, k - 1)[k - 1])
    return some[np.argsort(values[some], kind="stable")[:k]]


def _spread_sample(members: list[int], workload: np.ndarray, most: int) -> np.ndarray:
    """``members`` as an array, or ``most`` of them spread evenly over their workloads
    (a large bag's exchanges are then scored on a sample from light to heavy)."""
    m = np.asarray(members, dtype=np.int64)
    if len(m) <= most:
        return m
    m = m[np.argsort(workload[m], kind="stable")]
    return m[np.linspace(0, len(m) - 1, most).round().astype(np.int64)]


def _moved_estimate(step: _Step) -> float:
    """Tokens that leave their GPU: all of a sequence placed away from home, (g-1)/g of one
    at home in a g-GPU bag."""
    g = step.layout.size[step.bag].astype(np.float64)
    home = step.bag == step.home_bag
    return float(np.sum(step.lengths * np.where(home, (g - 1) / g, 1.0)))


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


class _BagShape:
    """Static arrays of a topology (read-only, cached): bag sizes, first GPU position of
    each bag, bag of each GPU position, the distinct sizes and each bag's size class."""

    def __init__(self, bag_sizes: tuple[int, ...]):
        self.size = np.asarray(bag_sizes, dtype=np.int64)
        self.start = (np.cumsum(self.size) - self.size).astype(np.int64)
        self.bag_of_pos = np.repeat(np.arange(len(self.size)), self.size)
        self.class_size = np.unique(self.size)
        self.class_of_bag_array = np.searchsorted(self.class_size, self.size)
        self.class_of_bag = self.class_of_bag_array.tolist()  # read item by item
        self.positions = np.arange(int(self.size.sum()))
        for arr in (
            self.size,
            self.start,
            self.bag_of_pos,
            self.class_size,
            self.class_of_bag_array,
            self.positions,
        ):
            arr.flags.writeable = False


@lru_cache(maxsize=64)
def _bag_shape(bag_sizes: tuple[int, ...]) -> _BagShape:
    return _BagShape(bag_sizes)


def _flatten(
    lengths_per_gpu: Sequence[ArrayLike], shape: _BagShape
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


class _BagLayout:
    """A topology's bags plus the mutable per-bag load and token state of a solve.

    ``weight`` is a bag's GPUs times the speed of its slowest GPU (the bag size when every
    GPU is nominal): its capacity is ``weight * gpu_capacity`` and ``load / weight`` the
    modelled time of each of its GPUs. ``even``: chunks spread a bag's tokens evenly over
    its GPUs (the default solver); else the published round-robin remainder (greedy).
    """

    def __init__(
        self,
        shape: _BagShape,
        gpu_capacity: float,
        max_tokens: int | None,
        bag_speed: np.ndarray | None,
        even: bool,
    ):
        self.shape = shape
        self.size, self.start, self.class_size = shape.size, shape.start, shape.class_size
        self.weight = self.size.astype(np.float64)
        if bag_speed is not None:
            self.weight = self.weight * bag_speed
        self.gpu_capacity = float(gpu_capacity)
        self.capacity = self.weight * self.gpu_capacity
        self.load = np.zeros(len(self.size))
        self.max_tokens = max_tokens
        self.even = even
        if max_tokens is not None:
            self.bag_tokens = np.zeros(len(self.size), dtype=np.int64)
            self.tokens = np.zeros(len(shape.bag_of_pos), dtype=np.int64)  # round-robin only

    def per_gpu_time(self) -> np.ndarray:
        """(num_bags,) modelled time of each GPU of each bag."""
        return self.load / self.weight

    def makespan(self) -> float:
        return float(self.per_gpu_time().max(initial=0.0))

    def candidate_keys(self, workload: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per sequence, the range (lo, hi) of bag-size classes that may take it, as lo*K+hi.

        Candidates: capacity >= workload and size <= length; if none, the largest bags.
        (Capacity by size class at nominal speed: slower bags are then avoided through
        their higher occupancy.)
        """
        k = len(self.class_size)
        if k == 1:  # one bag size (the usual topology): every bag is a candidate
            return np.zeros(len(workload), dtype=np.int64)
        lo = np.searchsorted(self.class_size * self.gpu_capacity * (1 + _EPS), workload, "left")
        hi = np.searchsorted(self.class_size, lengths, "right") - 1
        empty = lo > hi
        lo = np.where(empty, k - 1, lo)
        hi = np.where(empty, k - 1, hi)
        return lo * k + hi

    def bag_max_tokens(self) -> np.ndarray:
        """(num_bags,) tokens on the fullest GPU of each bag (under a token cap)."""
        if self.even:  # an even spread leaves every GPU of the bag within one token
            return -(-self.bag_tokens // self.size)
        return np.maximum.reduceat(self.tokens, self.start)

    def token_room(self, length: int) -> np.ndarray:
        """Which bags can take a sequence of ``length`` tokens under the cap (round-robin:
        conservatively, as if its remainder landed on the fullest GPU)."""
        if self.even:
            return -(-(self.bag_tokens + length) // self.size) <= self.max_tokens
        need = length // self.size + length % self.size
        return self.bag_max_tokens() + need <= self.max_tokens

    def add(self, bag: int, workload: float, length: int, rem: int, sign: int = 1) -> None:
        """Account a sequence placed in ``bag`` (``sign=-1`` takes it out again); ``rem``
        is its remainder chunk under round-robin."""
        self.load[bag] += sign * workload
        if self.max_tokens is not None:
            self.bag_tokens[bag] += sign * length
            if not self.even:
                g, s = int(self.size[bag]), int(self.start[bag])
                self.tokens[s : s + g] += sign * (length // g)
                self.tokens[s + rem] += sign * (length % g)

    def add_many(self, bag: np.ndarray, workload: np.ndarray, lengths: np.ndarray) -> None:
        """Vectorised ``add`` of sequences placed in ``bag`` (each (m,)), even spread."""
        self.load += np.bincount(bag, weights=workload, minlength=len(self.size))
        if self.max_tokens is not None:
            self.bag_tokens += np.bincount(bag, weights=lengths, minlength=len(self.size)).astype(
                np.int64
            )

    def over_token_cap(self) -> bool:
        return self.max_tokens is not None and bool((self.bag_max_tokens() > self.max_tokens).any())

    def infeasible(self, seq: int, length: int) -> KnapformerError:
        return KnapformerError(
            f"max_tokens_per_gpu={self.max_tokens} is infeasible: sequence {seq} "
            f"({length} tokens) fits no bag (most-loaded GPU already holds "
            f"{int(self.bag_max_tokens().max())} tokens)"
        )


@dataclass
class _Step:
    """The state of one solve: the step's sequences (read-only) and where they go."""

    lengths: np.ndarray  # (n,) tokens
    workload: np.ndarray  # (n,)
    src_pos: np.ndarray  # (n,) position of each sequence's source GPU
    home_bag: np.ndarray  # (n,) bag holding that GPU
    layout: _BagLayout
    bag: np.ndarray  # (n,) assigned bag; -1 while unplaced
    rem: np.ndarray  # (n,) round-robin only: the chunk that takes the L % g remainder
    chunks: tuple | None = None  # `_chunk_table`, once made (auto prices candidates by it)

    @classmethod
    def start(cls, shape, lengths, workload, src_pos, layout) -> _Step:
        n = len(lengths)
        bag = np.full(n, -1, dtype=np.int64)
        # A source position of -1: the sequence comes from a GPU outside these bags (one
        # size class of an auto partition), so it has no home bag.
        home = np.where(src_pos >= 0, shape.bag_of_pos[src_pos], -1)
        return cls(lengths, workload, src_pos, home, layout, bag,
                   np.zeros(n, dtype=np.int64))  # fmt: skip

    def move(self, seq: int, dst: int) -> None:
        """Move a placed sequence to bag ``dst`` (even spread: no remainder to track)."""
        w, length = float(self.workload[seq]), int(self.lengths[seq])
        self.layout.add(int(self.bag[seq]), w, length, 0, sign=-1)
        self.layout.add(dst, w, length, 0)
        self.bag[seq] = dst


def _descending(workload: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """``seq`` ordered by workload, largest first; ties by sequence id (stable)."""
    return seq[np.argsort(-workload[seq], kind="stable")]


def _place_in_order(order: np.ndarray, step: _Step, prefer_home: bool) -> None:
    """Place ``order`` one by one into the least-occupied candidate bag (LPT).

    With ``prefer_home`` a sequence stays in its home bag when that bag is a candidate
    and still has room. Under round-robin the remainder goes to the bag's chunks in turn
    (the published rule). Ties between equally occupied bags go to the lowest bag id.
    """
    if order.size == 0:
        return
    layout = step.layout
    shape = layout.shape
    num_classes = len(layout.class_size)
    lengths, workload = step.lengths[order], step.workload[order]
    lo, hi = np.divmod(layout.candidate_keys(workload, lengths), num_classes)
    home = step.home_bag[order]
    home_class = shape.class_of_bag_array[home]
    may_stay = (
        (lo <= home_class) & (home_class <= hi) & (home >= 0)
        if prefer_home
        else (np.zeros(len(lo), bool))
    )
    # Plain lists: for the few hundred to few thousand sequences placed one by one,
    # Python scalars beat per-item numpy calls several times over.
    load = layout.load.tolist()
    limit = (layout.capacity * (1 + _EPS)).tolist()
    safe_capacity = np.where(layout.capacity > 0, layout.capacity, 1.0).tolist()
    occupancy = [x / c for x, c in zip(load, safe_capacity, strict=True)]
    # One min-heap of (occupancy, bag) per size class; entries go stale when a bag's
    # occupancy grows and are dropped when they surface (occupancy never decreases).
    class_of_bag = shape.class_of_bag
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_classes)]
    for b, occ in enumerate(occupancy):
        heaps[class_of_bag[b]].append((occ, b))
    for heap in heaps:
        heapq.heapify(heap)
    size = layout.size.tolist()
    round_robin = [0] * len(size)
    capped = layout.max_tokens is not None
    rows = zip(order.tolist(), lo.tolist(), hi.tolist(), may_stay.tolist(), workload.tolist(),
               lengths.tolist(), home.tolist(), strict=True)  # fmt: skip
    chosen_bag, chosen_rem = [], []  # written back in one call each at the end
    for seq, lo, hi, may_stay, w, length, h in rows:
        room = layout.token_room(length).tolist() if capped else None
        if may_stay and load[h] + w <= limit[h] and (room is None or room[h]):
            b = h
        elif lo == hi and not capped:  # the usual case, one size class: its heap's top
            b = _live_top(heaps[lo], occupancy)[1]
        else:
            b = _least_occupied(heaps, lo, hi, occupancy, room)
            if b < 0:
                raise layout.infeasible(seq, length)
        r = 0
        if not layout.even:
            g = size[b]
            r = round_robin[b] % g
            if length % g:
                round_robin[b] += 1
        chosen_bag.append(b)
        chosen_rem.append(r)
        load[b] += w
        occupancy[b] = load[b] / safe_capacity[b]
        heap = heaps[class_of_bag[b]]
        if heap[0][1] == b:  # b was the least occupied: update in place, nothing goes stale
            heapq.heapreplace(heap, (occupancy[b], b))
        else:
            heapq.heappush(heap, (occupancy[b], b))
        if capped:
            layout.add(b, 0.0, length, r)
    step.bag[order], step.rem[order] = chosen_bag, chosen_rem
    layout.load[:] = load


def _least_occupied(
    heaps: list[list[tuple[float, int]]],
    lo: int,
    hi: int,
    occupancy: list[float],
    allowed: list[bool] | None,
) -> int:
    """The bag of size class lo..hi with the lowest (occupancy, id), or -1 if none is
    ``allowed`` (under a token cap, a scan of the class's live entries)."""
    best = None
    for c in range(lo, hi + 1):
        heap = heaps[c]
        if allowed is None:
            top = _live_top(heap, occupancy)
        else:
            live = (e for e in heap if allowed[e[1]] and e[0] == occupancy[e[1]])
            top = min(live, default=None)
        if top is not None and (best is None or top < best):
            best = top
    return -1 if best is None else best[1]


def _live_top(heap: list[tuple[float, int]], occupancy: list[float]) -> tuple[float, int]:
    """The heap's least (occupancy, bag), after dropping stale entries (bags whose load
    grew since the entry was pushed)."""
    while heap[0][0] != occupancy[heap[0][1]]:
        heapq.heappop(heap)
    return heap[0]


def _bag_speed(shape: _BagShape, speed: np.ndarray | None) -> np.ndarray | None:
    """(num_bags,) speed of each bag's slowest GPU, or None when every GPU is nominal."""
    return None if speed is None else np.minimum.reduceat(speed, shape.start)


def _solve_greedy(shape, lengths, workload, src_pos, speed, max_tokens, even=False) -> _Step:
    """The published greedy: capacity = total / #GPUs (by speed), largest first into the
    least-occupied candidate bag. ``even=False``: its own round-robin chunk rule."""
    bag_speed = _bag_speed(shape, speed)
    weight = shape.size if bag_speed is None else shape.size * bag_speed
    # Summed left to right (cumsum), as the published algorithm and its plain-Python
    # transcription do: pairwise summation differs in the last bits and flips near-ties.
    total = float(workload.cumsum()[-1]) if workload.size else 0.0
    mean = total / float(weight.sum())
    layout = _BagLayout(shape, mean, max_tokens, bag_speed, even)
    step = _Step.start(shape, lengths, workload, src_pos, layout)
    _place_in_order(_descending(workload, np.arange(len(lengths))), step, prefer_home=False)
    return step


def _solve_default(shape, lengths, workload, src_pos, speed, max_tokens, tolerance=None) -> _Step:
    """The default solver, with greedy as a safety net.

    Its per-GPU capacity is the lower bound on the makespan rather than greedy's mean
    load: when one sequence outweighs the mean, every GPU under that bound can keep all
    its sequences at no cost to the makespan. Chunks spread each bag's tokens evenly, so
    every GPU of a bag computes the bag's load / g to within one token's linear cost:
    scoring bags scores the real (Ulysses-exact) per-GPU loads. Where the local search
    stalls short of the bound (coarse sequences), greedy's placement is solved too (with
    the even spread) and the better makespan is kept.
    """
    bag_speed = _bag_speed(shape, speed)
    weight = shape.size.astype(np.float64) if bag_speed is None else shape.size * bag_speed
    bound = lower_bound(workload, weight)
    layout = _BagLayout(shape, bound, max_tokens, bag_speed, even=True)
    step = _Step.start(shape, lengths, workload, src_pos, layout)
    _solve_local(step, tolerance)
    makespan = layout.makespan()
    if makespan <= bound * (1 + _FALLBACK_TOLERANCE):
        return step
    try:
        greedy = _solve_greedy(shape, lengths, workload, src_pos, speed, max_tokens, even=True)
    except ValueError:  # greedy cannot meet the token cap where ours did
        return step
    return greedy if greedy.layout.makespan() < makespan else step


def _solve_local(step: _Step, tolerance: float | None = None) -> None:
    layout, lengths, workload = step.layout, step.lengths, step.workload
    n = len(lengths)
    empty = lengths == 0  # nothing to compute or move: keep at home, no chunks
    step.bag[empty] = step.home_bag[empty]

    # A small step is placed one by one, where a bulk pass would save little time and
    # land further from the bound; a large one only its heavy sequences.
    one_by_one = ~empty
    if n > _ONE_BY_ONE:
        one_by_one &= workload > _HEAVY_FRACTION * layout.gpu_capacity
    _place_in_order(_descending(workload, np.flatnonzero(one_by_one)), step, prefer_home=True)
    if n > _ONE_BY_ONE:
        _stay_home_in_bulk(np.flatnonzero(step.bag < 0), step)
        pool = _descending(workload, np.flatnonzero(step.bag < 0))
        _place_in_order(pool, step, prefer_home=True)
    _level_makespan(step, tolerance=tolerance)


def _stay_home_in_bulk(seqs: np.ndarray, step: _Step) -> None:
    """Within each home bag, the largest of ``seqs`` stay while there is room (one
    vectorised pass; sequences shorter than their home bag are left to the pool)."""
    layout, lengths, workload, home_bag = step.layout, step.lengths, step.workload, step.home_bag
    seqs = seqs[home_bag[seqs] >= 0]
    light = seqs[layout.size[home_bag[seqs]] <= lengths[seqs]]
    order = _by_home_heaviest_first(light, home_bag, workload, len(layout.size))
    hb = home_bag[order]
    room = layout.capacity - layout.load
    stays = _prefix_within_groups(workload[order], hb, room[hb])
    if layout.max_tokens is not None:
        # An even spread keeps a bag's fullest GPU at ceil(bag tokens / g).
        token_room = layout.max_tokens * layout.size[hb] - layout.bag_tokens[hb]
        stays &= _prefix_within_groups(lengths[order].astype(np.float64), hb, token_room)
    stay_ids = order[stays]
    step.bag[stay_ids] = hb[stays]
    layout.add_many(hb[stays], workload[stay_ids], lengths[stay_ids])


def _by_home_heaviest_first(seqs, home, workload, num_bags) -> np.ndarray:
    """``seqs`` ordered by home bag, heaviest first within one (ties by id): what
    ``seqs[np.lexsort((-workload[seqs], home[seqs]))]`` gives, in two stable passes, the
    second over small ints (a radix sort, faster than lexsort's)."""
    by_w = seqs[np.argsort(-workload[seqs], kind="stable")]
    key = home[by_w]
    return by_w[np.argsort(key.astype(np.int16) if num_bags < 2**15 else key, kind="stable")]


def _level_makespan(step: _Step, max_rounds: int | None = None, tolerance=None) -> None:
    """Local search on the makespan. Each round, every bag above the stopping load (up
    to ``_LEVEL_PARTNERS`` of them, most loaded first) is paired with a distinct one of
    the least-loaded bags: one sequence moves from it to the partner, or a pair is
    swapped, whichever evens the two out best, as long as that lowers the larger of the
    two. All pairs are scored in one vectorised pass. Staying home leaves uneven last
    gaps; a few well-sized moves and swaps close them (greedy gets the same effect from
    placing the smallest last)."""
    layout = step.layout
    num_bags = len(layout.size)
    if layout.gpu_capacity <= 0 or num_bags < 2:
        return
    weight = layout.weight
    per_gpu = layout.per_gpu_time()
    stop = lower_bound(step.workload, weight) * (1 + (tolerance or _LEVEL_TOLERANCE))
    if per_gpu.max() <= stop:  # the usual case: nothing to level
        return
    accepts = layout.capacity * (1 + _EPS)  # the largest workload each bag may take
    members = _Members(step.bag, step.lengths, step.workload, num_bags)
    one_size = len(layout.class_size) == 1
    for _ in range(4 * num_bags if max_rounds is None else max_rounds):
        num_over = min(int(np.count_nonzero(per_gpu > stop)), _LEVEL_PARTNERS)
        # The ends of the stable ascending order, without sorting every bag: the most
        # loaded (ties: the later bag first) and the least loaded that are not over.
        over = (num_bags - 1 - _least(-per_gpu[::-1], num_over)).tolist()
        partners = _least(per_gpu, min(_LEVEL_PARTNERS, num_bags - num_over)).tolist()
        if not over or not partners:
            return
        moves = _best_exchanges(
            over, partners, members, layout.size, weight, per_gpu, accepts, one_size
        )
        if not moves:
            return
        for a, b, out_of_a, out_of_b in moves:
            if not _exchange(step, a, b, out_of_a, out_of_b):
                return
            members.swap(a, b, out_of_a, out_of_b)
            per_gpu[a], per_gpu[b] = layout.load[a] / weight[a], layout.load[b] / weight[b]


class _Members:
    """Bag, length and workload of every sequence plus one *phantom* per bag (no tokens,
    fits every bag): "nothing comes back" in an exchange is then just the partner's
    phantom, scored like any other member."""

    def __init__(self, bag, lengths, workload, num_bags):
        self.num_real = len(bag)
        self.bag = np.concatenate([bag, np.arange(num_bags)])
        self.length = np.concatenate([lengths, np.full(num_bags, np.iinfo(np.int64).max)])
        self.workload = np.concatenate([workload, np.zeros(num_bags)])

    def real(self, member: int) -> int:
        """The sequence id of ``member``, or -1 for a phantom."""
        return member if member < self.num_real else -1

    def swap(self, a: int, b: int, out_of_a: int, out_of_b: int) -> None:
        self.bag[out_of_a] = b
        if out_of_b >= 0:
            self.bag[out_of_b] = a


def _best_exchanges(over, partners, members, size, weight, per_gpu, accepts, one_size):
    """One round's exchanges: each over-loaded bag ``a`` (most loaded first) with the free
    partner ``b`` that evens the two out best. Returns (a, b, sequence leaving a, sequence
    leaving b or -1) per exchange that lowers the larger of the two bags. ``size``: GPUs
    per bag (a sequence must not be shorter, bar the rule's fallback); ``weight``: load per
    GPU = load / weight; ``one_size``: every bag has the same number of GPUs."""
    num_o, num_p = len(over), len(partners)
    slot = np.full(len(size), num_o + num_p)  # over bag -> 0.., partner -> num_o.., rest last
    slot[over] = np.arange(num_o)
    slot[partners] = np.arange(num_o, num_o + num_p)
    slot_of = slot[members.bag]
    # Only the members of the paired bags are sorted (a round looks at a few bags of many).
    involved = np.flatnonzero(slot_of < num_o + num_p)
    by_slot = involved[slot_of[involved].argsort(kind="stable")]
    bounds = np.searchsorted(slot_of[by_slot], np.arange(num_o + num_p + 1)).tolist()
    # Rows: members that may leave the over-loaded bags; columns: members that may come
    # back from the partners (a phantom: nothing). Both grouped by bag, none empty.
    out, back = by_slot[: bounds[num_o]], by_slot[bounds[num_o] : bounds[-1]]
    row_starts, col_starts = bounds[:num_o], [s - bounds[num_o] for s in bounds[num_o:-1]]
    # With one bag size every bag is a candidate for every sequence (the rule's fallback
    # is "the largest bags"): the size and capacity checks are then skipped.
    if not one_size:
        ov = np.asarray(over)
        back = back[
            (members.length[back] >= size[ov].min()) & (members.workload[back] <= accepts[ov].max())
        ]
        col_starts = np.searchsorted(slot_of[back], np.arange(num_o, num_o + num_p)).tolist()
    out_w, a_bag = members.workload[out][:, None], members.bag[out][:, None]
    w_a, per_a = weight[a_bag], per_gpu[a_bag]
    if out.size * back.size <= _DENSE_CELLS:
        came = back[None, :]  # every pair is scored
    else:
        pb = np.asarray(partners)
        ideal = (per_a - per_gpu[pb]) / (1.0 / w_a + 1.0 / weight[pb])
        came = _nearest_members(back, slot_of[back] - num_o, members.workload, out_w - ideal)
        col_starts = list(range(0, 2 * num_p, 2))
    came_w, b_bag = members.workload[came], members.bag[came]
    w_b, per_b = weight[b_bag], per_gpu[b_bag]
    delta = out_w - came_w  # net workload leaving a
    new_max = np.maximum(per_a - delta / w_a, per_b + delta / w_b)
    ok = (delta > 0) & (new_max < per_a * (1 - 1e-9))
    if not one_size:
        ok &= (members.length[out][:, None] >= size[b_bag]) & (out_w <= accepts[b_bag])
        ok &= (members.length[came] >= size[a_bag]) & (came_w <= accepts[a_bag])
    new_max = np.where(ok, new_max, np.inf)
    # Best per (over-loaded bag, partner); each over-loaded bag, most loaded first, takes
    # its best among the partners still free.
    best = np.minimum.reduceat(np.minimum.reduceat(new_max, row_starts, 0), col_starts, 1)
    row_ends, col_ends = [*row_starts[1:], len(out)], [*col_starts[1:], new_max.shape[1]]
    free = [True] * num_p
    moves = []
    for o, row in enumerate(best.tolist()):
        score = [s if is_free else np.inf for s, is_free in zip(row, free, strict=True)]
        p = score.index(min(score))
        if score[p] == np.inf:
            continue
        free[p] = False
        block = new_max[row_starts[o] : row_ends[o], col_starts[p] : col_ends[p]]
        i, c = divmod(int(block.argmin()), block.shape[1])
        leaving = row_starts[o] + i
        coming = came[leaving if came.shape[0] > 1 else 0, col_starts[p] + c]
        moves.append((over[o], partners[p], int(out[leaving]), members.real(int(coming))))
    return moves


def _nearest_members(back, back_partner, workload, target):
    """Per (leaving sequence, partner) the two members whose workload is nearest
    ``target`` (rows x partners): the objective is V-shaped in the net workload moved, so
    only these two can be best. Columns 2p and 2p+1 belong to partner p."""
    num_p = target.shape[1]
    back_w = workload[back]
    span = 2.0 * float(back_w.max(initial=0.0)) + 1.0  # keeps partners' keys apart
    column = np.arange(num_p) * span
    key = back_partner * span + back_w
    by_key = key.argsort(kind="stable")
    key, back = key[by_key], back[by_key]
    seg = np.searchsorted(key, column)  # each partner's first (lightest) member
    seg_end = np.append(seg[1:], key.size) - 1
    hit = np.searchsorted(key, np.clip(target, 0.0, span / 2) + column)
    near = np.stack([np.maximum(hit - 1, seg), np.minimum(hit, seg_end)], 2)
    return back[near.reshape(len(target), 2 * num_p)]


def _exchange(step: _Step, a: int, b: int, out_of_a: int, out_of_b: int) -> bool:
    """Move ``out_of_a`` to bag b and ``out_of_b`` (or nothing if -1) to bag a; undone
    (returns False) when it breaks the token cap (rare; the cap wins over balance)."""
    moves = [(seq, src, dst) for seq, src, dst in ((out_of_a, a, b), (out_of_b, b, a)) if seq >= 0]
    for seq, _, dst in moves:
        step.move(seq, dst)
    if step.layout.over_token_cap():
        for seq, src, _ in moves:
            step.move(seq, src)
        return False
    return True


def _prefix_within_groups(values: np.ndarray, group: np.ndarray, room: np.ndarray) -> np.ndarray:
    """For rows sorted by ``group``: True while the running sum within the group <= room."""
    if values.size == 0:
        return np.zeros(0, dtype=bool)
    total = np.cumsum(values)
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    before = np.concatenate([[0.0], total[:-1]])[starts]
    group_start_sum = np.repeat(before, np.diff(np.concatenate([starts, [values.size]])))
    return total - group_start_sum <= room * (1 + _EPS)


def _chunk_table(step: _Step):
    """Split each sequence into one chunk per GPU of its bag (zero-length chunks dropped).

    Returns (seq, dst GPU position, offset, length), ordered by sequence then chunk
    index; chunk k of a sequence goes to the k-th GPU of its bag. Each chunk gets
    ``L // g`` tokens; the ``L % g`` remainder goes, under round-robin, all to chunk
    ``rem`` (the published rule), else one token each to the next GPUs of a cycle that
    runs through the bag's sequences in id order, so every GPU of a bag ends within one
    token of the others (the remainder never piles onto one GPU).
    """
    layout, lengths, bag = step.layout, step.lengths, step.bag
    g = layout.size[bag]
    quot = lengths // g
    ends = np.cumsum(g)
    first = ends - g  # row of each sequence's chunk 0
    rows = np.arange(int(ends[-1]) if ends.size else 0)
    k = rows - np.repeat(first, g)  # chunk index within its sequence
    length = np.repeat(quot, g)
    if layout.even:
        rem = lengths - quot * g
        start = np.repeat(_cycle_starts(bag, rem, g), g)
        length += (k - start) % np.repeat(g, g) < np.repeat(rem, g)
    else:
        length[first + step.rem] += lengths - quot * g
    pos = np.repeat(layout.start[bag], g) + k
    offset = np.cumsum(length) - length
    offset -= np.repeat(offset[first] if first.size else first, g)  # within the sequence
    idx = np.repeat(np.arange(len(lengths)), g)
    if quot.size and quot.min() == 0:  # some sequence is shorter than its bag
        keep = length > 0
        idx, pos, offset, length = idx[keep], pos[keep], offset[keep], length[keep]
    return idx, pos, offset, length


def _cycle_starts(bag: np.ndarray, rem: np.ndarray, size: np.ndarray) -> np.ndarray:
    """(n,) where each sequence's remainder starts in its bag's cycle: the remainders of the
    bag's earlier sequences (id order), summed, modulo the bag size."""
    # A stable sort of small ints is a radix sort (same order as on int64, much faster).
    order = np.argsort(bag.astype(np.int16) if bag.size and bag.max() < 2**15 else bag,
                       kind="stable")  # fmt: skip
    r = rem[order]
    before = np.cumsum(r) - r  # exclusive running sum over all bags
    group_start = np.ones(len(order), dtype=bool)
    group_start[1:] = bag[order][1:] != bag[order][:-1]
    base = np.maximum.accumulate(np.where(group_start, before, 0))
    starts = np.empty_like(rem)
    starts[order] = (before - base) % size[order]
    return starts
