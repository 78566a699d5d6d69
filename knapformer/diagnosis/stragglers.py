"""Which rank is slow, and why: per-rank verdicts over a window of measured steps.

Per rank, over the window's measured steps (`knapformer.diagnosis.measured` defines each
figure): predicted share of the work, measured compute, its **rate** under the affine
compute model (`knapformer.planning.compute_model`: a fixed overhead shared by the group
plus a rate per rank, fitted over the window; 1 = the group's median), time waiting in
collectives, time waiting for data, host work, time in the token exchanges, and a verdict.
Every verdict names the figure that decided it, and each needs that figure beyond its
threshold in at least `Thresholds.persistence` of the rank's steps, median included:

- ``slow_gpu``: its rate is at least `Thresholds.slow_ratio` times the group's. The
  hardware (throttling, another job) is slow, not the data; a rank given little work is
  not slow for its fixed overhead (the affine model takes it apart). What it costs does
  not decide whether it is named, only how severe it is (`RankVerdict.severity`): the
  time its rate costs the step (measured compute minus what a rank at the group's rate
  would take for its work, by the wall clock: on the CPU, with what the rank waited for
  a core) is ``minor`` under `Thresholds.material` of the step. A GPU 1.5x slower than
  its peers is a fault to hear about however little this model loses to it today. It
  takes `Thresholds.min_steps_gpu` measured steps, more
  than the other verdicts: the line the rate is read from needs them. A window whose fit
  is ambiguous (`ComputeFit.ambiguous`: another line, with other ranks off it, fits about
  as well, or within the noise of the window) names no rank slow_gpu.
- ``slow_host``: its host work (planning, recording, the loop's ``host`` phase, garbage
  collection) exceeds the group's median by `Thresholds.material` of the step.
- ``slow_input``: its wait for the next batch (``data`` phase) exceeds the group's
  median by `Thresholds.material` of the step.
- ``slow_link``: in the link probe (`knapformer.contract.probe`, when the balancer runs
  it) even the rank's fastest link moves at most `Thresholds.link_bandwidth` of what
  the group's typical rank's fastest link of the same kind moves
  (`knapformer.diagnosis.probed`), in at least `Thresholds.min_probes` probes. Only the
  probe can name a rank: in an all-to-all every peer waits for a slow link alike.
  Without it, the timings still say which **exchange scope** is slow (`LinkVerdict`:
  the group's routing all-to-alls, or one bag's Ulysses exchanges, whose no-wait time,
  the least any of its ranks spent in each, is at least `Thresholds.link_cost` times the
  longest compute it serves), not whose link it is. When the probe has timed every
  rank of a bag's scope and finds each one's links healthy (noise only slows a link, so
  one probe can clear it), the scope is not named (`LinkVerdict.cleared_by_probe`): its
  exchanges wait on something other than a link, such as peers waiting for a core on an
  oversubscribed host. The probe compares ranks with each other, so it never clears the
  group's scope: a network slow for every rank shows only there.
- ``layout_floor``: its predicted load is at least `Thresholds.heavy_load` times the
  ideal because it holds the step's layout floor: a sequence no bag of this topology can
  split further. Only other bags help (``knapformer suggest``).
- ``data_imbalance``: the plan put too much there (predicted load at least
  `Thresholds.heavy_load` times the ideal) above the floor: the solver's gap.
- ``ok`` otherwise, and for a rank with fewer than `Thresholds.min_steps` measured steps
  (nothing can be persistent yet).

Medians and the persistence rule make one noisy step (a page fault, a garbage
collection, a late kernel launch) name nobody. Every threshold is in `THRESHOLDS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from knapformer.contract.nan_reduce import nan_reduce, nan_to_zero
from knapformer.contract.phases import BAG_COLLECTIVES, GROUP_EXCHANGES
from knapformer.diagnosis.measured import RankFigures
from knapformer.diagnosis.probed import relative_bandwidth
from knapformer.diagnosis.rank_steps import RankSteps, rank_steps
from knapformer.planning.compute_model import (
    DEPARTURE,
    MATERIAL,
    MIN_STEPS,
    ComputeFit,
)

Verdict = Literal[
    "slow_gpu", "slow_host", "slow_input", "slow_link", "layout_floor", "data_imbalance", "ok"
]
#: The order a header or a table names verdicts in: the most actionable first.
VERDICTS: tuple[Verdict, ...] = (
    "slow_gpu", "slow_host", "slow_input", "slow_link", "layout_floor", "data_imbalance", "ok"
)  # fmt: skip
#: The figure each verdict is decided by (`RankVerdict` field names).
DECIDED_BY: dict[str, str] = {
    "slow_gpu": "ratio",
    "slow_host": "host_excess_ms",
    "slow_input": "data_excess_ms",
    "slow_link": "link_bandwidth",
    "layout_floor": "predicted_load",
    "data_imbalance": "predicted_load",
    "ok": "ratio",
}


@dataclass(frozen=True)
class Thresholds:
    """Where a verdict starts. The defaults are `THRESHOLDS`."""

    #: rate (1 = the group's) from which a step counts as slow for a rank: 30 % over
    #: (measured noise on a quiet GPU is a few %; an injected 2x shows as 2)
    slow_ratio: float = DEPARTURE
    #: predicted load (1.00 = the ideal) from which a step counts as overloaded by the plan
    heavy_load: float = 1.1
    #: excess time, as a share of the group's median step, that makes a figure matter: a
    #: rank is named slow_host or slow_input only for what costs the step at least this
    #: much; a slow_gpu costing less is named ``minor``
    material: float = MATERIAL
    #: fraction of the window's measured steps that must agree for a verdict
    persistence: float = 0.6
    #: measured steps a rank needs before it can get any verdict but ``ok``
    min_steps: int = 3
    #: a rank's rate names it ``slow_gpu`` whatever that costs only when the plan gave it at
    #: least this share of the median rank's work. On less, the model's small errors (a
    #: cost per sequence, a launch overhead), which a typical rank's work dwarfs, become
    #: large ratios: a clean g1n4 run on 2 cores read 1.76x for its lightest rank, on 4 %
    #: of the work. Such a rank is named when what its rate costs is `material`
    rate_work_share: float = 0.5
    #: ... and before it can be named ``slow_gpu``: as many as the history cost model needs
    #: to learn a slow rank (`knapformer.planning.compute_model.MIN_STEPS`). The rate rests
    #: on a line fitted through every rank's compute, which the first steps' warm-up and a
    #: busy host move most on the lightly loaded ranks: in kept demo runs on 2 cores, g1n4
    #: with rank 2 at 1.5x named the healthy rank 0 slow_gpu after 3 steps, never after 4
    min_steps_gpu: int = MIN_STEPS
    #: an exchange scope whose no-wait time is this much of the longest compute it serves
    #: is link-bound (`LinkVerdict`): healthy exchanges on a loaded CPU/gloo host measure
    #: 0.1-0.4 and, in a busy test suite, 0.55 for most steps of a healthy bag (NVLink:
    #: ~0.13 by the cost model); an injected 1.5x link, 0.5-1.5. 1.0 (an exchange as long
    #: as the compute it serves) names no healthy scope, at the price of missing milder
    #: links. A bag across nodes may be this slow by design (then the layout is to change)
    link_cost: float = 1.0
    #: relative bandwidth in the link probe (its fastest link over the group's typical
    #: fastest link of the same kind) at or below which a probe counts as slow for a rank:
    #: a link at half speed or worse. Noise only slows pairs (a descheduled end), which a
    #: healthy rank's fastest link shrugs off
    link_bandwidth: float = 0.5
    #: probes a rank needs before it can be named ``slow_link`` (as many as steps for
    #: any other verdict: two probes, one of them noisy, would split the vote)
    min_probes: int = 3


THRESHOLDS = Thresholds()
#: Steps analysed by default: the most recent ones, so a verdict describes the run now.
WINDOW = 20


@dataclass(frozen=True)
class RankVerdict:
    """One rank over the window (medians over its measured steps; ms per step)."""

    rank: int
    verdict: Verdict
    predicted_share: float  # of the step's work, at nominal speed
    predicted_load: float  # the plan's predicted time relative to the ideal (1.00)
    measured_ms: float  # compute
    ratio: float  # rate under the affine model relative to the group's (1 = typical)
    wait_ms: float  # in collectives, per step
    last_arrivals: int  # steps in which it was the straggler
    slow_steps: int  # steps with ratio >= slow_ratio
    heavy_steps: int  # steps with predicted load >= heavy_load
    steps: int  # measured steps of the window it took part in
    predicted_ms: float = float("nan")  # compute a rank at the group's rate would take
    compute_excess_ms: float = float("nan")  # measured - predicted compute
    host_ms: float = 0.0
    host_excess_ms: float = 0.0  # over the group's median
    gc_ms: float = 0.0  # of host_ms: garbage collection
    data_ms: float = 0.0
    data_excess_ms: float = 0.0
    exchange_ms: float = 0.0
    exchange_excess_ms: float = 0.0
    bandwidth: float = float("nan")  # routed values per ms relative to the group's median
    at_floor_steps: int = 0  # steps in which it holds the layout floor
    link_bandwidth: float = float("nan")  # probe: its fastest link over the group's (1)
    slow_probes: int = 0  # probes with link_bandwidth at or below the threshold
    probes: int = 0  # probes it took part in
    decided_by: str = "ratio"  # the field that decided the verdict
    #: what its verdict costs the step, by the wall clock (ms per step): its compute excess
    #: (with the time it waited for a core on the CPU), host excess or data excess
    cost_ms: float = float("nan")
    cost_share: float = float("nan")  # cost_ms over the group's median step
    #: of a named rank: "major", or "minor" when the cost is under `Thresholds.material`
    #: of the step ("" for ``ok``)
    severity: str = ""
    #: whether it was given enough work to name it by its rate alone
    #: (`Thresholds.rate_work_share`)
    rate_readable: bool = True

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None)."""
        return {
            k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


@dataclass(frozen=True)
class LinkVerdict:
    """One exchange scope over the window (medians over the steps it exchanged in)."""

    scope: str  # "group" or "bag"
    ranks: list[int]
    phases: list[str]
    verdict: Literal["slow_link", "ok"]
    link_cost: float  # median no-wait time over the longest compute it serves
    no_wait_ms: float  # median no-wait time per step
    slow_steps: int  # steps with cost >= link_cost
    steps: int
    decided_by: str = "link_cost"
    #: slow by its timings, but the link probe measured every rank of the scope and
    #: found each one's links healthy (so the verdict is ``ok``)
    cleared_by_probe: bool = False

    def as_dict(self) -> dict:
        return {
            k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


#: (scope, its ranks) -> (cost (k,), no-wait ms (k,)) over the k steps it exchanged in
ScopeTimes = dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]]


