"""Aligned GPU groups, the per-step choice of a partition (``topology="auto"``) and the
layout floor (docs/concepts.md, "Communication and the layout floor").

The balance group is cut into nodes of ``node_size`` consecutive GPUs. An *aligned* group
of g GPUs starts at a multiple of g and never crosses a node (unless ``cross_node`` allows
sizes above the node, which then span whole nodes). Any multiset of power-of-two sizes that
sums to the group's GPU count tiles it with aligned groups when placed largest first, so a
partition is just a count per size; `aligned_groups` lists every group any partition can
use (what the runtime creates once).

The choice (`mixed_partitions`) works on *effective* workloads: a sequence of workload W
and L tokens placed in a g-GPU group costs ``W + k_g*L`` (``k_g``: the Ulysses exchange
per token, `CommModel.ulysses_per_token`), spread evenly over the group's GPUs. For a
target per-GPU time T every sequence takes the smallest group size that brings it under
T; the GPUs each size needs follow, short sequences fill what rounding to whole groups
leaves over in the big groups, and the smallest T whose GPUs fit the group is found by
bisection (only the few sequences above the mean take part in it). Variants merge the
largest groups in pairs and pack the lower classes' long sequences into their room
(`_absorb`). The auto solver solves these beside the whole-family layouts (``gXnY``) and
keeps the best (auto.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError

DEFAULT_GROUP_SIZES = (1, 2, 4, 8)
_BISECTIONS = 40


def allowed_sizes(
    num_gpus: int,
    node_size: int,
    group_sizes: tuple[int, ...] = DEFAULT_GROUP_SIZES,
    min_group: int | None = None,
    max_group: int | None = None,
    cross_node: bool = False,
) -> tuple[tuple[int, ...], int]:
    """(the group sizes a partition of ``num_gpus`` GPUs may use, ascending; the node size
    in effect). A `KnapformerError` names the value when none is left or the GPUs cannot be
    cut into nodes."""
    for name, value in (("node_size", node_size), *((f"group size {g}", g) for g in group_sizes)):
        if int(value) <= 0 or int(value) & (int(value) - 1):
            raise KnapformerError(f"{name} must be a positive power of two, got {value}")
    if num_gpus < node_size:
        if num_gpus & (num_gpus - 1):
            raise KnapformerError(
                f"topology 'auto' on {num_gpus} GPUs: a group smaller than a node "
                f"({node_size} GPUs) must hold a power of two of GPUs"
            )
        node_size = num_gpus
    elif num_gpus % node_size:
        raise KnapformerError(
            f"topology 'auto' cuts the {num_gpus} GPUs into nodes of node_size={node_size}; "
            f"{num_gpus} is not a multiple of {node_size}"
        )
    sizes = sorted(
        g
        for g in {int(g) for g in group_sizes}
        if (min_group is None or g >= min_group)
        and (max_group is None or g <= max_group)
        and (g <= node_size or (cross_node and num_gpus % g == 0))
    )
    if not sizes:
        raise KnapformerError(
            f"no group size is left for topology 'auto' on {num_gpus} GPUs: sizes "
            f"{sorted(group_sizes)}, min_group={min_group}, max_group={max_group}, "
            f"node_size={node_size}, cross_node={cross_node}"
        )
    if num_gpus % sizes[0]:
        raise KnapformerError(
            f"the smallest group size {sizes[0]} does not divide the {num_gpus} GPUs"
        )
    return tuple(sizes), node_size


def aligned_groups(num_gpus: int, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every aligned group of every size, as GPU positions (what a partition may use; the
    runtime creates one process group per tuple of size > 1). About 2 * num_gpus tuples."""
    return [
        tuple(range(start, start + g))
        for g in sorted(sizes)
        for start in range(0, num_gpus - g + 1, g)
    ]


@dataclass(frozen=True)
class Candidate:
    """One partition: ``bag_sizes``, the GPUs of each bag in position order (the bags tile
    0..num_gpus-1 with aligned groups)."""

    bag_sizes: tuple[int, ...]

    @property
    def topology(self) -> str:
        return str(Topology.from_bag_sizes(list(self.bag_sizes)))


def effective_workloads(workload, lengths, sizes, per_token) -> np.ndarray:
    """(len(sizes), n) cost of each sequence in a group of each size: ``W + k_g * L``."""
    kappa = np.asarray([per_token[g] for g in sizes], dtype=np.float64)
    return workload[None, :] + kappa[:, None] * lengths.astype(np.float64)[None, :]


