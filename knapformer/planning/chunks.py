"""The chunk table a placement becomes (`chunk_table`): each sequence cut into one chunk
per GPU of its bag, its remainder spread one token at a time over a cycle through the
bag (or, under round-robin, all to one chunk).

A rank's router reads only its own rows (`StepChunks`: a fixed plan's table, derived);
the whole table is made when a reader reads the plan's columns (and per auto candidate
that is priced exactly), each column written once, in place, into its own array: a
sequence's g chunks are one row of an (n, g) grid per bag size, and no temporary of the
table's size is made beyond the int8 remainder patterns. (Each column stays a separate
array: one block of five would exceed glibc's largest mmap threshold, 32 MB, at 4,096
GPUs, and be faulted in fresh on every plan; arrays below it reuse the heap the previous
plan's columns freed.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from knapformer.contract.chunk_rows import ChunkRows
from knapformer.planning.bags import Step, by_small_key
from knapformer.planning.tuning import PATTERN_SIZES


def chunk_table(step: Step, with_source: bool = False) -> tuple[np.ndarray, ...]:
    """Split each sequence into one chunk per GPU of its bag (zero-length chunks dropped).

    Returns (seq, dst GPU position, offset, length), each (num_chunks,) int64, ordered by
    sequence then chunk index, and with ``with_source`` each chunk's source GPU position
    (its sequence's) last; chunk k of a sequence goes to the k-th GPU of its bag. Each
    chunk gets ``L // g`` tokens; the ``L % g`` remainder goes, under round-robin, all to
    chunk ``rem`` (the published rule), else one token each to the next GPUs of a cycle
    that runs through the bag's sequences in id order, so every GPU of a bag ends within
    one token of the others (the remainder never piles onto one GPU).
    """
    layout, lengths = step.layout, step.lengths
    if len(layout.class_size) == 1:  # the usual fixed topology: one (n, g) grid
        g = int(layout.class_size[0])
        columns = _one_size_table(step, g, with_source)
        short = lengths.size and int(lengths.min()) < g
    else:
        size = layout.size[step.bag]
        columns = _mixed_size_table(step, size, with_source)
        short = lengths.size and bool((lengths < size).any())
    if short:  # some sequence is shorter than its bag: drop its empty chunks
        keep = columns[3] > 0
        columns = tuple(column[keep] for column in columns)
    return columns


class StepChunks:
    """The chunk table of a solved step, made on demand (a
    `knapformer.contract.chunk_rows.ChunkSource`): whole (`chunk_table`) or the rows of
    some sequences only, cut by the same grids, so that a rank's router pays for its own
    few hundred chunks, not the step's million. ``ranks``: each GPU position's rank
    (None: positions are ranks). The step is not changed after it is solved.

    A sequence's rows need its first chunk id (the chunks before it: one per GPU of each
    earlier sequence's bag, less the empty ones of sequences shorter than their bag) and
    where its remainder starts in its bag's cycle (the remainders of the bag's earlier
    sequences): both are read from the few sequences that matter, not summed over all.
    """

    def __init__(self, step: Step, ranks: np.ndarray | None = None):
        self.step, self.ranks = step, ranks
        layout = step.layout
        self._one_size = int(layout.class_size[0]) if len(layout.class_size) == 1 else None
        self._base: np.ndarray | None = None  # first ids were no chunk empty (mixed sizes)
        self._short: tuple[np.ndarray, np.ndarray] | None = None

    def count(self) -> int:
        if not len(self.step.lengths):
            return 0
        one = self._one_size
        full = len(self.step.lengths) * one if one else int(self._size_ends()[-1])
        return full - int(self._short_sequences()[1][-1])

    def table(self) -> dict[str, np.ndarray]:
        seq, pos, offset, length, src = chunk_table(self.step, with_source=True)
        src, dst = self._rank(src), self._rank(pos)
        return {"seq": seq, "src_gpu": src, "dst_gpu": dst, "offset": offset, "length": length}

    def rows_of(self, seqs: np.ndarray) -> ChunkRows:
        step, seqs = self.step, np.asarray(seqs, dtype=np.int64)
        if self._one_size:
            parts = [self._grid_rows(seqs, self._one_size)] if len(seqs) else []
        else:
            size = step.layout.size[step.bag[seqs]]
            parts = [self._grid_rows(seqs[size == g], g) for g in np.unique(size).tolist()]
        if not parts:
            return ChunkRows(*(np.zeros(0, dtype=np.int64) for _ in range(6)))
        columns = [np.concatenate(c) for c in zip(*parts, strict=True)]
        if len(parts) > 1:  # sizes interleave in id order
            order = np.argsort(columns[0], kind="stable")
            columns = [c[order] for c in columns]
        ids, seq, pos, offset, length = columns
        return ChunkRows(ids, seq, self._rank(step.src_pos[seq]), self._rank(pos), offset, length)

    def _grid_rows(self, sel: np.ndarray, g: int) -> tuple[np.ndarray, ...]:
        """(id, seq, position, offset, length) of the non-empty chunks of sequences ``sel``
        (ascending), all in bags of ``g`` GPUs: their rows of `_chunk_grid`, numbered."""
        step = self.step
        quot, rem = np.divmod(step.lengths[sel], g)
        start = self._remainder_starts(sel) if step.layout.even else None
        length, pos, offset = _chunk_grid(step, sel, g, start, quot, rem)
        kept = length > 0
        # A sequence's chunks are numbered from its first id, skipping its empty ones.
        ids = self._first_ids(sel)[:, None] + (np.cumsum(kept, axis=1) - 1)
        seq = np.repeat(sel, g).reshape(len(sel), g)
        if kept.all():
            return ids.ravel(), seq.ravel(), pos.ravel(), offset.ravel(), length.ravel()
        return ids[kept], seq[kept], pos[kept], offset[kept], length[kept]

    def _first_ids(self, seqs: np.ndarray) -> np.ndarray:
        """The first chunk id of each of ``seqs``: the GPUs of the earlier sequences' bags,
        less their empty chunks (counted once per step, over the short sequences only)."""
        if self._one_size:
            base = seqs * self._one_size
        else:
            base = self._size_ends()[seqs] - self.step.layout.size[self.step.bag[seqs]]
        short, empty_before = self._short_sequences()
        if len(short) == 0:
            return base
        return base - empty_before[np.searchsorted(short, seqs)]

    def _size_ends(self) -> np.ndarray:
        """Mixed sizes: the GPUs of the bags of sequences 0..s, summed (made once)."""
        if self._base is None:
            self._base = np.cumsum(self.step.layout.size[self.step.bag])
        return self._base

    def _short_sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """(the sequences shorter than their bag, ascending; the empty chunks of those
        before each, with the total last). Such a sequence of L < g tokens has L chunks of
        one token, or one chunk of L under round-robin (none when L = 0)."""
        if self._short is None:
            step = self.step
            size = self._one_size or step.layout.size[step.bag]
            short = np.flatnonzero(step.lengths < size)
            g = size if self._one_size else size[short]
            length = step.lengths[short]
            kept = length if step.layout.even else (length > 0)
            empty = np.cumsum(g - kept)
            self._short = short, np.concatenate([[0], empty]).astype(np.int64)
        return self._short

    def _remainder_starts(self, seqs: np.ndarray) -> np.ndarray:
        """Where the remainder of each of ``seqs`` starts in its bag's cycle, as in
        `chunk_table`: `_remainder_starts` over every sequence of their bags only."""
        step, layout = self.step, self.step.layout
        bags = step.bag[seqs]
        wanted = np.zeros(len(layout.size), dtype=bool)
        wanted[bags] = True
        members = np.flatnonzero(wanted[step.bag])  # in id order
        size = self._one_size or layout.size[step.bag[members]]
        starts = _remainder_starts(step.bag[members], step.lengths[members] % size, size,
                                   layout.class_size)  # fmt: skip
        return starts[np.searchsorted(members, seqs)]

    def _rank(self, positions: np.ndarray) -> np.ndarray:
        return positions if self.ranks is None else self.ranks[positions]


def _one_size_table(step: Step, g: int, with_source: bool) -> tuple[np.ndarray, ...]:
    """`chunk_table` (empty chunks kept) of a layout whose bags all hold ``g`` GPUs."""
    n = len(step.lengths)
    quot, rem = np.divmod(step.lengths, g)
    start = _remainder_starts(step.bag, rem, g, [g]) if step.layout.even else None
    length, pos, offset = _chunk_grid(step, slice(None), g, start, quot, rem)
    columns = (np.repeat(np.arange(n), g), pos.reshape(-1), offset.reshape(-1),
               length.reshape(-1))  # fmt: skip
    return (*columns, np.repeat(step.src_pos, g)) if with_source else columns


def _mixed_size_table(step: Step, size: np.ndarray, with_source: bool) -> tuple[np.ndarray, ...]:
    """`chunk_table` (empty chunks kept) of a layout of several bag sizes (``size``: each
    sequence's): one grid per bag size, scattered to the rows of its sequences."""
    layout, lengths, bag = step.layout, step.lengths, step.bag
    n = len(lengths)
    even = layout.even
    start = _remainder_starts(bag, lengths % size, size, layout.class_size) if even else None
    ends = np.cumsum(size)
    first = ends - size  # row of each sequence's chunk 0
    total = int(ends[-1]) if n else 0
    pos, offset, length = (np.empty(total, dtype=np.int64) for _ in range(3))
    for g in layout.class_size.tolist():
        sel = np.flatnonzero(size == g)
        if g == 1:  # one whole chunk each, on the bag's GPU
            rows = first[sel]
            length[rows], pos[rows], offset[rows] = lengths[sel], layout.start[bag[sel]], 0
            continue
        rows = (first[sel][:, None] + np.arange(g)).ravel()
        quot, rem = np.divmod(lengths[sel], g)
        grid = _chunk_grid(step, sel, g, None if start is None else start[sel], quot, rem)
        length[rows], pos[rows], offset[rows] = (x.ravel() for x in grid)
    seq = np.repeat(np.arange(n), size)
    columns = (seq, pos, offset, length)
    return (*columns, np.repeat(step.src_pos, size)) if with_source else columns


def _chunk_grid(step: Step, sel, g: int, start, quot, rem):
    """(length, position, offset), each (m, g) int64, of the chunks of sequences ``sel``,
    all in bags of ``g`` GPUs, whose lengths are ``quot * g + rem``; ``start``: where each
    one's remainder starts in its bag's cycle (even spread), None under round-robin."""
    m, k = len(quot), np.arange(g)
    # (A repeat and an in-place add beat one broadcast add, whose inner loops run g long.)
    pos = np.repeat(step.layout.start[step.bag[sel]], g).reshape(m, g)
    pos += k
    if start is not None and g <= PATTERN_SIZES:
        # One of g*g remainder patterns per sequence, looked up by (start, rem): the only
        # temporaries are the looked-up int8 rows.
        extra, before = _remainder_patterns(g)
        pattern = start * g
        pattern += rem
        length = np.repeat(quot, g).reshape(m, g)
        length += np.take(extra, pattern, axis=0)
        offset = np.empty((m, g), dtype=np.int64)
        np.multiply(quot[:, None], k, out=offset)
        offset += np.take(before, pattern, axis=0)
        return length, pos, offset
    if start is not None:
        # Chunk k takes a remainder token when it lies in [start, start + rem) cyclically.
        first, end = start[:, None], (start + rem)[:, None]
        length = quot[:, None] + (((k >= first) & (k < end)) | (k + g < end))
    else:
        length = np.repeat(quot[:, None], g, axis=1)
        length[np.arange(m), step.rem[sel]] += rem
    return length, pos, np.cumsum(length, axis=1) - length


@lru_cache(maxsize=PATTERN_SIZES)
def _remainder_patterns(g: int) -> tuple[np.ndarray, np.ndarray]:
    """For a bag of ``g`` GPUs, row ``start * g + rem``: which of the g chunks take a
    remainder token when ``rem`` of them do from chunk ``start`` on, cyclically, and the
    tokens those add before each chunk (each (g * g, g) int8: ``g <= PATTERN_SIZES``)."""
    start, rem = np.divmod(np.arange(g * g), g)
    k = np.arange(g)
    extra = ((k - start[:, None]) % g < rem[:, None]).astype(np.int8)
    return extra, (np.cumsum(extra, axis=1) - extra).astype(np.int8)


def _remainder_starts(bag: np.ndarray, rem: np.ndarray, size, sizes) -> np.ndarray:
    """`_cycle_starts`, computed over the sequences with a remainder only when they are
    few (one-GPU bags, or most lengths a multiple of g): a sequence without one adds
    nothing to its bag's cycle, and its own start is never read (0 here). ``size``: each
    sequence's bag size, or the one size of every bag; ``sizes``: the distinct sizes."""
    if 2 * np.count_nonzero(rem) >= len(rem):
        return _cycle_starts(bag, rem, size, sizes)
    some = np.flatnonzero(rem)
    starts = np.zeros_like(rem)
    size_some = size if np.ndim(size) == 0 else size[some]
    starts[some] = _cycle_starts(bag[some], rem[some], size_some, sizes)
    return starts


def _cycle_starts(bag: np.ndarray, rem: np.ndarray, size, sizes) -> np.ndarray:
    """(n,) where each sequence's remainder starts in its bag's cycle: the remainders of the
    bag's earlier sequences (id order), summed, modulo the bag size (``size``: each
    sequence's, or one for all; ``sizes``: the distinct sizes)."""
    num_bags = int(bag.max()) + 1 if bag.size else 0
    order = by_small_key(bag, num_bags)
    # Only the sums modulo the bag size matter: when every size divides 2**16 (powers of
    # two), they are summed in uint16, whose wrap-around keeps them (and 4x narrower).
    wraps = all(s & (s - 1) == 0 and s <= 2**15 for s in map(int, sizes))
    dtype = np.uint16 if wraps else np.int64
    r = np.take(rem.astype(dtype), order)
    before = np.cumsum(r, dtype=dtype)
    before -= r  # exclusive running sum over all bags, in bag order
    counts = np.bincount(bag, minlength=num_bags)
    first = np.minimum(np.cumsum(counts) - counts, max(len(r) - 1, 0))
    before -= np.repeat(before[first], counts)  # from each bag's first sequence on
    starts = np.empty(len(rem), dtype=np.int64)
    starts[order] = before % (size if np.ndim(size) == 0 else np.take(size, order))
    return starts