def scope_times(figures: Sequence[RankFigures]) -> ScopeTimes:
    """The exchange scopes of ``figures`` (`RankFigures.links`) and their times."""
    seen: dict[tuple[str, tuple[int, ...]], list] = {}
    for f in figures:
        for link in f.links:
            seen.setdefault((link.scope, link.ranks), []).append(link)
    return {
        key: (np.array([x.cost for x in links]), np.array([x.no_wait_ms for x in links]))
        for key, links in seen.items()
    }


def link_verdicts(
    scopes: ScopeTimes,
    everyone: set[int],
    th: Thresholds,
    healthy_links: frozenset[int] = frozenset(),
) -> list[LinkVerdict]:
    """Every exchange scope of ``scopes`` and its verdict (`Thresholds.link_cost` in at
    least `Thresholds.persistence` of its steps, `Thresholds.min_steps` at least, and in
    the median); a scope all of whose ranks are in ``healthy_links`` (the link probe
    cleared them) is ``ok``, `LinkVerdict.cleared_by_probe`, unless it holds ``everyone``:
    the probe compares each rank's links with the group's, so it cannot clear them all."""
    out = []
    for (scope, ranks), (cost, no_wait) in scopes.items():
        counted = int(np.isfinite(cost).sum())
        median = nan_reduce(np.nanmedian, cost)
        slow = int((cost >= th.link_cost).sum())
        is_slow = (
            counted >= th.min_steps and slow >= th.persistence * counted and median >= th.link_cost
        )
        cleared = is_slow and set(ranks) <= healthy_links and set(ranks) != everyone
        out.append(
            LinkVerdict(
                scope=scope,
                ranks=list(ranks),
                phases=list(GROUP_EXCHANGES if scope == "group" else BAG_COLLECTIVES),
                verdict="slow_link" if is_slow and not cleared else "ok",
                link_cost=median,
                no_wait_ms=float(np.median(no_wait)),
                slow_steps=slow,
                steps=len(cost),
                cleared_by_probe=cleared,
            )
        )
    return sorted(out, key=lambda v: (v.scope != "group", v.ranks))


