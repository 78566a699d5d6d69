"""One mixed partition of ``topology="auto"`` solved as one problem over all its bags:
priced placement (heavy ones one by one, stay home in bulk, the pool poured or placed),
then the exchange passes (`solve_mixed`)."""

from __future__ import annotations

from functools import partial
from heapq import heapreplace
from math import inf

import numpy as np

from knapformer.planning.bags import (
    BagLayout,
    Step,
    bag_shape,
    bag_speeds,
    by_home_heaviest_first,
    by_small_key,
    descending,
    pour_slots,
    prefix_within_bags,
    prefix_within_groups,
    run_heads,
    water_room,
)
from knapformer.planning.coarse import even_out, is_coarse
from knapformer.planning.exchanges import exchange_across
from knapformer.planning.pricing import Prices, priced_loads
from knapformer.planning.tuning import EPS, HEAVY_FRACTION, ONE_BY_ONE, POUR


def solve_mixed(bag_sizes, lengths, workload, src_pos, speed, max_tokens, per_token,
                 floor, comm, model) -> Step:  # fmt: skip
    """One problem over all bags of a mixed partition, each sequence priced at the bag it
    is in (`Prices`: ``W + k_g*L`` plus the route its receivers pay; its source GPU's bag
    pays the sending; a bag's per-GPU time is its priced load / its weight).

    Largest first, a sequence stays in its home bag while that keeps the bag under
    ``floor`` (`partition_floor`), else goes where the larger of its bag's and its home
    bag's per-GPU time ends lowest (LPT across sizes, among the least loaded bag of each
    size overall and in its source's node; a tie to the smaller group). In a large step
    only the heavy sequences go one by one: the others stay home in bulk, and a large
    remainder is poured into the bags' room at one water level (`_pour`).
    `exchange_across` then evens out the top; in a coarse large step (`is_coarse`),
    `even_out` does instead.
    """
    shape = bag_shape(tuple(bag_sizes))
    layout = BagLayout(shape, floor, max_tokens, bag_speeds(shape, speed), even=True)
    step = Step.start(shape, lengths, workload, src_pos, layout)
    prices = Prices.of(shape, src_pos, per_token, comm, model)
    empty = lengths == 0
    if empty.any():
        step.bag[empty] = step.home_bag[empty]
        placed = np.flatnonzero(~empty)
    else:
        placed = np.arange(len(lengths))
    load = np.zeros(len(shape.size))
    known = None  # the prices as far as they are known (`priced_loads`)
    if len(placed) > ONE_BY_ONE:
        # Only the heavy ones and the pool need the descending order (the bulk pass sorts
        # by home bag itself): sorting every sequence would cost more than the rest.
        of_placed = workload if len(placed) == len(lengths) else workload[placed]
        heavy = of_placed > HEAVY_FRACTION * floor
        load = _place_priced(descending(workload, placed[heavy], step), step, load, prices, floor)
        rest = placed[~heavy]
        load, known = _stay_home_priced(rest, step, load, prices, floor)
        pool = descending(workload, rest[step.bag[rest] < 0], step)
        if len(pool) > POUR and max_tokens is None:
            load = _pour(pool, step, load, prices)
            pool = pool[step.bag[pool] < 0]
        order = pool
    else:
        order = descending(workload, placed, step)
    _place_priced(order, step, load, prices, floor)
    if len(placed) > ONE_BY_ONE and max_tokens is None:
        pool, before = _shave(step, prices, known)
        known = (*before, pool)  # stale for the pool only
        if pool.size:
            price, load, sent = priced_loads(step, prices, known)
            known = (price, sent, pool)  # the pool is placed next
            if len(pool) > POUR:
                load = _pour(pool, step, load, prices)
            _place_priced(pool[step.bag[pool] < 0], step, load, prices, floor)
    if is_coarse(step, len(placed)):
        even_out(step, prices, floor, max_tokens)
    else:
        exchange_across(step, prices, floor, max_tokens, known)
    layout.load[:] = np.bincount(step.bag, weights=workload, minlength=len(shape.size))
    return step


def _place_priced(order, step: Step, load: np.ndarray, prices: Prices, level: float):
    """Place ``order`` one by one (see `solve_mixed`); ``load`` (num_bags,): each bag's
    priced load so far. Returns the new loads."""
    if order.size == 0:
        return load
    bags = _PricedBags(step.layout, prices, load)
    step.bag[order] = bags.place(_rows(order, step, prices), step.layout, level * (1 + EPS))
    return np.asarray(bags.load)


