"""The group counts per size a step's sequences ask for at a per-GPU target, and the
mixed partitions `knapformer.planning.partitions.mixed_partitions` offers (`mixed_counts`).

Each sequence's cost per GPU in each group size (`per_gpu_costs`, `fitting_costs`); the
least target whose groups fit the GPUs (`_Demand`), by the bisection the partition floor
uses too (`least_fitting`); its largest groups merged in pairs, and those packed with the
lower classes' long sequences (`_absorb`)."""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from knapformer.planning.tuning import BISECTIONS, DEAR_SHARE, TIE


def per_gpu_costs(eff: np.ndarray, lengths: np.ndarray, size: np.ndarray):
    """(each sequence's per-GPU cost in the smallest group (n,), the largest over the
    sequences of their least per-GPU cost in a group they fit): a sequence shorter than
    every group still goes to the smallest. That largest is at least the least cost of
    the dearest sequence in the smallest group, and no sequence cheaper than that there
    can exceed it: only the others are looked at (a few hundred of 185,000 at 4,096 GPUs;
    the same largest), or all where they are many (gathering them costs more)."""
    smallest = eff[0] / size[0]
    top = np.array([int(smallest.argmax())])
    dear = np.flatnonzero(smallest >= _least_costs(eff, lengths, size, top, smallest)[0])
    seqs = dear if DEAR_SHARE * len(dear) <= len(smallest) else None
    return smallest, float(_least_costs(eff, lengths, size, seqs, smallest).max())


def _least_costs(eff, lengths, size, seqs: np.ndarray | None, smallest: np.ndarray) -> np.ndarray:
    """Each of ``seqs``' (None: every sequence's) least per-GPU cost in a group it fits
    (``smallest``: each one's in the smallest group, which any may take). One size at a
    time: no (sizes, n) temporary."""
    if seqs is None:
        cheapest, at, eff_of = smallest.copy(), lengths, eff
    else:
        cheapest, at, eff_of = smallest[seqs], lengths[seqs], eff[:, seqs]
    for j in range(1, len(size)):
        np.minimum(cheapest, np.where(at >= size[j], eff_of[j] / size[j], np.inf), out=cheapest)
    return cheapest


def fitting_costs(eff: np.ndarray, lengths: np.ndarray, size: np.ndarray, seqs: np.ndarray):
    """(fits, per-GPU cost), each (sizes, len(seqs)), of sequences ``seqs`` in a group of
    each size: whether it may go there (never shorter than the group, bar the smallest),
    and its cost there per GPU (inf where it may not)."""
    fits = lengths[seqs][None, :] >= size[:, None]
    fits[0] = True
    return fits, np.where(fits, eff[:, seqs] / size[:, None], np.inf)


def least_fitting(fits, lo: float, hi: float) -> float:
    """The least target in (lo, hi] that ``fits`` (a predicate true at ``hi``, and from
    some point on), to ``BISECTIONS`` halvings of the bracket."""
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


class Kept:
    """``of(target)`` where it reads the target only by comparisons ``cost <= target`` with
    ``costs``: kept from the last target while no cost lies between the two (a
    bisection's targets soon differ in no comparison: then it is not made again)."""

    def __init__(self, costs: np.ndarray, of):
        self.steps = np.unique(costs[np.isfinite(costs)]).tolist()
        self.of, self.last = of, None  # (target, its value)

    def __call__(self, target: float):
        last = self.last
        if last is not None:
            lo, hi = min(last[0], target), max(last[0], target)
            if bisect.bisect_right(self.steps, hi) == bisect.bisect_right(self.steps, lo):
                return last[1]  # every comparison the same at both targets
        value = self.of(target)
        self.last = (target, value)
        return value


def mixed_counts(eff, size, lengths, num_gpus, sizes, whole, costs=None):
    """(group counts per size, each sequence's size class) of the bisection's partition
    (`_Demand.least_target`) and of its variants (`_merged_variants`), cheapest first by
    `_Demand.waste`; None when no mixed partition is worth solving. ``eff`` (sizes, n):
    the effective workloads; ``size``: ``sizes`` as floats; ``whole``: the floor of each
    whole-family layout (the bisection's top); ``costs``: `per_gpu_costs` of the step, where
    the caller has them already."""
    if len(sizes) < 2 or not whole or eff.shape[1] == 0:
        return None
    smallest, cheapest = costs or per_gpu_costs(eff, lengths, size)
    lo = max(float(eff[0].sum()) / num_gpus, cheapest)
    hi = min(whole)
    if lo >= hi * (1 - TIE):
        return None
    # Only the sequences above lo in the smallest group have a class that depends on T.
    need = _Demand(eff, size, lengths, num_gpus, int(sizes[0]), np.flatnonzero(smallest > lo))
    hi = need.least_target(lo, hi)
    if hi is None:
        return None
    used, groups, cls = need.at(hi)
    groups[0] += (num_gpus - used) // sizes[0]  # spare GPUs go to the smallest groups
    if (groups[1:] == 0).all():
        return None  # no bigger group needed: that is the smallest whole-family layout
    variants = [(groups, cls), *_merged_variants(need, groups, cls, hi, sizes)]
    # The cheapest first (a large step solves only that one); ties keep the order above.
    scores = [need.waste(g, c, hi) for g, c in variants]
    out = []
    for i in sorted(range(len(variants)), key=lambda i: scores[i]):
        seq_class = np.zeros(eff.shape[1], dtype=np.int64)
        seq_class[need.big] = variants[i][1]
        out.append((variants[i][0], seq_class))
    return out


