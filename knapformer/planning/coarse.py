"""The last passes of a *coarse* large step (few sequences per GPU, many GPUs in small
groups): the size classes brought to the mean (`even_classes`, size_classes.py), then
many disjoint exchanges a round (`_level`)."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import (
    Step,
    least,
)
from knapformer.planning.exchanges import exchange_across, member_samples
from knapformer.planning.moves import Tokens, move
from knapformer.planning.pricing import Prices, priced_per_gpu
from knapformer.planning.size_classes import even_classes
from knapformer.planning.token_cap import within_token_cap
from knapformer.planning.tuning import (
    COARSE_PER_GPU,
    COARSE_SHARE,
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
    (`even_classes`), then many disjoint exchanges between the most and the least loaded
    bags (`_level`). Where that leaves the bag-level makespan above what placement
    reached, placement's assignment is kept and `exchange_across` runs on it instead."""
    before = step.bag.copy()
    top, known = even_classes(step, prices, max_tokens)
    if _level(step, prices, floor, max_tokens, known) > top * (1 + TIE):
        _restore(step, before, max_tokens)
        exchange_across(step, prices, floor, max_tokens)


def _level(step: Step, prices: Prices, floor: float, max_tokens, known=None) -> float:
    """Final leveling of a large step, many disjoint exchanges a round: the ``LEVEL_DONORS``
    most loaded bags above the mean each get ``LEVEL_PARTNERS`` of the least loaded bags
    (the most loaded donor the least loaded ones, dealt round-robin: no bag serves two
    donors) and move one sequence to, or swap one with, whichever of them evens the two
    out best, while that lowers the larger of the two below the donor. Sequences are
    re-priced at their new bags (`Prices`); a bag's slowest GPU counts its sending
    (`sender_extra`). The best assignment seen (by the bag-level makespan) is kept;
    returns its bag-level makespan. ``known``: as `priced_loads` takes it."""
    layout = step.layout
    num_bags = len(layout.size)
    lengths = step.lengths.astype(np.float64)
    tokens = np.bincount(step.bag, weights=lengths, minlength=num_bags)
    by_weight = _lightest_first(step, np.flatnonzero(step.lengths > 0))
    best_bag, best_top = None, np.inf
    for round_ in range(LEVEL_ROUNDS + 1):
        price, load, per, sent = priced_per_gpu(step, prices, known)
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
