"""Which bags a plan may hold: fixed bags laid out as their topology lays them, and
aligned GPU groups when the planner chose them for its step (``policy: "auto"``); the rule
the planner, the runtime and the validator share.

A fixed topology's bags hold consecutive GPUs of the plan's ``gpus``, smallest bags first
(`knapformer.contract.topology.Topology.bags`): the runtime creates a process group for
those bags only, so a plan whose bags group the GPUs otherwise cannot be routed.

The balance group (the plan's ``gpus``, in order) is cut into nodes of ``node_size``
consecutive GPUs, a power of two (a group of fewer GPUs than a node is one node, and then
holds a power of two of GPUs). A group of g GPUs is *aligned* when g is a power of two and
it holds the g consecutive GPUs from a position that is a multiple of g: such a group never
crosses a node when g ≤ ``node_size``, and spans whole nodes when g is larger. The
runtime creates one process group per aligned group of each allowed size, so a bag that
is not aligned, or of a size not allowed, has no process group to run in: replay and
training would fail on it. (`knapformer.planning.partitions` chooses partitions into
such groups; it should take the predicates from here.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knapformer.contract.topology import Topology

#: What to read for the rule (a message points there).
WHERE = "knapformer.contract.alignment"
#: GPUs per node when a plan records no ``solver_options.comm.node_size`` (the default
#: of `knapformer.planning.communication.CommModel`: an 8-GPU NVLink node).
DEFAULT_NODE_SIZE = 8


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def is_aligned(positions: Sequence[int] | np.ndarray) -> bool:
    """Whether GPUs at ``positions`` (in the order listed) form an aligned group: a
    power-of-two count of consecutive positions from a multiple of that count."""
    at = np.asarray(positions, dtype=np.int64)
    size = len(at)
    if not is_power_of_two(size) or at[0] % size:
        return False
    return bool(np.array_equal(at, np.arange(at[0], at[0] + size)))


def node_problem(num_gpus: int, node_size: int) -> str | None:
    """Why ``num_gpus`` GPUs cannot be cut into nodes of ``node_size`` GPUs (None when they
    can)."""
    if not is_power_of_two(node_size):
        return f"node_size {node_size:,} is not a power of two"
    if num_gpus < node_size and not is_power_of_two(num_gpus):
        return (
            f"{num_gpus:,} GPUs, fewer than a node of {node_size:,}, are not a power of two: "
            "they form no aligned groups"
        )
    if num_gpus >= node_size and num_gpus % node_size:
        return f"{num_gpus:,} GPUs do not cut into nodes of {node_size:,}"
    return None


def group_size_problem(size: int, num_gpus: int) -> str | None:
    """Why no aligned group of ``size`` GPUs exists among ``num_gpus`` (None when one
    does): a power of two that divides the GPU count."""
    if not is_power_of_two(size):
        return f"{size:,} is not a power of two"
    if num_gpus % size:
        return f"{size:,} does not divide the {num_gpus:,} GPUs"
    return None


def auto_layout_problem(
    members: np.ndarray,
    bag_sizes: np.ndarray,
    num_gpus: int,
    group_sizes: Sequence[int] | None,
    node_size: int,
) -> str | None:
    """Why a plan of ``policy: "auto"`` cannot run (None when it can), naming the field:
    its nodes (``solver_options.comm.node_size``), its group sizes
    (``solver_options.group_sizes``; when absent, its bags' sizes are the allowed ones),
    each bag's size among them and each bag aligned. ``members`` (sum of ``bag_sizes``,):
    the positions in ``gpus`` of every bag's GPUs, bag after bag, in the order each bag
    lists them; ``bag_sizes`` (bags,). Checked in a few array passes, whatever the bag
    count."""
    problem = node_problem(num_gpus, node_size)
    if problem is not None:
        field = "gpus" if is_power_of_two(node_size) else "solver_options.comm.node_size"
        return f"{field}: {problem} ({WHERE})"
    sizes = sorted(set(bag_sizes.tolist()) if group_sizes is None else set(group_sizes))
    for size in sizes:
        problem = group_size_problem(int(size), num_gpus)
        if problem is not None:
            where = "solver_options.group_sizes" if group_sizes is not None else "bag size"
            return f"{where}: {problem}; an auto plan's groups are aligned ({WHERE})"
    outside = np.flatnonzero(~np.isin(bag_sizes, sizes))
    if outside.size:
        index = int(outside[0])
        return (
            f"bags[{index}] holds {int(bag_sizes[index]):,} GPUs; an auto plan's bags have "
            f"the sizes of solver_options.group_sizes {sizes}"
        )
    index = _first_unaligned(members, bag_sizes)
    if index is None:
        return None
    first = int(np.sum(bag_sizes[:index]))
    positions = members[first : first + int(bag_sizes[index])].tolist()
    shown = ", ".join(map(str, positions[:8])) + (", …" if len(positions) > 8 else "")
    return (
        f"bags[{index}] is not aligned (positions {shown} in gpus): an auto plan's bag of g "
        f"GPUs holds the g consecutive GPUs of gpus from a multiple of g ({WHERE})"
    )


def _first_unaligned(members: np.ndarray, bag_sizes: np.ndarray) -> int | None:
    """The first bag whose positions are not consecutive from a multiple of its size
    (sizes are powers of two already)."""
    ends = np.cumsum(bag_sizes)
    starts = ends - bag_sizes
    first = members[starts]
    offset = np.arange(len(members)) - np.repeat(starts, bag_sizes)
    wrong = members != np.repeat(first, bag_sizes) + offset
    bad = (first % bag_sizes != 0) | np.logical_or.reduceat(wrong, starts)
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def fixed_layout_problem(topology: Topology, gpus: list[int], bags: list[list[int]]) -> str | None:
    """Why ``bags`` are not ``topology``'s bags laid on ``gpus`` (None when they are; bag
    ids may come in any order, a bag's GPUs may not). ``topology`` matches the bag sizes."""
    laid = {tuple(bag) for bag in topology.bags(gpus) if len(bag) > 1}
    for index, bag in enumerate(bags):
        if len(bag) > 1 and tuple(bag) not in laid:
            shown = ", ".join(map(str, bag[:8])) + (", …" if len(bag) > 8 else "")
            return (
                f"bags[{index}] [{shown}] is not a bag of topology '{topology}' on gpus: a "
                "fixed topology's bags hold consecutive GPUs of gpus, smallest bags first, "
                f"and the runtime groups no others ({WHERE})"
            )
    return None