def _rows(order, step: Step, prices: Prices):
    """`_PricedBags.place`'s rows of ``order``: each one's price at home made at once, the
    same bits as one by one (NaN where it may not be home: no home, or a group larger than
    it)."""
    w, length, home = step.workload[order], step.lengths[order], step.home_bag[order]
    size = step.layout.size[home]  # (no home: the last bag's, unused)
    at_home = w + prices.kappa[home] * length + 2 * prices.intra * length * (size - 1) / size
    at_home[(home < 0) | (size > length)] = np.nan
    return zip(order.tolist(), w.tolist(), length.tolist(), home.tolist(),
               prices.src_node[order].tolist(), at_home.tolist(), strict=True)  # fmt: skip


class _PricedBags:
    """The bags' priced loads while `_place_priced` places sequences one by one, kept in
    Python lists (read item by item, where numpy's per-call overhead would dominate), with
    the heaps of the least loaded bag of each size (`_size_heaps`). Loads only grow while
    sequences are placed, so a bag's entry is renewed only when it surfaces stale (the
    least live entry is the same as with every new load pushed, at a sift a bag that
    surfaces, not a push for every sequence placed)."""

    def __init__(self, layout: BagLayout, prices: Prices, load: np.ndarray):
        self.weight, self.bag_node = layout.weight.tolist(), prices.bag_node.tolist()
        self.class_size = layout.class_size.tolist()
        kap_class = np.zeros(len(self.class_size))  # (a bag's kappa is its class's)
        kap_class[layout.shape.class_of_bag_array] = prices.kappa
        self.kap_class = kap_class.tolist()
        self.intra, self.inter = prices.intra, prices.inter
        self.load = load.tolist()
        per = load / layout.weight
        self.per = per.tolist()
        self.heaps = _size_heaps(per, layout.shape.class_of_bag_array, prices.bag_node)
        self.tries: dict[int, list] = {}  # per source node (`_candidates`)

    def place(self, rows, layout: BagLayout, limit: float) -> list[int]:
        """The bag of each (sequence, workload, length, home bag, source node, price at
        home: NaN where it may not be home) of ``rows``, in turn: home while that keeps it
        within ``limit`` per GPU, else where the larger of the two bags' per-GPU times ends
        lowest, among the least loaded bag of each size it may go to (overall and in its
        node; under a token cap, of those with room), unless home is lower. One loop, the
        look-away inline: a call per sequence cost more than its pricing."""
        load, weight, per, bag_node = self.load, self.weight, self.per, self.bag_node
        intra, inter, tries, candidates = self.intra, self.inter, self.tries, self._candidates
        capped, room, chosen = layout.max_tokens is not None, None, []
        for seq, w, length, h, node, cost in rows:
            if capped:
                room = layout.token_room(length).tolist()
            b, lowest, sent = -1, inf, 0.0
            if cost == cost and (room is None or room[h]):  # (not NaN: it may be home)
                b, lowest = h, (load[h] + cost) / weight[h]
            if not lowest <= limit:  # the home bag (if any) would end too high: look away
                near, far = intra * length, inter * length  # the route in its node or not
                # The home bag's per-GPU time once it has sent the sequence, by route: the
                # larger of the two ends no lower, so a bag is priced only where that still
                # beats the best so far (as where its own time, already, does not).
                sends_near = sends_far = -inf
                if h >= 0:
                    sends_near = (load[h] + near) / weight[h]
                    sends_far = (load[h] + far) / weight[h]
                for g, kap, heap in tries.get(node) or candidates(node):
                    if g > length:
                        break  # groups larger than the sequence (the smallest always may)
                    if room is None:
                        top_per, top = heap[0]
                        while top_per != per[top]:  # stale (lower): renewed, sifted down
                            heapreplace(heap, (per[top], top))
                            top_per, top = heap[0]
                    else:
                        top_per, top = _least_with_room(heap, per, room)
                    if top_per >= lowest or top == h:
                        continue
                    route, value = (near, sends_near) if bag_node[top] == node else (far, sends_far)
                    if value >= lowest:
                        continue
                    there = (load[top] + w + kap * length + route) / weight[top]
                    if there > value:
                        value = there
                    if value < lowest:
                        b, lowest, cost, sent = top, value, w + kap * length + route, route
                if b < 0:
                    raise layout.infeasible(seq, length)
            chosen.append(b)
            # Charge the bag (and the home bag its sending); its heap entries go stale.
            load[b] += cost
            per[b] = load[b] / weight[b]
            if sent and h >= 0:
                load[h] += sent
                per[h] = load[h] / weight[h]
            if capped:
                layout.add(b, 0.0, length, 0)
        return chosen

    def _candidates(self, node: int) -> list:
        """(size, Ulysses per token, heap) of the least loaded bags of each size class,
        overall and in ``node``, made once per source node (the smallest class's size as
        0: it may take any sequence)."""
        heaps = self.heaps
        tried = self.tries[node] = [
            (g if c else 0, self.kap_class[c], heap)
            for c, g in enumerate(self.class_size)
            for heap in (heaps.get((c, -2)), heaps.get((c, node)))
            if heap
        ]
        return tried


