"""What a recorded step's measurements say about each rank: compute apart from waiting.

The definitions every straggler view uses (the CLI, the dashboard, the report):

- **measured compute** of a rank: its time in the phase that stands for compute —
  ``compute`` (the step minus the time inside `COLLECTIVE_PHASES`) when it was recorded,
  else the next of `COMPUTE_PHASES` that was (`knapformer.contract.phases.compute_phase`).
- **time in a collective**: ``per_rank_ms[phase]`` for each of `COLLECTIVE_PHASES`.
  Time inside a collective is waiting for the last rank to arrive plus the transfer, so
  the rank that arrived last waited least: its **wait** is ``t_i - min_j t_j`` and the
  **last arrival** is ``argmin_j t_j``, over the ranks taking part (the whole group; only
  the bag's GPUs for the Ulysses exchanges of `BAG_COLLECTIVES`). No clocks are compared
  across ranks.
- **predicted share**: ``plan.stats.work_after / total`` — the work the plan gave each
  GPU at nominal speed (not ``load_after``, which is divided by any speed the planner
  assumed), so a GPU that is slower than the plan assumed shows up however it was fed.
- **predicted load**: ``load_after / mean_load`` — the plan's own predicted time for the
  GPU relative to the ideal (1.00): above 1 the plan put more there than its share.
- **compute ratio**: ``(compute_i / share_i) / median_j (compute_j / share_j)``: 1 = the
  rank took the time the plan predicted for it, as the typical rank did; 2 = twice that.
  Undefined (NaN) for a rank given no work.
- **data** of a rank: its ``data`` phase, the time between steps it waited for its next
  batch (0 when not measured); **host**: its host work that is not the model's, `host_ms`
  (the balancer's planning without its gather, recording, and a ``host`` phase the loop
  adds); **exchange**: its time in the exchanges that move tokens (`EXCHANGES`), with the
  values (tokens x token dim) the plan moved through them from and to it, route and
  reverse route each (Ulysses exchanges move per layer, which the plan does not know).
- **link cost** of an exchange scope in a step (`LinkStep`): the scopes are the whole
  group for the routing all-to-alls (``route``, ``reverse_route``) and each multi-GPU
  bag for its Ulysses exchanges (``pre_attn``, ``post_attn``). Its **no-wait time** is,
  summed over its exchanges, the least time any of its ranks spent in each (the rank
  that arrived last waited for nobody: what is left is the transfer), its cost that over
  the longest compute among its ranks (the compute the exchanges serve; the step is at
  least that long). Every rank of a synchronous exchange waits for a slow link alike, so
  timings tell which exchanges are slow, never whose link it is.
- **probed links** of a step (`ProbedLinks`), when the balancer ran its link probe
  (`knapformer.contract.probe`): each pair that exchanged alone in a round, with the
  shorter of its two ends' times (a slow link slows both ends; a rank descheduled for a
  moment slows only its own) and the bandwidth that gives. Unlike the all-to-alls, these
  say whose link is slow.
- **layout floor** of a step: the largest sequence's workload over the largest bag, over
  the mean load (1.00 = the ideal): no plan on these bags can make the step shorter.
  A rank **at the floor** holds that much load itself.
- **straggler of a step**: the rank that waited least in all its collectives together —
  the one the others waited for (in a bag, its peers wait for it in the Ulysses
  exchanges and the group then waits for the whole bag); none when nobody waited.

Pure numpy, no readers: the dashboard and the CLI both import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from knapformer.contract.nan_reduce import nan_to_zero
from knapformer.contract.phases import (
    BAG_COLLECTIVES,
    COLLECTIVE_PHASES,
    DATA,
    DESCHEDULED,
    EXCHANGES,
    FIXED_PHASES,
    GC,
    GROUP_EXCHANGES,
    PROBE,
    STEP,
    host_ms,
    phase_ms,
)
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.contract.probe import LinkProbe, probe_partners
from knapformer.contract.units import LoadUnit


@dataclass(frozen=True, slots=True)
class LinkStep:
    """One exchange scope of one step (see the module doc)."""

    scope: str  # "group" (route, reverse_route) or "bag" (pre_attn, post_attn)
    ranks: tuple[int, ...]  # the ranks taking part
    no_wait_ms: float  # summed over the scope's exchanges: the least any rank spent in each
    compute_ms: float  # the longest compute of its ranks

    @property
    def phases(self) -> tuple[str, ...]:
        return GROUP_EXCHANGES if self.scope == "group" else BAG_COLLECTIVES

    @property
    def cost(self) -> float:
        """no-wait time over the compute it serves (NaN without compute)."""
        return self.no_wait_ms / self.compute_ms if self.compute_ms > 0 else float("nan")


def link_steps(
    per_rank: Mapping[str, Sequence[float]],
    gpus: Sequence[int],
    bags: Sequence[Sequence[int]],
    compute_ms: np.ndarray,
) -> tuple[LinkStep, ...]:
    """The exchange scopes of one step that measured their exchanges: the group (when
    it routed) and each bag of two or more GPUs (when it measured Ulysses exchanges)."""
    n = len(gpus)
    out = []
    group = [
        np.nan_to_num(np.asarray(per_rank[p], float)) for p in GROUP_EXCHANGES if p in per_rank
    ]
    if group and n >= 2:
        no_wait = float(sum(t.min() for t in group))
        out.append(LinkStep("group", tuple(int(g) for g in gpus), no_wait, _largest(compute_ms)))
    in_bag = [p for p in BAG_COLLECTIVES if p in per_rank]
    multi = [bag for bag in bags if len(bag) > 1]
    if not in_bag or not multi:
        return tuple(out)
    # Every bag at once (reduceat over the bags' members, bag after bag): a loop over 256
    # bags at 1,024 GPUs took 30 ms a step.
    sizes = np.fromiter(map(len, multi), dtype=np.int64, count=len(multi))
    rows = gpu_positions(gpus)[np.fromiter(itertools.chain.from_iterable(multi), np.int64)]
    starts = np.cumsum(sizes) - sizes
    no_wait = sum(
        np.minimum.reduceat(np.nan_to_num(np.asarray(per_rank[p], float))[rows], starts)
        for p in in_bag
    )
    longest = np.fmax.reduceat(np.asarray(compute_ms, float)[rows], starts)  # NaN ignored
    out += [
        LinkStep("bag", tuple(int(g) for g in bag), float(w), float(c))
        for bag, w, c in zip(multi, no_wait, longest, strict=True)
    ]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ProbedLinks:
    """The pairs one step's link probe timed, one entry per pair and round (see the
    module doc). Arrays are (k,)."""

    a: np.ndarray  # int32 rank
    b: np.ndarray  # int32 rank, its partner
    ms: np.ndarray  # float32: the shorter of the two ends' times
    cross_node: np.ndarray  # bool: a and b are on different hosts
    bytes: int  # sent each way

    @property
    def gbps(self) -> np.ndarray:
        """(k,) GB/s each way (NaN for a time of 0)."""
        with np.errstate(divide="ignore"):
            return np.where(self.ms > 0, self.bytes / (self.ms.astype(np.float64) * 1e6), np.nan)


def probed_links(probe: LinkProbe, gpus: Sequence[int]) -> ProbedLinks:
    """The pairs of ``probe``, a plan's `LinkProbe` over ``gpus``."""
    n = len(gpus)
    ranks, node = np.asarray(gpus, dtype=np.int32), np.asarray(probe.node)
    a, b, ms = [], [], []
    for round_index, row in zip(probe.rounds, probe.ms, strict=True):
        partner = probe_partners(n, round_index)
        first = np.flatnonzero(partner > np.arange(n))  # each pair once
        times = np.asarray(row, dtype=np.float64)
        a.append(first)
        b.append(partner[first])
        ms.append(np.minimum(times[first], times[partner[first]]))
    a_pos, b_pos = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (a, b))
    return ProbedLinks(
        a=ranks[a_pos],
        b=ranks[b_pos],
        ms=(np.concatenate(ms) if ms else np.zeros(0)).astype(np.float32),
        cross_node=node[a_pos] != node[b_pos],
        bytes=probe.bytes,
    )


