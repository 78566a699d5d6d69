"""Derived statistics of a routing plan (computed, never stored in the plan), the
per-step summary readers keep for every step, and how those figures are written.

Per-GPU arrays are indexed by position in ``plan.gpus`` (not by rank), per-bag arrays
by bag id.

Loads after routing are Ulysses-exact (docs/concepts.md): a GPU of a g-GPU bag runs the
linear layers on the tokens of the chunks it holds and attention on the whole sequence
for 1/g of the heads, so of a sequence's workload W (linear share f) it computes
``W*f*c/L`` for its chunk of c tokens plus ``W*(1-f)/g``. The share f comes from the
plan's token_dim and gamma; a plan that lacks them (a legacy one) has it fitted from its
own (length, workload) pairs. Loads are modelled *times*: a GPU the planner was told runs
at ``gpu_speed`` s takes work/s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from knapformer.contract.positions import gpu_positions


class RoutingPlan(Protocol):
    """What the statistics read of a plan: `knapformer.contract.plan.RoutingPlan`, typed by
    its shape so that the schema imports this module and not the other way round too."""

    step: int | None
    time: float | None
    run: str | None
    topology: str
    gpus: list[int]
    bags: list[list[int]]
    token_dim: int | None
    gamma: float | None
    gpu_speed: list[float] | None
    sequences: Any  # columns src_gpu, length, workload, bag (numpy arrays)
    chunks: Any  # columns seq, src_gpu, dst_gpu, offset, length
    measurements: Any  # `knapformer.contract.plan.Measurements` | None

    @property
    def stats(self) -> PlanStats: ...


@dataclass(frozen=True)
class PlanStats:
    load_before: np.ndarray  # (num_gpus,) modelled time of each GPU's own sequences
    load_after: np.ndarray  # (num_gpus,) modelled time each GPU computes after routing
    work_after: np.ndarray  # (num_gpus,) workload each GPU computes after routing (speed 1)
    tokens_before: np.ndarray  # (num_gpus,) int
    tokens_after: np.ndarray  # (num_gpus,) int
    bag_load_before: np.ndarray  # (num_bags,) sum of load_before over the bag's GPUs
    bag_load_after: np.ndarray  # (num_bags,) workload assigned to the bag
    tokens_sent: np.ndarray  # (num_gpus,) int, tokens route moves from the GPU to others
    tokens_received: np.ndarray  # (num_gpus,) int, tokens route brings to it from others
    gpu_bag: np.ndarray  # (num_gpus,) bag id of each GPU
    speed: np.ndarray  # (num_gpus,) relative speed the plan assumed (1 = nominal)
    bag_capacity: np.ndarray  # (num_bags,) GPUs x speed of the bag's slowest GPU
    total_load: float  # total workload of the step
    total_tokens: int
    moved_tokens: int  # tokens in chunks whose destination differs from their source
    lower_bound: float  # see `lower_bound`
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
        """The ideal per-GPU time: total workload over the group's capacity (with nominal
        speeds, total / #GPUs)."""
        return self.total_load / float(self.bag_capacity.sum())

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


def linear_share(plan: RoutingPlan) -> np.ndarray:
    """(n_seq,) fraction of each sequence's workload spent in the linear layers.

    From the plan's ``token_dim`` and ``gamma`` (``24*d / (24*d + 4*gamma*L)``, the
    `WorkloadModel` split); a plan without them has ``W = a*L + b*L^2`` fitted to its own
    sequences. Zero-length sequences count as attention (they have no chunk to carry a
    linear part).
    """
    length = np.asarray(plan.sequences.length, dtype=np.float64)
    d, gamma = plan.token_dim, plan.gamma
    if d is not None and d > 0 and gamma is not None and np.isfinite(gamma) and gamma >= 0:
        share = 24.0 * d / (24.0 * d + 4.0 * gamma * length)
    else:
        share = _fitted_linear_share(length, np.asarray(plan.sequences.workload, np.float64))
    return np.where(length > 0, share, 0.0)


def _fitted_linear_share(length: np.ndarray, workload: np.ndarray) -> np.ndarray:
    """``a*L / (a*L + b*L^2)`` with a, b >= 0 fitted by least squares; all linear when the
    plan cannot tell (fewer than two distinct lengths)."""
    used = (length > 0) & (workload > 0)
    if np.unique(length[used]).size < 2:
        return np.ones_like(length)
    design = np.stack([length[used], length[used] ** 2], axis=1)
    norms = np.linalg.norm(design, axis=0)  # column scaling keeps the fit well conditioned
    (a, b), *_ = np.linalg.lstsq(design / norms, workload[used], rcond=None)
    a, b = max(float(a / norms[0]), 0.0), max(float(b / norms[1]), 0.0)
    if a == 0.0 and b == 0.0:
        return np.ones_like(length)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nan_to_num(a / (a + b * length), nan=1.0)