class _Demand:
    """The groups a per-GPU target T asks for (`_mixed`): each big sequence (``big``) takes
    the smallest size that brings it under T, and the short ones fill the bigger groups'
    room at their ``inflation`` (what they cost there over what they cost alone), the rest
    going to the smallest groups."""

    def __init__(self, eff, size, lengths, num_gpus: int, unit: int, big: np.ndarray):
        self.size, self.num_gpus, self.unit, self.big = size, num_gpus, unit, big
        small = np.ones(eff.shape[1], dtype=bool)
        small[big] = False
        base, fill_cost = _filling_sums(eff, lengths, size, small)
        self.x0_small, self.fill_base = base[0], np.array(base)
        fill_cost = np.array(fill_cost)
        self.inflation = np.divide(fill_cost, self.fill_base, out=np.ones(len(size)),
                                   where=self.fill_base > 0)  # fmt: skip
        self.big_eff, self.big_per_gpu = eff[:, big], fitting_costs(eff, lengths, size, big)[1]
        self.sizes, self.inflation_list = size.tolist(), self.inflation.tolist()
        self.fill_base_list = self.fill_base.tolist()
        # A big sequence's class at a target is the first size whose per-GPU cost is at
        # most the target: the first whose least cost so far is (the sizes before it);
        # every big sequence fits some size from ``fits_all`` on.
        least = np.minimum.accumulate(self.big_per_gpu, axis=0)
        self.fits_all = float(least[-1].max(initial=-np.inf))
        self.classes = Kept(least, lambda target: (least > target).sum(axis=0))
        self.of_class = None  # the last classes' (classes, load, per-GPU costs) (`_at`)

    def _at(self, cls: np.ndarray) -> tuple[list[float], np.ndarray]:
        """(each size's load, each big sequence's per-GPU cost) at classes ``cls``: the last
        classes' kept, as most of a bisection's targets give the same classes."""
        held = self.of_class
        if held is None or (held[0] is not cls and not np.array_equal(held[0], cls)):
            flat = cls * len(self.big) + np.arange(len(self.big))  # (size, sequence) cells
            load = np.bincount(cls, weights=self.big_eff.take(flat), minlength=len(self.size))
            held = self.of_class = (cls, load.tolist(), self.big_per_gpu.take(flat))
        return held[1], held[2]

    def load(self, cls: np.ndarray) -> np.ndarray:
        """Each size's load from the big sequences of classes ``cls``."""
        return np.array(self._at(cls)[0])

    def groups(self, cls: np.ndarray, target: float) -> tuple[list[float], list[int]]:
        """(load, groups) per size for the big sequences of classes ``cls`` at ``target``:
        enough room for the load (within `TIE` of whole groups needs no more), and a group
        of its own for each sequence above half a group's room (two cannot share). Python
        numbers: a few sizes, where numpy's per-call cost would dominate (the same
        arithmetic, element by element)."""
        load, per_gpu = self._at(cls)
        alone = np.bincount(cls[per_gpu > 0.5 * target], minlength=len(load)).tolist()
        return load, [max(math.ceil(x / (g * target) - TIE), a)
                      for x, g, a in zip(load, self.sizes, alone, strict=True)]  # fmt: skip

    def at(self, target: float):
        """(GPUs used, groups per size, classes of the big sequences) at ``target``; None
        when a big sequence fits no size at it."""
        if not self.fits_all <= target:
            return None
        cls = self.classes(target)
        load, groups = self.groups(cls, target)
        size, inflation, base = self.sizes, self.inflation_list, self.fill_base_list
        # The bigger groups' slack, filled with short sequences (summed by numpy: its order).
        fill = float(np.sum([min((groups[j] * size[j] * target - load[j]) / inflation[j], base[j])
                             for j in range(1, len(size))]))  # fmt: skip
        rest = max(0.0, load[0] + self.x0_small - fill)
        groups[0] = math.ceil(rest / (size[0] * target) - TIE)
        used = int(sum(c * g for c, g in zip(groups, size, strict=True)))
        return used, np.array(groups, dtype=np.int64), cls

    def fits(self, target: float) -> bool:
        got = self.at(target)
        return got is not None and got[0] <= self.num_gpus

    def least_target(self, lo: float, hi: float) -> float | None:
        """The least target in (lo, hi] whose groups fit the GPUs, by bisection; None when
        even ``hi`` does not."""
        return least_fitting(self.fits, lo, hi) if self.fits(hi) else None

    def counts(self, cls: np.ndarray, target: float) -> np.ndarray:
        """Groups per size for the big sequences of classes ``cls`` at ``target`` (as `at`),
        the spare GPUs in the smallest groups."""
        out = np.array(self.groups(cls, target)[1], dtype=np.int64)
        out[0] = (self.num_gpus - int((out[1:] * self.size[1:]).sum())) // self.unit
        return out

    def waste(self, groups: np.ndarray, cls: np.ndarray, target: float) -> float:
        """Work the step costs at ``target`` under ``groups``: the big sequences at their
        class, every bigger group's room filled with short ones at its inflation, the
        remaining short ones alone (lower: less Ulysses paid)."""
        load, inflation = self.load(cls), self.inflation[1:]
        room = np.maximum(groups * self.size * target - load, 0.0)[1:]
        filled = np.minimum(room / inflation, self.fill_base[1:])
        return float(load[1:].sum() + (filled * inflation).sum()
                     + max(0.0, load[0] + self.x0_small - filled.sum()))  # fmt: skip