@dataclass(frozen=True)
class MeasuredStep:
    """Per rank of one plan (arrays indexed by position in ``gpus``), from its
    ``measurements.per_rank_ms``. Build with `measure`."""

    step: int | None
    gpus: np.ndarray  # (n,) ranks
    phase: str  # the measured phase standing for compute
    compute_ms: np.ndarray  # (n,)
    collective_ms: dict[str, np.ndarray]  # phase -> (n,), the measured collectives
    wait_ms: dict[str, np.ndarray]  # phase -> (n,) t_i - min_j t_j among its peers
    last_arrival: dict[str, np.ndarray]  # phase -> (n,) bool: arrived last among its peers
    predicted_share: np.ndarray  # (n,) work_after / total work, sums to 1
    predicted_load: np.ndarray  # (n,) load_after / mean_load
    step_ms: np.ndarray | None  # (n,) the whole step less the link probe, when measured
    straggler: int | None  # rank the others waited for (see the module doc)
    shown_total: float  # total work of the step in the plan's `LoadUnit`
    load_axis: str  # what that unit is called on an axis
    data_ms: np.ndarray  # (n,) waiting for the next batch (0: not measured)
    host_ms: np.ndarray  # (n,) host work that is not the model's (`host_ms`)
    gc_ms: np.ndarray  # (n,) of which garbage collection (``gc``; 0: not measured)
    #: (n,) on the CPU, what the wall clock counted beyond the compute's CPU time: the
    #: thread waiting for a core (`knapformer.runtime.timing`; 0 where not measured)
    descheduled_ms: np.ndarray
    exchange_ms: np.ndarray  # (n,) time in the token exchanges (`EXCHANGES`)
    exchange_values: np.ndarray  # (n,) values the routing moved from and to it, both ways
    #: (n,) ms in each of `FIXED_PHASES` it measured: the length gather, the gradient
    #: all-reduce, the optimizer and the time between the loop's phases
    fixed_ms: dict[str, np.ndarray]
    floor_load: float  # the layout floor over the mean load (1.00 = the ideal)
    at_floor: np.ndarray  # (n,) bool: its predicted load reaches the floor
    links: tuple[LinkStep, ...] = ()  # the exchange scopes (`link_steps`)
    probed: ProbedLinks | None = None  # the link probe's pairs, when it ran

    @property
    def total_wait_ms(self) -> np.ndarray:
        """(n,) time each rank waited in all its collectives together."""
        return sum(self.wait_ms.values(), np.zeros(len(self.gpus)))

    @property
    def compute_ratio(self) -> np.ndarray:
        """(n,) measured compute relative to the plan's prediction (see the module doc)."""
        return compute_ratio(self.compute_ms, self.predicted_share)

    def _exchange_wait(self) -> np.ndarray:
        """(n,) of ``exchange_ms``, the time each rank waited for its peers."""
        waits = (self.wait_ms[p] for p in EXCHANGES if p in self.wait_ms)
        return sum(waits, np.zeros(len(self.gpus)))

    def figures(self) -> RankFigures:
        """The compact per-rank figures the straggler analysis keeps for every step."""
        return RankFigures(
            step=self.step,
            gpus=self.gpus.astype(np.int32),
            phase=self.phase,
            compute_ms=self.compute_ms.astype(np.float32),
            predicted_share=self.predicted_share.astype(np.float32),
            predicted_load=self.predicted_load.astype(np.float32),
            wait_ms=self.total_wait_ms.astype(np.float32),
            straggler=self.straggler,
            shown_total=self.shown_total,
            load_axis=self.load_axis,
            step_ms=None if self.step_ms is None else self.step_ms.astype(np.float32),
            data_ms=self.data_ms.astype(np.float32),
            host_ms=self.host_ms.astype(np.float32),
            gc_ms=self.gc_ms.astype(np.float32),
            descheduled_ms=self.descheduled_ms.astype(np.float32),
            exchange_ms=self.exchange_ms.astype(np.float32),
            exchange_wait_ms=self._exchange_wait().astype(np.float32),
            exchange_values=self.exchange_values.astype(np.float32),
            fixed_ms={p: ms.astype(np.float32) for p, ms in self.fixed_ms.items()},
            floor_load=self.floor_load,
            at_floor=self.at_floor,
            links=self.links,
            probed=self.probed,
        )