def describe_link(v: LinkVerdict) -> str:
    """``slow_link: bag of ranks 2, 3 (pre_attn, post_attn) — ...``."""
    where = "the group" if v.scope == "group" else "the bag"
    why = (
        "but the link probe finds every link of these ranks healthy: the exchanges wait "
        "on something else (a peer waiting for a core, contention outside the links)"
        if v.cleared_by_probe
        else "whose link it is the timings cannot say (every rank of an exchange waits "
        "for it alike)"
    )
    return (
        f"{v.verdict}: {where} of ranks {', '.join(map(str, v.ranks))} "
        f"({', '.join(v.phases)}) — {v.no_wait_ms:.0f} ms per step in them with nobody "
        f"waiting, {v.link_cost:.2f}× the compute they serve, in {v.slow_steps} of "
        f"{v.steps} steps; {why}"
    )


@dataclass(frozen=True)
class StragglerReport:
    """Verdicts of every rank over a window of steps, with the affine fit they used."""

    ranks: list[RankVerdict]  # by rank
    steps: list[int | None]  # the measured steps analysed
    phases: list[str]  # the measured phases that stood for compute
    thresholds: Thresholds
    fit: ComputeFit | None = None
    step_ms: float = float("nan")  # the group's median step (ms), what "material" is of
    links: list[LinkVerdict] = field(default_factory=list)  # every exchange scope

    @property
    def withheld_by_ambiguity(self) -> bool:
        """Whether the fit's ambiguity kept a rank whose rate is past `slow_ratio` from
        being named ``slow_gpu`` (an ambiguous window where every rate is below it names
        nobody either way)."""
        return (
            self.fit is not None
            and self.fit.ambiguous
            and any(r.ratio >= self.thresholds.slow_ratio for r in self.ranks)
        )

    @property
    def slow_links(self) -> list[LinkVerdict]:
        return [v for v in self.links if v.verdict != "ok"]

    @property
    def cleared_links(self) -> list[LinkVerdict]:
        """Scopes slow by their timings that the link probe cleared."""
        return [v for v in self.links if v.cleared_by_probe]

    @property
    def named(self) -> list[RankVerdict]:
        """Ranks whose verdict is not ``ok``: major ones first, then the most actionable
        verdict, then by how far off."""
        bad = [r for r in self.ranks if r.verdict != "ok"]
        return sorted(
            bad,
            key=lambda r: (r.severity == "minor", VERDICTS.index(r.verdict), -_severity(r)),
        )

    @property
    def straggler(self) -> RankVerdict | None:
        """The one rank to name in a header (None: every rank is ok)."""
        named = self.named
        return named[0] if named else None