def _filling_sums(eff, lengths, size, small: np.ndarray) -> tuple[list[float], list[float]]:
    """(alone, there) per size: what the short sequences (``small``, a mask) that may fill a
    group of that size (as long as it; all of them for the smallest) cost alone (``eff[0]``)
    and in it (``eff[j]``). A set is cut and summed alone only where it changes (its
    shortest is shorter than the group): where every short sequence is as long as the
    largest group, once for all sizes. Masks, not ids: a step-sized gather is slower than
    a compress of the same rows (the same sums)."""
    seqs = small
    total = float(eff[0][seqs].sum())
    shortest = lengths.min(where=seqs, initial=size[-1])
    alone, there = [], []
    for j, g in enumerate(size):
        if j and shortest < g:
            seqs = seqs & (lengths >= g)
            total = float(eff[0][seqs].sum())
            shortest = lengths.min(where=seqs, initial=size[-1])
        alone.append(total)
        there.append(float(eff[j][seqs].sum()) if j else total)
    return alone, there


def _merged_variants(need: _Demand, groups, cls, target: float, sizes) -> list[tuple]:
    """The variants of the partition ``groups`` (`_mixed`): its largest size's groups merged
    in pairs into the next size, and the same with the lower classes' big sequences packed
    into the merged groups' room (`_absorb`); none when the next size is not twice it."""
    top = int(np.flatnonzero(groups)[-1])
    if not (top > 0 and top + 1 < len(sizes) and sizes[top + 1] == 2 * sizes[top]
            and groups[top] > 1):  # fmt: skip
        return []
    merged = groups.copy()
    merged[top + 1] += merged[top] // 2
    merged[top] %= 2
    out = [(merged, cls)]
    packed = _absorb(cls, top, merged, need.big_eff, need.size, target)
    if packed is not None:
        # The shared groups as packed; the lower classes' groups for what is left.
        repacked = need.counts(np.where(packed >= top, 0, packed), target)
        repacked[top:] = merged[top:]
        repacked[0] = (need.num_gpus - int((repacked[1:] * need.size[1:]).sum())) // sizes[0]
        if repacked[0] >= 0:
            out.append((repacked, packed))
    return out


