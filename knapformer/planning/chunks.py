"""The chunk table a placement becomes (`chunk_table`): each sequence cut into one chunk
per GPU of its bag, its remainder spread one token at a time over a cycle through the
bag (or, under round-robin, all to one chunk).

Made once per chosen plan (and per auto candidate that is priced exactly), so it is built
as one (n, g) grid per bag size with no temporary of its size beyond one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from knapformer.planning.bags import Step, by_small_key
from knapformer.planning.tuning import PATTERN_SIZES


def chunk_table(step: Step):
    """Split each sequence into one chunk per GPU of its bag (zero-length chunks dropped).

    Returns (seq, dst GPU position, offset, length), ordered by sequence then chunk
    index; chunk k of a sequence goes to the k-th GPU of its bag. Each chunk gets
    ``L // g`` tokens; the ``L % g`` remainder goes, under round-robin, all to chunk
    ``rem`` (the published rule), else one token each to the next GPUs of a cycle that
    runs through the bag's sequences in id order, so every GPU of a bag ends within one
    token of the others (the remainder never piles onto one GPU).
    """
    layout, lengths, bag = step.layout, step.lengths, step.bag
    n = len(lengths)
    size = layout.size[bag]
    rem = lengths % size
    start = _remainder_starts(bag, rem, size) if layout.even else None
    if len(layout.class_size) == 1:  # the usual fixed topology: one (n, g) grid
        g = int(layout.class_size[0])
        idx = np.repeat(np.arange(n), g)
        length, pos, offset = (x.ravel() for x in _chunk_grid(step, slice(None), g, start))
    else:  # one grid per bag size, scattered to the rows of its sequences
        ends = np.cumsum(size)
        first = ends - size  # row of each sequence's chunk 0
        total = int(ends[-1]) if n else 0
        pos, offset, length = (np.empty(total, dtype=np.int64) for _ in range(3))
        idx = np.repeat(np.arange(n), size)
        for g in layout.class_size.tolist():
            sel = np.flatnonzero(size == g)
            if g == 1:  # one whole chunk each, on the bag's GPU
                rows = first[sel]
                length[rows], pos[rows], offset[rows] = lengths[sel], layout.start[bag[sel]], 0
                continue
            rows = (first[sel][:, None] + np.arange(g)).ravel()
            grid = _chunk_grid(step, sel, g, None if start is None else start[sel])
            length[rows], pos[rows], offset[rows] = (x.ravel() for x in grid)
    if n and (lengths < size).any():  # some sequence is shorter than its bag
        keep = length > 0
        idx, pos, offset, length = idx[keep], pos[keep], offset[keep], length[keep]
    return idx, pos, offset, length


def _chunk_grid(step: Step, sel, g: int, start):
    """(length, position, offset), each (m, g), of the chunks of sequences ``sel``, all in
    bags of ``g`` GPUs; ``start``: where each one's remainder starts in its bag's cycle
    (even spread), None under round-robin."""
    lengths, bag = step.lengths[sel], step.bag[sel]
    quot = lengths // g
    rem = lengths - quot * g
    k = np.arange(g)
    pos = step.layout.start[bag][:, None] + k[None, :]
    if start is not None and g <= PATTERN_SIZES:
        # One of g*g remainder patterns per sequence, looked up with its running sum.
        extra, before = _remainder_patterns(g)
        pattern = start * g + rem
        # (np.take gathers rows faster than fancy indexing; the product is the temporary.)
        length = np.take(extra, pattern, axis=0)
        length += quot[:, None]
        offset = np.take(before, pattern, axis=0)
        offset += np.multiply.outer(quot, k)
        return length, pos, offset
    if start is not None:
        # Chunk k takes a remainder token when it lies in [start, start + rem) cyclically.
        first, end = start[:, None], (start + rem)[:, None]
        length = quot[:, None] + (((k >= first) & (k < end)) | (k + g < end))
    else:
        length = np.repeat(quot[:, None], g, axis=1)
        length[np.arange(len(quot)), step.rem[sel]] += rem
    return length, pos, np.cumsum(length, axis=1) - length


@lru_cache(maxsize=PATTERN_SIZES)
def _remainder_patterns(g: int) -> tuple[np.ndarray, np.ndarray]:
    """For a bag of ``g`` GPUs, row ``start * g + rem``: which of the g chunks take a
    remainder token when ``rem`` of them do from chunk ``start`` on, cyclically, and the
    tokens those add before each chunk (each (g * g, g))."""
    start, rem = np.divmod(np.arange(g * g), g)
    k = np.arange(g)
    extra = ((k - start[:, None]) % g < rem[:, None]).astype(np.int64)
    return extra, np.cumsum(extra, axis=1) - extra


def _remainder_starts(bag: np.ndarray, rem: np.ndarray, size: np.ndarray) -> np.ndarray:
    """`_cycle_starts`, computed over the sequences with a remainder only when they are
    few (one-GPU bags, or most lengths a multiple of g): a sequence without one adds
    nothing to its bag's cycle, and its own start is never read (0 here)."""
    some = np.flatnonzero(rem)
    if 2 * len(some) >= len(rem):
        return _cycle_starts(bag, rem, size)
    starts = np.zeros_like(rem)
    starts[some] = _cycle_starts(bag[some], rem[some], size[some])
    return starts


def _cycle_starts(bag: np.ndarray, rem: np.ndarray, size: np.ndarray) -> np.ndarray:
    """(n,) where each sequence's remainder starts in its bag's cycle: the remainders of the
    bag's earlier sequences (id order), summed, modulo the bag size."""
    order = by_small_key(bag, int(bag.max()) + 1 if bag.size else 0)
    r = np.take(rem, order)
    before = np.cumsum(r) - r  # exclusive running sum over all bags
    sorted_bag = np.take(bag, order)
    group_start = np.ones(len(order), dtype=bool)
    np.not_equal(sorted_bag[1:], sorted_bag[:-1], out=group_start[1:])
    base = np.maximum.accumulate(np.where(group_start, before, 0))
    starts = np.empty_like(rem)
    starts[order] = (before - base) % np.take(size, order)
    return starts
