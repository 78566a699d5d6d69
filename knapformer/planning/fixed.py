"""The fixed-topology solvers: ``"knapformer"`` (default; `solve_default`) and the
published ``"greedy"`` (`solve_greedy`), on a given layout's bags (docs/planning.md).

Their rules are described where `plan_routing` documents the solvers
(knapformer/planning/planner.py). Plans of fixed topologies are byte-identical across
versions (the sample plans replay), so every change here must keep them so.
"""

from __future__ import annotations

import heapq

import numpy as np

from knapformer.contract.stats import lower_bound
from knapformer.planning.bags import (
    BagLayout,
    Step,
    bag_speeds,
    by_home_heaviest_first,
    descending,
    least,
    pour_slots,
    prefix_within_bags,
    water_room,
)
from knapformer.planning.levelling import level_makespan
from knapformer.planning.tuning import (
    BY_HEAP,
    EPS,
    FALLBACK_TOLERANCE,
    HEAVY_FRACTION,
    HOME_RUNS,
    ONE_BY_ONE,
    POUR_TAIL,
    RANKED_SORT,
    SHORT_BATCH,
)


def _place_in_order(order: np.ndarray, step: Step, prefer_home: bool) -> None:
    """Place ``order`` one by one into the least-occupied candidate bag (LPT).

    With ``prefer_home`` a sequence stays in its home bag when that bag is a candidate
    and still has room. Under round-robin the remainder goes to the bag's chunks in turn
    (the published rule). Ties between equally occupied bags go to the lowest bag id.
    """
    if order.size == 0:
        return
    layout = step.layout
    num_classes = len(layout.class_size)
    if layout.even and layout.max_tokens is None and num_classes == 1:
        _place_in_one_class(order, step, prefer_home)
        return
    lengths, workload = step.lengths[order], step.workload[order]
    lo, hi = np.divmod(layout.candidate_keys(workload, lengths), num_classes)
    home = step.home_bag[order]
    home_class = layout.shape.class_of_bag_array[home]
    may_stay = (lo <= home_class) & (home_class <= hi) & (home >= 0) & prefer_home
    # Plain lists: for the few hundred to few thousand sequences placed one by one,
    # Python scalars beat per-item numpy calls several times over.
    load = layout.load.tolist()
    limit = (layout.capacity * (1 + EPS)).tolist()
    safe_capacity = np.where(layout.capacity > 0, layout.capacity, 1.0).tolist()
    occupancy = [x / c for x, c in zip(load, safe_capacity, strict=True)]
    class_of_bag = layout.shape.class_of_bag
    heaps = _class_heaps(occupancy, class_of_bag, num_classes)
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
        r = 0 if layout.even else round_robin[b] % size[b]  # round-robin: the next chunk
        if not layout.even and length % size[b]:
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


def _place_in_one_class(order: np.ndarray, step: Step, prefer_home: bool) -> None:
    """`_place_in_order` where every bag is a candidate for every sequence (one bag size),
    chunks spread evenly (no remainder to track) and no token cap: the same placements
    (the pool of a large step goes through it, a few thousand sequences). A pool of at
    most one sequence per bag goes in batches (`_batch`), the next ``BY_HEAP`` one by one
    (`_place_by_heap`) where a batch would place fewer than ``SHORT_BATCH``; a larger
    pool one by one."""
    layout = step.layout
    load = layout.load.copy()
    limit = layout.capacity * (1 + EPS)
    safe_capacity = np.where(layout.capacity > 0, layout.capacity, 1.0)
    occupancy = load / safe_capacity
    workload, home = step.workload[order], step.home_bag[order]
    may_stay = (home >= 0) & prefer_home
    chosen = np.empty(len(order), dtype=np.int64)
    # More sequences than bags: a run ends where one would take a bag twice, so soon.
    start, window, batches = 0, len(load), len(order) <= len(load)
    while start < len(order):
        if batches:
            w, h = workload[start : start + window], home[start : start + window]
            stays = may_stay[start : start + window] & (load[h] + w <= limit[h])
            bag, new = _batch(w, h, stays, load, safe_capacity, occupancy)
            if len(bag) >= SHORT_BATCH:  # shorter ones cost more than they save
                load[bag] += w[: len(bag)]
                occupancy[bag] = new
                chosen[start : start + len(bag)] = bag
                start += len(bag)
                window = min(len(load), 2 * len(bag))  # a batch runs about as far as the last
                continue
        end = min(len(order), start + BY_HEAP) if batches else len(order)
        chosen[start:end] = _place_by_heap(workload[start:end], home[start:end],
                                           may_stay[start:end], load, limit, safe_capacity,
                                           occupancy)  # fmt: skip
        start, window = end, len(load)
    step.bag[order] = chosen
    step.rem[order] = 0
    layout.load[:] = load