def describe(r: RankVerdict) -> str:
    """One line naming a rank's verdict, what it costs and the figure that decided it:
    ``slow_gpu: rank 5 (major: costs 41 ms per step, 20% of the step) — rate 2.04× the
    group's, in 15 of 15 steps: +41 ms of compute per step over its share``."""
    if r.verdict == "slow_gpu":
        why = (
            f"rate {r.ratio:.2f}× the group's, in {r.slow_steps} of {r.steps} steps: "
            f"{_ms(r.compute_excess_ms)} of compute per step over its share"
        )
        if np.isfinite(r.cost_ms) and abs(r.cost_ms - r.compute_excess_ms) >= 0.5:
            why += f" ({_ms(r.cost_ms)} by the wall clock, waiting for a core included)"
    elif r.verdict == "slow_host":
        collected = f" (garbage collection {r.gc_ms:.0f} ms)" if r.gc_ms >= 0.5 else ""
        why = (
            f"host work {r.host_ms:.0f} ms per step{collected}, {_ms(r.host_excess_ms)} over "
            "the group's"
        )
    elif r.verdict == "slow_input":
        why = (
            f"waits {r.data_ms:.0f} ms per step for data, {_ms(r.data_excess_ms)} over the group's"
        )
    elif r.verdict == "slow_link":
        why = (
            f"its fastest link moves {r.link_bandwidth:.2f}× the group's (link probe), in "
            f"{r.slow_probes} of {r.probes} probes"
        )
    elif r.verdict == "layout_floor":
        why = (
            f"the plan gives it {r.predicted_load:.2f}× the ideal load, the layout floor "
            f"(a sequence no bag can split further) in {r.at_floor_steps} of {r.steps} steps"
        )
    elif r.verdict == "data_imbalance":
        why = (
            f"the plan gives it {r.predicted_load:.2f}× the ideal load, in {r.heavy_steps} of "
            f"{r.steps} steps"
        )
    else:
        why = f"rate {r.ratio:.2f}× the group's (median of {r.steps} steps)"
    return f"{r.verdict}: rank {r.rank}{_cost(r)} — {why}"


