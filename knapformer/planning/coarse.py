"""The last passes of a *coarse* large step (few sequences per GPU, many GPUs in small
groups): the size classes brought to the mean (`_even_classes`), then many disjoint
exchanges a round (`_level`)."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import (
    Step,
    least,
)
from knapformer.planning.exchanges import exchange_across, member_samples
from knapformer.planning.moves import Tokens, move
from knapformer.planning.pricing import Prices, bag_makespan, priced_loads, sender_extra
from knapformer.planning.token_cap import within_token_cap
from knapformer.planning.tuning import (
    COARSE_PER_GPU,
    COARSE_SHARE,
    EVEN_BAND,
    EVEN_ROUNDS,
    EVEN_TRIES,
    FLOOR_STOP,
    LEVEL_DONORS,
    LEVEL_MEMBERS,
    LEVEL_PARTNERS,
    LEVEL_ROUNDS,
    SMALL_GPUS,
    SMALL_SEQUENCES,
    TIE,
)


def is_coarse(step: Step, placed: int) -> bool:
    """A large step whose GPUs hold few sequences each (at most ``COARSE_PER_GPU``) and
    whose smaller groups hold at least ``COARSE_SHARE`` of the GPUs: a one-GPU bag there
    takes whole sequences of many milliseconds, which the placement cannot even out
    finely and one exchange at a time cannot either (`even_out`). Where GPUs hold many
    short sequences, the pour and the exchange pass already reach the mean."""
    layout = step.layout
    num_gpus = len(layout.shape.bag_of_pos)
    if placed <= SMALL_SEQUENCES and len(layout.size) <= SMALL_GPUS:
        return False  # a small step is refined exactly instead (`refine`)
    smaller = int(layout.size[layout.size < layout.size.max()].sum())
    return placed <= COARSE_PER_GPU * num_gpus and smaller >= COARSE_SHARE * num_gpus


def even_out(step: Step, prices: Prices, floor: float, max_tokens) -> None:
    """The coarse step's last passes: the size classes brought to the mean
    (`_even_classes`), then many disjoint exchanges between the most and the least loaded
    bags (`_level`). Where that leaves the bag-level makespan above what placement
    reached, placement's assignment is kept and `exchange_across` runs on it instead."""
    before = step.bag.copy()
    top = _even_classes(step, prices, max_tokens)
    if _level(step, prices, floor, max_tokens) > top * (1 + TIE):
        _restore(step, before, max_tokens)
        exchange_across(step, prices, floor, max_tokens)


def _level(step: Step, prices: Prices, floor: float, max_tokens) -> float:
    """Final leveling of a large step, many disjoint exchanges a round: the ``LEVEL_DONORS``
    most loaded bags above the mean each get ``LEVEL_PARTNERS`` of the least loaded bags
    (the most loaded donor the least loaded ones, dealt round-robin: no bag serves two
    donors) and move one sequence to, or swap one with, whichever of them evens the two
    out best, while that lowers the larger of the two below the donor. Sequences are
    re-priced at their new bags (`Prices`); a bag's slowest GPU counts its sending
    (`sender_extra`). The best assignment seen (by the bag-level makespan) is kept;
    returns its bag-level makespan."""
    layout = step.layout
    num_bags = len(layout.size)
    lengths = step.lengths.astype(np.float64)
    tokens = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    by_weight = _lightest_first(step, np.flatnonzero(step.lengths > 0))
    best_bag, best_top, known = None, np.inf, None
    for round_ in range(LEVEL_ROUNDS + 1):
        price, load, per, sent = _per_gpu(step, prices, known)
        top = float(per.max())
        if top < best_top * (1 - TIE):
            best_bag, best_top = step.bag.copy(), top
        mean = float(load.sum() / layout.weight.sum())
        if round_ == LEVEL_ROUNDS or top <= floor * (1 + FLOOR_STOP):
            break
        paired = _donors_and_takers(per, mean)
        if paired is None:
            break
        donors, takers = paired
        ma, mb = _level_members(step, by_weight, donors, takers)
        value = _exchange_values(step, prices, (price, per, tokens), ma, mb, paired, max_tokens)
        pick = value.argmin(axis=1)
        gain = value[np.arange(len(donors)), pick] < per[donors] * (1 - TIE)
        if not gain.any():
            break
        moved = _apply_picks(step, tokens, lengths, ma, mb, donors, takers, pick, gain)
        known = (price, sent, moved)  # only the moved ones are priced again
    _restore(step, best_bag, max_tokens)
    return best_top


