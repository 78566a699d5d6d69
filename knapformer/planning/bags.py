"""The state of one planning solve, shared by the fixed-topology and the auto solvers.

The fixed-topology solvers (planner.py) and the ``topology="auto"`` solver (auto.py) share
a layout's static bag arrays (`BagShape`), its mutable loads and token counts
(`BagLayout`), where each sequence goes (`Step`; the chunk table it becomes is made in
chunks.py), and the orderings both solvers sort by.

Per-bag state read item by item stays in Python lists where numpy's per-call overhead
would dominate; static per-topology arrays are cached (`bag_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.tuning import EPS, POUR_BISECTIONS, RANKED_SORT


class BagShape:
    """Static arrays of a topology (read-only, cached): bag sizes, first GPU position of
    each bag, bag of each GPU position, the distinct sizes and each bag's size class."""

    def __init__(self, bag_sizes: tuple[int, ...]):
        self.size = np.asarray(bag_sizes, dtype=np.int64)
        self.start = (np.cumsum(self.size) - self.size).astype(np.int64)
        self.bag_of_pos = np.repeat(np.arange(len(self.size)), self.size)
        self.class_size = np.unique(self.size)
        self.class_of_bag_array = np.searchsorted(self.class_size, self.size)
        self.class_of_bag = self.class_of_bag_array.tolist()  # read item by item
        self.positions = np.arange(int(self.size.sum()))
        for arr in (
            self.size,
            self.start,
            self.bag_of_pos,
            self.class_size,
            self.class_of_bag_array,
            self.positions,
        ):
            arr.flags.writeable = False

    @cached_property
    def topology(self) -> str:
        """The layout's topology name (``g1n2+g4n1``): made once per cached shape (a
        partition of 4,096 bags takes milliseconds to name)."""
        return str(Topology.from_bag_sizes(self.size.tolist()))


@lru_cache(maxsize=64)
def bag_shape(bag_sizes: tuple[int, ...]) -> BagShape:
    return BagShape(bag_sizes)


