"""The planner: a pure, deterministic function from sequence lengths to a `RoutingPlan`.

Every rank computes the same plan from the same gathered lengths, so nothing here may
depend on process state. Two solvers:

``"greedy"`` — the published algorithm. Per-GPU capacity C = total load / #GPUs, a bag
of g GPUs has capacity g*C. Sequences are taken by workload, largest first; candidate
bags are those with capacity >= the workload and g <= the length (if none: the bags of
the largest size); the sequence goes to the candidate with the lowest occupancy
(load / capacity). A sequence in a bag of g GPUs is split into g chunks of L // g tokens,
the remainder going to one chunk chosen round-robin.

``"knapformer"`` (default) — the same capacity model, with locality:
1. *heavy* sequences (more than half a GPU's capacity) are placed first, largest first,
   in their home bag (the bag holding their source GPU) when it has room, else like
   greedy;
2. every other sequence stays in its home bag while the bag has room — decided for all
   sequences at once with a sorted cumulative sum per bag (largest stay home);
3. the rest (the *pool*, usually a few percent) is placed largest first: home when it
   still fits, else the least-occupied candidate bag, so the smallest sequences even
   out the last gaps as in greedy.
In a multi-GPU bag the remainder tokens go to the chunk that stays on the source GPU,
so fewer tokens move. An optional ``max_tokens_per_gpu`` is a hard cap on the tokens
each GPU holds after routing (``ValueError`` when a sequence fits nowhere).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from knapformer.plan import RoutingPlan
from knapformer.topology import Topology, as_topology
from knapformer.workload import WorkloadModel

DEFAULT_SOLVER = "knapformer"
SOLVERS = ("knapformer", "greedy")
_HEAVY_FRACTION = 0.5  # of one GPU's capacity: placed before the bulk "stay home" pass
_EPS = 1e-12
_LEVEL_TOLERANCE = 2e-4  # local search stops this close to the lower bound
_FALLBACK_TOLERANCE = 1e-3  # further from the bound than this, greedy is tried as well
_LEVEL_PARTNERS = 8  # least-loaded bags tried as exchange partners of the most-loaded one


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

    lengths, src_pos = _flatten(lengths_per_gpu)
    workload = model.workload(lengths)
    mean = workload.sum() / topo.num_gpus
    if solver == "greedy":
        layout = _BagLayout(topo, mean, max_tokens_per_gpu)
        bag, rem = _solve_greedy(lengths, workload, layout.bag_of_pos[src_pos], src_pos, layout)
    else:
        bag, rem, layout = _solve_local_or_greedy(
            topo, lengths, workload, src_pos, mean, max_tokens_per_gpu
        )

    chunk_seq, chunk_pos, chunk_off, chunk_len = _chunk_table(lengths, bag, rem, layout)
    ranks = np.asarray(gpu_ranks, dtype=np.int64)
    identity = bool(np.array_equal(ranks, np.arange(len(ranks))))

    def rank_of(pos: np.ndarray) -> np.ndarray:
        return pos if identity else ranks[pos]

    options = {} if max_tokens_per_gpu is None else {"max_tokens_per_gpu": max_tokens_per_gpu}
    plan = RoutingPlan.build(
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
        sequences={
            "src_gpu": rank_of(src_pos),
            "length": lengths,
            "workload": workload,
            "bag": bag,
        },
        chunks={
            "seq": chunk_seq,
            "src_gpu": rank_of(src_pos[chunk_seq]),
            "dst_gpu": rank_of(chunk_pos),
            "offset": chunk_off,
            "length": chunk_len,
        },
    )
    from knapformer.plan import Measurements

    plan.measurements = Measurements(plan_ms=(time.perf_counter() - started) * 1e3)
    return plan


def _flatten(lengths_per_gpu: Sequence[ArrayLike]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-GPU lengths; returns (lengths, source GPU position) per sequence."""
    parts = [np.asarray(part).reshape(-1) for part in lengths_per_gpu]
    counts = np.array([p.size for p in parts], dtype=np.int64)
    src_pos = np.repeat(np.arange(len(parts)), counts)
    lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if lengths.size == 0:
        return lengths.astype(np.int64), src_pos
    if lengths.dtype.kind not in "iu":
        if lengths.dtype.kind != "f" or np.any(np.mod(lengths, 1) != 0):
            bad = int(src_pos[np.flatnonzero(np.mod(lengths.astype(float), 1) != 0)[0]])
            raise ValueError(f"lengths on GPU position {bad} must be whole numbers of tokens")
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise ValueError(
            f"lengths on GPU position {int(src_pos[bad])} include a negative value {lengths[bad]}"
        )
    return lengths, src_pos