def _lightest_first(step: Step, seqs: np.ndarray) -> np.ndarray:
    """``seqs`` by workload, lightest first, ties by position: a radix sort of the step's
    shared ranks (`Step.ranks`) where there are few distinct workloads."""
    rank, distinct = step.ranks(lightest=True)
    if distinct <= 2**15:
        return seqs[np.argsort(rank[seqs].astype(np.int16), kind="stable")]
    return seqs[np.argsort(step.workload[seqs], kind="stable")]


def _restore(step: Step, bag: np.ndarray, max_tokens) -> None:
    """Put the step back to the assignment ``bag``; under a token cap its bags' token
    counts too (what the later passes check the cap by)."""
    step.bag[:] = bag
    if max_tokens is not None:
        lengths = step.lengths.astype(np.float64)
        step.layout.bag_tokens[:] = np.bincount(bag, weights=lengths,
                                                minlength=len(step.layout.size))  # fmt: skip


def _per_gpu(step: Step, prices: Prices, known=None):
    """(each sequence's price, each bag's priced load, each bag's per-GPU time, what each
    sequence's home bag pays to send it): the load spread over the bag's GPUs plus what its
    slowest GPU pays to send (`sender_extra`). ``known``: as `priced_loads` takes it."""
    price, load, sent = priced_loads(step, prices, known)
    return price, load, load / step.layout.weight + sender_extra(step, sent), sent


def _level_members(step: Step, by_weight: np.ndarray, donors: np.ndarray, takers: np.ndarray):
    """(ma (k, s), mb (k, p, s + 1)) of a `_level` round: a spread sample of each donor's
    and each taker's members (`member_samples`), lightest first, -1 padding; each taker's
    row ends with an empty slot (a move, not a swap)."""
    num_bags = len(step.layout.size)
    # Only the members of the round's bags are ordered (the same runs as ordering all).
    needed = np.zeros(num_bags, dtype=bool)
    needed[donors] = needed[takers.ravel()] = True
    mine = by_weight[needed[step.bag[by_weight]]]
    key = step.bag[mine]  # a stable sort of small ints is a radix sort
    order = mine[np.argsort(key.astype(np.int16) if num_bags < 2**15 else key, kind="stable")]
    cuts = np.searchsorted(step.bag[order], np.arange(num_bags + 1))
    k, p = takers.shape
    ma = member_samples(order, cuts, donors, LEVEL_MEMBERS)
    mb = member_samples(order, cuts, takers.ravel(), LEVEL_MEMBERS)
    return ma, np.concatenate([mb, np.full((len(mb), 1), -1)], axis=1).reshape(k, p, -1)


def _exchange_values(step, prices, loads, ma, mb, paired, max_tokens) -> np.ndarray:
    """(k, s * p * t) the larger per-GPU time of donor and taker after each exchange of a
    `_level` round (inf where a sequence would be shorter than its new group, or a token
    cap breaks): donor member i of ``ma`` to taker j, with taker j's member q of ``mb``
    back (or nothing). ``loads``: (price, per-GPU time, tokens) before the round."""
    size, weight = step.layout.size, step.layout.weight
    price, per, tokens = loads
    donors, takers = paired
    lengths = step.lengths.astype(np.float64)
    ra, rb = ma >= 0, mb >= 0
    mai, mbi = np.maximum(ma, 0), np.maximum(mb, 0)
    a_, b_ = donors[:, None, None, None], takers[:, None, :, None]  # (k, 1, 1|p, 1)
    into_b = prices.cost(step, lengths, mai[:, :, None, None], b_)[0]  # (k, s, p, 1)
    into_a = np.where(rb, prices.cost(step, lengths, mbi, donors[:, None, None])[0], 0.0)
    out_a = np.where(ra, price[mai], 0.0)[:, :, None, None]
    out_b = np.where(rb, price[mbi], 0.0)[:, None]
    new_a = per[a_] + (into_a[:, None] - out_a) / weight[a_]  # into_a: (k, 1, p, t)
    new_b = per[b_] + (into_b - out_b) / weight[b_]
    li = lengths[mai][:, :, None, None]
    lj = np.where(rb, lengths[mbi], 0.0)[:, None]
    ok = ra[:, :, None, None] & (li >= size[b_]) & ((lj >= size[a_]) | ~rb[:, None])
    if max_tokens is not None:
        ok &= within_token_cap(tokens, size, a_, b_, li - lj, max_tokens)
    return np.where(ok, np.maximum(new_a, new_b), np.inf).reshape(len(donors), -1)


