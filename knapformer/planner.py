"""The planner: a pure, deterministic function from sequence lengths to a `RoutingPlan`.

Every rank computes the same plan from the same gathered lengths, so nothing here may
depend on process state. Two solvers:

``"greedy"`` — the published algorithm. Per-GPU capacity C = total load / #GPUs, a bag
of g GPUs has capacity g*C. Sequences are taken by workload, largest first; candidate
bags are those with capacity >= the workload and g <= the length (if none: the bags of
the largest size); the sequence goes to the candidate with the lowest occupancy
(load / capacity). A sequence in a bag of g GPUs is split into g chunks of L // g tokens,
the remainder going to one chunk chosen round-robin.

``"knapformer"`` (default) — balance like greedy, move far fewer tokens. Its per-GPU
capacity is the lower bound on the makespan (at least greedy's mean load; larger when one
sequence outweighs the mean, and then every GPU under it keeps its own work).
1. *heavy* sequences (more than a quarter of a GPU's capacity; in a step of at most 128
   sequences, every sequence) are placed one by one, largest first, in their home bag
   (the bag holding their source GPU) when it has room, else like greedy;
2. every other sequence stays in its home bag while the bag has room — decided for all
   sequences at once with a sorted cumulative sum per bag (largest stay home);
3. the rest (the *pool*, usually a few percent) is placed largest first: home when it
   still fits, else the least-occupied candidate bag, so the smallest sequences even
   out the last gaps as in greedy;
4. a local search moves or swaps sequences between the most-loaded bag and the
   least-loaded ones until the makespan is within 0.08 % of the lower bound, or no
   exchange helps; if it ends more than 0.1 % above the bound, greedy is solved too and
   the better makespan kept (so it is never worse than greedy's beyond 0.1 % of the bound).
   A small round scores every (leaving, returning) pair at once; a large one only the two
   members per partner nearest the ideal exchange (the best one is always among them).
In a multi-GPU bag the remainder tokens go to the chunk that stays on the source GPU,
so fewer tokens move. An optional ``max_tokens_per_gpu`` is a hard cap on the tokens
each GPU holds after routing (``ValueError`` when a sequence fits nowhere).

Speed: a plan is made every training step, for ~100 sequences (32 GPUs) up to ~30,000
(1024 GPUs). Per-sequence work is a fixed number of numpy calls; per-bag state that is
read item by item (occupancies, heaps) is kept in Python lists, where numpy's per-call
overhead would dominate; static per-topology arrays are cached.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike

from knapformer import __version__
from knapformer.errors import KnapformerError
from knapformer.limits import MAX_SEQ_LENGTH, MAX_SEQUENCES, check_count
from knapformer.plan import Measurements, RoutingPlan
from knapformer.topology import Topology, as_topology
from knapformer.workload import WorkloadModel

DEFAULT_SOLVER = "knapformer"
SOLVERS = ("knapformer", "greedy")
_HEAVY_FRACTION = 0.25  # of one GPU's capacity: placed before the bulk "stay home" pass
_EPS = 1e-12
_ONE_BY_ONE = 128  # steps of at most this many sequences are placed one by one
# Further from the lower bound than this fraction, greedy is solved as well and the
# better makespan kept: the result is then never worse than greedy's (which is >= the
# bound) by more than 0.1 % of the bound.
_FALLBACK_TOLERANCE = 1e-3
_LEVEL_TOLERANCE = 8e-4  # the local search stops this close to the bound (with margin)
_LEVEL_PARTNERS = 8  # least-loaded bags tried as exchange partners of the most-loaded one
# A search round scores every (leaving, returning) pair while there are at most this many;
# beyond, only the two candidates nearest the ideal exchange per partner.
_DENSE_CELLS = 8192


def plan_routing(
    lengths_per_gpu: Sequence[ArrayLike],
    topology: Topology | str,
    model: WorkloadModel,
    solver: str = DEFAULT_SOLVER,
    max_tokens_per_gpu: int | None = None,
    gpus: Sequence[int] | None = None,
    step: int | None = None,
    run: str | None = None,
) -> RoutingPlan:
    """Plan one step.

    ``lengths_per_gpu[i]`` holds the sequence lengths (tokens) on GPU ``gpus[i]``, in the
    order they are packed there. Sequence ids are assigned in that order, GPU by GPU.
    """
    started = time.perf_counter()
    topo = as_topology(topology)
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if len(lengths_per_gpu) != topo.num_gpus:
        raise ValueError(
            f"topology {topo} has {topo.num_gpus} GPUs but lengths were given for "
            f"{len(lengths_per_gpu)} GPUs"
        )
    gpu_ranks = list(range(topo.num_gpus)) if gpus is None else [int(g) for g in gpus]
    bags = topo.bags(gpu_ranks)
    if max_tokens_per_gpu is not None and max_tokens_per_gpu <= 0:
        raise ValueError(f"max_tokens_per_gpu must be positive, got {max_tokens_per_gpu}")

    shape = _bag_shape(topo.bag_sizes)
    lengths, src_pos = _flatten(lengths_per_gpu, shape)
    workload = model.workload(lengths)
    # Summed left to right (cumsum), as the published algorithm and its plain-Python
    # transcription do: pairwise summation differs in the last bits and flips near-ties.
    with np.errstate(over="ignore"):
        mean = float(workload.cumsum()[-1]) / topo.num_gpus if workload.size else 0.0
    if not np.isfinite(mean):
        raise KnapformerError(
            f"the workloads of the step sum to {mean} under {model}: loads cannot be balanced"
        )
    home_bag = shape.bag_of_pos[src_pos]
    if solver == "greedy":
        layout = _BagLayout(shape, mean, max_tokens_per_gpu)
        bag, rem = _solve_greedy(lengths, workload, home_bag, src_pos, layout)
    else:
        bag, rem, layout = _solve_local_or_greedy(
            shape, lengths, workload, home_bag, src_pos, mean, max_tokens_per_gpu
        )

    chunk_seq, chunk_pos, chunk_off, chunk_len = _chunk_table(lengths, bag, rem, layout)
    if gpus is None:  # positions are ranks
        src_gpu, chunk_src, chunk_dst = src_pos, src_pos[chunk_seq], chunk_pos
    else:
        ranks = np.asarray(gpu_ranks, dtype=np.int64)
        src_gpu, chunk_src, chunk_dst = ranks[src_pos], ranks[src_pos[chunk_seq]], ranks[chunk_pos]

    options = {} if max_tokens_per_gpu is None else {"max_tokens_per_gpu": max_tokens_per_gpu}
    plan = RoutingPlan.build(
        planner_version=__version__,
        step=step,
        time=time.time(),
        run=run,
        topology=str(topo),
        gpus=gpu_ranks,
        bags=bags,
        token_dim=model.token_dim,
        gamma=model.gamma,
        solver=solver,
        solver_options=options,
        sequences={"src_gpu": src_gpu, "length": lengths, "workload": workload, "bag": bag},
        chunks={
            "seq": chunk_seq,
            "src_gpu": chunk_src,
            "dst_gpu": chunk_dst,
            "offset": chunk_off,
            "length": chunk_len,
        },
    )
    plan.measurements = Measurements(plan_ms=(time.perf_counter() - started) * 1e3)
    return plan


class _BagShape:
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


@lru_cache(maxsize=64)
def _bag_shape(bag_sizes: tuple[int, ...]) -> _BagShape:
    return _BagShape(bag_sizes)


def _flatten(
    lengths_per_gpu: Sequence[ArrayLike], shape: _BagShape
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-GPU lengths; returns (lengths, source GPU position) per sequence."""
    try:  # one C-level pass for the usual input: one flat list or array per GPU
        lengths = np.concatenate(lengths_per_gpu)
        counts = list(map(len, lengths_per_gpu))
    except (ValueError, TypeError):  # scalars or nested parts: flatten each
        parts = [np.asarray(part).reshape(-1) for part in lengths_per_gpu]
        lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        counts = [p.size for p in parts]
    if lengths.ndim != 1:
        parts = [np.asarray(part).reshape(-1) for part in lengths_per_gpu]
        lengths, counts = np.concatenate(parts), [p.size for p in parts]
    src_pos = np.repeat(shape.positions, counts)
    if lengths.size == 0:
        return lengths.astype(np.int64), src_pos
    if lengths.dtype.kind not in "iu" and (
        lengths.dtype.kind != "f" or np.any(np.mod(lengths, 1) != 0)
    ):
        bad = int(src_pos[np.flatnonzero(np.mod(lengths.astype(float), 1) != 0)[0]])
        raise ValueError(f"lengths on GPU position {bad} must be whole numbers of tokens")
    check_count(lengths.size, MAX_SEQUENCES, "the sequences of a step")
    # Bounded before the cast: a uint64 beyond int64 would wrap around to a negative.
    if lengths.max() > MAX_SEQ_LENGTH:
        bad = int(np.argmax(lengths))
        raise KnapformerError(
            f"lengths on GPU position {int(src_pos[bad])} include {lengths[bad]:,} tokens; a "
            f"sequence holds at most {MAX_SEQ_LENGTH:,} (knapformer.limits)"
        )
    if lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise ValueError(
            f"lengths on GPU position {int(src_pos[bad])} include a negative value {lengths[bad]}"
        )
    return lengths.astype(np.int64, copy=False), src_pos