@dataclass(frozen=True, slots=True)
class RankFigures:
    """What the straggler views keep of one measured step: a few float32 numbers per rank
    (cheap to hold for every step of a long run). Arrays are indexed like ``gpus``."""

    step: int | None
    gpus: np.ndarray  # (n,) int32 ranks
    phase: str
    compute_ms: np.ndarray  # (n,) float32
    predicted_share: np.ndarray  # (n,) float32
    predicted_load: np.ndarray  # (n,) float32
    wait_ms: np.ndarray  # (n,) float32, summed over the collectives
    straggler: int | None
    shown_total: float
    load_axis: str
    step_ms: np.ndarray | None = None  # (n,) float32, when measured
    data_ms: np.ndarray | None = None  # (n,) float32 (None: figures of an older version)
    host_ms: np.ndarray | None = None  # (n,) float32
    gc_ms: np.ndarray | None = None  # (n,) float32, of host_ms
    descheduled_ms: np.ndarray | None = None  # (n,) float32
    exchange_ms: np.ndarray | None = None  # (n,) float32
    exchange_wait_ms: np.ndarray | None = None  # (n,) float32, of exchange_ms: waiting
    exchange_values: np.ndarray | None = None  # (n,) float32
    fixed_ms: dict[str, np.ndarray] | None = None  # phase of `FIXED_PHASES` -> (n,) float32
    floor_load: float = float("nan")
    at_floor: np.ndarray | None = None  # (n,) bool
    links: tuple[LinkStep, ...] = ()  # the exchange scopes (`link_steps`)
    probed: ProbedLinks | None = None  # the link probe's pairs, when it ran

    @property
    def compute_ratio(self) -> np.ndarray:
        return compute_ratio(self.compute_ms, self.predicted_share)

    @property
    def predicted_shown(self) -> np.ndarray:
        """(n,) the predicted work of each rank in the plan's `LoadUnit` (nominal speed)."""
        return self.predicted_share.astype(np.float64) * self.shown_total