def _donors_and_takers(per: np.ndarray, mean: float):
    """(donors (k,), takers (k, p)) of a `_level` round: the ``LEVEL_DONORS`` most loaded
    bags above the mean, each dealt ``LEVEL_PARTNERS`` of the least loaded bags
    round-robin (donor d gets takers d, d+k, ...: no bag serves two donors); None when
    there is no pair."""
    donors = least(-per, LEVEL_DONORS)
    donors = donors[per[donors] > mean]
    takers = least(per, len(donors) * (LEVEL_PARTNERS + 1))
    is_donor = np.zeros(len(per), dtype=bool)
    is_donor[donors] = True
    takers = takers[~is_donor[takers]][: len(donors) * LEVEL_PARTNERS]
    k = min(len(donors), len(takers))
    if k == 0:
        return None
    p = len(takers) // k
    return donors[:k], takers[: k * p].reshape(p, k).T


def _apply_picks(step, tokens, lengths, ma, mb, donors, takers, pick, gain) -> np.ndarray:
    """Apply each donor's picked exchange where it ``gain``s: ``pick`` indexes its flattened
    (member of the donor, taker, member of the taker or nothing) scores. ``tokens``: each
    bag's, charged. Returns the sequences moved."""
    pp, t = mb.shape[1:]
    i, rest = np.divmod(pick, pp * t)
    j, q = np.divmod(rest, t)
    rows = np.arange(len(donors))
    x, y = ma[rows, i][gain], mb[rows, j, q][gain]
    a, b = donors[gain], takers[rows, j][gain]
    swap = y >= 0
    seqs = np.concatenate([x, y[swap]])
    move(step.bag, Tokens(tokens, lengths), seqs, np.concatenate([b, a[swap]]))
    return seqs


def _even_classes(step: Step, prices: Prices, max_tokens) -> float:
    """Bring the bags of the smaller groups into the band [mean, mean + band] of per-GPU
    time, in a few vectorised rounds (``band``: ``EVEN_BAND`` of the mean).

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
    handed in.
    """
    layout = step.layout
    size, kappa = layout.size, prices.kappa
    if not (size < size.max()).any():
        return bag_makespan(step, prices)
    kappa_of = {int(g): float(kappa[int(np.argmax(size == g))]) for g in layout.class_size}
    # Each class's candidates by cost, sorted once: a round takes those in its pool.
    by_cost = {
        g: _by_cost(step, g, kappa_of[g] + prices.inter) for g in layout.class_size[:-1].tolist()
    }
    handed = None
    for _ in range(EVEN_ROUNDS):
        band = _Band(step, prices)
        handed = float(band.per.max()) if handed is None else handed
        changed = False
        for g in layout.class_size[:-1].tolist():
            offers = _even_offers(step, band, g, by_cost[g])
            if offers is None:
                continue
            good, new_b, a, big = _even_scores(step, prices, band, offers, max_tokens)
            if good.any():
                _even_apply(step, band, offers, good, new_b, a, big & (max_tokens is None))
                changed = True
        if not changed:
            break
    return handed


class _Band:
    """One `_even_classes` round as it starts: each sequence's price, each bag's per-GPU
    time and tokens, the band's top (``target``) and width, the bags outside it, and the
    ``pool`` of sequences a smaller bag may take (those of the largest groups' bags and of
    the bags above the band; each leaves it once taken)."""

    def __init__(self, step: Step, prices: Prices):
        size, weight = step.layout.size, step.layout.weight
        self.price, load, self.per, _ = _per_gpu(step, prices)
        mean = float(load.sum() / weight.sum())
        self.band = EVEN_BAND * mean
        self.target = mean + self.band
        self.live = live = step.lengths > 0
        self.bag_of = bag_of = np.where(live, step.bag, 0)
        per, target = self.per, self.target
        self.outside = (per < target - self.band) | (per > target)
        above = (size == size.max()) | (per > target)
        self.pool = np.flatnonzero(live & above[bag_of])
        weights = np.where(live, step.lengths.astype(np.float64), 0.0)
        self.tokens = np.bincount(bag_of, weights=weights, minlength=len(size))


def _by_cost(step: Step, g: int, per_token: float) -> tuple[np.ndarray, np.ndarray]:
    """(sequences, their costs): every sequence a ``g``-GPU bag may take, by its cost there
    (priced as in a g-GPU bag of another node, ``per_token`` its tokens' cost), ties in id
    order."""
    seqs = np.flatnonzero((step.lengths > 0) & (step.lengths >= g))
    key = step.workload[seqs] + per_token * step.lengths[seqs].astype(np.float64)
    order = np.argsort(key, kind="stable")
    return seqs[order], key[order]