def headline(report: StragglerReport) -> str:
    """The one line a header gives a window: its straggler (`describe`), or why no rank is
    named. It never says every rank is as predicted while a rank's rate is past
    `Thresholds.slow_ratio`: such a rank is named, or the line says why not yet."""
    if report.straggler is not None:
        return describe(report.straggler)
    th = report.thresholds
    if report.withheld_by_ambiguity:
        return (
            "none named: the compute model cannot tell which ranks are off its line "
            "(ambiguous); read the rate column"
        )
    past = [r for r in report.ranks if np.isfinite(r.ratio) and r.ratio >= th.slow_ratio]
    if past:
        r = max(past, key=lambda v: v.ratio)
        said = f"rank {r.rank}'s rate is {r.ratio:.2f}× the group's"
        if not r.rate_readable:
            return (
                f"none named: {said}, on {r.predicted_share:.0%} of the work, too little to "
                f"read a rate from (named when it costs {th.material:.0%} of the step)"
            )
        return (
            f"none named yet: {said}, past {th.slow_ratio:g}× in {r.slow_steps} of "
            f"{r.steps} steps (slow_gpu needs {th.persistence:.0%} of at least "
            f"{th.min_steps_gpu} measured steps)"
        )
    return "none: every rank takes about the time the plan predicts"


def _cost(r: RankVerdict) -> str:
    """`` (minor: costs 8 ms per step, 6% of the step)``: what a named rank's verdict
    costs the step, where it is measured in time."""
    if not r.severity or not np.isfinite(r.cost_ms) or not np.isfinite(r.cost_share):
        return ""
    return f" ({r.severity}: costs {r.cost_ms:.0f} ms per step, {r.cost_share:.0%} of the step)"


def _ms(value: float) -> str:
    return "–" if not np.isfinite(value) else f"{value:+.0f} ms"


def _severity(r: RankVerdict) -> float:
    value = getattr(r, r.decided_by)
    if not np.isfinite(value):
        return 0.0
    # a link is the worse the less it moves
    return 1.0 / max(value, 1e-9) if r.decided_by == "link_bandwidth" else value


def analyse(
    figures: Sequence[RankFigures],
    window: int | None = WINDOW,
    thresholds: Thresholds = THRESHOLDS,
) -> StragglerReport:
    """Verdicts over the last ``window`` steps of ``figures`` (None or 0: all of them)."""
    if window:
        figures = list(figures)[-window:]
    m = rank_steps(figures)
    return judge(m, scope_times(figures), relative_bandwidth(figures, m.ranks), thresholds)


