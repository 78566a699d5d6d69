"""The fixed-topology solver's local search on the makespan (`level_makespan`): moves and
swaps between the most loaded bags and the least loaded ones, in narrow rounds (a few
bags each, `_best_exchanges`) and, in a step of many bags, wide rounds first (every
over-loaded bag paired at once, `_level_in_pairs`). Plans of fixed topologies are
byte-identical across versions, so every change here must keep them so (docs/planning.md).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from knapformer.contract.stats import lower_bound
from knapformer.planning.bags import Step, by_small_key, least
from knapformer.planning.moves import Loads, move
from knapformer.planning.tuning import (
    DENSE_CELLS,
    EPS,
    SEARCH_PARTNERS,
    SEARCH_TOLERANCE,
    WIDE_BAGS,
    WIDE_BLOCK,
    WIDE_ROUNDS,
)


def level_makespan(step: Step, max_rounds: int | None = None, tolerance=None) -> None:
    """Local search on the makespan. Each round, every bag above the stopping load (up
    to ``SEARCH_PARTNERS`` of them, most loaded first) is paired with a distinct one of
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
    stop = lower_bound(step.workload, weight) * (1 + (tolerance or SEARCH_TOLERANCE))
    if per_gpu.max() <= stop:  # the usual case: nothing to level
        return
    accepts = layout.capacity * (1 + EPS)  # the largest workload each bag may take
    members = _Members(step.bag, step.lengths, step.workload, num_bags)
    one_size = len(layout.class_size) == 1
    loads = Loads(step)
    if num_bags > WIDE_BAGS and one_size and layout.max_tokens is None:
        _level_in_pairs(step, loads, members, stop)
        per_gpu = layout.per_gpu_time()
    for _ in range(4 * num_bags if max_rounds is None else max_rounds):
        num_over = min(int(np.count_nonzero(per_gpu > stop)), SEARCH_PARTNERS)
        # The ends of the stable ascending order, without sorting every bag: the most
        # loaded (ties: the later bag first) and the least loaded that are not over.
        over = (num_bags - 1 - least(-per_gpu[::-1], num_over)).tolist()
        partners = least(per_gpu, min(SEARCH_PARTNERS, num_bags - num_over)).tolist()
        if not over or not partners:
            return
        moves = _best_exchanges(
            over, partners, members, layout.size, weight, per_gpu, accepts, one_size
        )
        if not moves:
            return
        for a, b, out_of_a, out_of_b in moves:
            # out_of_a to b, out_of_b (-1: nothing) to a; undone where it breaks the
            # token cap (rare; the cap wins over balance)
            seqs, dst = ([out_of_a], [b]) if out_of_b < 0 else ([out_of_a, out_of_b], [b, a])
            if not move(step.bag, loads, seqs, dst):
                return
            members.swap(a, b, out_of_a, out_of_b)
            per_gpu[a], per_gpu[b] = layout.load[a] / weight[a], layout.load[b] / weight[b]


def _level_in_pairs(step: Step, loads: Loads, members: _Members, stop: float) -> None:
    """Wide rounds, for a step of many bags (one bag size, no token cap), where rounds of
    a few bags would take thousands: every bag above the stopping load, most loaded
    first, is paired with one of as many least-loaded bags, in rank order, and every pair
    makes its best exchange at once (`_paired_exchanges`); at most ``WIDE_ROUNDS`` rounds,
    until few bags are over. The narrow rounds then finish."""
    layout = step.layout
    for _ in range(WIDE_ROUNDS):
        per_gpu = layout.per_gpu_time()
        over = np.flatnonzero(per_gpu > stop)
        k = min(len(over), len(per_gpu) - len(over))
        if k <= SEARCH_PARTNERS:
            return
        over = over[np.argsort(-per_gpu[over], kind="stable")[:k]]
        a, b, x, y = _paired_exchanges(over, least(per_gpu, k), members, layout.weight, per_gpu)
        if a.size == 0:
            return
        real = y < members.num_real  # a phantom: nothing comes back
        seqs, dst = np.concatenate([x, y[real]]), np.concatenate([b, a[real]])
        move(step.bag, loads, seqs, dst)  # (no token cap: nothing to undo)
        members.bag[seqs] = dst
        members.index()


