"""The ``topology="auto"`` solver: each step's GPU groups and sequence places, by modelled
time with communication.

Each step it chooses a partition of the balance group into aligned GPU groups and the
sequences' places in it, minimising the modelled step time with communication
(docs/concepts.md, "Communication and the layout floor").

`solve_auto` prices candidate partitions (`knapformer.planning.partitions`) by the
slowest GPU's compute + Ulysses + route (`knapformer.planning.communication`) and keeps
the best, beside the whole-family layouts gXnY that the planner's fixed solver places (so
a step is never slower than under the best fixed layout of the family). The planner
(`plan_routing`) is the entry point; the solve state it shares with this module is in
`knapformer.planning.bags`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from knapformer.errors import KnapformerError
from knapformer.planning.bags import (
    EPS,
    HEAVY_FRACTION,
    ONE_BY_ONE,
    BagLayout,
    Step,
    bag_shape,
    bag_speeds,
    by_home_heaviest_first,
    chunk_table,
    descending,
    least,
    prefix_within_groups,
)
from knapformer.planning.communication import CommModel, communication_loads
from knapformer.planning.partitions import (
    effective_workloads,
    mixed_partitions,
    partition_floor,
)
from knapformer.planning.workload import WorkloadModel

_AUTO_MOVES = 128  # exchanges of the refinement pass, per mixed partition
_AUTO_MOVES_LARGE = 24  # in a large step (where sequences are fine-grained)
_AUTO_PARTNERS = 8  # least-loaded bags tried per exchange (every bag up to _AUTO_ALL)
_AUTO_ALL = 64
_AUTO_ALL_SEQUENCES = 512
_AUTO_MEMBERS = 32  # members of a bag scored per exchange (a spread sample beyond)
_AUTO_STOP = 1e-4  # the refinement stops this close to the partition floor
_AUTO_POUR = 2048  # a larger pool is poured into the bags' room at once, not one by one
_TIE = 1e-9
_NONE = np.array([-1])  # an exchange's empty slot: a move, not a swap
# A coarse large step (`_is_coarse`): few sequences per GPU and many GPUs in the smaller groups.
_COARSE_PER_GPU = 8  # sequences per GPU, at most
_COARSE_SHARE = 1 / 8  # of the GPUs in groups smaller than the largest, at least
_EVEN_ROUNDS = 4  # rounds of `_even_classes`
_EVEN_TRIES = 4  # distinct costs tried per sequence of a bag outside the band
_EVEN_BAND = 6e-4  # the band's width, of the mean per-GPU time
_LEVEL_ROUNDS = 6  # rounds of `_level`
_LEVEL_DONORS = 32  # most loaded bags that exchange in one round
_LEVEL_PARTNERS = 4  # least loaded bags offered to each
_LEVEL_MEMBERS = 12  # members of a bag scored (a spread sample beyond)
_REFINE_ROUNDS = 12  # GPU-exact refinement rounds of a small step (`_refine`)
_REFINE_PARTNERS = 8  # least loaded bags whose sequences it tries swapping with
_SLOW = 0.9  # a GPU below this share of its group's fastest is split off (`_isolate_slow`)
# (candidate, GPU) cells a refinement round scores at most: a round costs the same
# whether a GPU holds 4 sequences or 400 (sampled beyond, `_within_budget`).
_REFINE_CELLS = 1 << 14


def solve_auto(lengths, workload, src_pos, speed, max_tokens, solve_fixed, model, comm, sizes,
               node_size, num_gpus) -> Step:  # fmt: skip
    """Choose the step's partition into aligned groups and place the sequences in it,
    minimising the modelled step time: the slowest GPU's compute + Ulysses + route
    (`_modelled_makespan`).

    Candidates: the mixed partitions of `mixed_partitions` (every one in a small step, the
    cheapest in a large one), each solved as one problem over all its bags (`_solve_mixed`;
    in a small step the best is then refined GPU by GPU, `_refine`), and the whole-family
    layouts gXnY, solved by ``solve_fixed(shape)`` exactly as a fixed topology is (the
    chosen solver, compute-only; the planner's, handed in): the step is then never
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
        step.chunks = chunk_table(step)
        key = (_modelled_makespan(step, model, comm, speed), _moved_estimate(step))
        held = best[1]
        if (held is None or key[0] < held[0] * (1 - _TIE)
                or (key[0] <= held[0] * (1 + _TIE) and key[1] < held[1])):  # fmt: skip
            best[:] = [step, key]

    mixed = mixed_partitions(workload, lengths, src_pos, num_gpus, sizes, per_token, node_size, eff)
    # Variants only pay off where sequences are coarse (few per GPU); a large step solves one.
    small = len(lengths) <= _AUTO_ALL_SEQUENCES and num_gpus <= _AUTO_ALL
    layouts = [c.bag_sizes for c in mixed[: None if small else 1]]
    # A slow GPU holds its whole group back: the same partition with it split off, beside
    # (a small step) or instead of (a large one, which solves one partition) the original.
    isolated = [_isolate_slow(b, speed) for b in layouts]
    if small:
        layouts += [b for b in isolated if b]
    else:
        layouts = [i or b for i, b in zip(isolated, layouts, strict=True)]
    for bag_sizes in layouts:
        consider(lambda b=bag_sizes: _solve_mixed(
            b, lengths, workload, src_pos, speed, max_tokens, per_token, floor,
            comm, model))  # fmt: skip
    if small and best[0] is not None:  # the best mixed partition, GPU-exact
        refined = _refine(best[0], model, comm, speed, max_tokens)
        if refined is not best[0]:
            best[:] = [refined, (_modelled_makespan(refined, model, comm, speed),
                                 _moved_estimate(refined))]  # fmt: skip
    whole = sorted(
        (max(float(eff[j].sum()) / num_gpus, float(eff[j].max(initial=0.0)) / g), g)
        for j, g in enumerate(sizes)
        if num_gpus % g == 0
    )
    for bound, g in whole:
        # Speeds change what a layout can reach: every layout is solved then.
        if speed is None and best[1] is not None and bound > best[1][0] * (1 + _TIE):
            continue
        shape = bag_shape((g,) * (num_gpus // g))
        consider(lambda s=shape: solve_fixed(s))
    if best[0] is None:
        raise failure or KnapformerError("topology 'auto' found no partition for the step")
    return best[0]


def _isolate_slow(bag_sizes: tuple[int, ...], speed) -> tuple[int, ...] | None:
    """``bag_sizes`` with every bag that holds a slow GPU (below ``_SLOW`` of its bag's
    fastest) halved, again and again, until that GPU is alone: the halves stay aligned,
    and the others no longer wait for it in Ulysses. None when no bag changes."""
    if speed is None:
        return None
    out, start, changed = [], 0, False
    for g in bag_sizes:
        parts = [(start, g)]
        while parts:
            s, n = parts.pop(0)
            part = speed[s : s + n]
            if n > 1 and part.min() < _SLOW * part.max():
                parts[:0] = [(s, n // 2), (s + n // 2, n // 2)]
                changed = True
            else:
                out.append(n)
        start += g
    return tuple(out) if changed else None


def _modelled_makespan(step: Step, model: WorkloadModel, comm: CommModel, speed) -> float:
    """The largest per-GPU load of ``step`` (its chunk table made), communication included:
    what `plan_cost` gives the plan it becomes, computed before the plan exists."""
    layout = step.layout
    seq, pos, _, length = step.chunks
    compute, tokens = _compute_per_gpu(step, model, speed)
    ulysses, route = communication_loads(
        comm, model.token_dim, float(model.scale), layout.size[layout.shape.bag_of_pos], tokens,
        step.src_pos[seq], pos, length,
    )  # fmt: skip
    return float((compute + ulysses + route).max(initial=0.0))


def _compute_per_gpu(step: Step, model: WorkloadModel, speed) -> tuple[np.ndarray, np.ndarray]:
    """(compute, tokens), each (num_gpus,), of ``step``'s chunk table: each GPU's linear part
    of its own tokens plus 1/g of the attention of every sequence of its bag, over its
    speed."""
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
    return compute, np.bincount(pos, weights=length, minlength=n)


def _route_per_token(comm: CommModel, model: WorkloadModel) -> tuple[float, float]:
    """Workload units (per layer) a GPU pays per token it sends or returns over the node's
    link and over the network."""
    return tuple(
        float(comm.work_of(model.token_dim * comm.dtype_bytes / (gbs * 1e9), model.scale))
        / comm.layers
        for gbs in (comm.intra_gbs, comm.inter_gbs)
    )


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
        per_token_route = _route_per_token(comm, model)
        bag_node = np.where(shape.size > node, -1, shape.start // node)
        return cls(np.array([per_token[int(g)] for g in shape.size]), bag_node,
                   np.where(src_pos >= 0, src_pos // node, -2), *per_token_route)  # fmt: skip

    def route(self, seqs, bags, home, size, lengths):
        """Per (sequence, bag) pair (broadcast): tokens that leave the source times the
        route per token: all of them away from home, (g-1)/g at home."""
        per = np.where(self.bag_node[bags] == self.src_node[seqs], self.intra, self.inter)
        moved = np.where(bags == home, (size[bags] - 1) / size[bags], 1.0) * lengths
        return per * moved

    def cost(self, step: Step, lengths: np.ndarray, seq, bag):
        """(price, sent) of sequences ``seq`` in bags ``bag`` (broadcast): ``W + k_g*L`` plus
        the route its receivers pay (twice at home, where the bag also sends), and what its
        home bag pays to send it (0 at home). ``lengths``: the step's, as floats."""
        home = step.home_bag[seq]
        r = self.route(seq, bag, home, step.layout.size, lengths[seq])
        there = bag == home
        return (step.workload[seq] + self.kappa[bag] * lengths[seq] + np.where(there, 2 * r, r),
                np.where(there | (home < 0), 0.0, r))  # fmt: skip


def _solve_mixed(bag_sizes, lengths, workload, src_pos, speed, max_tokens, per_token,
                 floor, comm, model) -> Step:  # fmt: skip
    """One problem over all bags of a mixed partition, each sequence priced at the bag it
    is in (`_Prices`: ``W + k_g*L`` plus the route its receivers pay; its source GPU's bag
    pays the sending; a bag's per-GPU time is its priced load / its weight).

    Largest first, a sequence stays in its home bag while that keeps the bag under
    ``floor`` (`partition_floor`), else goes where the larger of its bag's and its home
    bag's per-GPU time ends lowest (LPT across sizes, among the least loaded bag of each
    size overall and in its source's node; a tie to the smaller group). In a large step
    only the heavy sequences go one by one: the others stay home in bulk, and a large
    remainder is poured into the bags' room at one water level (`_pour`).
    `_exchange_across` then evens out the top; in a coarse large step (`_is_coarse`),
    `_even_out` does instead.
    """
    shape = bag_shape(tuple(bag_sizes))
    layout = BagLayout(shape, floor, max_tokens, bag_speeds(shape, speed), even=True)
    step = Step.start(shape, lengths, workload, src_pos, layout)
    prices = _Prices.of(shape, src_pos, per_token, comm, model)
    empty = lengths == 0
    step.bag[empty] = step.home_bag[empty]
    load = np.zeros(len(shape.size))
    placed = np.flatnonzero(~empty)
    if len(placed) > ONE_BY_ONE:
        # Only the heavy ones and the pool need the descending order (the bulk pass sorts
        # by home bag itself): sorting every sequence would cost more than the rest.
        heavy = workload[placed] > HEAVY_FRACTION * floor
        load = _place_priced(descending(workload, placed[heavy]), step, load, prices, floor)
        rest = placed[~heavy]
        load = _stay_home_priced(rest, step, load, prices, floor)
        pool = descending(workload, rest[step.bag[rest] < 0])
        if len(pool) > _AUTO_POUR and max_tokens is None:
            load = _pour(pool, step, load, prices)
            pool = pool[step.bag[pool] < 0]
        order = pool
    else:
        order = descending(workload, placed)
    _place_priced(order, step, load, prices, floor)
    if len(placed) > ONE_BY_ONE and max_tokens is None:
        pool = _shave(step, prices)
        if pool.size:
            load = _priced_loads(step, prices)[1]
            if len(pool) > _AUTO_POUR:
                load = _pour(pool, step, load, prices)
            _place_priced(pool[step.bag[pool] < 0], step, load, prices, floor)
    if _is_coarse(step, len(placed)):
        _even_out(step, prices, floor, max_tokens)
    else:
        _exchange_across(step, prices, floor, max_tokens)
    layout.load[:] = np.bincount(step.bag, weights=workload, minlength=len(shape.size))
    return step


def _place_priced(order, step: Step, load: np.ndarray, prices: _Prices, level: float):
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
    limit = level * (1 + EPS)
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


def _stay_home_priced(seqs, step: Step, load: np.ndarray, prices: _Prices, level: float):
    """Within each home bag, the largest of ``seqs`` stay while the bag's priced load stays
    under ``level`` per GPU (one vectorised pass, as `_stay_home_in_bulk`). Returns the new
    loads."""
    layout, lengths, home = step.layout, step.lengths, step.home_bag
    seqs = seqs[(home[seqs] >= 0) & (layout.size[np.maximum(home[seqs], 0)] <= lengths[seqs])]
    order = by_home_heaviest_first(seqs, home, step.workload, len(layout.size))
    hb = home[order]
    cost = (step.workload[order] + prices.kappa[hb] * lengths[order]
            + 2 * prices.route(order, hb, hb, layout.size, lengths[order]))  # fmt: skip
    stays = prefix_within_groups(cost, hb, (level * layout.weight - load)[hb])
    if layout.max_tokens is not None:
        token_room = layout.max_tokens * layout.size[hb] - layout.bag_tokens[hb]
        stays &= prefix_within_groups(lengths[order].astype(np.float64), hb, token_room)
    step.bag[order[stays]] = hb[stays]
    if layout.max_tokens is not None:
        layout.add_many(hb[stays], np.zeros(int(stays.sum())), lengths[order[stays]])
    return load + np.bincount(hb[stays], weights=cost[stays], minlength=len(load))


def _pour(pool, step: Step, load: np.ndarray, prices: _Prices) -> np.ndarray:
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


def _priced_loads(step: Step, prices: _Prices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(price (n,) of each sequence in its bag (0 while unplaced), priced load (num_bags,),
    sent (n,): what each sequence placed away from its home bag costs that bag to send):
    ``W + k_g*L`` plus the route its receivers pay (twice at home, where the bag also sends),
    and each home bag the sending of its sequences placed away."""
    layout, home = step.layout, step.home_bag
    num_bags = len(layout.size)
    lengths = step.lengths.astype(np.float64)
    placed = step.bag >= 0
    bag = np.where(placed, step.bag, 0)
    route = prices.route(np.arange(len(lengths)), bag, home, layout.size, lengths)
    away = (bag != home) & (home >= 0) & placed
    price = step.workload + prices.kappa[bag] * lengths + np.where(away, route, 2 * route)
    price[~placed] = 0.0
    load = np.bincount(bag, weights=price, minlength=num_bags)
    sent = np.where(away, route, 0.0)
    load += np.bincount(np.maximum(home, 0), weights=sent, minlength=num_bags)
    return price, load, sent


def _shave(step: Step, prices: _Prices) -> np.ndarray:
    """Take the lightest sequences out of every bag above the mean priced per-GPU time until
    it is at most that mean (sequences that fit any bag only), in one vectorised pass: the
    bulk passes of a large step leave whole size classes above or below the mean, which a
    few exchanges cannot even out. Returns them, unplaced (bag -1), heaviest first."""
    layout = step.layout
    price, load, _ = _priced_loads(step, prices)
    mean = float(load.sum() / layout.weight.sum())
    excess = load - mean * layout.weight
    movable = (step.lengths >= layout.class_size[-1]) & (step.bag >= 0)
    movable &= excess[np.maximum(step.bag, 0)] > 0
    seqs = np.flatnonzero(movable)
    if seqs.size == 0:
        return seqs
    order = by_home_heaviest_first(seqs, step.bag, -step.workload, len(layout.size))
    bags = step.bag[order]
    # Lightest first within each bag, while the middle of each one's running price stays
    # within the bag's excess (the nearest cut: sequences often outweigh the excess).
    cost = price[order]
    out = order[prefix_within_groups(cost, bags, excess[bags] + 0.5 * cost)]
    step.bag[out] = -1
    return descending(step.workload, out)


def _exchange_across(step: Step, prices: _Prices, floor: float, max_tokens) -> None:
    """Exchanges between bags of any sizes, each sequence re-priced at its new bag
    (`_Prices`): the most loaded bag moves one sequence to, or swaps one with, whichever of
    the least loaded bags (every bag in a step of at most ``_AUTO_ALL`` bags and
    ``_AUTO_ALL_SEQUENCES`` sequences, else ``_AUTO_PARTNERS``)
    evens the two out best, while that lowers the larger of the two and leaves the
    sequences' home bags (which pay the sending) below it (at most ``_AUTO_MOVES``
    exchanges; stops within ``_AUTO_STOP`` of ``floor``). All pairs of a move are scored
    in one vectorised pass."""
    layout = step.layout
    size, weight = layout.size, layout.weight
    num_bags = len(size)
    if num_bags < 2:
        return
    lengths = step.lengths.astype(np.float64)
    workload, home = step.workload, step.home_bag
    price, load, sent = _priced_loads(step, prices)
    tokens = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    # One GPU sends a sequence placed away from it, not its bag: a bag's slowest GPU is its
    # spread load plus the most any of its GPUs sends, less that GPU's share of the sends.
    src_gpu = step.src_pos
    gpu_sends, bag_sends = _sends(step, sent)

    def uneven(bags) -> np.ndarray:
        return np.maximum.reduceat(gpu_sends, layout.start)[bags] - bag_sends[bags] / weight[bags]

    extra = _uneven_sends(layout, gpu_sends, bag_sends)
    per = load / weight + extra
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
        return prices.cost(step, lengths, seq, bag)

    for _ in range(_AUTO_MOVES if small else _AUTO_MOVES_LARGE):
        a = int(np.argmax(per))
        if per[a] <= stop or not members[a]:
            break
        lightest = least(per, partners + 1)
        lightest = lightest[lightest != a][:partners]
        ma = sample(a)
        cols = [sample(b) for b in lightest.tolist()]
        mb = np.concatenate([x for c in cols for x in (c, _NONE)])  # -1: a move, no swap
        col = np.repeat(np.arange(len(cols)), [len(c) + 1 for c in cols])  # partner of each
        b = lightest[col]
        real = mb >= 0
        mbi = np.maximum(mb, 0)
        lj = np.where(real, lengths[mbi], 0.0)
        into_a = np.where(real, priced(mbi, np.full(len(mbi), a))[0], 0.0)
        out_b = np.where(real, price[mbi], 0.0)
        li = lengths[ma][:, None]
        # (len(ma), len(b)): priced once per partner bag, then spread over its columns.
        into_b = priced(ma[:, None], lightest[None, :])[0][:, col]
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
        undo = (load.copy(), tokens.copy(), price.copy(), gpu_sends.copy(), bag_sends.copy(),
                extra.copy())  # fmt: skip
        moves = [(int(ma[i]), a, dst), (int(mb[j]), dst, a)]
        touched = {a, dst}
        moves = [m for m in moves if m[0] >= 0]
        seqs, srcs, tos = (np.array(x) for x in zip(*moves, strict=True))
        old_sents = priced(seqs, srcs)[1].tolist()
        new_prices, new_sents = (x.tolist() for x in priced(seqs, tos))
        for (seq, src, to), old_sent, new_price, new_sent in zip(
            moves, old_sents, new_prices, new_sents, strict=True
        ):
            load[src] -= price[seq]
            load[to] += new_price
            price[seq] = new_price
            tokens[src] -= lengths[seq]
            tokens[to] += lengths[seq]
            if home[seq] >= 0:
                load[home[seq]] += new_sent - old_sent
                gpu_sends[src_gpu[seq]] += new_sent - old_sent
                bag_sends[home[seq]] += new_sent - old_sent
                touched.add(int(home[seq]))
        touched_list = list(touched)
        extra[touched_list] = uneven(touched_list)
        new_per = load[touched_list] / weight[touched_list] + extra[touched_list]
        if new_per.max() >= before * (1 - _TIE):  # a home bag rose to the top: undo, stop
            load, tokens, price, gpu_sends, bag_sends, extra = undo
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


def _is_coarse(step: Step, placed: int) -> bool:
    """A large step whose GPUs hold few sequences each (at most ``_COARSE_PER_GPU``) and
    whose smaller groups hold at least ``_COARSE_SHARE`` of the GPUs: a one-GPU bag there
    takes whole sequences of many milliseconds, which the placement cannot even out
    finely and one exchange at a time cannot either (`_even_out`). Where GPUs hold many
    short sequences, the pour and the exchange pass already reach the mean."""
    layout = step.layout
    num_gpus = len(layout.shape.bag_of_pos)
    if placed <= _AUTO_ALL_SEQUENCES and len(layout.size) <= _AUTO_ALL:
        return False  # a small step is refined exactly instead (`_refine`)
    smaller = int(layout.size[layout.size < layout.size.max()].sum())
    return placed <= _COARSE_PER_GPU * num_gpus and smaller >= _COARSE_SHARE * num_gpus


def _even_out(step: Step, prices: _Prices, floor: float, max_tokens) -> None:
    """The coarse step's last passes: the size classes brought to the mean
    (`_even_classes`), then many disjoint exchanges between the most and the least loaded
    bags (`_level`). Where that leaves the bag-level makespan above what placement
    reached, placement's assignment is kept and `_exchange_across` runs on it instead."""
    before = step.bag.copy()
    top = _even_classes(step, prices, max_tokens)
    if _level(step, prices, floor, max_tokens) > top * (1 + _TIE):
        step.bag[:] = before
        if max_tokens is not None:
            lengths = step.lengths.astype(np.float64)
            step.layout.bag_tokens[:] = np.bincount(before, weights=lengths,
                                                    minlength=len(step.layout.size))  # fmt: skip
        _exchange_across(step, prices, floor, max_tokens)


def _bag_makespan(step: Step, prices: _Prices) -> float:
    """The largest priced per-GPU time of any bag, its sending GPU counted."""
    _, load, sent = _priced_loads(step, prices)
    return float((load / step.layout.weight + _sender_extra(step, sent)).max(initial=0.0))


def _sender_extra(step: Step, sent: np.ndarray) -> np.ndarray:
    """(num_bags,) how far each bag's slowest GPU sits above the bag's spread load, given
    ``sent`` (n,) (`_priced_loads`): one GPU sends each of its sequences placed away, not
    the whole bag (per GPU, workload units)."""
    return _uneven_sends(step.layout, *_sends(step, sent))


def _sends(step: Step, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each GPU (num_gpus,) and each home bag (num_bags,) pays to send its sequences
    placed away (``sent`` (n,), `_priced_loads`)."""
    layout = step.layout
    num_gpus = len(layout.shape.bag_of_pos)
    gpu_sends = np.bincount(np.maximum(step.src_pos, 0), weights=sent, minlength=num_gpus)
    bag_sends = np.bincount(np.maximum(step.home_bag, 0), weights=sent, minlength=len(layout.size))
    return gpu_sends, bag_sends


def _uneven_sends(layout: BagLayout, gpu_sends: np.ndarray, bag_sends: np.ndarray) -> np.ndarray:
    """(num_bags,) each bag's most sending GPU less the bag's sends spread over its GPUs."""
    return np.maximum.reduceat(gpu_sends, layout.start) - bag_sends / layout.weight


def _level(step: Step, prices: _Prices, floor: float, max_tokens) -> float:
    """Final leveling of a large step, many disjoint exchanges a round: the ``_LEVEL_DONORS``
    most loaded bags above the mean each get ``_LEVEL_PARTNERS`` of the least loaded bags
    (the most loaded donor the least loaded ones, dealt round-robin: no bag serves two
    donors) and move one sequence to, or swap one with, whichever of them evens the two
    out best, while that lowers the larger of the two below the donor. Sequences are
    re-priced at their new bags (`_Prices`); a bag's slowest GPU counts its sending
    (`_sender_extra`). The best assignment seen (by the bag-level makespan) is kept;
    returns its bag-level makespan."""
    layout = step.layout
    size, weight = layout.size, layout.weight
    num_bags = len(size)
    lengths = step.lengths.astype(np.float64)
    workload = step.workload
    tokens = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    placed = np.flatnonzero(step.lengths > 0)
    by_weight = placed[np.argsort(workload[placed], kind="stable")]  # lightest first
    best_bag, best_top = None, np.inf

    def priced(seq, bag):
        return prices.cost(step, lengths, seq, bag)[0]

    for round_ in range(_LEVEL_ROUNDS + 1):
        price, load, sent = _priced_loads(step, prices)
        per = load / weight + _sender_extra(step, sent)
        top = float(per.max())
        if top < best_top * (1 - _TIE):
            best_bag, best_top = step.bag.copy(), top
        mean = float(load.sum() / weight.sum())
        if round_ == _LEVEL_ROUNDS or top <= floor * (1 + _AUTO_STOP):
            break
        donors = least(-per, _LEVEL_DONORS)
        donors = donors[per[donors] > mean]
        takers = least(per, len(donors) * (_LEVEL_PARTNERS + 1))
        is_donor = np.zeros(num_bags, dtype=bool)
        is_donor[donors] = True
        takers = takers[~is_donor[takers]][: len(donors) * _LEVEL_PARTNERS]
        k = min(len(donors), len(takers))
        if k == 0:
            break
        donors = donors[:k]
        p = len(takers) // k
        takers = takers[: k * p].reshape(p, k).T  # (k, p): donor d gets takers d, d+k, ...
        # Each bag's members, lightest first, and a spread sample of them per bag.
        key = step.bag[by_weight]  # a stable sort of small ints is a radix sort
        order = by_weight[np.argsort(key.astype(np.int16) if num_bags < 2**15 else key,
                                     kind="stable")]  # fmt: skip
        cuts = np.searchsorted(step.bag[order], np.arange(num_bags + 1))
        ma = _member_sample(order, cuts, donors, _LEVEL_MEMBERS)  # (k, s)
        mb = _member_sample(order, cuts, takers.ravel(), _LEVEL_MEMBERS)
        mb = np.concatenate([mb, np.full((len(mb), 1), -1)], axis=1).reshape(k, p, -1)
        ra, rb = ma >= 0, mb >= 0
        mai, mbi = np.maximum(ma, 0), np.maximum(mb, 0)
        a_, b_ = donors[:, None, None, None], takers[:, None, :, None]  # (k, 1, 1|p, 1)
        into_b = priced(mai[:, :, None, None], b_)  # (k, s, p, 1)
        into_a = np.where(rb, priced(mbi, donors[:, None, None]), 0.0)[:, None]  # (k, 1, p, t)
        out_a = np.where(ra, price[mai], 0.0)[:, :, None, None]
        out_b = np.where(rb, price[mbi], 0.0)[:, None]
        new_a = per[a_] + (into_a - out_a) / weight[a_]
        new_b = per[b_] + (into_b - out_b) / weight[b_]
        li = lengths[mai][:, :, None, None]
        lj = np.where(rb, lengths[mbi], 0.0)[:, None]
        ok = ra[:, :, None, None] & (li >= size[b_]) & ((lj >= size[a_]) | ~rb[:, None])
        if max_tokens is not None:
            ok &= np.ceil((tokens[b_] + li - lj) / size[b_]) <= max_tokens
            ok &= np.ceil((tokens[a_] - li + lj) / size[a_]) <= max_tokens
        value = np.where(ok, np.maximum(new_a, new_b), np.inf).reshape(k, -1)
        pick = value.argmin(axis=1)
        gain = value[np.arange(k), pick] < per[donors] * (1 - _TIE)
        if not gain.any():
            break
        pp, t = mb.shape[1:]
        i, rest = np.divmod(pick, pp * t)
        j, q = np.divmod(rest, t)
        rows = np.arange(k)
        x, y = ma[rows, i][gain], mb[rows, j, q][gain]
        a, b = donors[gain], takers[rows, j][gain]
        step.bag[x] = b
        np.add.at(tokens, a, -lengths[x])
        np.add.at(tokens, b, lengths[x])
        swap = y >= 0
        step.bag[y[swap]] = a[swap]
        np.add.at(tokens, b[swap], -lengths[y[swap]])
        np.add.at(tokens, a[swap], lengths[y[swap]])
    step.bag[:] = best_bag
    if max_tokens is not None:
        layout.bag_tokens[:] = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    return best_top


def _even_classes(step: Step, prices: _Prices, max_tokens) -> float:
    """Bring the bags of the smaller groups into the band [mean, mean + band] of per-GPU
    time, in a few vectorised rounds (``band``: ``_EVEN_BAND`` of the mean).

    A g-GPU bag takes a sequence's cost over g GPUs, so placement leaves the bags of one
    GPU scattered by up to a whole sequence around the mean while the largest groups,
    which take 1/g of each, sit above it on average: no exchange of the top bag alone
    evens that out. Here every smaller bag outside the band swaps one of its sequences
    for (or takes) one of a largest-group bag's, or of a smaller bag above the band, whose
    cost brings it into the band, as close to its top as it gets: load moves between the
    size classes in steps as fine as the differences between sequences, not their sizes.
    Candidates are found by bisection on their cost (the ``_EVEN_TRIES`` nearest distinct
    costs, the least loaded donor of each), then priced exactly (`_Prices`); a donor of
    the largest size may not end above the band's top unless it already was, a smaller
    one must end nearer the band. Each bag and sequence takes part in one exchange a round.
    Returns the bag-level makespan (`_bag_makespan`) of the step as it was handed in.
    """
    layout = step.layout
    size, weight, kappa = layout.size, layout.weight, prices.kappa
    top_size = int(size.max())
    if not (size < top_size).any():
        return _bag_makespan(step, prices)
    lengths = step.lengths.astype(np.float64)
    workload = step.workload
    num_bags = len(size)
    live = step.lengths > 0
    kappa_of = {int(g): float(kappa[int(np.argmax(size == g))]) for g in layout.class_size}

    def priced(seq, bag):
        return prices.cost(step, lengths, seq, bag)[0]

    handed = None
    for _ in range(_EVEN_ROUNDS):
        price, load, sent = _priced_loads(step, prices)
        per = load / weight + _sender_extra(step, sent)
        handed = float(per.max()) if handed is None else handed
        mean = float(load.sum() / weight.sum())
        band = _EVEN_BAND * mean
        target = mean + band
        bag = step.bag
        bag_of = np.where(live, bag, 0)
        outside = (per < target - band) | (per > target)
        pool = np.flatnonzero(live & ((size == top_size) | (per > target))[bag_of])
        tokens = np.bincount(bag_of, weights=np.where(live, lengths, 0.0), minlength=num_bags)
        changed = False
        for g in layout.class_size[:-1].tolist():
            takers = np.flatnonzero((size == g) & outside)
            cand = pool[step.lengths[pool] >= g]
            if not takers.size or not cand.size:
                continue
            # Candidates by what each costs in a g-GPU bag of another node (most are), the
            # least loaded donor first among equal costs (sequences' costs repeat).
            key = workload[cand] + (kappa_of[g] + prices.inter) * lengths[cand]
            order = np.lexsort((per[bag[cand]], key))
            cand, key = cand[order], key[order]
            run = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
            is_taker = np.zeros(num_bags, dtype=bool)
            is_taker[takers] = True
            mine = np.flatnonzero(live & is_taker[bag_of])
            # Each taker's sequences, and one empty slot per taker (a move, not a swap).
            j = np.concatenate([mine, np.full(len(takers), -1)])
            b = np.concatenate([bag[mine], takers])
            jj = np.maximum(j, 0)
            out_j = np.where(j >= 0, price[jj], 0.0)
            lo = out_j + (target - band - per[b]) * weight[b]
            hi = out_j + (target - per[b]) * weight[b]
            u = (np.searchsorted(key[run], hi, "right") - 1)[:, None] - np.arange(_EVEN_TRIES)
            first = run[np.maximum(u, 0)]
            ok = (u >= 0) & (key[first] >= lo[:, None]) & (bag[cand[first]] != b[:, None])
            rows, cols = np.nonzero(ok)
            if not rows.size:
                continue
            j, jj, b, i = j[rows], jj[rows], b[rows], cand[first[rows, cols]]
            a = bag[i]
            into_a = np.where(j >= 0, priced(jj, a), 0.0)
            out_j = np.where(j >= 0, price[jj], 0.0)
            new_b = per[b] + (priced(i, b) - out_j) / weight[b]
            new_a = per[a] + (into_a - price[i]) / weight[a]
            big = size[a] == top_size
            good = (np.abs(new_b - target) < np.abs(per[b] - target)) & (new_b <= target + band)
            good &= (j < 0) | (step.lengths[jj] >= size[a])
            good &= np.where(big, new_a <= np.maximum(per[a], target),
                             np.abs(new_a - target) < np.abs(per[a] - target))  # fmt: skip
            if max_tokens is not None:
                shift = lengths[i] - np.where(j >= 0, lengths[jj], 0.0)
                good &= np.ceil((tokens[b] + shift) / size[b]) <= max_tokens
                good &= np.ceil((tokens[a] - shift) / size[a]) <= max_tokens
            sel = np.flatnonzero(good)
            if not sel.size:
                continue
            # The exchanges closest to the band's top first; each bag takes part in one (a
            # largest-group donor in several, but one under a token cap), each sequence
            # moves once.
            sel = sel[np.argsort(np.abs(new_b[sel] - target), kind="stable")]
            sel = sel[_first_each(b[sel])]
            sel = sel[_first_each(i[sel])]
            used = np.zeros(num_bags, dtype=bool)
            shared = big & (max_tokens is None)
            keep = []
            for k, bk, ak, sh in zip(sel.tolist(), b[sel].tolist(), a[sel].tolist(),
                                     shared[sel].tolist(), strict=True):  # fmt: skip
                if used[bk] or (used[ak] and not sh):
                    continue
                used[bk] = True
                if not sh:
                    used[ak] = True
                keep.append(k)
            sel = np.asarray(keep, dtype=np.int64)
            swap = sel[j[sel] >= 0]
            bag[j[swap]] = a[swap]
            bag[i[sel]] = b[sel]
            moved = np.zeros(len(live), dtype=bool)
            moved[i[sel]] = True
            pool = pool[~moved[pool]]
            changed = True
        if not changed:
            break
    return handed


def _first_each(values: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each distinct value of ``values``, in order."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    return np.sort(order[np.concatenate([[True], v[1:] != v[:-1]])]) if len(v) else order


def _member_sample(order: np.ndarray, cuts: np.ndarray, bags: np.ndarray, most: int):
    """(len(bags), most) sequence ids of each of ``bags`` (-1 pads): all of a bag's members
    when it has at most ``most``, else ``most`` spread evenly from its lightest to its
    heaviest. ``order``: placed sequences sorted by bag, lightest first; bag b's run is
    ``cuts[b]:cuts[b + 1]``."""
    first, count = cuts[bags], cuts[bags + 1] - cuts[bags]
    q = np.arange(most)
    spread = np.round(q[None, :] * ((count[:, None] - 1) / max(most - 1, 1))).astype(np.int64)
    offset = np.where(count[:, None] > most, spread, q[None, :])
    valid = q[None, :] < count[:, None]
    return np.where(valid, order[np.minimum(first[:, None] + offset, len(order) - 1)], -1)


class _LazyMembers(dict):
    """Bag -> its sequence ids (a list), cut from ``by_bag`` (ids sorted by bag; bag b's
    run is ``cuts[b]:cuts[b + 1]``) when first asked for: an exchange pass reads few bags."""

    def __init__(self, by_bag: np.ndarray, cuts: list[int]):
        super().__init__()
        self.by_bag, self.cuts = by_bag, cuts

    def __missing__(self, bag: int) -> list[int]:
        self[bag] = part = self.by_bag[self.cuts[bag] : self.cuts[bag + 1]].tolist()
        return part


def _spread_sample(members: list[int], workload: np.ndarray, most: int) -> np.ndarray:
    """``members`` as an array, or ``most`` of them spread evenly over their workloads
    (a large bag's exchanges are then scored on a sample from light to heavy)."""
    m = np.asarray(members, dtype=np.int64)
    if len(m) <= most:
        return m
    m = m[np.argsort(workload[m], kind="stable")]
    return m[np.linspace(0, len(m) - 1, most).round().astype(np.int64)]


def _moved_estimate(step: Step) -> float:
    """Tokens that leave their GPU: all of a sequence placed away from home, (g-1)/g of one
    at home in a g-GPU bag."""
    g = step.layout.size[step.bag].astype(np.float64)
    home = step.bag == step.home_bag
    return float(np.sum(step.lengths * np.where(home, (g - 1) / g, 1.0)))


def _within_budget(mine, theirs, num_bags, num_gpus, workload):
    """``mine`` and ``theirs`` (sequence ids), or spread samples of them (`_spread_sample`)
    when scoring every move of ``mine`` to each of ``num_bags`` bags and every swap with
    ``theirs`` on each of ``num_gpus`` GPUs would exceed ``_REFINE_CELLS``: half the
    candidates go to moves, the rest to swaps."""
    cap = max(_REFINE_CELLS // num_gpus, 2 * num_bags)
    if len(mine) * (num_bags + len(theirs)) <= cap:
        return mine, theirs
    most = min(len(mine), max(4, cap // (2 * num_bags)))
    mine = _spread_sample(mine, workload, most)
    swaps = max(4, (cap - len(mine) * num_bags) // len(mine))
    return mine, _spread_sample(theirs, workload, swaps)


def _refine(step: Step, model: WorkloadModel, comm: CommModel, speed, max_tokens) -> Step:
    """GPU-exact refinement of a small step (its chunk table made): the bag-level prices
    spread a sequence's sending over its home bag, but one GPU sends it, and a long video
    sent to another node puts that GPU above its bag. Each round scores, on every GPU at
    once, moving one sequence of the slowest GPU's bag (or one it sends) to any bag, or
    swapping it with one of the least loaded bags' sequences, and applies the one that
    lowers the slowest GPU most (or, at an equal top, the load above the mean). Chunks are
    scored as L/g tokens each; the result is kept only where its exact modelled makespan
    (`_modelled_makespan`) is lower. Returns the better step."""
    layout, lengths, workload, home = step.layout, step.lengths, step.workload, step.home_bag
    shape, size = layout.shape, layout.size
    num_gpus = len(shape.bag_of_pos)
    before = _modelled_makespan(step, model, comm, speed)
    compute, tokens = _compute_per_gpu(step, model, speed)
    kappa = np.array([comm.ulysses_per_token(model.token_dim, int(g), model.scale) for g in size])
    base = compute + kappa[shape.bag_of_pos] * tokens
    seq, pos, _, length = step.chunks
    src = step.src_pos
    node = np.arange(num_gpus) // int(comm.node_size)
    away = src[seq] != pos
    across = node[src[seq]] != node[pos]
    ends = [np.concatenate([src[seq][m], pos[m]]) for m in (away & ~across, away & across)]
    weights = [np.tile(length[m].astype(np.float64), 2) for m in (away & ~across, away & across)]
    intra, inter = (
        np.bincount(e, weights=w, minlength=num_gpus) for e, w in zip(ends, weights, strict=True)
    )
    ci, ce = _route_per_token(comm, model)
    inv_speed = np.ones(num_gpus) if speed is None else 1.0 / speed
    bag = step.bag.copy()
    bag_tokens = np.bincount(bag, weights=lengths, minlength=len(size))
    fl = lengths.astype(np.float64)
    gpu = np.arange(num_gpus)
    smallest = layout.class_size[0]

    def deltas(seqs, to):
        """(base, intra, inter) changes (k, num_gpus) of moving ``seqs`` to bags ``to``."""
        frm = bag[seqs]
        ell, w, sig = fl[seqs][:, None], workload[seqs][:, None], src[seqs]
        in_a = shape.bag_of_pos[None, :] == frm[:, None]
        in_b = shape.bag_of_pos[None, :] == to[:, None]
        ga, gb = size[frm][:, None], size[to][:, None]
        d_base = (in_b * (w / gb * inv_speed + kappa[to][:, None] * ell / gb)
                  - in_a * (w / ga * inv_speed + kappa[frm][:, None] * ell / ga))  # fmt: skip
        recv = (in_b * (ell / gb) - in_a * (ell / ga)) * (gpu[None, :] != sig[:, None])
        same = node[None, :] == node[sig][:, None]
        d_in, d_out = recv * same, recv * ~same
        rows = np.arange(len(seqs))
        d_in[rows, sig] += d_in.sum(1)
        d_out[rows, sig] += d_out.sum(1)
        return d_base, d_in, d_out

    def allowed(seqs, to):
        ok = (lengths[seqs] >= size[to]) | (size[to] == smallest)
        return ok & (to != bag[seqs]) & (lengths[seqs] > 0)

    for _ in range(_REFINE_ROUNDS):
        load = base + np.maximum(intra * ci, inter * ce)
        top = float(load.max())
        mean = float(load.mean())
        spill = float(np.square(np.maximum(load - mean, 0.0)).sum())
        p = int(load.argmax())
        a = int(shape.bag_of_pos[p])
        mine = np.flatnonzero(((bag == a) | ((src == p) & (bag != a))) & (lengths > 0))
        per_bag = np.maximum.reduceat(load, layout.start)
        light = least(per_bag, min(_REFINE_PARTNERS + 1, len(size)))
        light = light[light != a][:_REFINE_PARTNERS]
        theirs = np.flatnonzero(np.isin(bag, light) & (lengths > 0))
        mine, theirs = _within_budget(mine, theirs, len(size), num_gpus, workload)
        # Moves to every bag, then swaps with the light bags' sequences.
        s1 = np.repeat(mine, len(size))
        t1 = np.tile(np.arange(len(size)), len(mine))
        keep = allowed(s1, t1)
        s1, t1 = s1[keep], t1[keep]
        s2 = np.repeat(mine, len(theirs))
        o2 = np.tile(theirs, len(mine))
        keep = (bag[s2] != bag[o2]) & allowed(s2, bag[o2]) & allowed(o2, bag[s2])
        s2, o2 = s2[keep], o2[keep]
        db, di, de = deltas(np.concatenate([s1, s2]), np.concatenate([t1, bag[o2]]))
        if len(o2):
            xb, xi, xe = deltas(o2, bag[s2])
            db[len(s1) :] += xb
            di[len(s1) :] += xi
            de[len(s1) :] += xe
        if not len(db):
            break
        new = base + db + np.maximum((intra + di) * ci, (inter + de) * ce)
        if max_tokens is not None:
            moved_to = np.concatenate([t1, bag[o2]])
            moved = np.concatenate([s1, s2])
            gain = fl[moved] - np.concatenate([np.zeros(len(s1)), fl[o2]])
            ok = np.ceil((bag_tokens[moved_to] + gain) / size[moved_to]) <= max_tokens
            ok &= np.ceil((bag_tokens[bag[moved]] - gain) / size[bag[moved]]) <= max_tokens
            new[~ok] = np.inf
        worst = new.max(1)
        score = np.square(np.maximum(new - mean, 0.0)).sum(1)
        better = worst < top * (1 - 1e-9)
        if not better.any():
            better = (worst <= top * (1 + 1e-12)) & (score < spill * (1 - 1e-9))
            if not better.any():
                break
            k = int(np.flatnonzero(better)[np.argmin(score[better])])
        else:
            k = int(np.argmin(np.where(better, worst, np.inf)))
        base, intra, inter = base + db[k], intra + di[k], inter + de[k]
        if k < len(s1):
            moves = [(int(s1[k]), int(t1[k]))]
        else:
            j = k - len(s1)
            moves = [(int(s2[j]), int(bag[o2[j]])), (int(o2[j]), int(bag[s2[j]]))]
        for x, to in moves:
            bag_tokens[bag[x]] -= fl[x]
            bag_tokens[to] += fl[x]
        for x, to in moves:
            bag[x] = to
    if np.array_equal(bag, step.bag):
        return step
    refined = Step(lengths, workload, src, home, layout, bag, step.rem)
    refined.chunks = chunk_table(refined)
    if _modelled_makespan(refined, model, comm, speed) < before * (1 - _TIE):
        layout.load[:] = np.bincount(bag, weights=workload, minlength=len(size))
        if max_tokens is not None:
            layout.bag_tokens[:] = bag_tokens.astype(np.int64)
        return refined
    return step