def _least_with_room(heap, per: list, room: list) -> tuple[float, int]:
    """(per-GPU time, bag) of the least loaded bag of ``heap`` with room under the token
    cap, from every entry's current time ((inf, -1) where none has room)."""
    live = [(per[b], b) for _, b in heap if room[b]]
    return min(live) if live else (inf, -1)


def _size_heaps(per: np.ndarray, class_of_bag: np.ndarray, bag_node: np.ndarray):
    """Min-heaps of (per-GPU time, bag) giving the least loaded bag of each size, overall
    (node -2) and in each node, keyed (size class, node): one entry per bag in each of its
    two heaps. A node's heaps are searched only for its own sequences, which pass their
    home bag over, so a bag alone in its node (home to all of them) has no node heap, nor
    has a bag that spans nodes. Each heap is made sorted (a sorted list is a heap) from
    one sort by time and a radix sort by key, not entry by entry: at thousands of bags, a
    third of the time."""
    n = len(per)
    by_per = np.argsort(per, kind="stable")  # ties by bag, as the tuples order them
    in_node = bag_node >= 0
    in_node[in_node] = np.bincount(bag_node[in_node])[bag_node[in_node]] > 1
    heaps: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for node, bags in ((np.full(n, -2), by_per), (bag_node, by_per[in_node[by_per]])):
        if bags.size == 0:
            continue  # (no node holds two bags)
        key = class_of_bag * (n + 2) + node + 2  # (class, node) as one small int
        order = bags[by_small_key(key[bags], int(key.max(initial=0)) + 1)]
        starts = np.flatnonzero(run_heads(key[order])).tolist()
        ordered = list(zip(per[order].tolist(), order.tolist(), strict=True))
        own = [ordered[s:e] for s, e in zip(starts, [*starts[1:], len(order)], strict=True)]
        first = order[starts]
        keys = zip(class_of_bag[first].tolist(), node[first].tolist(), strict=True)
        heaps.update(zip(keys, own, strict=True))
    return heaps


def _stay_home_priced(seqs, step: Step, load: np.ndarray, prices: Prices, level: float):
    """Within each home bag, the largest of ``seqs`` stay while the bag's priced load stays
    under ``level`` per GPU (one vectorised pass, as `_stay_home_in_bulk`). Returns the new
    loads and the prices it knows (`priced_loads`'s ``known``: of the sequences kept home,
    every other's stale). A bag that has room for all of its sequences keeps them all:
    only the others' sequences are ordered (at 4,096 GPUs, half of a step's or fewer)."""
    layout, lengths, home = step.layout, step.lengths, step.home_bag
    hb = home[seqs]
    at = lengths[seqs]
    # Only a sequence shorter than the largest group may not fit its home bag.
    short = np.flatnonzero(at < layout.class_size[-1])
    fits = np.take(layout.size, hb[short], mode="clip") <= at[short]  # (no home: next)
    if hb.min(initial=0) < 0 or not fits.all():
        keep = hb >= 0
        keep[short] &= fits
        seqs, hb, at = seqs[keep], hb[keep], at[keep]
    cost = prices.at_home(step.workload, seqs, hb, layout.size, at)
    room = level * layout.weight - load
    token_room = None
    whole = np.bincount(hb, weights=cost, minlength=len(load)) <= room
    if layout.max_tokens is not None:
        token_room = layout.max_tokens * layout.size - layout.bag_tokens
        tokens = np.bincount(hb, weights=at.astype(np.float64), minlength=len(load))
        whole &= tokens <= token_room
    stays = whole[hb]
    rest = seqs[~stays]
    order = by_home_heaviest_first(rest, home, step.workload, len(layout.size), step.ranks)
    price = np.zeros(len(lengths))  # by sequence id
    price[seqs] = cost
    staying = np.zeros(len(lengths), dtype=bool)
    staying[order] = _staying(order, step, price[order], room, token_room)
    stays[~stays] = staying[rest]
    kept, hb = seqs[stays], hb[stays]
    # The kept ones' costs alone: the same bits as every cost with the others' as zeros.
    load = load + np.bincount(hb, weights=cost[stays], minlength=len(load))
    step.bag[kept] = hb
    if layout.max_tokens is not None:
        layout.add_many(hb, np.zeros(len(kept)), lengths[kept])
    stale = np.ones(len(lengths), dtype=bool)
    stale[kept] = False
    return load, (price, np.zeros(len(lengths)), np.flatnonzero(stale))


