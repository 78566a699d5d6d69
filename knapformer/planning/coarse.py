"""The last passes of a *coarse* large step (few sequences per GPU, many GPUs in small
groups): the size classes brought to the mean (`_even_classes`), then many disjoint
exchanges a round (`_level`)."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import (
    Step,
    least,
)
from knapformer.planning.exchanges import exchange_across
from knapformer.planning.pricing import Prices, bag_makespan, priced_loads, sender_extra
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
        step.bag[:] = before
        if max_tokens is not None:
            lengths = step.lengths.astype(np.float64)
            step.layout.bag_tokens[:] = np.bincount(before, weights=lengths,
                                                    minlength=len(step.layout.size))  # fmt: skip
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

    for round_ in range(LEVEL_ROUNDS + 1):
        price, load, sent = priced_loads(step, prices)
        per = load / weight + sender_extra(step, sent)
        top = float(per.max())
        if top < best_top * (1 - TIE):
            best_bag, best_top = step.bag.copy(), top
        mean = float(load.sum() / weight.sum())
        if round_ == LEVEL_ROUNDS or top <= floor * (1 + FLOOR_STOP):
            break
        paired = _donors_and_takers(per, mean)
        if paired is None:
            break
        donors, takers = paired
        k, p = takers.shape
        # Each bag's members, lightest first, and a spread sample of them per bag.
        key = step.bag[by_weight]  # a stable sort of small ints is a radix sort
        order = by_weight[np.argsort(key.astype(np.int16) if num_bags < 2**15 else key,
                                     kind="stable")]  # fmt: skip
        cuts = np.searchsorted(step.bag[order], np.arange(num_bags + 1))
        ma = _member_sample(order, cuts, donors, LEVEL_MEMBERS)  # (k, s)
        mb = _member_sample(order, cuts, takers.ravel(), LEVEL_MEMBERS)
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
        gain = value[np.arange(k), pick] < per[donors] * (1 - TIE)
        if not gain.any():
            break
        _apply_picks(step, tokens, lengths, ma, mb, donors, takers, pick, gain)
    step.bag[:] = best_bag
    if max_tokens is not None:
        layout.bag_tokens[:] = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    return best_top


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


def _apply_picks(step, tokens, lengths, ma, mb, donors, takers, pick, gain) -> None:
    """Apply each donor's picked exchange where it ``gain``s: ``pick`` indexes its flattened
    (member of the donor, taker, member of the taker or nothing) scores."""
    pp, t = mb.shape[1:]
    i, rest = np.divmod(pick, pp * t)
    j, q = np.divmod(rest, t)
    rows = np.arange(len(donors))
    x, y = ma[rows, i][gain], mb[rows, j, q][gain]
    a, b = donors[gain], takers[rows, j][gain]
    step.bag[x] = b
    np.add.at(tokens, a, -lengths[x])
    np.add.at(tokens, b, lengths[x])
    swap = y >= 0
    step.bag[y[swap]] = a[swap]
    np.add.at(tokens, b[swap], -lengths[y[swap]])
    np.add.at(tokens, a[swap], lengths[y[swap]])


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
    Candidates are found by bisection on their cost (the ``EVEN_TRIES`` nearest distinct
    costs, the least loaded donor of each), then priced exactly (`Prices`); a donor of
    the largest size may not end above the band's top unless it already was, a smaller
    one must end nearer the band. Each bag and sequence takes part in one exchange a round.
    Returns the bag-level makespan (`bag_makespan`) of the step as it was handed in.
    """
    layout = step.layout
    size, weight, kappa = layout.size, layout.weight, prices.kappa
    top_size = int(size.max())
    if not (size < top_size).any():
        return bag_makespan(step, prices)
    lengths = step.lengths.astype(np.float64)
    workload = step.workload
    num_bags = len(size)
    live = step.lengths > 0
    kappa_of = {int(g): float(kappa[int(np.argmax(size == g))]) for g in layout.class_size}

    def priced(seq, bag):
        return prices.cost(step, lengths, seq, bag)[0]

    handed = None
    for _ in range(EVEN_ROUNDS):
        price, load, sent = priced_loads(step, prices)
        per = load / weight + sender_extra(step, sent)
        handed = float(per.max()) if handed is None else handed
        mean = float(load.sum() / weight.sum())
        band = EVEN_BAND * mean
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
            u = (np.searchsorted(key[run], hi, "right") - 1)[:, None] - np.arange(EVEN_TRIES)
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
            sel = _disjoint(sel, b, a, i, big & (max_tokens is None), num_bags)
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