def compute_ratio(compute_ms: np.ndarray, share: np.ndarray) -> np.ndarray:
    """(n,) ``(compute_i / share_i) / median_j (compute_j / share_j)``; NaN where a rank
    has no predicted work or nothing is comparable."""
    compute = np.asarray(compute_ms, dtype=np.float64)
    share = np.asarray(share, dtype=np.float64)
    per_work = np.full(len(compute), np.nan)
    given = (share > 0) & np.isfinite(compute)
    per_work[given] = compute[given] / share[given]
    if not given.any():
        return per_work
    typical = float(np.median(per_work[given]))
    if typical <= 0:
        return np.full(len(compute), np.nan)
    return per_work / typical


def measure(plan: RoutingPlan, links: bool = True) -> MeasuredStep | None:
    """The per-rank measured figures of ``plan``; None when it measured no compute phase.
    ``links=False`` leaves out the exchange scopes (one object per bag: the run store's
    writer, which keeps none of them, saves most of its time at 1,024 GPUs)."""
    m = plan.measurements
    phase = None if m is None else m.compute_phase()
    if phase is None:
        return None
    n = len(plan.gpus)
    # each phase made an array once (they are lists in a plan; looked up several times)
    per_rank = {name: np.asarray(v, dtype=np.float64) for name, v in m.per_rank_ms.items()}
    st = plan.stats
    total_work = float(st.work_after.sum())
    share = st.work_after / total_work if total_work > 0 else np.zeros(n)
    predicted_load = st.load_after / st.mean_load if st.mean_load > 0 else np.zeros(n)
    collective_ms, wait_ms, last = {}, {}, {}
    for name in COLLECTIVE_PHASES:
        if name not in per_rank:
            continue
        t = np.asarray(per_rank[name], dtype=np.float64)
        wait, last_of_group = collective_waits(t, peer_groups(name, st.gpu_bag))
        is_last = np.zeros(n, dtype=bool)
        is_last[last_of_group[last_of_group >= 0]] = True
        collective_ms[name], wait_ms[name], last[name] = t, wait, is_last
    total_wait = sum(wait_ms.values(), np.zeros(n))
    straggler = int(plan.gpus[int(np.argmin(total_wait))]) if total_wait.sum() > 0 else None
    step_ms = per_rank.get(STEP)
    if step_ms is not None and PROBE in per_rank:
        # The link probe is a diagnostic, not training: what "matters" is of the step
        # training takes, and a probe run every step must not dilute it.
        step_ms = np.maximum(np.asarray(step_ms, float) - np.nan_to_num(per_rank[PROBE]), 0)
    unit = LoadUnit.of(plan)
    exchange = sum(
        (np.nan_to_num(np.asarray(per_rank[p], float)) for p in EXCHANGES if p in per_rank),
        np.zeros(n),
    )
    values = (st.tokens_sent + st.tokens_received).astype(np.float64) * 2 * (plan.token_dim or 1)
    floor_load = layout_floor(plan)
    at_floor = (st.load_after >= 0.99 * floor_load * st.mean_load) & (floor_load > 1.0)
    compute = np.asarray(per_rank[phase], dtype=np.float64)
    descheduled = phase_ms(per_rank, DESCHEDULED, n)
    return MeasuredStep(
        step=plan.step,
        gpus=np.asarray(plan.gpus, dtype=np.int64),
        phase=phase,
        compute_ms=compute,
        collective_ms=collective_ms,
        wait_ms=wait_ms,
        last_arrival=last,
        predicted_share=share,
        predicted_load=predicted_load,
        step_ms=None if step_ms is None else np.asarray(step_ms, dtype=np.float64),
        straggler=straggler,
        shown_total=st.total_load * unit.factor,
        load_axis=unit.axis_title,
        data_ms=phase_ms(per_rank, DATA, n),
        host_ms=host_ms(per_rank, n),
        gc_ms=phase_ms(per_rank, GC, n),
        descheduled_ms=descheduled,
        exchange_ms=exchange,
        exchange_values=values,
        fixed_ms={p: phase_ms(per_rank, p, n) for p in FIXED_PHASES if p in per_rank},
        floor_load=floor_load,
        at_floor=at_floor,
        # the compute the exchanges serve by the wall clock (the step is at least that long)
        links=link_steps(per_rank, plan.gpus, plan.bags, compute + descheduled) if links else (),
        probed=None if m.link_probe is None else probed_links(m.link_probe, plan.gpus),
    )