def _absorb(cls, top, merged, big_eff, size, target):
    """Big sequences' classes when the class-``top`` sequences share ``merged``'s groups of
    twice their size (and the odd one left of their own size) and the lower classes' big
    sequences move into those groups' room where they fit: each lower group so emptied
    goes back to the smallest size, whose GPUs pay no exchange. Largest first, each to the
    least loaded group it fits (the top ones) or the fullest (the lower ones), a tie to the
    first group. None when a top sequence fits no group.

    The groups are of two kinds (class ``top + 1``, then ``top``) and a sequence costs the
    same in every group of a kind, so only one group of each kind is worth comparing: the
    least loaded (a heap) or the fullest with room (a sorted list, `_Kind`)."""
    kinds = [_Kind(c, int(merged[c]), float(size[c]), target, first)
             for c, first in ((top + 1, 0), (top, int(merged[top + 1])))]  # fmt: skip
    kinds = [k for k in kinds if k.heap]
    out = cls.copy()
    tops = np.flatnonzero(cls == top)
    tops = tops[np.argsort(-big_eff[top + 1, tops], kind="stable")]
    if len(kinds) == 1:  # no odd group: a heap of the merged ones alone
        if not _one_kind_least_loaded(kinds[0], big_eff[kinds[0].cls, tops].tolist()):
            return None
        out[tops] = kinds[0].cls
    elif not _least_loaded(kinds, tops, big_eff, out):
        return None
    lower = np.flatnonzero((cls > 0) & (cls < top))
    lower = lower[np.argsort(-big_eff[0, lower], kind="stable")]
    for kind in kinds:
        kind.by_held = sorted((held, -b) for held, b in kind.heap)
    for x, costs in zip(lower.tolist(), _costs(big_eff, kinds, lower), strict=True):
        fit = [(*f, k, c) for k, c in zip(kinds, costs, strict=True)
               if (f := k.fullest_with_room(c))]  # fmt: skip
        if fit:
            _, b, held, kind, cost = max(fit, key=lambda f: (f[0], -f[1]))
            kind.add(held, b, cost)
            out[x] = kind.cls
    return None if np.array_equal(out, cls) else out


def _least_loaded(kinds, tops, big_eff, out) -> bool:
    """`_absorb`'s top sequences ``tops`` (largest first), each to the least loaded group
    of either of the two kinds that it fits, per GPU (a tie to the first group); their
    classes into ``out``. False when one fits no group."""
    (one, two), got = kinds, []
    (heap1, cap1, size1), (heap2, cap2, size2) = ((k.heap, k.cap, k.size) for k in kinds)
    for cost1, cost2 in _costs(big_eff, kinds, tops):
        # Within a kind the least held is the least per GPU (sizes are powers of two);
        # the kinds number their groups apart, so (per GPU, group) never ties.
        (held1, b1), (held2, b2) = heap1[0], heap2[0]
        fits1, fits2 = held1 + cost1 <= cap1, held2 + cost2 <= cap2
        if fits1 and (not fits2 or (held1 / size1, b1) < (held2 / size2, b2)):
            heapq.heapreplace(heap1, (held1 + cost1, b1))
            got.append(one.cls)
        elif fits2:
            heapq.heapreplace(heap2, (held2 + cost2, b2))
            got.append(two.cls)
        else:
            return False
    out[tops] = got
    return True


def _one_kind_least_loaded(kind: _Kind, costs: list[float]) -> bool:
    """`_least_loaded` where every group is of one kind: each cost (largest first) to the
    least loaded group, the heap's top. False when one fits no group."""
    heap, cap = kind.heap, kind.cap
    for cost in costs:
        held, b = heap[0]
        if held + cost > cap:
            return False
        heapq.heapreplace(heap, (held + cost, b))
    return True


def _costs(big_eff, kinds, seqs) -> list:
    """Each of ``seqs``' cost in a group of each kind of `_absorb`."""
    return list(zip(*(big_eff[k.cls, seqs].tolist() for k in kinds), strict=True))


class _Kind:
    """The groups of one size class in `_absorb`, numbered from ``first`` in `_absorb`'s
    group order: their room (``cap``) and what each holds, as a heap of (held, group)
    while the top sequences go in, then as a list sorted by (held, -group)."""

    def __init__(self, cls: int, count: int, size: float, target: float, first: int):
        self.cls, self.size = cls, size
        self.cap = size * target * (1 + TIE)
        self.heap = [(0.0, first + i) for i in range(count)]  # all equal: a heap
        self.by_held: list[tuple[float, int]] = []

    def fullest_with_room(self, cost: float) -> tuple[float, int, float] | None:
        """(held / cap, group, held) of the fullest group with room for ``cost`` (a tie,
        also one that rounding makes, to the first group); None when none has room."""
        rows, cap = self.by_held, self.cap
        # The first row without room: those held at most cap - cost, then moved to where
        # the test itself turns (held + cost grows with held; rounding may move it a row).
        n = bisect.bisect_right(rows, (cap - cost, math.inf))
        while n and rows[n - 1][0] + cost > cap:
            n -= 1
        while n < len(rows) and rows[n][0] + cost <= cap:
            n += 1
        if n == 0:
            return None
        held, b = rows[n - 1][0], -rows[n - 1][1]
        value, j = held / cap, n - 2
        while j >= 0 and rows[j][0] / cap == value:
            if -rows[j][1] < b:
                held, b = rows[j][0], -rows[j][1]
            j -= 1
        return value, b, held

    def add(self, held: float, b: int, cost: float) -> None:
        """Group ``b``, holding ``held``, takes ``cost`` more."""
        rows = self.by_held
        rows.pop(bisect.bisect_left(rows, (held, -b)))
        bisect.insort(rows, (held + cost, -b))