def _even_offers(step: Step, band: _Band, g: int, by_cost):
    """(j, b, i) of the exchanges worth pricing for the ``g``-GPU bags outside the band:
    taker ``b`` gives its sequence ``j`` (-1: nothing, a move) for the pool's sequence
    ``i``, one of the ``EVEN_TRIES`` nearest distinct costs that bring ``b`` into the band
    (``by_cost``: `_by_cost`; of equal costs, the least loaded donor's, then the lowest id).
    None when there is none."""
    size, bag, per, price = step.layout.size, step.bag, band.per, band.price
    takers = np.flatnonzero((size == g) & band.outside)
    in_pool = np.zeros(len(bag), dtype=bool)
    in_pool[band.pool] = True
    seqs, costs = by_cost
    taken = in_pool[seqs]
    cand, key = seqs[taken], costs[taken]
    if not takers.size or not cand.size:
        return None
    run_key, first = _least_loaded_of_each_cost(key, per[bag[cand]])
    first = cand[first]
    is_taker = np.zeros(len(size), dtype=bool)
    is_taker[takers] = True
    mine = np.flatnonzero(band.live & is_taker[band.bag_of])
    # Each taker's sequences, and one empty slot per taker (a move, not a swap).
    j = np.concatenate([mine, np.full(len(takers), -1)])
    b = np.concatenate([bag[mine], takers])
    out_j = np.where(j >= 0, price[np.maximum(j, 0)], 0.0)
    weight = step.layout.weight[b]
    lo = out_j + (band.target - band.band - per[b]) * weight
    hi = out_j + (band.target - per[b]) * weight
    u = (np.searchsorted(run_key, hi, "right") - 1)[:, None] - np.arange(EVEN_TRIES)
    at = np.maximum(u, 0)
    ok = (u >= 0) & (run_key[at] >= lo[:, None]) & (bag[first[at]] != b[:, None])
    rows, cols = np.nonzero(ok)
    if not rows.size:
        return None
    return j[rows], b[rows], first[at[rows, cols]]


def _least_loaded_of_each_cost(key: np.ndarray, load: np.ndarray):
    """(each distinct value of ``key`` (sorted), the position of its least ``load``, the
    first of equal ones): the first of each run of ``np.lexsort((load, key))``."""
    new = np.empty(len(key), dtype=bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    run = np.cumsum(new) - 1
    least_load = np.minimum.reduceat(load, starts)
    at_least = np.flatnonzero(load == least_load[run])
    return key[starts], at_least[np.flatnonzero(np.diff(run[at_least], prepend=-1))]


def _even_scores(step: Step, prices: Prices, band: _Band, offers, max_tokens):
    """(good, new_b, a, big) of ``offers`` (`_even_offers`) priced exactly (`Prices`):
    whether each may be made, the taker's per-GPU time after it, the donor bag and whether
    it is of the largest size. A taker must end nearer the band's top and within the band;
    a donor of the largest size may not end above the top unless it already was, a
    smaller one must end nearer it."""
    size, weight, per, price = step.layout.size, step.layout.weight, band.per, band.price
    j, b, i = offers
    lengths = step.lengths.astype(np.float64)
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


def _even_apply(step: Step, band: _Band, offers, good, new_b, a, shared) -> None:
    """Make the ``good`` offers closest to the band's top first, each bag in one (a donor
    ``shared``, of the largest size without a token cap, in several) and each sequence
    moved once; the sequences taken leave the pool."""
    j, b, i = offers
    sel = np.flatnonzero(good)
    sel = sel[np.argsort(np.abs(new_b[sel] - band.target), kind="stable")]
    sel = _disjoint(sel, b, a, i, shared, len(step.layout.size))
    swap = sel[j[sel] >= 0]
    # Nothing charged: the next round prices every bag anew (`_Band`).
    move(step.bag, None, np.concatenate([j[swap], i[sel]]), np.concatenate([a[swap], b[sel]]))
    moved = np.zeros(len(band.live), dtype=bool)
    moved[i[sel]] = True
    band.pool = band.pool[~moved[band.pool]]


def _disjoint(sel, b, a, i, shared, num_bags) -> np.ndarray:
    """The exchanges ``sel`` (best first) that touch disjoint bags and sequences: each taker
    ``b`` and sequence ``i`` takes part in one; a donor ``a`` too, unless ``shared`` (a
    largest-group donor, which may give to several)."""
    sel = sel[_first_each(b[sel])]
    sel = sel[_first_each(i[sel])]
    used = np.zeros(num_bags, dtype=bool)
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
    return np.sort(order[np.concatenate([[True], v[1:] != v[:-1]])]) if len(v) else order