def _batch(w, h, stays, load, safe_capacity, occupancy):
    """(bags, their new occupancies) of the longest run of the sequences of workload
    ``w`` (home ``h``, ``stays`` where it may stay and fits) that the one-by-one rule
    would place just so: each either home, or in the next of the bags ranked by
    occupancy (ties: the lower id) while that one is still below every occupancy the run
    has raised, no bag taken twice (loads and the home test as they stood). Never empty."""
    ranked = least(occupancy, len(w))
    bag = np.where(stays, h, ranked[np.maximum(np.cumsum(~stays) - 1, 0)])
    new = (load[bag] + w) / safe_capacity[bag]
    index = np.arange(len(bag))
    first = np.full(len(load), len(bag))  # each bag's first sequence of the run
    first[bag[::-1]] = index[::-1]
    raised = np.minimum.accumulate(np.concatenate([[np.inf], new[:-1]]))
    bad = (first[bag] != index) | ~(stays | (occupancy[bag] < raised))
    end = int(bad.argmax()) if bad.any() else len(bag)  # bad[0] never is
    return bag[:end], new[:end]


def _place_by_heap(workload, home, may_stay, load, limit, safe_capacity, occupancy):
    """`_place_in_one_class`'s sequences one by one (its arrays updated in place): home
    when it may stay and fits, else the least occupied bag, kept on a heap. Returns the
    bags chosen."""
    load_list, limit_list = load.tolist(), limit.tolist()
    safe, occ = safe_capacity.tolist(), occupancy.tolist()
    heap = _class_heaps(occ, [0] * len(occ), 1)[0]
    chosen = []
    # Bound once: the loop runs thousands of times (mixres on g4n1024: 6,700 sequences).
    choose, push, replace, pop = chosen.append, heapq.heappush, heapq.heapreplace, heapq.heappop
    for w, h, stay in zip(workload.tolist(), home.tolist(), may_stay.tolist(), strict=True):
        if stay and load_list[h] + w <= limit_list[h]:
            b = h
        else:
            top = heap[0]
            while top[0] != occ[top[1]]:  # drop stale entries (`_live_top`)
                pop(heap)
                top = heap[0]
            b = top[1]
        choose(b)
        load_list[b] = new_load = load_list[b] + w
        occ[b] = new = new_load / safe[b]
        if heap[0][1] == b:  # b was the least occupied: update in place
            replace(heap, (new, b))
        else:
            push(heap, (new, b))
    load[:], occupancy[:] = load_list, occ
    return chosen


def _class_heaps(occupancy, class_of_bag, num_classes) -> list[list[tuple[float, int]]]:
    """One min-heap of (occupancy, bag) per size class; entries go stale when a bag's
    occupancy grows and are dropped when they surface (occupancy never decreases)."""
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_classes)]
    for b, occ in enumerate(occupancy):
        heaps[class_of_bag[b]].append((occ, b))
    for heap in heaps:
        heapq.heapify(heap)
    return heaps


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


def solve_greedy(shape, lengths, workload, src_pos, speed, max_tokens, even=False) -> Step:
    """The published greedy: capacity = total / #GPUs (by speed), largest first into the
    least-occupied candidate bag. ``even=False``: its own round-robin chunk rule."""
    bag_speed = bag_speeds(shape, speed)
    weight = shape.size if bag_speed is None else shape.size * bag_speed
    # Summed left to right (cumsum), as the published algorithm and its plain-Python
    # transcription do: pairwise summation differs in the last bits and flips near-ties.
    total = float(workload.cumsum()[-1]) if workload.size else 0.0
    mean = total / float(weight.sum())
    layout = BagLayout(shape, mean, max_tokens, bag_speed, even)
    step = Step.start(shape, lengths, workload, src_pos, layout)
    _place_in_order(descending(workload, np.arange(len(lengths))), step, prefer_home=False)
    return step


def solve_default(shape, lengths, workload, src_pos, speed, max_tokens, tolerance=None) -> Step:
    """The default solver, with greedy as a safety net.

    Its per-GPU capacity is the lower bound on the makespan rather than greedy's mean
    load: when one sequence outweighs the mean, every GPU under that bound can keep all
    its sequences at no cost to the makespan. Chunks spread each bag's tokens evenly, so
    every GPU of a bag computes the bag's load / g to within one token's linear cost:
    scoring bags scores the real (Ulysses-exact) per-GPU loads. Where the local search
    stalls short of the bound (coarse sequences), greedy's placement is solved too (with
    the even spread) and the better makespan is kept.
    """
    bag_speed = bag_speeds(shape, speed)
    weight = shape.size.astype(np.float64) if bag_speed is None else shape.size * bag_speed
    bound = lower_bound(workload, weight)
    layout = BagLayout(shape, bound, max_tokens, bag_speed, even=True)
    step = Step.start(shape, lengths, workload, src_pos, layout)
    _solve_local(step, tolerance)
    makespan = layout.makespan()
    if makespan <= bound * (1 + FALLBACK_TOLERANCE):
        return step
    try:
        greedy = solve_greedy(shape, lengths, workload, src_pos, speed, max_tokens, even=True)
    except ValueError:  # greedy cannot meet the token cap where ours did
        return step
    return greedy if greedy.layout.makespan() < makespan else step


