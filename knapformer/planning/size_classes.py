"""A coarse large step's size classes brought to the mean (`even_classes`): the first of
its last passes (coarse.py), many disjoint exchanges between the size classes a round."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import Step, run_heads
from knapformer.planning.moves import move
from knapformer.planning.pricing import Prices, bag_makespan, priced_per_gpu
from knapformer.planning.token_cap import within_token_cap
from knapformer.planning.tuning import EVEN_BAND, EVEN_OFFERS, EVEN_ROUNDS, EVEN_TRIES


def even_classes(step: Step, prices: Prices, max_tokens):
    """Bring the bags of the smaller groups into the band [mean, mean + band] of per-GPU
    time, in a few vectorised rounds (``band``: ``EVEN_BAND`` of the mean; at most
    ``EVEN_ROUNDS``, and none started once ``EVEN_OFFERS`` offers have been priced).

    A g-GPU bag takes a sequence's cost over g GPUs, so placement leaves the bags of one
    GPU scattered by up to a whole sequence around the mean while the largest groups,
    which take 1/g of each, sit above it on average: no exchange of the top bag alone
    evens that out. Here every smaller bag outside the band swaps one of its sequences
    for (or takes) one of a largest-group bag's, or of a smaller bag above the band, whose
    cost brings it into the band, as close to its top as it gets: load moves between the
    size classes in steps as fine as the differences between sequences, not their sizes.
    Candidates are found by bisection on their cost (`_even_offers`), then priced exactly
    (`_even_scores`); each bag and sequence takes part in one exchange a round
    (`_even_apply`). Returns the bag-level makespan (`bag_makespan`) of the step as it was
    handed in, and the last round's prices as `priced_loads` takes them (``known``: only
    the sequences moved since are priced again; None where there are no smaller groups).
    """
    layout = step.layout
    size, kappa = layout.size, prices.kappa
    if not (size < size.max()).any():
        return bag_makespan(step, prices), None
    kappa_of = {int(g): float(kappa[int(np.argmax(size == g))]) for g in layout.class_size}
    # Each class's candidates by cost, sorted once: a round takes those in its pool.
    by_cost = {
        g: _by_cost(step, g, kappa_of[g] + prices.inter) for g in layout.class_size[:-1].tolist()
    }
    handed, known, priced = None, None, 0
    for _ in range(EVEN_ROUNDS):
        if priced >= EVEN_OFFERS:
            break
        band = _Band(step, prices, known, max_tokens is not None)
        handed = float(band.per.max()) if handed is None else handed
        moved = []
        for g in layout.class_size[:-1].tolist():
            offers = _even_offers(step, band, g, by_cost[g])
            if offers is None:
                continue
            good, new_b, a, big = _even_scores(step, prices, band, offers, max_tokens)
            priced += len(good)
            if good.any():
                moved.append(_even_apply(step, band, offers, good, new_b, a,
                                         big & (max_tokens is None)))  # fmt: skip
        # The next round prices again only the sequences this one moved.
        known = (band.price, band.sent, np.concatenate(moved) if moved else np.empty(0, int))
        if not moved:
            break
    return handed, known


class _Band:
    """One `even_classes` round as it starts: each sequence's price and what its home bag
    pays to send it, each bag's per-GPU time and (under a token cap) tokens, the band's
    top (``target``) and width, the bags outside it, and the pool (``in_pool``, by
    sequence) a smaller bag may take from (the sequences of the largest groups' bags and of
    the bags above the band; each leaves it once taken)."""

    def __init__(self, step: Step, prices: Prices, known, capped: bool):
        size, weight = step.layout.size, step.layout.weight
        self.price, load, self.per, self.sent = priced_per_gpu(step, prices, known)
        mean = float(load.sum() / weight.sum())
        self.band = EVEN_BAND * mean
        self.target = mean + self.band
        self.live = live = step.lengths > 0
        self.bag_of = bag_of = np.where(live, step.bag, 0)
        per, target = self.per, self.target
        self.outside = (per < target - self.band) | (per > target)
        above = (size == size.max()) | (per > target)
        self.in_pool = live & above[bag_of]
        self.lengths = step.lengths.astype(np.float64)
        self.tokens = None
        if capped:
            weights = np.where(live, self.lengths, 0.0)
            self.tokens = np.bincount(bag_of, weights=weights, minlength=len(size))


def _by_cost(step: Step, g: int, per_token: float):
    """(sequences, each one's run of equal costs, each run's first position and its cost):
    every sequence a ``g``-GPU bag may take, by its cost there (priced as in a g-GPU bag of
    another node, ``per_token`` its tokens' cost), ties in id order."""
    seqs = np.flatnonzero((step.lengths > 0) & (step.lengths >= g))
    key = step.workload[seqs] + per_token * step.lengths[seqs].astype(np.float64)
    order = np.argsort(key, kind="stable")
    key = key[order]
    new = run_heads(key)
    starts = np.flatnonzero(new)
    return seqs[order], np.cumsum(new) - 1, starts, key[starts]


def _even_offers(step: Step, band: _Band, g: int, by_cost):
    """(j, b, i) of the exchanges worth pricing for the ``g``-GPU bags outside the band:
    taker ``b`` gives its sequence ``j`` (-1: nothing, a move) for the pool's sequence
    ``i``, one of the ``EVEN_TRIES`` nearest distinct costs that bring ``b`` into the band
    (``by_cost``: `_by_cost`; of equal costs, the least loaded donor's, then the lowest id).
    None when there is none."""
    size, bag, per, price = step.layout.size, step.bag, band.per, band.price
    takers = np.flatnonzero((size == g) & band.outside)
    seqs, run, starts, run_cost = by_cost
    if not takers.size or not seqs.size:
        return None
    load = np.where(band.in_pool[seqs], per[bag[seqs]], np.inf)  # inf: not in the pool
    first = _least_loaded_of_each_cost(load, run, starts)
    if not first.size:
        return None
    run_key, first = run_cost[run[first]], seqs[first]
    is_taker = np.zeros(len(size), dtype=bool)
    is_taker[takers] = True
    mine = np.flatnonzero(band.live & is_taker[band.bag_of])
    # Each taker's sequences, and one empty slot per taker (a move, not a swap).
    j = np.concatenate([mine, np.full(len(takers), -1)])
    b = np.concatenate([bag[mine], takers])
    out_j = np.concatenate([price[mine], np.zeros(len(takers))])
    weight = step.layout.weight[b]
    lo = out_j + (band.target - band.band - per[b]) * weight
    hi = out_j + (band.target - per[b]) * weight
    u = (np.searchsorted(run_key, hi, "right") - 1)[:, None] - np.arange(EVEN_TRIES)
    at = np.maximum(u, 0)
    ok = (u >= 0) & (run_key[at] >= lo[:, None]) & (bag[first][at] != b[:, None])
    flat = np.flatnonzero(ok)  # row by row, as np.nonzero
    if not flat.size:
        return None
    rows = flat // EVEN_TRIES
    return j[rows], b[rows], first[at.ravel()[flat]]


def _least_loaded_of_each_cost(load: np.ndarray, run: np.ndarray, starts: np.ndarray):
    """The position of the least ``load`` of each run of equal costs (``run``: each
    position's, ``starts``: each run's first position), the first of equal ones, in run
    order; runs whose loads are all inf (nothing in the pool) have none."""
    least = np.minimum.reduceat(load, starts)
    least[least == np.inf] = np.nan  # equal to no load
    at_least = np.flatnonzero(load == least[run])
    return at_least[np.flatnonzero(np.diff(run[at_least], prepend=-1))]


def _even_scores(step: Step, prices: Prices, band: _Band, offers, max_tokens):
    """(good, new_b, a, big) of ``offers`` (`_even_offers`) priced exactly (`Prices`):
    whether each may be made, the taker's per-GPU time after it, the donor bag and whether
    it is of the largest size. A taker must end nearer the band's top and within the band;
    a donor of the largest size may not end above the top unless it already was, a
    smaller one must end nearer it."""
    size, weight, per, price = step.layout.size, step.layout.weight, band.per, band.price
    j, b, i = offers
    lengths = band.lengths
    jj = np.maximum(j, 0)
    a = step.bag[i]
    into_a = np.where(j >= 0, prices.cost(step, lengths, jj, a)[0], 0.0)
    out_j = np.where(j >= 0, price[jj], 0.0)
    new_b = per[b] + (prices.cost(step, lengths, i, b)[0] - out_j) / weight[b]
    new_a = per[a] + (into_a - price[i]) / weight[a]
    big = size[a] == size.max()
    target = band.target
    good = (np.abs(new_b - target) < np.abs(per[b] - target)) & (new_b <= target + band.band)
    good &= (j < 0) | (step.lengths[jj] >= size[a])
    good &= np.where(big, new_a <= np.maximum(per[a], target),
                     np.abs(new_a - target) < np.abs(per[a] - target))  # fmt: skip
    if max_tokens is not None:
        shift = lengths[i] - np.where(j >= 0, lengths[jj], 0.0)
        good &= within_token_cap(band.tokens, size, a, b, shift, max_tokens)
    return good, new_b, a, big


def _even_apply(step: Step, band: _Band, offers, good, new_b, a, shared) -> np.ndarray:
    """Make the ``good`` offers closest to the band's top first, each bag in one (a donor
    ``shared``, of the largest size without a token cap, in several) and each sequence
    moved once; the sequences taken leave the pool. Returns the sequences moved."""
    j, b, i = offers
    sel = np.flatnonzero(good)
    sel = sel[np.argsort(np.abs(new_b[sel] - band.target), kind="stable")]
    sel = _disjoint(sel, b, a, i, shared, len(step.layout.size))
    swap = sel[j[sel] >= 0]
    seqs = np.concatenate([j[swap], i[sel]])
    # Nothing charged: the next round prices the moved sequences anew (`_Band`).
    move(step.bag, None, seqs, np.concatenate([a[swap], b[sel]]))
    band.in_pool[i[sel]] = False
    return seqs


def _disjoint(sel, b, a, i, shared, num_bags) -> np.ndarray:
    """The exchanges ``sel`` (best first) that touch disjoint bags and sequences: each taker
    ``b`` and sequence ``i`` takes part in one; a donor ``a`` too, unless ``shared`` (a
    largest-group donor, which may give to several)."""
    sel = sel[_first_each(b[sel])]
    sel = sel[_first_each(i[sel])]
    used = [False] * num_bags  # a list: read item by item, faster than an array
    keep = []
    for k, bk, ak, sh in zip(sel.tolist(), b[sel].tolist(), a[sel].tolist(),
                             shared[sel].tolist(), strict=True):  # fmt: skip
        if used[bk] or (used[ak] and not sh):
            continue
        used[bk] = True
        if not sh:
            used[ak] = True
        keep.append(k)
    return np.asarray(keep, dtype=np.int64)


def _first_each(values: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each distinct value of ``values``, in order."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    return np.sort(order[run_heads(v)])