def partition_floor(eff: np.ndarray, lengths: np.ndarray, sizes, num_gpus: int) -> float:
    """The least per-GPU makespan (compute + Ulysses) any partition of ``sizes`` can reach:
    the least T such that every sequence fits some allowed group at T per GPU and the
    cheapest such placements sum to at most ``num_gpus * T`` (each sequence costs at least
    its cheapest fitting group, and the GPUs' loads add up to the total). ``eff``
    (len(sizes), n): `effective_workloads`; ``lengths`` (n,)."""
    if eff.shape[1] == 0:
        return 0.0
    size = np.asarray(sizes, dtype=np.float64)
    smallest, cheapest = _per_gpu_costs(eff, lengths, size)
    lo = max(float(eff.min(axis=0).sum()) / num_gpus, cheapest)
    # Only sequences above lo per GPU in their cheapest group depend on T.
    big = np.flatnonzero(smallest > lo)
    if big.size == 0:
        return lo
    rest = float(np.delete(eff[0], big).sum())
    fits, big_per_gpu = _fitting(eff, lengths, size, big)
    big_eff = np.where(fits, eff[:, big], np.inf)

    def fits_at(target: float) -> bool:
        cost = np.where(big_per_gpu <= target, big_eff, np.inf).min(axis=0)
        return float(cost.sum()) + rest <= num_gpus * target

    hi = lo
    while not fits_at(hi):
        hi *= 2.0
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits_at(mid) else (mid, hi)
    return hi


def _per_gpu_costs(eff: np.ndarray, lengths: np.ndarray, size: np.ndarray):
    """(each sequence's per-GPU cost in the smallest group (n,), the largest over the
    sequences of their least per-GPU cost in a group they fit): a sequence shorter than
    every group still goes to the smallest. One size at a time: no (sizes, n) temporary."""
    smallest = eff[0] / size[0]
    cheapest = smallest.copy()
    for j in range(1, len(size)):
        np.minimum(cheapest, np.where(lengths >= size[j], eff[j] / size[j], np.inf), out=cheapest)
    return smallest, float(cheapest.max())


def _fitting(eff: np.ndarray, lengths: np.ndarray, size: np.ndarray, seqs: np.ndarray):
    """(fits, per-GPU cost), each (sizes, len(seqs)), of sequences ``seqs`` in a group of
    each size: whether it may go there (never shorter than the group, bar the smallest),
    and its cost there per GPU (inf where it may not)."""
    fits = lengths[seqs][None, :] >= size[:, None]
    fits[0] = True
    return fits, np.where(fits, eff[:, seqs] / size[:, None], np.inf)


def mixed_partitions(
    workload: np.ndarray,
    lengths: np.ndarray,
    src_pos: np.ndarray,
    num_gpus: int,
    sizes: tuple[int, ...],
    per_token: dict[int, float],
    node_size: int,
    eff: np.ndarray | None = None,
) -> list[Candidate]:
    """Mixed partitions worth solving for this step (none when one group size is best for
    every sequence): the bisection's (module doc), the same with the groups of its
    largest size merged in pairs (fewer, larger groups: coarse sequences share them), and
    the merged groups packed with the lower classes' long sequences (`_absorb`), cheapest
    first by the work each costs at the bisection's time. Deterministic.

    ``workload``, ``lengths``, ``src_pos`` (n,): each sequence's compute, tokens and source
    GPU position; ``per_token[g]``: Ulysses cost per token in a g-GPU group; ``eff``: their
    `effective_workloads` where the caller has them already.
    """
    if eff is None:
        eff = effective_workloads(workload, lengths, sizes, per_token)
    size = np.asarray(sizes, dtype=np.float64)
    whole = [
        max(float(eff[j].sum()) / num_gpus, float(eff[j].max(initial=0.0)) / g)
        for j, g in enumerate(sizes)
        if num_gpus % g == 0
    ]
    found = _mixed(eff, size, lengths, num_gpus, sizes, whole)
    if found is None:
        return []
    out = []
    for counts, seq_class in found:
        bag_sizes = _place(counts, sizes, num_gpus, node_size, eff, seq_class, src_pos)
        if Candidate(bag_sizes) not in out:
            out.append(Candidate(bag_sizes))
    return out