def _staying(order, step: Step, cost, room, token_room) -> np.ndarray:
    """Which of ``order`` (by home bag, heaviest first) stay: the running ``cost`` within the
    home bag inside its ``room`` (and its tokens inside ``token_room``, where capped)."""
    hb = step.home_bag[order]
    stays = prefix_within_bags(cost, hb, room)
    if token_room is not None:
        stays &= prefix_within_bags(step.lengths[order].astype(np.float64), hb, token_room)
    return stays


def _pour(pool, step: Step, load: np.ndarray, prices: Prices) -> np.ndarray:
    """Pour many small sequences into the bags' room at one water level: bags of the
    smallest groups first (no Ulysses), each sequence where the running sum of the pool's
    costs puts its middle. The level is the least at which the whole pool fits. Sequences
    shorter than some group are left unplaced (placed one by one after). Returns the new
    loads (route priced over the network, on both ends)."""
    layout, lengths, workload = step.layout, step.lengths, step.workload
    at = lengths[pool]
    fits = at >= layout.class_size[-1]
    if not fits.all():
        pool, at = pool[fits], at[fits]
    if pool.size == 0:
        return load
    kappa = prices.kappa
    by_class = np.argsort(layout.size, kind="stable")  # bags, smallest groups first
    cost = workload[pool]
    base = cost.sum()
    # A bag's room in the pool's own units (cost without Ulysses): its priced room over the
    # pool's mean inflation in that group.
    inflation = 1.0 + (kappa[by_class] + prices.inter) * at.sum() / base
    room = water_room(load[by_class], layout.weight[by_class], base, inflation)
    bags = by_class[pour_slots(cost, room)]
    step.bag[pool] = bags
    sent = prices.inter * at
    load = load + np.bincount(bags, weights=cost + kappa[bags] * at + sent, minlength=len(load))
    home = step.home_bag[pool]
    if home.min() < 0:  # (sources outside the partition send nothing from these bags)
        home, sent = home[home >= 0], sent[home >= 0]
    return load + np.bincount(home, weights=sent, minlength=len(load))


def _shave(step: Step, prices: Prices, known) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Take the lightest sequences out of every bag above the mean priced per-GPU time until
    it is at most that mean (sequences that fit any bag only), in one vectorised pass: the
    bulk passes of a large step leave whole size classes above or below the mean, which a
    few exchanges cannot even out. Returns them, unplaced (bag -1), heaviest first, and the
    (price, sent) of every sequence before (`priced_loads`; ``known``: as it takes it)."""
    layout = step.layout
    price, load, sent = priced_loads(step, prices, known)
    mean = float(load.sum() / layout.weight.sum())
    excess = load - mean * layout.weight
    over = excess > 0
    if step.bag.min(initial=0) >= 0:  # every sequence placed: one gather of bags' flags
        movable = over[step.bag]
    else:
        movable = (step.bag >= 0) & over[np.maximum(step.bag, 0)]
    movable &= step.lengths >= layout.class_size[-1]
    seqs = np.flatnonzero(movable)
    if seqs.size == 0:
        return seqs, (price, sent)
    order = by_home_heaviest_first(
        seqs, step.bag, -step.workload, len(layout.size), partial(step.ranks, lightest=True)
    )
    bags = step.bag[order]
    # Lightest first within each bag, while the middle of each one's running price stays
    # within the bag's excess (the nearest cut: sequences often outweigh the excess).
    cost = price[order]
    out = order[prefix_within_groups(cost, bags, excess[bags] + 0.5 * cost)]
    step.bag[out] = -1
    return descending(step.workload, out, step), (price, sent)
