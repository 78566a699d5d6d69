"""Derived statistics of a routing plan (computed, never stored in the plan).

Per-GPU arrays are indexed by position in ``plan.gpus`` (not by rank), per-bag arrays
by bag id. A sequence in a bag of g GPUs costs each GPU of that bag workload / g.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from knapformer.plan import gpu_positions

if TYPE_CHECKING:
    from knapformer.plan import RoutingPlan


@dataclass(frozen=True)
class PlanStats:
    load_before: np.ndarray  # (num_gpus,) workload held by each GPU before routing
    load_after: np.ndarray  # (num_gpus,) workload each GPU computes after routing
    tokens_before: np.ndarray  # (num_gpus,) int
    tokens_after: np.ndarray  # (num_gpus,) int
    bag_load_before: np.ndarray  # (num_bags,) sum of load_before over the bag's GPUs
    bag_load_after: np.ndarray  # (num_bags,) workload assigned to the bag
    tokens_sent: np.ndarray  # (num_gpus,) int, tokens route moves from the GPU to others
    tokens_received: np.ndarray  # (num_gpus,) int, tokens route brings to it from others
    gpu_bag: np.ndarray  # (num_gpus,) bag id of each GPU
    total_load: float
    total_tokens: int
    moved_tokens: int  # tokens in chunks whose destination differs from their source
    lower_bound: float  # max(total / #GPUs, max workload / largest bag size)
    # (num_chunks,) positions of each chunk's source and destination GPU, and its tokens:
    # what `traffic` is built from, on demand.
    chunk_src: np.ndarray = field(repr=False)
    chunk_dst: np.ndarray = field(repr=False)
    chunk_len: np.ndarray = field(repr=False)

    @cached_property
    def traffic(self) -> np.ndarray:
        """(num_gpus, num_gpus) int, tokens sent from ``gpus[i]`` to ``gpus[j]``.

        Built on first use: it takes num_gpus² memory (2 GiB at 16,384 GPUs), so views of
        large plans aggregate with `traffic_between` instead."""
        n = len(self.load_before)
        return self.traffic_between(np.arange(n), n)

    def traffic_between(self, group: np.ndarray, num_groups: int) -> np.ndarray:
        """(num_groups, num_groups) int, tokens sent from group i to group j, where
        ``group`` (num_gpus,) gives the group of each GPU position."""
        group = np.asarray(group, dtype=np.int64)
        pair = group[self.chunk_src] * num_groups + group[self.chunk_dst]
        flat = np.bincount(pair, weights=self.chunk_len, minlength=num_groups * num_groups)
        return flat.astype(np.int64).reshape(num_groups, num_groups)

    @property
    def mean_load(self) -> float:
        return self.total_load / len(self.load_before)

    @property
    def makespan_before(self) -> float:
        return float(self.load_before.max())

    @property
    def makespan_after(self) -> float:
        return float(self.load_after.max())

    @property
    def imbalance_before(self) -> float:
        """max / mean load before balancing (1.0 = perfect)."""
        return _ratio(self.makespan_before, self.mean_load)

    @property
    def imbalance_after(self) -> float:
        return _ratio(self.makespan_after, self.mean_load)

    @property
    def max_min_before(self) -> float:
        """max / min load before balancing (inf when a GPU has nothing)."""
        return _ratio(self.makespan_before, float(self.load_before.min()))

    @property
    def max_min_after(self) -> float:
        return _ratio(self.makespan_after, float(self.load_after.min()))

    @property
    def moved_fraction(self) -> float:
        return self.moved_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def speedup(self) -> float:
        """Modelled speedup of the step: makespan before / after."""
        return _ratio(self.makespan_before, self.makespan_after)

    @property
    def makespan_over_lb(self) -> float:
        return _ratio(self.makespan_after, self.lower_bound)


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 1.0 if a == 0 else float("inf")


def bag_share(plan: RoutingPlan, per_seq: np.ndarray) -> np.ndarray:
    """Per GPU of ``plan.gpus``: its share of ``per_seq`` (n_seq,) values after routing.

    Each GPU of a bag of g computes 1/g of every sequence of its bag (Ulysses), so it
    gets the bag's sum over its sequences divided by g. ``load_after`` is the share of
    the workloads; calibration takes the share of each workload term.
    """
    sizes = np.array([len(b) for b in plan.bags], dtype=np.int64)
    return _share_after(plan.sequences.bag, per_seq, sizes, plan.stats.gpu_bag)[1]


def _share_after(seq_bag, per_seq, bag_sizes, gpu_bag) -> tuple[np.ndarray, np.ndarray]:
    """(sum per bag, share per GPU) of ``per_seq`` values after routing."""
    per_bag = np.bincount(seq_bag, weights=per_seq, minlength=len(bag_sizes))
    return per_bag, (per_bag / bag_sizes)[gpu_bag]


def compute_stats(plan: RoutingPlan) -> PlanStats:
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    n = len(gpus)
    pos = gpu_positions(gpus)
    seqs, chunks = plan.sequences, plan.chunks
    bag_sizes = np.array([len(b) for b in plan.bags], dtype=np.int64)
    workload = np.asarray(seqs.workload, dtype=np.float64)

    src = pos[seqs.src_gpu]
    load_before = np.bincount(src, weights=workload, minlength=n)
    tokens_before = np.bincount(src, weights=seqs.length, minlength=n).astype(np.int64)

    gpu_bag = np.empty(n, dtype=np.int64)
    for bag_id, members in enumerate(plan.bags):
        gpu_bag[pos[members]] = bag_id
    bag_load_after, load_after = _share_after(seqs.bag, workload, bag_sizes, gpu_bag)
    bag_load_before = np.bincount(gpu_bag, weights=load_before, minlength=len(plan.bags))

    csrc, cdst = pos[chunks.src_gpu], pos[chunks.dst_gpu]
    tokens_after = np.bincount(cdst, weights=chunks.length, minlength=n).astype(np.int64)
    away = csrc != cdst
    moving = chunks.length[away]
    sent = np.bincount(csrc[away], weights=moving, minlength=n).astype(np.int64)
    received = np.bincount(cdst[away], weights=moving, minlength=n).astype(np.int64)

    total = float(workload.sum())
    max_seq = float(workload.max()) if workload.size else 0.0
    lower_bound = max(total / n, max_seq / int(bag_sizes.max()))
    return PlanStats(
        load_before=load_before,
        load_after=load_after,
        tokens_before=tokens_before,
        tokens_after=tokens_after,
        bag_load_before=bag_load_before,
        bag_load_after=bag_load_after,
        tokens_sent=sent,
        tokens_received=received,
        gpu_bag=gpu_bag,
        total_load=total,
        total_tokens=int(seqs.length.sum()),
        moved_tokens=int(moving.sum()),
        lower_bound=lower_bound,
        chunk_src=csrc,
        chunk_dst=cdst,
        chunk_len=np.asarray(chunks.length, dtype=np.int64),
    )