def judge(
    m: RankSteps,
    scopes: ScopeTimes,
    bandwidth_steps: np.ndarray,
    thresholds: Thresholds = THRESHOLDS,
) -> StragglerReport:
    """Verdicts over the window ``m``, its exchange scopes' times (`scope_times`) and its
    ranks' relative bandwidth (r, s) in the link probe (`relative_bandwidth`)."""
    th = thresholds
    fit = m.fit
    took_part = np.isfinite(m.compute_ms)  # (r, s); NaN marks a rank absent from a step
    rated = np.isfinite(m.ratio)
    steps, rated_steps = took_part.sum(axis=1), rated.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN marks what was not measured
        step_col = nan_reduce(np.nanmax, m.step_ms, axis=0) if m.step_ms.size else np.zeros(0)
        if not np.isfinite(step_col).any():  # no step measured: the longest compute
            step_col = (
                nan_reduce(np.nanmax, m.compute_ms, axis=0) if m.compute_ms.size else step_col
            )
        step_ms = nan_reduce(np.nanmedian, step_col)
        material = th.material * step_col  # (s,) ms that matter in each step
        excess = {
            name: matrix - nan_reduce(np.nanmedian, matrix, axis=0)
            for name, matrix in (("host", m.host_ms), ("data", m.data_ms),
                                 ("exchange", m.exchange_ms))
        }  # fmt: skip
        predicted = fit.predicted_ms * (m.ratio * 0 + 1)  # (r, s), NaN where unrated
        # By the wall clock: on the CPU the compute is the thread's CPU time, and each ms
        # of it took as much longer as the rank waited for a core (`descheduled`).
        stretch = (m.compute_ms + nan_to_zero(m.descheduled_ms)) / m.compute_ms
        stretch = np.where(np.isfinite(stretch) & (m.compute_ms > 0), stretch, 1.0)
        compute_excess = m.compute_ms - predicted
        wall_excess = compute_excess * stretch
        values_per_ms = m.exchange_values / m.exchange_ms
        bandwidth = row_medians(values_per_ms / nan_reduce(np.nanmedian, values_per_ms, axis=0))
        share = row_medians(m.predicted_share)
        readable = share >= th.rate_work_share * nan_reduce(np.nanmedian, share)  # (r,)
        # NaN compares False: absent steps never count
        slow_each = (m.ratio >= th.slow_ratio) & (readable[:, None] | (wall_excess >= material))
        heavy_each = m.predicted_load >= th.heavy_load
    probes = np.isfinite(bandwidth_steps).sum(axis=1)
    with np.errstate(invalid="ignore"):
        slow_link_each = bandwidth_steps <= th.link_bandwidth
    link_bandwidth = row_medians(bandwidth_steps)
    slow_steps = (m.ratio >= th.slow_ratio).sum(axis=1)
    heavy_steps = heavy_each.sum(axis=1)
    # the fit took the median of each rank's rates already (the same reduction)
    same_fit = fit is not None and m.ratio is fit.rate_steps
    ratio = fit.rate if same_fit else row_medians(m.ratio)
    load = row_medians(m.predicted_load)
    host_excess, data_excess = row_medians(excess["host"]), row_medians(excess["data"])
    enough = rated_steps >= th.min_steps

    def persistent(each: np.ndarray, counted: np.ndarray) -> np.ndarray:
        return (
            enough
            & (each.sum(axis=1) >= th.persistence * np.maximum(counted, 1))
            & (counted >= th.min_steps)
        )

    flags = {
        # An ambiguous window (another line, with other ranks off it, fits about as well)
        # names no rank slow by its rate, as the history cost model learns none from it.
        "slow_gpu": persistent(slow_each, rated_steps) & (ratio >= th.slow_ratio)
        & (rated_steps >= th.min_steps_gpu) & (fit is None or not fit.ambiguous),
        **{
            verdict: persistent(excess[name] >= material, steps)
            for verdict, name in (("slow_host", "host"), ("slow_input", "data"))
        },
        "slow_link": (probes >= th.min_probes)
        & (slow_link_each.sum(axis=1) >= th.persistence * np.maximum(probes, 1))
        & (link_bandwidth <= th.link_bandwidth),
        "layout_floor": persistent(heavy_each & m.at_floor, steps) & (load >= th.heavy_load),
        "data_imbalance": persistent(heavy_each, steps) & (load >= th.heavy_load),
    }  # fmt: skip
    named = [s for s in m.straggler if s is not None]
    last = np.bincount(np.searchsorted(m.ranks, named), minlength=len(m.ranks))
    columns = {
        "predicted_share": share.tolist(),
        "predicted_load": load.tolist(),
        "measured_ms": row_medians(m.compute_ms).tolist(),
        "ratio": ratio.tolist(),
        "wait_ms": row_medians(m.wait_ms).tolist(),
        "last_arrivals": last.tolist(),
        "slow_steps": slow_steps.tolist(),
        "heavy_steps": heavy_steps.tolist(),
        "steps": steps.tolist(),
        "predicted_ms": row_medians(predicted).tolist(),
        "compute_excess_ms": row_medians(compute_excess).tolist(),
        "host_ms": _zeros(row_medians(m.host_ms)),
        "host_excess_ms": _zeros(host_excess),
        "gc_ms": _zeros(row_medians(m.gc_ms)),
        "data_ms": _zeros(row_medians(m.data_ms)),
        "data_excess_ms": _zeros(data_excess),
        "exchange_ms": _zeros(row_medians(m.exchange_ms)),
        "exchange_excess_ms": _zeros(row_medians(excess["exchange"])),
        "bandwidth": bandwidth.tolist(),
        "at_floor_steps": m.at_floor.sum(axis=1).tolist(),
        "link_bandwidth": link_bandwidth.tolist(),
        "slow_probes": slow_link_each.sum(axis=1).tolist(),
        "probes": probes.tolist(),
        "rate_readable": readable.tolist(),
    }
    costs = {
        "slow_gpu": row_medians(wall_excess),
        "slow_host": host_excess,
        "slow_input": data_excess,
    }
    verdicts = []
    for i, rank in enumerate(m.ranks.tolist()):
        verdict = next((v for v in VERDICTS[:-1] if flags[v][i]), "ok")
        cost = float(costs[verdict][i]) if verdict in costs else float("nan")
        share = cost / step_ms if np.isfinite(cost) and step_ms > 0 else float("nan")
        verdicts.append(
            RankVerdict(
                rank=rank,
                verdict=verdict,
                decided_by=DECIDED_BY[verdict],
                cost_ms=cost,
                cost_share=share,
                severity=_severity_of(verdict, share, th),
                **{name: values[i] for name, values in columns.items()},
            )
        )
    # The probe times each rank's links alone, and noise only slows a link: one probe that
    # finds a rank's links healthy clears them (naming one slow takes `min_probes`).
    probed_healthy = (probes >= 1) & (link_bandwidth > th.link_bandwidth)
    healthy = frozenset(m.ranks[probed_healthy].tolist())
    links = link_verdicts(scopes, set(m.ranks.tolist()), th, healthy)
    return StragglerReport(verdicts, m.steps, m.phases, th, fit, step_ms, links)