def _solve_local(step: Step, tolerance: float | None = None) -> None:
    layout, lengths, workload = step.layout, step.lengths, step.workload
    n = len(lengths)
    empty = lengths == 0  # nothing to compute or move: keep at home, no chunks
    step.bag[empty] = step.home_bag[empty]

    # A small step is placed one by one, where a bulk pass would save little time and
    # land further from the bound; a large one only its heavy sequences.
    one_by_one = ~empty
    if n > ONE_BY_ONE:
        one_by_one &= workload > HEAVY_FRACTION * layout.gpu_capacity
    _place_in_order(descending(workload, np.flatnonzero(one_by_one)), step, prefer_home=True)
    if n > ONE_BY_ONE:
        _stay_home_in_bulk(step)
        pool = descending(workload, np.flatnonzero(step.bag < 0), step)
        if len(pool) > POUR_TAIL and len(layout.class_size) == 1 and layout.max_tokens is None:
            pool = _pour(pool, step)
        _place_in_order(pool, step, prefer_home=True)
    level_makespan(step, tolerance=tolerance)


def _pour(pool: np.ndarray, step: Step) -> np.ndarray:
    """Pour the heaviest of a large pool (heaviest first; one bag size, no token cap)
    into the bags' room at one water level, in one pass; returns the ``POUR_TAIL``
    lightest, left to the one-by-one placement, which evens out the last gaps."""
    layout = step.layout
    poured = pool[: len(pool) - POUR_TAIL]
    cost = step.workload[poured]
    bags = pour_slots(cost, water_room(layout.load, layout.weight, float(cost.sum())))
    step.bag[poured] = bags
    layout.add_many(bags, cost, None if layout.max_tokens is None else step.lengths[poured])
    return pool[len(poured) :]


def _stay_home_in_bulk(step: Step) -> None:
    """Within each home bag, the largest of the unplaced sequences stay while there is room
    (one vectorised pass; sequences shorter than their home bag are left to the pool)."""
    layout, lengths, workload, home_bag = step.layout, step.lengths, step.workload, step.home_bag
    if len(layout.class_size) == 1:  # one mask over the step: no gathers by home bag
        fits = lengths >= layout.class_size[0]
    else:  # (a home bag of -1 reads the last bag's size: the home test masks it)
        fits = layout.size[home_bag] <= lengths
    light = np.flatnonzero((step.bag < 0) & (home_bag >= 0) & fits)
    order = _by_home_heaviest_first(light, step, len(layout.size))
    del light  # its memory serves the gathers below: fewer fresh pages to fault in
    # hb ascends: ``order`` is by home bag
    hb, cost = np.take(home_bag, order), np.take(workload, order)
    stays = prefix_within_bags(cost, hb, layout.capacity - layout.load)
    capped = layout.max_tokens is not None
    if capped:
        # An even spread keeps a bag's fullest GPU at ceil(bag tokens / g).
        token_room = layout.max_tokens * layout.size - layout.bag_tokens
        stays &= prefix_within_bags(lengths[order].astype(np.float64), hb, token_room)
        stay_ids, stay_bags = order[stays], hb[stays]
        step.bag[stay_ids] = stay_bags
        layout.add_many(stay_bags, cost[stays], lengths[stay_ids])
        return
    # In place, without gathering the stayers: the leavers weigh nothing in the bags'
    # sums (adding 0.0 leaves a sum as it was) and stay unplaced (bag -1).
    cost *= stays
    layout.add_many(hb, cost, None)
    np.copyto(hb, -1, where=~stays)
    step.bag[order] = hb


def _by_home_heaviest_first(light: np.ndarray, step: Step, num_bags: int) -> np.ndarray:
    """`by_home_heaviest_first` of the ascending ids ``light`` (by home bag, heaviest
    first, ties by id), by one stable sort of (home, workload rank) as int32 where their
    homes ascend too, as a fixed layout's do (bags are runs of GPU positions and a step is
    flattened GPU by GPU), and the bags hold few each (``HOME_RUNS``): the sort then
    merges short runs, up to 1.6x as fast as the general path's sort of unique int64
    keys. (Could move into bags.by_home_heaviest_first.)"""
    if RANKED_SORT <= len(light) <= HOME_RUNS * num_bags:
        home = np.take(step.home_bag, light)
        rank, distinct = step.ranks()
        if num_bags * distinct < 2**31 and not (home[1:] < home[:-1]).any():
            key = home.astype(np.int32)
            del home  # its memory serves the sort's result: fewer fresh pages to fault in
            key *= distinct
            key += np.take(rank, light)
            return np.take(light, np.argsort(key, kind="stable"))
    return by_home_heaviest_first(light, step.home_bag, step.workload, num_bags, step.ranks)