def _mixed(eff, size, lengths, num_gpus, sizes, whole):
    """(group counts per size, each sequence's size class) of the bisection's partition
    and of its variants (`mixed_partitions`), cheapest first; None when no mixed partition
    is worth solving."""
    if len(sizes) < 2 or not whole or eff.shape[1] == 0:
        return None
    smallest, cheapest = _per_gpu_costs(eff, lengths, size)
    lo = max(float(eff[0].sum()) / num_gpus, cheapest)
    hi = min(whole)
    if lo >= hi * (1 - 1e-9):
        return None
    big = np.flatnonzero(smallest > lo)  # the only ones whose group depends on T
    small = np.ones(eff.shape[1], dtype=bool)
    small[big] = False
    x0_small = float(eff[0, small].sum())
    # What short sequences cost when they fill a bigger group, relative to their own.
    filling = [small] + [small & (lengths >= g) for g in size[1:]]
    fill_base = np.array([float(eff[0, mask].sum()) for mask in filling])
    fill_cost = np.array([float(eff[j, mask].sum()) for j, mask in enumerate(filling)])
    inflation = np.divide(fill_cost, fill_base, out=np.ones(len(size)), where=fill_base > 0)
    big_eff, big_per_gpu = eff[:, big], _fitting(eff, lengths, size, big)[1]

    def demand(target: float):
        ok = big_per_gpu <= target
        if not ok.any(axis=0).all():
            return None
        cls = ok.argmax(axis=0)
        load = np.bincount(cls, weights=big_eff[cls, np.arange(len(big))], minlength=len(size))
        load[0] += x0_small
        # A sequence above half a group's room takes a group of its own (two cannot share).
        alone = big_per_gpu[cls, np.arange(len(big))] > 0.5 * target
        groups = np.maximum(
            np.ceil(load / (size * target) - 1e-9), np.bincount(cls[alone], minlength=len(size))
        ).astype(np.int64)
        groups[0] = 0
        slack = groups * size * target - load
        fill = np.minimum(slack / inflation, fill_base)[1:].sum()
        rest = max(0.0, load[0] - fill)
        groups[0] = int(np.ceil(rest / (size[0] * target) - 1e-9))
        return int((groups * size).sum()), groups, cls

    if demand(hi) is None or demand(hi)[0] > num_gpus:
        return None
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        got = demand(mid)
        if got is not None and got[0] <= num_gpus:
            hi = mid
        else:
            lo = mid
    used, groups, cls = demand(hi)
    groups[0] += (num_gpus - used) // sizes[0]  # spare GPUs go to the smallest groups
    if (groups[1:] == 0).all():
        return None  # no bigger group needed: that is the smallest whole-family layout

    def counts(cls: np.ndarray) -> np.ndarray:
        """Groups per size for big sequences of classes ``cls`` at ``hi`` (as `demand`),
        the spare GPUs in the smallest groups."""
        load = np.bincount(cls, weights=big_eff[cls, np.arange(len(big))], minlength=len(size))
        alone = big_per_gpu[cls, np.arange(len(big))] > 0.5 * hi
        out = np.maximum(
            np.ceil(load / (size * hi) - 1e-9), np.bincount(cls[alone], minlength=len(size))
        ).astype(np.int64)
        out[0] = (num_gpus - int((out[1:] * size[1:]).sum())) // sizes[0]
        return out

    def waste(groups: np.ndarray, cls: np.ndarray) -> float:
        """Work the step costs at ``hi`` under ``groups``: the big sequences at their class,
        every bigger group's room filled with short ones at its inflation, the remaining short
        ones alone (lower: less Ulysses paid)."""
        load = np.bincount(cls, weights=big_eff[cls, np.arange(len(big))], minlength=len(size))
        room = np.maximum(groups * size * hi - load, 0.0)[1:]
        filled = np.minimum(room / inflation[1:], fill_base[1:])
        return float(load[1:].sum() + (filled * inflation[1:]).sum()
                     + max(0.0, load[0] + x0_small - filled.sum()))  # fmt: skip

    variants = [(groups, cls)]
    top = int(np.flatnonzero(groups)[-1])
    if top > 0 and top + 1 < len(sizes) and sizes[top + 1] == 2 * sizes[top] and groups[top] > 1:
        merged = groups.copy()
        merged[top + 1] += merged[top] // 2
        merged[top] %= 2
        variants.append((merged, cls))
        packed = _absorb(cls, top, merged, big_eff, size, hi)
        if packed is not None:
            # The shared groups as packed; the lower classes' groups for what is left.
            repacked = counts(np.where(packed >= top, 0, packed))
            repacked[top:] = merged[top:]
            repacked[0] = (num_gpus - int((repacked[1:] * size[1:]).sum())) // sizes[0]
            if repacked[0] >= 0:
                variants.append((repacked, packed))
    # The cheapest first (a large step solves only that one); ties keep the order above.
    scores = [waste(g, c) for g, c in variants]
    out = []
    for i in sorted(range(len(variants)), key=lambda i: scores[i]):
        seq_class = np.zeros(eff.shape[1], dtype=np.int64)
        seq_class[big] = variants[i][1]
        out.append((variants[i][0], seq_class))
    return out