class _BagLayout:
    """A topology's bags plus the mutable per-bag load and per-GPU token state of a solve."""

    def __init__(self, shape: _BagShape, gpu_capacity: float, max_tokens: int | None):
        self.shape = shape
        self.size, self.start, self.class_size = shape.size, shape.start, shape.class_size
        self.gpu_capacity = float(gpu_capacity)
        self.capacity = self.size * self.gpu_capacity
        self.load = np.zeros(len(self.size))
        self.max_tokens = max_tokens
        if max_tokens is not None:
            self.tokens = np.zeros(len(shape.bag_of_pos), dtype=np.int64)
            self.bag_max_tokens = np.zeros(len(self.size), dtype=np.int64)

    def candidate_keys(self, workload: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per sequence, the range (lo, hi) of bag-size classes that may take it, as lo*K+hi.

        Candidates: capacity >= workload and size <= length; if none, the largest bags.
        """
        k = len(self.class_size)
        if k == 1:  # one bag size (the usual topology): every bag is a candidate
            return np.zeros(len(workload), dtype=np.int64)
        lo = np.searchsorted(self.class_size * self.gpu_capacity * (1 + _EPS), workload, "left")
        hi = np.searchsorted(self.class_size, lengths, "right") - 1
        empty = lo > hi
        lo = np.where(empty, k - 1, lo)
        hi = np.where(empty, k - 1, hi)
        return lo * k + hi

    def token_room(self, length: int) -> np.ndarray:
        """Which bags can take a sequence of ``length`` tokens under the cap (conservative)."""
        need = length // self.size + length % self.size
        return self.bag_max_tokens + need <= self.max_tokens

    def add(self, bag: int, workload: float, length: int, rem: int, sign: int = 1) -> None:
        """Account a sequence placed in ``bag`` (``sign=-1`` takes it out again)."""
        self.load[bag] += sign * workload
        if self.max_tokens is not None:
            g, s = int(self.size[bag]), int(self.start[bag])
            self.tokens[s : s + g] += sign * (length // g)
            self.tokens[s + rem] += sign * (length % g)
            self.bag_max_tokens[bag] = self.tokens[s : s + g].max()

    def add_many(self, seq: np.ndarray, bag: np.ndarray, workload, lengths, rem) -> None:
        """Vectorised ``add`` for many sequences at once."""
        self.load += np.bincount(bag, weights=workload[seq], minlength=len(self.size))
        if self.max_tokens is not None:
            full = np.full(len(lengths), -1, dtype=np.int64)
            full[seq] = bag
            _, pos, _, ln = _chunk_table(lengths, full, rem, self, only=seq)
            self.tokens += np.bincount(pos, weights=ln, minlength=len(self.tokens)).astype(np.int64)
            self.bag_max_tokens = np.maximum.reduceat(self.tokens, self.start)

    def infeasible(self, seq: int, length: int) -> ValueError:
        return ValueError(
            f"max_tokens_per_gpu={self.max_tokens} is infeasible: sequence {seq} "
            f"({length} tokens) fits no bag (most-loaded GPU already holds "
            f"{int(self.tokens.max())} tokens)"
        )


def _descending(workload: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """``seq`` ordered by workload, largest first; ties by sequence id (stable)."""
    return seq[np.argsort(-workload[seq], kind="stable")]


def _place_in_order(
    order: np.ndarray,
    lengths: np.ndarray,
    workload: np.ndarray,
    home_bag: np.ndarray,
    src_pos: np.ndarray,
    layout: _BagLayout,
    bag: np.ndarray,
    rem: np.ndarray,
    prefer_home: bool,
) -> None:
    """Place ``order`` one by one into the least-occupied candidate bag (LPT).

    With ``prefer_home`` a sequence stays in its home bag when that bag is a candidate
    and still has room; its remainder tokens then stay on the source GPU. Without it the
    remainder goes to the bag's chunks round-robin (the published rule). Ties between
    equally occupied bags go to the lowest bag id.
    """
    if order.size == 0:
        return
    shape = layout.shape
    num_classes = len(layout.class_size)
    lo, hi = np.divmod(layout.candidate_keys(workload[order], lengths[order]), num_classes)
    home = home_bag[order]
    home_class = shape.class_of_bag_array[home]
    may_stay = (lo <= home_class) & (home_class <= hi) if prefer_home else np.zeros(len(lo), bool)
    # Plain lists: for the few hundred to few thousand sequences placed one by one,
    # Python scalars beat per-item numpy calls several times over.
    load = layout.load.tolist()
    limit = (layout.capacity * (1 + _EPS)).tolist()
    safe_capacity = np.where(layout.capacity > 0, layout.capacity, 1.0).tolist()
    occupancy = [x / c for x, c in zip(load, safe_capacity, strict=True)]
    # One min-heap of (occupancy, bag) per size class; entries go stale when a bag's
    # occupancy grows and are dropped when they surface (occupancy never decreases).
    class_of_bag = shape.class_of_bag
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_classes)]
    for b, occ in enumerate(occupancy):
        heaps[class_of_bag[b]].append((occ, b))
    for heap in heaps:
        heapq.heapify(heap)
    size, start = layout.size.tolist(), layout.start.tolist()
    round_robin = [0] * len(size)
    capped = layout.max_tokens is not None
    rows = zip(
        order.tolist(),
        lo.tolist(),
        hi.tolist(),
        may_stay.tolist(),
        workload[order].tolist(),
        lengths[order].tolist(),
        home.tolist(),
        src_pos[order].tolist(),
        strict=True,
    )
    chosen_bag, chosen_rem = [], []  # written back in one call each at the end
    for seq, lo, hi, may_stay, w, length, h, src in rows:
        room = layout.token_room(length).tolist() if capped else None
        if may_stay and load[h] + w <= limit[h] and (room is None or room[h]):
            b = h
        elif lo == hi and not capped:  # the usual case, one size class: its heap's top
            b = _live_top(heaps[lo], occupancy)[1]
        else:
            b = _least_occupied(heaps, lo, hi, occupancy, room)
            if b < 0:
                raise layout.infeasible(seq, length)
        g = size[b]
        if prefer_home and b == h:
            r = src - start[b]
        elif prefer_home:
            r = int(np.argmin(layout.tokens[start[b] : start[b] + g])) if capped else 0
        else:
            r = round_robin[b] % g
            if length % g:
                round_robin[b] += 1
        chosen_bag.append(b)
        chosen_rem.append(r)
        load[b] += w
        occupancy[b] = load[b] / safe_capacity[b]
        heap = heaps[class_of_bag[b]]
        if heap[0][1] == b:  # b was the least occupied: update in place, nothing goes stale
            heapq.heapreplace(heap, (occupancy[b], b))
        else:
            heapq.heappush(heap, (occupancy[b], b))
        if capped:
            layout.add(b, 0.0, length, r)
    bag[order], rem[order] = chosen_bag, chosen_rem
    layout.load[:] = load


def _least_occupied(
    heaps: list[list[tuple[float, int]]],
    lo: int,
    hi: int,
    occupancy: list[float],
    allowed: list[bool] | None,
) -> int:
    """The bag of size class lo..hi with the lowest (occupancy, id), or -1 if none is
    ``allowed`` (under a token cap, a scan of the class's live entries)."""
    best = None
    for c in range(lo, hi + 1):
        heap = heaps[c]
        if allowed is None:
            top = _live_top(heap, occupancy)
        else:
            live = (e for e in heap if allowed[e[1]] and e[0] == occupancy[e[1]])
            top = min(live, default=None)
        if top is not None and (best is None or top < best):
            best = top
    return -1 if best is None else best[1]


def _live_top(heap: list[tuple[float, int]], occupancy: list[float]) -> tuple[float, int]:
    """The heap's least (occupancy, bag), after dropping stale entries (bags whose load
    grew since the entry was pushed)."""
    while heap[0][0] != occupancy[heap[0][1]]:
        heapq.heappop(heap)
    return heap[0]


def _solve_local_or_greedy(shape, lengths, workload, home_bag, src_pos, mean, max_tokens):
    """The default solver, with greedy as a safety net.

    Its per-GPU capacity is the lower bound on the makespan rather than greedy's mean
    load: when one sequence outweighs the mean, every GPU under that bound can keep all
    its sequences at no cost to the makespan. Where the local search stalls short of the
    bound (coarse sequences), greedy is solved too and the better makespan is kept.
    """
    top = float(workload.max()) / int(shape.size[-1]) if workload.size else 0.0
    lower_bound = max(mean, top)
    layout = _BagLayout(shape, lower_bound, max_tokens)
    bag, rem = _solve_local(lengths, workload, home_bag, src_pos, layout)
    makespan = float((layout.load / layout.size).max(initial=0.0))
    if makespan <= lower_bound * (1 + _FALLBACK_TOLERANCE):
        return bag, rem, layout
    greedy_layout = _BagLayout(shape, mean, max_tokens)
    try:
        g_bag, g_rem = _solve_greedy(lengths, workload, home_bag, src_pos, greedy_layout)
    except ValueError:  # greedy cannot meet the token cap where ours did
        return bag, rem, layout
    if float((greedy_layout.load / greedy_layout.size).max(initial=0.0)) < makespan:
        return g_bag, g_rem, greedy_layout
    return bag, rem, layout


def _solve_greedy(lengths, workload, home_bag, src_pos, layout):
    n = len(lengths)
    bag = np.zeros(n, dtype=np.int64)
    rem = np.zeros(n, dtype=np.int64)
    order = _descending(workload, np.arange(n))
    _place_in_order(order, lengths, workload, home_bag, src_pos, layout, bag, rem, False)
    return bag, rem


def _solve_local(lengths, workload, home_bag, src_pos, layout):
    n = len(lengths)
    bag = np.full(n, -1, dtype=np.int64)
    rem = src_pos - layout.start[home_bag]  # remainder chunk = the one on the source GPU

    empty = lengths == 0  # nothing to compute or move: keep at home, no chunks
    bag[empty] = home_bag[empty]

    # A small step is placed one by one, where a bulk pass would save little time and
    # land further from the bound; a large one only its heavy sequences.
    one_by_one = ~empty
    if n > _ONE_BY_ONE:
        one_by_one &= workload > _HEAVY_FRACTION * layout.gpu_capacity
    first = _descending(workload, np.flatnonzero(one_by_one))
    _place_in_order(first, lengths, workload, home_bag, src_pos, layout, bag, rem, True)
    if n > _ONE_BY_ONE:
        _stay_home_in_bulk(np.flatnonzero(bag < 0), lengths, workload, home_bag, layout, bag, rem)
        pool = _descending(workload, np.flatnonzero(bag < 0))
        _place_in_order(pool, lengths, workload, home_bag, src_pos, layout, bag, rem, True)
    _level_makespan(lengths, workload, home_bag, src_pos, layout, bag, rem)
    return bag, rem


def _stay_home_in_bulk(seqs, lengths, workload, home_bag, layout, bag, rem):
    """Within each home bag, the largest of ``seqs`` stay while there is room (one
    vectorised pass; sequences shorter than their home bag are left to the pool)."""
    light = seqs[layout.size[home_bag[seqs]] <= lengths[seqs]]
    order = light[np.lexsort((-workload[light], home_bag[light]))]
    hb = home_bag[order]
    room = layout.capacity - layout.load
    stays = _prefix_within_groups(workload[order], hb, room[hb])
    if layout.max_tokens is not None:
        g = layout.size[hb]
        need = lengths[order] // g + lengths[order] % g
        token_room = layout.max_tokens - layout.bag_max_tokens[hb]
        stays &= _prefix_within_groups(need.astype(np.float64), hb, token_room)
    stay_ids = order[stays]
    bag[stay_ids] = hb[stays]
    layout.add_many(stay_ids, hb[stays], workload, lengths, rem)


def _level_makespan(lengths, workload, home_bag, src_pos, layout, bag, rem, max_rounds=None):
    """Local search on the makespan. Each round, every bag above the stopping load (up
    to ``_LEVEL_PARTNERS`` of them, most loaded first) is paired with a distinct one of
    the least-loaded bags: one sequence moves from it to the partner, or a pair is
    swapped, whichever evens the two out best, as long as that lowers the larger of the
    two. All pairs are scored in one vectorised pass. Staying home leaves uneven last
    gaps; a few well-sized moves and swaps close them (greedy gets the same effect from
    placing the smallest last)."""
    num_bags = len(layout.size)
    if layout.gpu_capacity <= 0 or num_bags < 2:
        return
    size = layout.size.astype(np.float64)
    per_gpu = layout.load / size
    lower_bound = max(
        float(layout.load.sum() / size.sum()), float(workload.max(initial=0.0)) / size[-1]
    )
    stop = lower_bound * (1 + _LEVEL_TOLERANCE)
    if per_gpu.max() <= stop:  # the usual case: nothing to level
        return
    accepts = layout.capacity * (1 + _EPS)  # the largest workload each bag may take
    members = _Members(bag, lengths, workload, num_bags)
    one_size = len(layout.class_size) == 1
    for _ in range(4 * num_bags if max_rounds is None else max_rounds):
        by_load = per_gpu.argsort(kind="stable").tolist()
        num_over = min(int(np.count_nonzero(per_gpu > stop)), _LEVEL_PARTNERS)
        over = by_load[::-1][:num_over]
        partners = by_load[: num_bags - num_over][:_LEVEL_PARTNERS]
        if not over or not partners:
            return
        moves = _best_exchanges(over, partners, members, size, per_gpu, accepts, one_size)
        if not moves:
            return
        for a, b, out_of_a, out_of_b in moves:
            if not _exchange(
                a, b, out_of_a, out_of_b, lengths, workload, home_bag, src_pos, layout, bag, rem
            ):
                return
            members.swap(a, b, out_of_a, out_of_b)
            per_gpu[a], per_gpu[b] = layout.load[a] / size[a], layout.load[b] / size[b]


class _Members:
    """Bag, length and workload of every sequence plus one *phantom* per bag (no tokens,
    fits every bag): "nothing comes back" in an exchange is then just the partner's
    phantom, scored like any other member."""

    def __init__(self, bag, lengths, workload, num_bags):
        self.num_real = len(bag)
        self.bag = np.concatenate([bag, np.arange(num_bags)])
        self.length = np.concatenate([lengths, np.full(num_bags, np.iinfo(np.int64).max)])
        self.workload = np.concatenate([workload, np.zeros(num_bags)])

    def real(self, member: int) -> int:
        """The sequence id of ``member``, or -1 for a phantom."""
        return member if member < self.num_real else -1

    def swap(self, a: int, b: int, out_of_a: int, out_of_b: int) -> None:
        self.bag[out_of_a] = b
        if out_of_b >= 0:
            self.bag[out_of_b] = a


def _best_exchanges(over, partners, members, size, per_gpu, accepts, one_size):
    """One round's exchanges: each over-loaded bag ``a`` (most loaded first) with the free
    partner ``b`` that evens the two out best. Returns (a, b, sequence leaving a, sequence
    leaving b or -1) per exchange that lowers the larger of the two bags. ``one_size``:
    every bag has the same number of GPUs."""
    num_o, num_p = len(over), len(partners)
    slot = np.full(len(size), num_o + num_p)  # over bag -> 0.., partner -> num_o.., rest last
    slot[over] = np.arange(num_o)
    slot[partners] = np.arange(num_o, num_o + num_p)
    slot_of = slot[members.bag]
    by_slot = slot_of.argsort(kind="stable")
    bounds = np.searchsorted(slot_of[by_slot], np.arange(num_o + num_p + 1)).tolist()
    # Rows: members that may leave the over-loaded bags; columns: members that may come
    # back from the partners (a phantom: nothing). Both grouped by bag, none empty.
    out, back = by_slot[: bounds[num_o]], by_slot[bounds[num_o] : bounds[-1]]
    row_starts, col_starts = bounds[:num_o], [s - bounds[num_o] for s in bounds[num_o:-1]]
    # With one bag size every bag is a candidate for every sequence (the rule's fallback
    # is "the largest bags"): the size and capacity checks are then skipped.
    if not one_size:
        ov = np.asarray(over)
        back = back[
            (members.length[back] >= size[ov].min()) & (members.workload[back] <= accepts[ov].max())
        ]
        col_starts = np.searchsorted(slot_of[back], np.arange(num_o, num_o + num_p)).tolist()
    out_w, a_bag = members.workload[out][:, None], members.bag[out][:, None]
    g_a, per_a = size[a_bag], per_gpu[a_bag]
    if out.size * back.size <= _DENSE_CELLS:
        came = back[None, :]  # every pair is scored
    else:
        pb = np.asarray(partners)
        ideal = (per_a - per_gpu[pb]) / (1.0 / g_a + 1.0 / size[pb])
        came = _nearest_members(back, slot_of[back] - num_o, members.workload, out_w - ideal)
        col_starts = list(range(0, 2 * num_p, 2))
    came_w, b_bag = members.workload[came], members.bag[came]
    g_b, per_b = size[b_bag], per_gpu[b_bag]
    delta = out_w - came_w  # net workload leaving a
    new_max = np.maximum(per_a - delta / g_a, per_b + delta / g_b)
    ok = (delta > 0) & (new_max < per_a * (1 - 1e-9))
    if not one_size:
        ok &= (members.length[out][:, None] >= g_b) & (out_w <= accepts[b_bag])
        ok &= (members.length[came] >= g_a) & (came_w <= accepts[a_bag])
    new_max = np.where(ok, new_max, np.inf)
    # Best per (over-loaded bag, partner); each over-loaded bag, most loaded first, takes
    # its best among the partners still free.
    best = np.minimum.reduceat(np.minimum.reduceat(new_max, row_starts, 0), col_starts, 1)
    row_ends, col_ends = [*row_starts[1:], len(out)], [*col_starts[1:], new_max.shape[1]]
    free = [True] * num_p
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


def _exchange(a, b, out_of_a, out_of_b, lengths, workload, home_bag, src_pos, layout, bag, rem):
    """Move ``out_of_a`` to bag b and ``out_of_b`` (or nothing if -1) to bag a; undone
    (returns False) when it breaks the token cap (rare; the cap wins over balance)."""

    def move(seq: int, src: int, dst: int) -> None:
        new_rem = int(src_pos[seq] - layout.start[dst]) if home_bag[seq] == dst else 0
        layout.add(src, float(workload[seq]), int(lengths[seq]), int(rem[seq]), sign=-1)
        layout.add(dst, float(workload[seq]), int(lengths[seq]), new_rem)
        bag[seq], rem[seq] = dst, new_rem

    moves = [(seq, src, dst) for seq, src, dst in ((out_of_a, a, b), (out_of_b, b, a)) if seq >= 0]
    for seq, src, dst in moves:
        move(seq, src, dst)
    if layout.max_tokens is not None and (layout.bag_max_tokens > layout.max_tokens).any():
        for seq, src, dst in moves:
            move(seq, dst, src)
        return False
    return True


def _prefix_within_groups(values: np.ndarray, group: np.ndarray, room: np.ndarray) -> np.ndarray:
    """For rows sorted by ``group``: True while the running sum within the group <= room."""
    if values.size == 0:
        return np.zeros(0, dtype=bool)
    total = np.cumsum(values)
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    before = np.concatenate([[0.0], total[:-1]])[starts]
    group_start_sum = np.repeat(before, np.diff(np.concatenate([starts, [values.size]])))
    return total - group_start_sum <= room * (1 + _EPS)


def _chunk_table(lengths, bag, rem, layout, only: np.ndarray | None = None):
    """Split each sequence into one chunk per GPU of its bag (zero-length chunks dropped).

    Returns (seq, dst GPU position, offset, length), ordered by sequence then chunk
    index; chunk k of a sequence goes to the k-th GPU of its bag and chunk ``rem`` takes
    the ``L % g`` remainder tokens.
    """
    if only is None:
        seq, seq_bag, seq_len, seq_rem = None, bag, lengths, rem
    else:
        seq = np.asarray(only)
        seq_bag, seq_len, seq_rem = bag[seq], lengths[seq], rem[seq]
    g = layout.size[seq_bag]
    quot = seq_len // g
    ends = np.cumsum(g)
    first = ends - g  # row of each sequence's chunk 0
    length = np.repeat(quot, g)
    length[first + seq_rem] += seq_len - quot * g
    # chunk k of a sequence -> GPU position start(bag) + k = row + (start(bag) - first)
    rows = np.arange(int(ends[-1]) if ends.size else 0)
    pos = rows + np.repeat(layout.start[seq_bag] - first, g)
    # offset = tokens of the same sequence in earlier chunks
    offset = np.cumsum(length) - length
    offset -= np.repeat(offset[first] if first.size else first, g)
    idx = np.repeat(np.arange(len(seq_len)) if seq is None else seq, g)
    if quot.size and quot.min() == 0:  # some sequence is shorter than its bag
        keep = length > 0
        idx, pos, offset, length = idx[keep], pos[keep], offset[keep], length[keep]
    return idx, pos, offset, length