class BagLayout:
    """A topology's bags plus the mutable per-bag load and token state of a solve.

    ``weight`` is a bag's GPUs times the speed of its slowest GPU (the bag size when every
    GPU is nominal): its capacity is ``weight * gpu_capacity`` and ``load / weight`` the
    modelled time of each of its GPUs. ``even``: chunks spread a bag's tokens evenly over
    its GPUs (the default solver); else the published round-robin remainder (greedy).
    """

    def __init__(
        self,
        shape: BagShape,
        gpu_capacity: float,
        max_tokens: int | None,
        bag_speed: np.ndarray | None,
        even: bool,
    ):
        self.shape = shape
        self.size, self.start, self.class_size = shape.size, shape.start, shape.class_size
        self.weight = self.size.astype(np.float64)
        if bag_speed is not None:
            self.weight = self.weight * bag_speed
        self.gpu_capacity = float(gpu_capacity)
        self.capacity = self.weight * self.gpu_capacity
        self.load = np.zeros(len(self.size))
        self.max_tokens = max_tokens
        self.even = even
        if max_tokens is not None:
            self.bag_tokens = np.zeros(len(self.size), dtype=np.int64)
            self.tokens = np.zeros(len(shape.bag_of_pos), dtype=np.int64)  # round-robin only

    def per_gpu_time(self) -> np.ndarray:
        """(num_bags,) modelled time of each GPU of each bag."""
        return self.load / self.weight

    def makespan(self) -> float:
        return float(self.per_gpu_time().max(initial=0.0))

    def candidate_keys(self, workload: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per sequence, the range (lo, hi) of bag-size classes that may take it, as lo*K+hi.

        Candidates: capacity >= workload and size <= length; if none, the largest bags.
        (Capacity by size class at nominal speed: slower bags are then avoided through
        their higher occupancy.)
        """
        k = len(self.class_size)
        if k == 1:  # one bag size (the usual topology): every bag is a candidate
            return np.zeros(len(workload), dtype=np.int64)
        lo = np.searchsorted(self.class_size * self.gpu_capacity * (1 + EPS), workload, "left")
        hi = np.searchsorted(self.class_size, lengths, "right") - 1
        empty = lo > hi
        lo = np.where(empty, k - 1, lo)
        hi = np.where(empty, k - 1, hi)
        return lo * k + hi

    def bag_max_tokens(self) -> np.ndarray:
        """(num_bags,) tokens on the fullest GPU of each bag (under a token cap)."""
        if self.even:  # an even spread leaves every GPU of the bag within one token
            return -(-self.bag_tokens // self.size)
        return np.maximum.reduceat(self.tokens, self.start)

    def token_room(self, length: int) -> np.ndarray:
        """Which bags can take a sequence of ``length`` tokens under the cap (round-robin:
        conservatively, as if its remainder landed on the fullest GPU)."""
        if self.even:
            return -(-(self.bag_tokens + length) // self.size) <= self.max_tokens
        need = length // self.size + length % self.size
        return self.bag_max_tokens() + need <= self.max_tokens

    def add(self, bag: int, workload: float, length: int, rem: int, sign: int = 1) -> None:
        """Account a sequence placed in ``bag`` (``sign=-1`` takes it out again); ``rem``
        is its remainder chunk under round-robin."""
        self.load[bag] += sign * workload
        if self.max_tokens is not None:
            self.bag_tokens[bag] += sign * length
            if not self.even:
                g, s = int(self.size[bag]), int(self.start[bag])
                self.tokens[s : s + g] += sign * (length // g)
                self.tokens[s + rem] += sign * (length % g)

    def add_many(self, bag: np.ndarray, workload: np.ndarray, lengths: np.ndarray | None) -> None:
        """Vectorised ``add`` of sequences placed in ``bag`` (each (m,)), even spread;
        ``lengths`` may be None when there is no token cap."""
        self.load += np.bincount(bag, weights=workload, minlength=len(self.size))
        if self.max_tokens is not None:
            self.bag_tokens += np.bincount(bag, weights=lengths, minlength=len(self.size)).astype(
                np.int64
            )

    def over_token_cap(self) -> bool:
        return self.max_tokens is not None and bool((self.bag_max_tokens() > self.max_tokens).any())

    def infeasible(self, seq: int, length: int) -> KnapformerError:
        return KnapformerError(
            f"max_tokens_per_gpu={self.max_tokens} is infeasible: sequence {seq} "
            f"({length} tokens) fits no bag (most-loaded GPU already holds "
            f"{int(self.bag_max_tokens().max())} tokens)"
        )


@dataclass
class Step:
    """The state of one solve: the step's sequences (read-only) and where they go."""

    lengths: np.ndarray  # (n,) tokens
    workload: np.ndarray  # (n,)
    src_pos: np.ndarray  # (n,) position of each sequence's source GPU
    home_bag: np.ndarray  # (n,) bag holding that GPU
    layout: BagLayout
    bag: np.ndarray  # (n,) assigned bag; -1 while unplaced
    rem: np.ndarray  # (n,) round-robin only: the chunk that takes the L % g remainder
    chunks: tuple | None = None  # `chunk_table`, once made (auto prices candidates by it)
    # `ranks`, made on first need; not a constructor argument (a new step ranks anew).
    _ranks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def start(cls, shape, lengths, workload, src_pos, layout) -> Step:
        n = len(lengths)
        bag = np.full(n, -1, dtype=np.int64)
        # A source position of -1: the sequence comes from a GPU outside these bags (one
        # size class of an auto partition), so it has no home bag.
        home = np.take(shape.bag_of_pos, src_pos)  # (np.take: a step-sized gather, faster)
        if n and src_pos.min() < 0:
            home[src_pos < 0] = -1
        return cls(lengths, workload, src_pos, home, layout, bag,
                   np.zeros(n, dtype=np.int64))  # fmt: skip

    def ranks(self, lightest: bool = False) -> tuple[np.ndarray, int]:
        """(each sequence's rank among the step's distinct workloads, heaviest first, or
        lightest first; how many distinct there are), made once: the large sorts of a
        solve read their subsets' order from it instead of sorting their workloads."""
        if lightest not in self._ranks:
            if lightest:
                rank, distinct = self.ranks()
                self._ranks[True] = (distinct - 1 - rank, distinct)
            else:
                by_length = _ranks_by_length(self.lengths, self.workload)
                self._ranks[False] = by_length or _dense_ranks(-self.workload, np.int64)
        return self._ranks[lightest]


def descending(workload: np.ndarray, seq: np.ndarray, step: Step | None = None) -> np.ndarray:
    """``seq`` ordered by workload, largest first; ties by sequence id (stable). Many of a
    ``step``'s sequences: a radix sort of their ranks (`Step.ranks`), the same order."""
    if step is not None and len(seq) >= RANKED_SORT:
        rank, distinct = step.ranks()
        if distinct <= 2**15:
            return seq[np.argsort(rank[seq].astype(np.int16), kind="stable")]
    return seq[stable_argsort(-workload[seq])]


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")``, faster for many values of few distinct ones
    (a step's workloads): an unstable sort ranks the distinct values, and a stable radix
    sort of the ranks as int16 orders the ties by position, as the stable sort does."""
    if values.size < RANKED_SORT:
        return np.argsort(values, kind="stable")
    ranks, distinct = _dense_ranks(values, np.int16)
    if distinct > 2**15:  # too many distinct values for a radix sort
        return np.argsort(values, kind="stable")
    return np.argsort(ranks, kind="stable")


def _dense_ranks(values: np.ndarray, dtype) -> tuple[np.ndarray, int]:
    """(each value's rank among the distinct values, least first, as ``dtype``; how many
    distinct values there are), from one unstable sort."""
    order = np.argsort(values)
    rank = np.cumsum(run_heads(np.take(values, order)))
    ranks = np.empty(values.size, dtype=dtype)
    ranks[order] = rank - 1  # int16 wraps beyond 2**15: the caller checks the count
    return ranks, int(rank[-1])


def _ranks_by_length(lengths: np.ndarray, workload: np.ndarray) -> tuple[np.ndarray, int] | None:
    """`_dense_ranks` of ``-workload`` read off a table indexed by length, without sorting:
    the same ranks when the workload is a non-decreasing function of the length (the
    workload model's always is; checked here), else None. Only for lengths of at most a
    few times as many tokens as there are sequences (the table's size)."""
    if lengths.size == 0 or lengths.dtype.kind not in "iu" or lengths.min() < 0:
        return None
    span = int(lengths.max()) + 1  # the table: lengths 0.. (the lengths index it)
    if span > 4 * lengths.size + 4096:
        return None
    of_length = np.zeros(span)
    of_length[lengths] = workload
    present = np.zeros(span, dtype=bool)
    present[lengths] = True
    if not np.array_equal(np.take(of_length, lengths), workload):  # not a function of the length
        return None
    ordered = of_length[present]  # the distinct lengths' workloads, shortest first
    if (ordered[1:] < ordered[:-1]).any():  # not non-decreasing
        return None
    ascending = np.cumsum(run_heads(ordered))  # 1-based rank among the distinct workloads
    distinct = int(ascending[-1])
    # int16 where the ranks fit: every reader narrows them to that for a radix sort
    rank_of_length = np.zeros(span, dtype=np.int16 if distinct <= 2**15 else np.int64)
    rank_of_length[present] = distinct - ascending  # heaviest first, 0-based
    return np.take(rank_of_length, lengths), distinct


def bag_speeds(shape: BagShape, speed: np.ndarray | None) -> np.ndarray | None:
    """(num_bags,) speed of each bag's slowest GPU, or None when every GPU is nominal."""
    return None if speed is None else np.minimum.reduceat(speed, shape.start)


def by_home_heaviest_first(seqs, home, workload, num_bags, ranks=None) -> np.ndarray:
    """``seqs`` ordered by home bag, heaviest first within one (ties by position in
    ``seqs``): what ``seqs[np.lexsort((-workload[seqs], home[seqs]))]`` gives. Many
    sequences: their workload ranks, read from ``ranks()`` (`Step.ranks` in
    ``workload``'s order) when given, then two stable radix sorts of int16, by rank and
    then by home (2.7 ms for 86,000 where one sort of unique int64 keys takes 4.0), or,
    where the ranks or the homes do not fit int16, that sort of keys made unique by (home,
    rank, position); else two stable passes, the second over small ints (a radix sort)."""
    n = len(seqs)
    if n >= RANKED_SORT:
        if ranks is None:
            ranks, distinct = _dense_ranks(-workload[seqs], np.int64)
        else:
            step_ranks, distinct = ranks()
            ranks = np.take(step_ranks, seqs)
        if distinct <= 2**15 and num_bags <= 2**15:
            by_w = np.take(seqs, np.argsort(ranks.astype(np.int16, copy=False), kind="stable"))
            return np.take(by_w, by_small_key(np.take(home, by_w), num_bags))
        # Ties by position; where ``seqs`` ascends, by id: the same order, no positions made.
        ascending = bool((seqs[1:] > seqs[:-1]).all())
        span = int(seqs[-1]) + 1 if ascending else n
        if num_bags * distinct * span < 2**62:
            key = np.take(home, seqs)  # (home * distinct + rank) * span + position, in place
            key *= distinct
            key += ranks
            key *= span
            key += seqs if ascending else np.arange(n)
            if key.dtype != seqs.dtype:
                return seqs[np.argsort(key)]
            # Into the keys' buffer (a step-sized array less to page in); "clip": the
            # indices are valid, and "raise" would gather into a temporary first.
            return np.take(seqs, np.argsort(key), out=key, mode="clip")
    by_w = descending(workload, seqs)
    return by_w[by_small_key(home[by_w], num_bags)]


def run_heads(ordered: np.ndarray) -> np.ndarray:
    """Where each run of equal values of ``ordered`` begins: True at the first value and
    wherever a value differs from the one before."""
    new = np.empty(ordered.size, dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    return new


def by_small_key(key: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` for ints in 0..bound-1: below 2**15 a stable
    sort of int16 is a radix sort (the same order, several times faster)."""
    return np.argsort(key.astype(np.int16, copy=False) if bound <= 2**15 else key, kind="stable")


def prefix_within_groups(values: np.ndarray, group: np.ndarray, room: np.ndarray) -> np.ndarray:
    """For rows sorted by ``group``: True while the running sum within the group <= room."""
    if values.size == 0:
        return np.zeros(0, dtype=bool)
    total = np.cumsum(values)  # over every group: a group's sums are differences of it
    starts = np.flatnonzero(run_heads(group))
    before = np.empty(starts.size, dtype=total.dtype)  # the sum before each group
    before[0] = 0.0
    np.take(total, starts[1:] - 1, out=before[1:])
    total -= np.repeat(before, np.diff(starts, append=values.size))
    return total <= room * (1 + EPS)


def prefix_within_bags(values: np.ndarray, bag: np.ndarray, room: np.ndarray) -> np.ndarray:
    """`prefix_within_groups` for rows sorted by bag id, ``room`` given per bag (the same
    result, bit for bit): the groups found by binary search, and two step-sized
    temporaries instead of six (each a fresh allocation the kernel pages in)."""
    if values.size == 0:
        return np.zeros(0, dtype=bool)
    total = np.cumsum(values)
    starts = np.searchsorted(bag, np.arange(len(room)))  # each bag's first row
    before = np.zeros(len(room))  # the running sum before each bag's rows
    has_before = starts > 0
    before[has_before] = total[starts[has_before] - 1]
    per_row = np.take(before, bag)
    total -= per_row
    np.take(room * (1 + EPS), bag, out=per_row, mode="clip")  # (valid ids; "raise" buffers)
    return total <= per_row


def water_room(held: np.ndarray, weight: np.ndarray, amount: float, inflation=1.0):
    """Each bag's room up to one water level: the least per-GPU level (to
    ``POUR_BISECTIONS`` halvings) at which the bags, holding ``held`` on ``weight`` GPUs,
    have room for ``amount`` (a bag's room: ``max(0, level * weight - held) / inflation``)."""

    def room(level: float) -> np.ndarray:
        return np.maximum(0.0, level * weight - held) / inflation

    lo, hi = 0.0, float((held.sum() + amount * np.max(inflation)) / weight.sum()) + held.max()
    for _ in range(POUR_BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if room(mid).sum() >= amount else (mid, hi)
    return room(hi)


def pour_slots(cost: np.ndarray, room: np.ndarray) -> np.ndarray:
    """The slot (index into ``room``) each of a run of sequences is poured into: where the
    running sum of ``cost`` puts the sequence's middle among the slots' running room."""
    middle = np.cumsum(cost) - 0.5 * cost
    return np.minimum(np.searchsorted(np.cumsum(room), middle, side="right"), len(room) - 1)


def least(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of ``np.argsort(values, kind="stable")`` without sorting them all:
    every value up to the k-th smallest, then a stable sort of those few."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= len(values):
        return np.argsort(values, kind="stable")
    some = np.flatnonzero(values <= np.partition(values, k - 1)[k - 1])
    return some[np.argsort(values[some], kind="stable")[:k]]