def _absorb(cls, top, merged, big_eff, size, target):
    """Big sequences' classes when the class-``top`` sequences share ``merged``'s groups of
    twice their size (and the odd one left of their own size) and the lower classes' big
    sequences move into those groups' room where they fit: each lower group so emptied
    goes back to the smallest size, whose GPUs pay no exchange. Largest first, each to the
    least loaded group it fits (the top ones) or the fullest (the lower ones). None when a
    top sequence fits no group."""
    bins = np.repeat([top + 1, top], [merged[top + 1], merged[top]])
    cap = size[bins] * target * (1 + 1e-9)
    held = np.zeros(len(bins))
    out = cls.copy()
    tops = np.flatnonzero(cls == top)
    for x in tops[np.argsort(-big_eff[top + 1, tops], kind="stable")].tolist():
        cost = big_eff[bins, x]
        fit = np.flatnonzero(held + cost <= cap)
        if fit.size == 0:
            return None
        b = int(fit[np.argmin(held[fit] / size[bins[fit]])])
        held[b] += cost[b]
        out[x] = bins[b]
    lower = np.flatnonzero((cls > 0) & (cls < top))
    for x in lower[np.argsort(-big_eff[0, lower], kind="stable")].tolist():
        cost = big_eff[bins, x]
        fit = np.flatnonzero(held + cost <= cap)
        if fit.size:
            b = int(fit[np.argmax(held[fit] / cap[fit])])
            held[b] += cost[b]
            out[x] = bins[b]
    return None if np.array_equal(out, cls) else out


def _place(groups, sizes, num_gpus, node_size, eff, seq_class, src_pos):
    """Tile the GPUs with ``groups[j]`` groups of ``sizes[j]``, largest first, visiting
    nodes (or runs of nodes as wide as the largest group) by how much work their own GPUs
    hold for big groups, most first: big groups then land where their sequences already
    are. Returns the bag sizes in position order."""
    unit = max(node_size, max(s for s, n in zip(sizes, groups, strict=True) if n))
    num_units = num_gpus // unit
    heavy = np.where(seq_class > 0, eff[0], 0.0)
    score = np.bincount(src_pos // unit, weights=heavy, minlength=num_units)
    unit_order = np.argsort(-score, kind="stable")
    cls = np.repeat(np.arange(len(sizes))[::-1], groups[::-1])  # largest first
    widths = np.asarray(sizes)[cls]
    virtual = np.cumsum(widths) - widths
    start = unit_order[virtual // unit] * unit + virtual % unit
    order = np.argsort(start, kind="stable")
    return tuple(int(w) for w in widths[order])


@dataclass(frozen=True)
class LayoutFloor:
    """The least per-GPU makespan (workload units, per layer) a layout can reach for one
    step: ``fixed[topology]`` for each whole-family layout gXnY, ``partitions`` for any
    partition of the allowed sizes (the step's sequences fixed, bags free)."""

    fixed: dict[str, float]
    partitions: float

    @property
    def best_fixed(self) -> float:
        return min(self.fixed.values())


def layout_floor(
    workload: np.ndarray,
    lengths: np.ndarray,
    num_gpus: int,
    sizes: tuple[int, ...] = DEFAULT_GROUP_SIZES,
    per_token: dict[int, float] | None = None,
) -> LayoutFloor:
    """Lower bounds on the makespan of one step's sequences (``workload``, ``lengths``
    (n,)) on ``num_gpus`` GPUs: per fixed layout gXnY, ``max(total / N, max W / g)``
    (the layout floor: no layout beats its largest sequence spread over its largest bag),
    and over all partitions of ``sizes``, `partition_floor` (at least ``max(total / N, max
    over sequences of the least per-GPU cost any allowed group gives it)``). With
    ``per_token`` (Ulysses cost per token of a g-GPU group) costs include communication;
    without, compute only."""
    sizes = tuple(g for g in sorted(sizes) if g <= num_gpus)
    per_token = per_token or dict.fromkeys(sizes, 0.0)
    workload = np.asarray(workload, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    eff = effective_workloads(workload, lengths, sizes, per_token)
    fixed = {
        f"g{g}n{num_gpus // g}": max(
            float(eff[j].sum()) / num_gpus, float(eff[j].max(initial=0.0)) / g
        )
        for j, g in enumerate(sizes)
        if num_gpus % g == 0
    }
    return LayoutFloor(fixed, partition_floor(eff, lengths, sizes, num_gpus))