def _paired_exchanges(over, partners, members, weight, per_gpu):
    """Per pair (``over[i]``, ``partners[i]``), the exchange that evens the two out best:
    a member leaving the over-loaded bag, and the partner's member whose workload is
    nearest the ideal coming back (its phantom: nothing). Returns (a, b, leaving a,
    leaving b) arrays of the pairs whose exchange lowers the larger of the two."""
    k = len(over)
    out, slot, back, back_slot = members.in_pairs(over, partners)
    w = members.workload
    # Each partner's members by workload, partners apart (as `_nearest_members` keys them).
    back_w = np.take(w, back)
    span = 2.0 * float(back_w.max(initial=0.0)) + 1.0
    key = back_slot * span
    key += back_w
    by_key = np.argsort(key, kind="stable")
    # Into back_w's buffer ("clip": the indices are valid, and "raise" would gather into a
    # temporary first); the sort's order is dropped at once: its memory serves the scores.
    key, back = np.take(key, by_key, out=back_w, mode="clip"), np.take(back, by_key)
    del by_key
    seg = np.searchsorted(key, np.arange(k + 1) * span)  # each partner's first; then the end
    score, came = _score_rows(out, slot, w, key, back, seg, span, weight[over],
                              weight[partners], per_gpu[over], per_gpu[partners])  # fmt: skip
    # Rows come grouped by pair (every pair has one: the bag's phantom): each pair's first
    # row of its least score.
    starts = np.searchsorted(slot, np.arange(k))
    least_score = np.minimum.reduceat(score, starts)
    rows = np.flatnonzero((score == least_score[slot]) & np.isfinite(score))
    best = rows[np.flatnonzero(np.diff(slot[rows], prepend=-1))]
    pair = slot[best]
    return over[pair], partners[pair], out[best], came[best]


def _score_rows(out, slot, w, key, back, seg, span, wa, wb, pa, pb):
    """Each leaving member's best exchange in its pair (``slot``): (the larger of the two
    bags' new per-GPU loads, inf where it lowers nothing; the member coming back), of the
    two partner members nearest the ideal (``key``: the partners' members by workload,
    ``seg``: each partner's first). Scored ``WIDE_BLOCK`` rows at a time into buffers made
    once: the temporaries stay small and their memory is reused (fresh pages cost more
    than the arithmetic)."""
    ideal = (pa - pb) / (1.0 / wa + 1.0 / wb)
    below = pa * (1 - 1e-9)  # an exchange must bring the larger of the two below this
    if wa.min() == wa.max() == wb.min() == wb.max():  # one weight: divide by a scalar
        wa = wb = float(wa[0]) if wa.size else 1.0
    # Per pair: where its keys start (its targets are offset by as much), its first and
    # its last member.
    offset, first, last = np.arange(len(pa)) * span, seg[:-1], seg[1:] - 1
    score, came = np.empty(len(out)), np.empty(len(out), dtype=np.int64)
    rows = min(len(out), WIDE_BLOCK)

    def pair(dtype=np.float64):  # a block's two nearest members, one row each
        return np.empty((2, rows), dtype=dtype)

    # target, hit, member, delta, new_max, up, bad, flag
    buffers = (np.empty(rows), pair(np.int64), pair(np.int64), pair(), pair(), pair(),
               pair(bool), pair(bool))  # fmt: skip
    for i in range(0, len(out), WIDE_BLOCK):
        s = slot[i : i + WIDE_BLOCK].astype(np.intp)  # (a gather by intp is the fast one)
        target, hit, member, delta, new_max, up, bad, flag = (x[..., : len(s)] for x in buffers)
        out_w = np.take(w, out[i : i + WIDE_BLOCK])
        np.clip(np.subtract(out_w, np.take(ideal, s), out=target), 0.0, span / 2, out=target)
        target += np.take(offset, s)
        # The block's pairs' keys only: a search within a few cached pages.
        lo, hi = first[s[0]], last[s[-1]] + 1
        # Rows: the member just lighter than the ideal, the one not lighter.
        np.add(np.searchsorted(key[lo:hi], target), lo, out=hit[1])
        np.maximum(np.subtract(hit[1], 1, out=hit[0]), np.take(first, s), out=hit[0])
        np.minimum(hit[1], np.take(last, s), out=hit[1])
        np.take(back, hit, out=member, mode="clip")  # (valid indices; "raise" buffers)
        np.subtract(out_w, np.take(w, member, out=delta, mode="clip"), out=delta)
        if not isinstance(wa, float):
            np.subtract(np.take(pa, s), delta / wa[s], out=new_max)
            np.add(np.take(pb, s), delta / wb[s], out=up)
        else:  # x / 1.0 is x, bit for bit: one weight of 1 (g1 bags) divides nothing
            moved = delta if wa == 1.0 else np.divide(delta, wa, out=up)
            np.subtract(np.take(pa, s), moved, out=new_max)
            np.add(np.take(pb, s), moved, out=up)
        np.maximum(new_max, up, out=new_max)
        # Lowers nothing: no net workload leaves a, or a stays at or above ``below``.
        bad = np.less_equal(delta, 0.0, out=bad)
        bad |= np.greater_equal(new_max, np.take(below, s), out=flag)
        np.copyto(new_max, np.inf, where=bad)
        heavier = np.less(new_max[1], new_max[0], out=flag[0])  # the lighter one wins ties
        np.copyto(score[i : i + WIDE_BLOCK], new_max[0])
        np.copyto(score[i : i + WIDE_BLOCK], new_max[1], where=heavier)
        np.copyto(came[i : i + WIDE_BLOCK], member[0])
        np.copyto(came[i : i + WIDE_BLOCK], member[1], where=heavier)
    return score, came