def terms_after(
    plan: RoutingPlan, per_seq_linear: np.ndarray, per_seq_attention: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU of ``plan.gpus``: the (linear, attention) parts of per-sequence values it
    computes after routing, each (num_gpus,).

    ``per_seq_linear`` (n_seq,) is split over a sequence's chunks by their tokens (it goes
    where the tokens go); ``per_seq_attention`` (n_seq,) is shared equally by the g GPUs of
    the sequence's bag (Ulysses gives each 1/g of the heads of the whole sequence).
    `compute_stats` passes the two parts of each workload; calibration the model's terms.
    """
    n = len(plan.gpus)
    pos = gpu_positions(plan.gpus)
    seqs, chunks = plan.sequences, plan.chunks
    length = np.asarray(seqs.length, dtype=np.float64)
    per_token = np.divide(per_seq_linear, length, out=np.zeros(len(length)), where=length > 0)
    linear = np.bincount(
        pos[chunks.dst_gpu], weights=per_token[chunks.seq] * chunks.length, minlength=n
    )
    bag_sizes = np.fromiter(map(len, plan.bags), dtype=np.float64, count=len(plan.bags))
    per_bag = np.bincount(seqs.bag, weights=per_seq_attention, minlength=len(plan.bags))
    attention = (per_bag / bag_sizes)[gpu_bags(plan)]
    return linear, attention


def _bag_members(plan: RoutingPlan) -> tuple[np.ndarray, np.ndarray]:
    """(sizes (num_bags,), GPU positions of every bag's members, bag after bag)."""
    sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    ranks = np.fromiter(itertools.chain.from_iterable(plan.bags), np.int64, int(sizes.sum()))
    return sizes, gpu_positions(plan.gpus)[ranks]


def chunk_loads(plan: RoutingPlan, chunk_ids: np.ndarray) -> np.ndarray:
    """(m,) the Ulysses-exact cost each of ``chunk_ids`` puts on its destination GPU:
    its tokens' share of the sequence's linear part plus 1/g of its attention part."""
    chunks, seqs = plan.chunks, plan.sequences
    seq = chunks.seq[chunk_ids]
    workload, length = seqs.workload[seq], seqs.length[seq].astype(np.float64)
    share = linear_share(plan)[seq]
    g = np.fromiter(map(len, plan.bags), dtype=np.float64, count=len(plan.bags))[seqs.bag[seq]]
    linear = np.divide(workload * share * chunks.length[chunk_ids], length,
                       out=np.zeros(len(seq)), where=length > 0)  # fmt: skip
    return linear + workload * (1.0 - share) / g


def gpu_bags(plan: RoutingPlan) -> np.ndarray:
    """(num_gpus,) bag id of each GPU of ``plan.gpus``."""
    sizes, members = _bag_members(plan)
    gpu_bag = np.empty(len(plan.gpus), dtype=np.int64)
    gpu_bag[members] = np.repeat(np.arange(len(sizes)), sizes)
    return gpu_bag


def bag_capacity(plan: RoutingPlan) -> np.ndarray:
    """(num_bags,) GPUs of each bag times the speed of its slowest GPU (the bag waits for it
    in every Ulysses exchange); with nominal speeds, the bag sizes."""
    sizes, members = _bag_members(plan)
    if plan.gpu_speed is None:
        return sizes.astype(np.float64)
    speed = np.asarray(plan.gpu_speed, dtype=np.float64)[members]
    return sizes * np.minimum.reduceat(speed, np.cumsum(sizes) - sizes)


def lower_bound(workload: np.ndarray, capacity: np.ndarray) -> float:
    """Lower bound on the makespan (modelled time) of ``workload`` (n_seq,) over bags of
    ``capacity`` (num_bags,): the total over the group's capacity, or the largest sequence
    on the bag of the largest capacity, whichever is larger. With nominal speeds:
    max(total / #GPUs, max workload / largest bag size)."""
    biggest = float(workload.max()) if workload.size else 0.0
    return max(float(workload.sum()) / float(capacity.sum()), biggest / float(capacity.max()))


def compute_stats(plan: RoutingPlan) -> PlanStats:
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    n = len(gpus)
    pos = gpu_positions(gpus)
    seqs, chunks = plan.sequences, plan.chunks
    workload = np.asarray(seqs.workload, dtype=np.float64)
    speed = np.ones(n) if plan.gpu_speed is None else np.asarray(plan.gpu_speed, np.float64)
    gpu_bag = gpu_bags(plan)
    capacity = bag_capacity(plan)

    src = pos[seqs.src_gpu]
    work_before = np.bincount(src, weights=workload, minlength=n)
    tokens_before = np.bincount(src, weights=seqs.length, minlength=n).astype(np.int64)
    share = linear_share(plan)
    linear, attention = terms_after(plan, workload * share, workload * (1.0 - share))
    work_after = linear + attention
    load_before, load_after = work_before / speed, work_after / speed
    bag_load_after = np.bincount(seqs.bag, weights=workload, minlength=len(plan.bags))
    bag_load_before = np.bincount(gpu_bag, weights=load_before, minlength=len(plan.bags))

    csrc, cdst = pos[chunks.src_gpu], pos[chunks.dst_gpu]
    tokens_after = np.bincount(cdst, weights=chunks.length, minlength=n).astype(np.int64)
    away = csrc != cdst
    moving = chunks.length[away]
    sent = np.bincount(csrc[away], weights=moving, minlength=n).astype(np.int64)
    received = np.bincount(cdst[away], weights=moving, minlength=n).astype(np.int64)

    return PlanStats(
        load_before=load_before,
        load_after=load_after,
        work_after=work_after,
        tokens_before=tokens_before,
        tokens_after=tokens_after,
        bag_load_before=bag_load_before,
        bag_load_after=bag_load_after,
        tokens_sent=sent,
        tokens_received=received,
        gpu_bag=gpu_bag,
        speed=speed,
        bag_capacity=capacity,
        total_load=float(workload.sum()),
        total_tokens=int(seqs.length.sum()),
        moved_tokens=int(moving.sum()),
        lower_bound=lower_bound(workload, capacity),
        chunk_src=csrc,
        chunk_dst=cdst,
        chunk_len=np.asarray(chunks.length, dtype=np.int64),
    )


@dataclass(frozen=True, slots=True)
class StepSummary:
    """The few numbers of one plan that a timeline and a header need (cheap to keep for
    every step of a long run)."""

    step: int | None
    time: float | None
    run: str | None
    line: int | None  # 1-based line in the file it came from
    num_gpus: int
    num_sequences: int
    num_chunks: int
    imbalance_before: float  # max / mean load
    imbalance_after: float
    max_min_before: float
    max_min_after: float
    moved_fraction: float
    plan_ms: float | None
    speedup: float  # makespan before / after (modelled)
    makespan_over_lb: float
    has_measurements: bool
    step_ms: float | None = None  # measured wall time of the step: the longest rank's "step"
    topology: str | None = None  # the partition the step used ("g1n4+g2n2")
    bags: str | None = None  # where its bags sat, `bag_runs` ("g1@0-3 g4@4-7")


def summarize(plan: RoutingPlan, line: int | None = None) -> StepSummary:
    """Summary of one plan (computes ``plan.stats`` once)."""
    st = plan.stats
    m = plan.measurements
    return StepSummary(
        step=plan.step,
        time=plan.time,
        run=plan.run,
        line=line,
        num_gpus=len(plan.gpus),
        num_sequences=len(plan.sequences),
        num_chunks=len(plan.chunks),
        imbalance_before=st.imbalance_before,
        imbalance_after=st.imbalance_after,
        max_min_before=st.max_min_before,
        max_min_after=st.max_min_after,
        moved_fraction=st.moved_fraction,
        plan_ms=None if m is None else m.plan_ms,
        speedup=st.speedup,
        makespan_over_lb=st.makespan_over_lb,
        has_measurements=bool(m is not None and m.per_rank_ms),
        step_ms=measured_step_ms(m),
        topology=plan.topology,
        bags=bag_runs(plan.bags),
    )


def bag_runs(bags: list[list[int]]) -> str:
    """Where a plan's bags sit, compactly: each run of consecutive bags of one size as
    ``g<size>@<first rank>-<last rank>``, e.g. ``"g1@0-3 g4@4-7"`` (four single GPUs, then
    a bag of 4). Two plans with one topology string but bags in other places differ here."""
    runs: list[list[int]] = []  # [size, first rank, last rank]
    for bag in bags:
        if runs and runs[-1][0] == len(bag):
            runs[-1][2] = bag[-1]
        else:
            runs.append([len(bag), bag[0], bag[-1]])
    return " ".join(f"g{g}@{a}-{b}" if a != b else f"g{g}@{a}" for g, a, b in runs)


def measured_step_ms(m: Any) -> float | None:
    """The measured wall time of a step (``m``: its `Measurements` or None): its longest
    rank's ``step`` phase (ranks end a step together at the gradient all-reduce, so this
    is what the job waited)."""
    times = None if m is None else m.per_rank_ms.get("step")
    return float(max(times)) if times else None


# ------------------------------------------------------------ how figures are written
def before_after(before: float, after: float, spec: str = ".3f") -> str:
    """A figure that balancing changed, as every reader writes it: ``1.842 → 1.013``."""
    return f"{before:{spec}} → {after:{spec}}"


def share(part: int, whole: int, unit: str = "") -> str:
    """``12,345 of 67,890 tokens (18.2%)`` (``unit`` after the whole, if given)."""
    fraction = part / whole if whole else 0.0
    return f"{part:,} of {whole:,}{f' {unit}' if unit else ''} ({fraction:.1%})"


def summary_line(
    imbalance_before: float, imbalance_after: float, moved_tokens: int, total_tokens: int
) -> str:
    """The one-line summary of a balanced step:
    ``imbalance 1.842 → 1.013  moved 12,345 of 67,890 tokens (18.2%)``."""
    return (
        f"imbalance {before_after(imbalance_before, imbalance_after)}  "
        f"moved {share(moved_tokens, total_tokens, 'tokens')}"
    )