class _BagLayout:
    """Bags as arrays, plus the mutable per-bag load and per-GPU token state of a solve."""

    def __init__(self, topo: Topology, gpu_capacity: float, max_tokens: int | None):
        self.size = np.asarray(topo.bag_sizes, dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(self.size)[:-1]]).astype(np.int64)
        self.bag_of_pos = np.repeat(np.arange(len(self.size)), self.size)
        self.gpu_capacity = float(gpu_capacity)
        self.capacity = self.size * self.gpu_capacity
        self.load = np.zeros(len(self.size))
        self.tokens = np.zeros(topo.num_gpus, dtype=np.int64)
        self.bag_max_tokens = np.zeros(len(self.size), dtype=np.int64)
        self.max_tokens = max_tokens
        self.class_size = np.unique(self.size)
        self._masks: dict[tuple[int, int], np.ndarray] = {}

    def candidate_keys(self, workload: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per sequence, the range (lo, hi) of bag-size classes that may take it, as lo*K+hi.

        Candidates: capacity >= workload and size <= length; if none, the largest bags.
        """
        k = len(self.class_size)
        lo = np.searchsorted(self.class_size * self.gpu_capacity * (1 + _EPS), workload, "left")
        hi = np.searchsorted(self.class_size, lengths, "right") - 1
        empty = lo > hi
        lo = np.where(empty, k - 1, lo)
        hi = np.where(empty, k - 1, hi)
        return lo * k + hi

    def mask(self, key: int) -> np.ndarray:
        mask = self._masks.get(key)
        if mask is None:
            k = len(self.class_size)
            lo, hi = divmod(int(key), k)
            mask = (self.size >= self.class_size[lo]) & (self.size <= self.class_size[hi])
            self._masks[key] = mask
        return mask

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

    def fits_tokens(self, bag: int, length: int, rem: int) -> bool:
        if self.max_tokens is None:
            return True
        g, s = int(self.size[bag]), int(self.start[bag])
        after = self.tokens[s : s + g] + length // g
        after[rem] += length % g
        return bool(after.max() <= self.max_tokens)

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
    remainder goes to the bag's chunks round-robin (the published rule).
    """
    if order.size == 0:
        return
    keys = layout.candidate_keys(workload[order], lengths[order])
    # Plain lists: for the few hundred to few thousand sequences placed one by one,
    # Python scalars beat per-item numpy calls several times over.
    candidates = {k: np.flatnonzero(layout.mask(k)).tolist() for k in np.unique(keys).tolist()}
    allowed = {k: layout.mask(k).tolist() for k in candidates}
    load = layout.load.tolist()
    limit = (layout.capacity * (1 + _EPS)).tolist()
    safe_capacity = np.where(layout.capacity > 0, layout.capacity, 1.0).tolist()
    occupancy = [x / c for x, c in zip(load, safe_capacity, strict=True)]
    size, start = layout.size.tolist(), layout.start.tolist()
    round_robin = [0] * len(size)
    capped = layout.max_tokens is not None
    rows = zip(
        order.tolist(),
        keys.tolist(),
        workload[order].tolist(),
        lengths[order].tolist(),
        home_bag[order].tolist(),
        src_pos[order].tolist(),
        strict=True,
    )
    for seq, key, w, length, h, src in rows:
        cands = candidates[key]
        home_ok = prefer_home and allowed[key][h]
        if capped:
            room = layout.token_room(length)
            cands = [b for b in cands if room[b]]
            home_ok = home_ok and bool(room[h])
        if home_ok and load[h] + w <= limit[h]:
            b = h
        elif cands:
            b = min(cands, key=occupancy.__getitem__)
        else:
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
        bag[seq], rem[seq] = b, r
        load[b] += w
        occupancy[b] = load[b] / safe_capacity[b]
        if capped:
            layout.add(b, 0.0, length, r)
    layout.load[:] = load


def _solve_local_or_greedy(topo, lengths, workload, src_pos, mean, max_tokens):
    """The default solver, with greedy as a safety net.

    Its per-GPU capacity is the lower bound on the makespan rather than greedy's mean
    load: when one sequence outweighs the mean, every GPU under that bound can keep all
    its sequences at no cost to the makespan. Where the local search stalls short of the
    bound (coarse sequences), greedy is solved too and the better makespan is kept.
    """
    top = float(workload.max()) / topo.max_bag_size if workload.size else 0.0
    layout = _BagLayout(topo, max(mean, top), max_tokens)
    home_bag = layout.bag_of_pos[src_pos]
    bag, rem = _solve_local(lengths, workload, home_bag, src_pos, layout)
    makespan = float((layout.load / layout.size).max(initial=0.0))
    lower_bound = max(mean, top)
    if makespan <= lower_bound * (1 + _FALLBACK_TOLERANCE):
        return bag, rem, layout
    greedy_layout = _BagLayout(topo, mean, max_tokens)
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
    home_size = layout.size[home_bag]

    empty = lengths == 0  # nothing to compute or move: keep at home, no chunks
    bag[empty] = home_bag[empty]

    heavy = ~empty & (workload > _HEAVY_FRACTION * layout.gpu_capacity)
    heavy_ids = _descending(workload, np.flatnonzero(heavy))
    _place_in_order(heavy_ids, lengths, workload, home_bag, src_pos, layout, bag, rem, True)

    # Bulk pass: within each home bag, the largest sequences stay while there is room.
    light = np.flatnonzero(~empty & ~heavy & (home_size <= lengths))
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
    bag[stay_ids] = home_bag[stay_ids]
    layout.add_many(stay_ids, bag[stay_ids], workload, lengths, rem)

    pool = _descending(workload, np.flatnonzero(bag < 0))
    _place_in_order(pool, lengths, workload, home_bag, src_pos, layout, bag, rem, True)
    _level_makespan(lengths, workload, home_bag, src_pos, layout, bag, rem)
    return bag, rem


def _level_makespan(lengths, workload, home_bag, src_pos, layout, bag, rem, max_iters=None):
    """Local search on the makespan: move one sequence from the most- to the least-loaded
    bag, or swap a pair between them, whichever evens them out best, while that lowers the
    larger of the two. Staying home leaves uneven last gaps; a few well-sized moves and
    swaps close them (greedy gets the same effect from placing the smallest last)."""
    size = layout.size.astype(np.float64)
    if layout.gpu_capacity <= 0 or len(size) < 2:
        return
    order = np.argsort(bag, kind="stable")
    bounds = np.searchsorted(bag[order], np.arange(len(size) + 1))
    members = [order[bounds[b] : bounds[b + 1]] for b in range(len(size))]
    per_gpu = layout.load / size
    lower_bound = max(
        float(layout.load.sum() / size.sum()), float(workload.max(initial=0.0)) / float(size.max())
    )
    for _ in range(4 * len(size) if max_iters is None else max_iters):
        a = int(np.argmax(per_gpu))
        if per_gpu[a] <= lower_bound * (1 + _LEVEL_TOLERANCE):
            return
        best = None
        for b in np.argsort(per_gpu, kind="stable")[:_LEVEL_PARTNERS].tolist():
            if b != a:
                best = _best_exchange(a, b, members, lengths, workload, layout, per_gpu)
            if best is not None:
                break
        if best is None:
            return
        out_of_a, out_of_b = best
        for seq, src, dst in ((out_of_a, a, b), (out_of_b, b, a)):
            if seq < 0:
                continue
            new_rem = int(src_pos[seq] - layout.start[dst]) if home_bag[seq] == dst else 0
            layout.add(src, float(workload[seq]), int(lengths[seq]), int(rem[seq]), sign=-1)
            layout.add(dst, float(workload[seq]), int(lengths[seq]), new_rem)
            bag[seq], rem[seq] = dst, new_rem
            members[src] = members[src][members[src] != seq]
            members[dst] = np.append(members[dst], seq)
        if layout.max_tokens is not None and (layout.bag_max_tokens > layout.max_tokens).any():
            # Undo: the exchange broke the token cap (rare; the cap wins over balance).
            for seq, src, dst in ((out_of_a, b, a), (out_of_b, a, b)):
                if seq >= 0:
                    layout.add(src, float(workload[seq]), int(lengths[seq]), int(rem[seq]), -1)
                    rem[seq] = int(src_pos[seq] - layout.start[dst]) if home_bag[seq] == dst else 0
                    layout.add(dst, float(workload[seq]), int(lengths[seq]), int(rem[seq]))
                    bag[seq] = dst
            return
        per_gpu[a], per_gpu[b] = layout.load[a] / size[a], layout.load[b] / size[b]


def _best_exchange(a, b, members, lengths, workload, layout, per_gpu):
    """The (seq from a or -1, seq from b or -1) exchange that most lowers max(load a, b)."""
    ga, gb = float(layout.size[a]), float(layout.size[b])
    gap = per_gpu[a] - per_gpu[b]
    if gap <= _EPS * max(per_gpu[a], 1e-300):
        return None
    ma, mb = members[a], members[b]
    # Sequences that may enter each bag (size <= length, capacity >= workload).
    to_b = ma[(lengths[ma] >= layout.size[b]) & (workload[ma] <= layout.capacity[b] * (1 + _EPS))]
    to_a = mb[(lengths[mb] >= layout.size[a]) & (workload[mb] <= layout.capacity[a] * (1 + _EPS))]
    if to_b.size == 0:
        return None
    wa = workload[to_b]
    wb = np.concatenate([[0.0], workload[to_a]])  # 0.0 = a plain move, nothing comes back
    ids_b = np.concatenate([[-1], to_a])
    # The best exchange moves net delta = ideal from a to b; for each sequence leaving a
    # look only at the two partners whose workload is nearest to (its workload - ideal).
    ideal = gap / (1.0 / ga + 1.0 / gb)
    sort_b = np.argsort(wb, kind="stable")
    wb_sorted = wb[sort_b]
    hit = np.searchsorted(wb_sorted, wa - ideal)
    near = np.concatenate([np.maximum(hit - 1, 0), np.minimum(hit, wb.size - 1)])
    delta = np.concatenate([wa, wa]) - wb_sorted[near]  # workload leaving a, net
    new_max = np.maximum(per_gpu[a] - delta / ga, per_gpu[b] + delta / gb)
    new_max[delta <= 0] = np.inf
    best = int(np.argmin(new_max))
    if not new_max[best] < per_gpu[a] * (1 - 1e-9):
        return None
    i, j = best % wa.size, sort_b[near[best]]
    return int(to_b[i]), int(ids_b[j])


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
    the ``L % g`` remainder tokens, so chunk k starts at ``k*(L//g)`` plus the remainder
    when k is past ``rem``.
    """
    seq = np.arange(len(lengths)) if only is None else np.asarray(only)
    seq_bag = bag[seq]
    g = layout.size[seq_bag]
    seq_len = lengths[seq]
    quot, extra = seq_len // g, seq_len % g
    if g.size and g.min() == g.max():  # one bag size: a cheap regular layout
        g0 = int(g[0])
        row = np.repeat(np.arange(seq.size), g0)
        k = np.tile(np.arange(g0), seq.size)
    else:
        row = np.repeat(np.arange(seq.size), g)
        k = np.arange(row.size) - np.repeat(np.cumsum(g) - g, g)
    q, e, r = quot[row], extra[row], rem[seq][row]
    length = q + np.where(k == r, e, 0)
    offset = k * q + np.where(k > r, e, 0)
    pos = layout.start[seq_bag][row] + k
    idx = seq[row]
    if quot.size and quot.min() == 0:  # some sequence is shorter than its bag
        keep = length > 0
        idx, pos, offset, length = idx[keep], pos[keep], offset[keep], length[keep]
    return idx, pos, offset, length