def layout_floor(plan: RoutingPlan) -> float:
    """The plan's layout floor over its mean load (1.00 = the ideal; NaN: no load): the
    largest sequence over the largest bag."""
    st = plan.stats
    biggest = float(plan.sequences.workload.max()) if len(plan.sequences.length) else 0.0
    floor = biggest / float(st.bag_capacity.max()) if st.bag_capacity.size else 0.0
    return floor / st.mean_load if st.mean_load > 0 else float("nan")


def _largest(values: np.ndarray) -> float:
    """The largest of ``values`` ignoring NaN (NaN when all are)."""
    values = np.asarray(values, float)
    return float(np.nanmax(values)) if np.isfinite(values).any() else float("nan")


def collective_waits(t: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For times ``t`` (n,) in a collective whose peers share a ``group`` id (n,): each
    rank's wait (n,) and the position of each group's last arrival (num_groups,; -1 for a
    group of one rank or with no measured time). A rank alone in its group neither waits
    nor arrives last; unmeasured (NaN) times count as no wait."""
    wait, earliest, first, has = _group_waits(t, group)
    # the last arrival: the first position holding its group's earliest time
    position = np.where(earliest == first[group], np.arange(len(t)), len(t))
    last = np.full(len(first), len(t), dtype=np.int64)
    np.minimum.at(last, group, position)
    return wait, np.where(has, last, -1)


def peer_groups(collective: str, bags) -> np.ndarray:
    """(n,) group ids of whom each rank waits for in ``collective``: its bag's GPUs in the
    Ulysses exchanges (`BAG_COLLECTIVES`, ``bags``: each rank's bag id), else the group."""
    if collective in BAG_COLLECTIVES:
        return np.asarray(bags, dtype=np.int64)
    return np.zeros(len(bags), dtype=np.int64)


def group_waits(t: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The waits of `collective_waits` alone (a window of the run store needs no more)."""
    return _group_waits(t, group)[0]


def _group_waits(t: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, ...]:
    """(wait (n,), each time with NaN as inf (n,), each group's earliest time, whether a
    group has a wait: two ranks or more, one measured)."""
    groups = int(group.max()) + 1 if len(group) else 0
    size = np.bincount(group, minlength=groups)
    earliest = np.where(np.isnan(t), np.inf, t)
    # By unbuffered reductions, not a sort: a store reader passes a whole window of steps
    # at once (a million rows), where sorting took 0.4 s per collective.
    first = np.full(groups, np.inf)
    np.minimum.at(first, group, earliest)
    has = (size >= 2) & np.isfinite(first)
    wait = nan_to_zero(np.where(has[group], t - first[group], 0.0), copy=False)
    return wait, earliest, first, has