class _Members:
    """Bag, length and workload of every sequence plus one *phantom* per bag (no tokens,
    fits every bag): "nothing comes back" in an exchange is then just the partner's
    phantom, scored like any other member.

    A round reads the members of a few bags of many: they are looked up in a by-bag index
    built once (`grouped`), plus the few members that moved in since, so a round costs
    what its bags hold, not what the step holds."""

    def __init__(self, bag, lengths, workload, num_bags):
        self.num_real = len(bag)
        self.bag = np.concatenate([bag, np.arange(num_bags)])
        self.workload = np.concatenate([workload, np.zeros(num_bags)])
        self._lengths = lengths
        self.index()

    @cached_property
    def length(self) -> np.ndarray:
        """Tokens of every member (a phantom: more than any bag's size); made on first
        need: only layouts of several bag sizes check lengths."""
        num_bags = len(self.bag) - self.num_real
        return np.concatenate([self._lengths, np.full(num_bags, np.iinfo(np.int64).max)])

    def index(self) -> None:
        """Index the members by their bags, when next read (`grouped`, `swap`): after the
        last wide round, the narrow ones often have nothing left to read."""
        self.by_bag = None

    def _indexed(self) -> None:
        """Build the by-bag index if `index` asked for it since it was last built."""
        if self.by_bag is not None:
            return
        num_bags = len(self.bag) - self.num_real
        # The bag each member was indexed under; int16 where bag ids fit (a step-sized
        # array of a quarter the pages, and the radix sort's key as it is).
        self.home = self.bag.astype(np.int16 if num_bags <= 2**15 else self.bag.dtype)
        self.by_bag = by_small_key(self.home, num_bags)  # members, grouped by bag, id order
        self.first = np.zeros(num_bags + 1, dtype=np.int64)  # each bag's first in by_bag
        np.cumsum(np.bincount(self.bag, minlength=num_bags), out=self.first[1:])
        # bag -> members indexed under another bag; a bag stays a key once a member moved
        self.moved_in: dict[int, set[int]] = {}

    def in_pairs(self, over: np.ndarray, partners: np.ndarray):
        """`grouped` of both sides of a wide round's pairs, (members, pair) of ``over``, then
        of ``partners``, by one stable sort of every member by its bag's slot: where the
        pairs hold most of the step, cheaper than indexing it first."""
        k, num_bags = len(over), len(self.bag) - self.num_real
        slot_of = np.full(num_bags, 2 * k, dtype=np.int16 if 2 * k < 2**15 else np.int64)
        slot_of[over], slot_of[partners] = np.arange(k), np.arange(k, 2 * k)
        slot = np.take(slot_of, self.bag)
        by_slot = by_small_key(slot, 2 * k + 1)  # by pair, over then partners; id order
        ends = np.cumsum(np.bincount(slot, minlength=2 * k + 1))[[k - 1, 2 * k - 1]]
        out, back = by_slot[: ends[0]], by_slot[ends[0] : ends[1]]
        return out, slot[out], back, slot[back] - k  # (slots as int16 where they fit)

    def real(self, member: int) -> int:
        """The sequence id of ``member``, or -1 for a phantom."""
        return member if member < self.num_real else -1

    def swap(self, a: int, b: int, out_of_a: int, out_of_b: int) -> None:
        self._indexed()
        for member, src, dst in ((out_of_a, a, b), (out_of_b, b, a)):
            if member < 0:
                continue
            self.bag[member] = dst
            self.moved_in.get(src, set()).discard(member)
            if self.home[member] != dst:
                self.moved_in.setdefault(dst, set()).add(member)

    def grouped(self, bags: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The members now in ``bags``, grouped by bag in the order given, by id within one
        (what a stable sort of every member by its bag's slot gives), and each one's slot."""
        self._indexed()
        bags_arr = np.asarray(bags)
        starts, ends = self.first[bags_arr], self.first[bags_arr + 1]
        counts = ends - starts
        slot = np.repeat(np.arange(len(bags)), counts)
        # The index ranges of the bags, concatenated: each range's start plus 0..count-1.
        offsets = np.cumsum(counts) - counts
        members = self.by_bag[np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()))]
        if not self.moved_in:  # nothing moved since the index was built (a first round)
            return members, slot
        still = self.bag[members] == bags_arr[slot]
        members, slot = members[still], slot[still]
        extra = [(m, s) for s, b in enumerate(bags) for m in self.moved_in.get(b, ())]
        if extra:
            members = np.concatenate([members, [m for m, _ in extra]]).astype(np.int64)
            slot = np.concatenate([slot, [s for _, s in extra]]).astype(np.int64)
            order = np.argsort(slot * len(self.bag) + members)
            members, slot = members[order], slot[order]
        return members, slot


def _best_exchanges(over, partners, members, size, weight, per_gpu, accepts, one_size):
    """One round's exchanges: each over-loaded bag ``a`` (most loaded first) with the free
    partner ``b`` that evens the two out best. Returns (a, b, sequence leaving a, sequence
    leaving b or -1) per exchange that lowers the larger of the two bags. ``size``: GPUs
    per bag (a sequence must not be shorter, bar the rule's fallback); ``weight``: load per
    GPU = load / weight; ``one_size``: every bag has the same number of GPUs."""
    num_o, num_p = len(over), len(partners)
    # Slots: over bag -> 0.., partner -> num_o.. (the two never share a bag).
    by_slot, slot_sorted = members.grouped(over + partners)
    bounds = np.searchsorted(slot_sorted, np.arange(num_o + num_p + 1)).tolist()
    # Rows: members that may leave the over-loaded bags; columns: members that may come
    # back from the partners (a phantom: nothing). Both grouped by bag, none empty.
    out, back = by_slot[: bounds[num_o]], by_slot[bounds[num_o] : bounds[-1]]
    back_slot = slot_sorted[bounds[num_o] : bounds[-1]]
    row_starts, col_starts = bounds[:num_o], [s - bounds[num_o] for s in bounds[num_o:-1]]
    # With one bag size every bag is a candidate for every sequence (the rule's fallback
    # is "the largest bags"): the size and capacity checks are then skipped.
    if not one_size:
        ov = np.asarray(over)
        fits = (members.length[back] >= size[ov].min()) & (
            members.workload[back] <= accepts[ov].max()
        )
        back, back_slot = back[fits], back_slot[fits]
        col_starts = np.searchsorted(back_slot, np.arange(num_o, num_o + num_p)).tolist()
    out_w, a_bag = members.workload[out][:, None], members.bag[out][:, None]
    w_a, per_a = weight[a_bag], per_gpu[a_bag]
    if out.size * back.size <= DENSE_CELLS:
        came = back[None, :]  # every pair is scored
        b_bag = members.bag[back][None, :]
    else:
        pb = np.asarray(partners)
        ideal = (per_a - per_gpu[pb]) / (1.0 / w_a + 1.0 / weight[pb])
        came = _nearest_members(back, back_slot - num_o, members.workload, out_w - ideal)
        col_starts = list(range(0, 2 * num_p, 2))
        b_bag = np.repeat(pb, 2)[None, :]  # columns 2p and 2p + 1 come from partner p
    came_w = members.workload[came]
    w_b, per_b = weight[b_bag], per_gpu[b_bag]  # one row: each column's bag
    delta = out_w - came_w  # net workload leaving a
    new_max = np.maximum(per_a - delta / w_a, per_b + delta / w_b)
    ok = (delta > 0) & (new_max < per_a * (1 - 1e-9))
    if not one_size:
        ok &= (members.length[out][:, None] >= size[b_bag]) & (out_w <= accepts[b_bag])
        ok &= (members.length[came] >= size[a_bag]) & (came_w <= accepts[a_bag])
    new_max = np.where(ok, new_max, np.inf)
    return _take_best(new_max, row_starts, col_starts, came, out, over, partners, members)


def _take_best(new_max, row_starts, col_starts, came, out, over, partners, members):
    """Of the scored exchanges ``new_max`` (rows: sequences leaving the over-loaded bags,
    grouped by bag from ``row_starts``; columns: those coming back, by partner from
    ``col_starts``), each over-loaded bag, most loaded first, takes its best among the
    partners still free."""
    best = np.minimum.reduceat(np.minimum.reduceat(new_max, row_starts, 0), col_starts, 1)
    row_ends, col_ends = [*row_starts[1:], len(out)], [*col_starts[1:], new_max.shape[1]]
    free = [True] * len(partners)
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
