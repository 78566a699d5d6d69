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
largest groups in pairs and pack the lower classes' long sequences into their room (the
counts: `knapformer.planning.group_demand`). The auto solver solves these beside the
whole-family layouts (``gXnY``) and keeps the best (auto.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.group_demand import (
    Kept,
    fitting_costs,
    least_fitting,
    mixed_counts,
    per_gpu_costs,
)

DEFAULT_GROUP_SIZES = (1, 2, 4, 8)


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
    # Into one array, the lengths cast inside the product: no (sizes, n) temporary and no
    # float copy of the lengths (a few ms a step at 4,096 GPUs); the same sums.
    eff = np.multiply(kappa[:, None], lengths, dtype=np.float64)
    eff += workload
    return eff


def family_floors(eff: np.ndarray, sizes, num_gpus: int) -> dict[int, float]:
    """The floor of each whole-family layout gXnY that tiles the group, by g: ``max(total /
    N, largest sequence / g)`` of the effective workloads ``eff`` (`effective_workloads`):
    no such layout beats its largest sequence spread over one of its bags."""
    return {
        g: max(float(eff[j].sum()) / num_gpus, float(eff[j].max(initial=0.0)) / g)
        for j, g in enumerate(sizes)
        if num_gpus % g == 0
    }


def partition_floor(eff: np.ndarray, lengths: np.ndarray, sizes, num_gpus: int,
                    costs=None) -> float:  # fmt: skip
    """The least per-GPU makespan (compute + Ulysses) any partition of ``sizes`` can reach:
    the least T such that every sequence fits some allowed group at T per GPU and the
    cheapest such placements sum to at most ``num_gpus * T`` (each sequence costs at least
    its cheapest fitting group, and the GPUs' loads add up to the total). ``eff``
    (len(sizes), n): `effective_workloads`; ``lengths`` (n,); ``costs``: their
    `per_gpu_costs` where the caller has them already."""
    if eff.shape[1] == 0:
        return 0.0
    size = np.asarray(sizes, dtype=np.float64)
    smallest, cheapest = costs or per_gpu_costs(eff, lengths, size)
    lo = max(float(eff.min(axis=0).sum()) / num_gpus, cheapest)
    # Only sequences above lo per GPU in their cheapest group depend on T.
    big = np.flatnonzero(smallest > lo)
    if big.size == 0:
        return lo
    rest = float(np.delete(eff[0], big).sum())
    fits, big_per_gpu = fitting_costs(eff, lengths, size, big)
    big_eff = np.where(fits, eff[:, big], np.inf)

    # Each big sequence's least cost in a group where it fits under the target, summed.
    least = Kept(big_per_gpu, lambda t: float(np.where(big_per_gpu <= t, big_eff, np.inf)
                                              .min(axis=0).sum()))  # fmt: skip

    def fits_at(target: float) -> bool:
        return least(target) + rest <= num_gpus * target

    hi = lo
    while not fits_at(hi):
        hi *= 2.0
    return least_fitting(fits_at, lo, hi)


def mixed_partitions(
    workload: np.ndarray,
    lengths: np.ndarray,
    src_pos: np.ndarray,
    num_gpus: int,
    sizes: tuple[int, ...],
    per_token: dict[int, float],
    node_size: int,
    eff: np.ndarray | None = None,
    floors: dict[int, float] | None = None,
    costs=None,
) -> list[Candidate]:
    """Mixed partitions worth solving for this step (none when one group size is best for
    every sequence): the bisection's (module doc), the same with the groups of its
    largest size merged in pairs (fewer, larger groups: coarse sequences share them), and
    the merged groups packed with the lower classes' long sequences (`mixed_counts`),
    cheapest first by the work each costs at the bisection's time. Deterministic.

    ``workload``, ``lengths``, ``src_pos`` (n,): each sequence's compute, tokens and source
    GPU position; ``per_token[g]``: Ulysses cost per token in a g-GPU group; ``eff``,
    ``floors``, ``costs``: their `effective_workloads`, `family_floors` and
    `per_gpu_costs` where the caller has them already.
    """
    if eff is None:
        eff = effective_workloads(workload, lengths, sizes, per_token)
    size = np.asarray(sizes, dtype=np.float64)
    whole = list((floors or family_floors(eff, sizes, num_gpus)).values())
    found = mixed_counts(eff, size, lengths, num_gpus, sizes, whole, costs)
    if found is None:
        return []
    out = []
    for counts, seq_class in found:
        bag_sizes = _place(counts, sizes, num_gpus, node_size, eff, seq_class, src_pos)
        if Candidate(bag_sizes) not in out:
            out.append(Candidate(bag_sizes))
    return out


def _place(groups, sizes, num_gpus, node_size, eff, seq_class, src_pos):
    """Tile the GPUs with ``groups[j]`` groups of ``sizes[j]``, largest first, visiting
    nodes (or runs of nodes as wide as the largest group) by how much work their own GPUs
    hold for big groups, most first: big groups then land where their sequences already
    are. Returns the bag sizes in position order."""
    unit = max(node_size, max(s for s, n in zip(sizes, groups, strict=True) if n))
    num_units = num_gpus // unit
    # Only the sequences of the larger classes weigh (the others' zeros add nothing to the
    # sums): a few hundred rows, not the step's.
    heavy = np.flatnonzero(seq_class > 0)
    score = np.bincount(src_pos[heavy] // unit, weights=eff[0][heavy], minlength=num_units)
    unit_order = np.argsort(-score, kind="stable")
    cls = np.repeat(np.arange(len(sizes))[::-1], groups[::-1])  # largest first
    widths = np.asarray(sizes)[cls]
    virtual = np.cumsum(widths) - widths
    start = unit_order[virtual // unit] * unit + virtual % unit
    order = np.argsort(start, kind="stable")
    return tuple(widths[order].tolist())


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
    fixed = {f"g{g}n{num_gpus // g}": v for g, v in family_floors(eff, sizes, num_gpus).items()}
    return LayoutFloor(fixed, partition_floor(eff, lengths, sizes, num_gpus))