def _severity_of(verdict: str, share: float, th: Thresholds) -> str:
    """ "minor" for a named rank whose verdict costs under `Thresholds.material` of the
    step, "major" for the others named, "" for ``ok``."""
    if verdict == "ok":
        return ""
    return "minor" if share < th.material else "major"


def _zeros(values: np.ndarray) -> list[float]:
    """Medians of a phase that may not have been measured: NaN as 0 (nothing spent)."""
    return np.nan_to_num(values, nan=0.0).tolist()


def row_medians(matrix: np.ndarray) -> np.ndarray:
    """(r,) the median of each row's values (NaN for a row with none)."""
    return nan_reduce(np.nanmedian, matrix, axis=1)


def named_over_run(
    figures: Sequence[RankFigures], window: int | None = WINDOW
) -> list[tuple[int | None, dict[int, str], list[tuple[int, ...]]]]:
    """What `analyse` names after each measured step of a run, as the run goes: per step,
    ``(step, {rank: verdict}, [ranks of a slow link scope])`` of the ranks not ``ok`` and
    the exchange scopes named ``slow_link``, over the steps measured so far."""
    out = []
    for k, f in enumerate(figures):
        report = analyse(figures[: k + 1], window)
        named = {r.rank: r.verdict for r in report.named}
        out.append((f.step, named, [tuple(v.ranks) for v in report.slow_links]))
    return out
