"""Where each rank's step went: per-rank stacked bars of its phases, for one step or a
window, in at most eight hues (`knapformer.visualization.palette.PHASE_GROUPS`).

Built from `knapformer.diagnosis.measured`, which defines every part: compute, the
optimizer, host work (planning without its gather, recording, the loop's ``host`` phase,
garbage collection), the wait for the next batch (``data``), on the CPU the time the
thread waited for a core (``descheduled``), the time between the loop's phases
(``untimed``), and for each collective the transfer (solid) and the wait for peers
(hatched). The recorded ``compute`` holds none of the others (`knapformer.runtime.timing`),
so when it is the measured compute phase the stack of a rank adds up to its measured
``step``, the link probe included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from knapformer.visualization import palette
from knapformer.visualization.axes import rank_ticks
from knapformer.visualization.figures import build_figure

from knapformer.contract.nan_reduce import nan_reduce
from knapformer.contract.phases import (
    ALLREDUCE,
    COLLECTIVE_PHASES,
    DATA,
    DESCHEDULED,
    FIXED_PHASES,
    GATHER,
    GROUP_EXCHANGES,
    OPTIMIZER,
    POST_ATTN,
    PRE_ATTN,
    PROBE,
    STEP,
    UNTIMED,
    compute_phase,
    host_ms,
    phase_ms,
)
from knapformer.contract.plan import RoutingPlan
from knapformer.diagnosis.measured import group_waits, peer_groups
from knapformer.diagnosis.store_window import WindowRows

HOST_PART = "host work (planning, recording, loop, GC)"
DATA_PART = "waiting for data"
DESCHEDULED_PART = "waiting for a core (CPU)"
UNTIMED_PART = "between phases (untimed)"
OPTIMIZER_PART = "optimizer"
PROBE_PART = "link probe"
#: The collectives by group: (transfer part, group hue, [(wait part, its phases)]).
_COLLECTIVES = (
    ("transfer: token exchanges", "exchanges", (
        ("waiting: route, reverse_route", GROUP_EXCHANGES),
        ("waiting: pre_attn, post_attn", (PRE_ATTN, POST_ATTN)),
    )),
    ("transfer: gather, all-reduce", "sync", (
        ("waiting: gather", (GATHER,)),
        ("waiting: allreduce", (ALLREDUCE,)),
    )),
)  # fmt: skip


@dataclass(frozen=True)
class PartStyle:
    """How a part is drawn: its colour, hatched when it is time spent waiting."""

    color: str
    waiting: bool = False


def part_style(group: str, shade: int = 0, waiting: bool = False) -> PartStyle:
    """The style of a part in a group's hue (`palette.PHASE_GROUPS`), its ``shade``-th."""
    shades = palette.PHASE_GROUPS[group]
    return PartStyle(shades[min(shade, len(shades) - 1)], waiting)


@dataclass(frozen=True)
class RankPhases:
    """Milliseconds per rank of each part of a step (arrays (n,), indexed like ``ranks``),
    parts in stacking order (bottom first); NaN where a rank was not in a step."""

    ranks: np.ndarray  # (n,) GPU ranks, in the order the figure draws them
    parts: dict[str, np.ndarray]  # part name -> (n,) ms
    styles: dict[str, PartStyle]  # part name -> how it is drawn
    step_ms: np.ndarray | None  # (n,) the measured step, the link probe included
    steps: list[int | None]  # the steps it covers
    phase: str  # the measured phase standing for compute


def step_parts(plan: RoutingPlan) -> RankPhases | None:
    """The parts of ``plan``'s step per rank (ranks in ``plan.gpus`` order); None when it
    measured no compute phase."""
    m = plan.measurements
    if m is None:
        return None
    return rank_parts(plan.step, plan.gpus, plan.stats.gpu_bag, m.per_rank_ms)


def rank_parts(
    step: int | None,
    ranks: Sequence[int],
    bags: Sequence[int],
    per_rank: Mapping[str, Sequence[float]],
) -> RankPhases | None:
    """The parts of one step per rank from its measured phases (``per_rank``: phase ->
    ms per rank, indexed like ``ranks``; ``bags``: each rank's bag id): what a plan
    measured, or the run store's rows of a step. None when no compute phase was measured.
    The figures are `measure`'s (`MeasuredStep`) of a step with those phases."""
    measured = measured_phases(step, ranks, bags, per_rank)
    if measured is None:
        return None
    parts: dict[str, np.ndarray] = {}
    styles: dict[str, PartStyle] = {}

    def add(name: str, ms: np.ndarray, style: PartStyle) -> None:
        if np.any(ms > 0):
            parts[name], styles[name] = ms, style

    if measured.phase == "compute":  # the step's other parts lie outside it
        add("compute (the model's)", np.clip(measured.compute_ms, 0.0, None), part_style("compute"))
        if _optimizer_outside_compute(measured, per_rank):
            add(OPTIMIZER_PART, measured.fixed_ms.get(OPTIMIZER, 0), part_style("compute", 1))
        add(HOST_PART, measured.host_ms, part_style("host"))
        add(DATA_PART, measured.data_ms, part_style("host", 2))
        add(DESCHEDULED_PART, measured.descheduled_ms, part_style("cpu", 1))
        add(UNTIMED_PART, measured.fixed_ms.get(UNTIMED, np.zeros(0)), part_style("cpu", 0))
    else:
        name = f"compute ({measured.phase})"
        parts[name], styles[name] = np.clip(measured.compute_ms, 0.0, None), part_style("compute")
    _add_collectives(measured, add)
    step_ms = per_rank.get(STEP)
    return RankPhases(
        ranks=measured.gpus,
        parts=parts,
        styles=styles,
        step_ms=None if step_ms is None else np.asarray(step_ms, dtype=np.float64),
        steps=[step],
        phase=measured.phase,
    )


@dataclass(frozen=True)
class StepPhases:
    """What the parts of a step are made of, per rank (arrays (n,), indexed like
    ``gpus``): the figures of `knapformer.diagnosis.measured.MeasuredStep` of the same
    name, by the same functions, from the measured phases alone (a store row holds no
    plan)."""

    gpus: np.ndarray
    phase: str  # the measured phase standing for compute
    compute_ms: np.ndarray
    collective_ms: dict[str, np.ndarray]  # each measured collective
    wait_ms: dict[str, np.ndarray]  # of it, the wait for its peers
    host_ms: np.ndarray
    data_ms: np.ndarray
    descheduled_ms: np.ndarray
    fixed_ms: dict[str, np.ndarray]  # each of `FIXED_PHASES` measured


def measured_phases(
    step: int | None,
    ranks: Sequence[int],
    bags: Sequence[int],
    per_rank: Mapping[str, Sequence[float]],
) -> StepPhases | None:
    """`StepPhases` of a step's measured ``per_rank`` phases; None without a compute phase.
    A collective's peers are the whole group, or the bag for `BAG_COLLECTIVES`."""
    phase = compute_phase(per_rank)
    if phase is None:
        return None
    n = len(ranks)
    collective, wait = {}, {}
    for name in COLLECTIVE_PHASES:
        if name in per_rank:
            t = np.asarray(per_rank[name], dtype=np.float64)
            collective[name], wait[name] = t, group_waits(t, peer_groups(name, bags))
    return StepPhases(
        gpus=np.asarray(ranks, dtype=np.int64),
        phase=phase,
        compute_ms=np.asarray(per_rank[phase], dtype=np.float64),
        collective_ms=collective,
        wait_ms=wait,
        host_ms=host_ms(per_rank, n),
        data_ms=phase_ms(per_rank, DATA, n),
        descheduled_ms=phase_ms(per_rank, DESCHEDULED, n),
        fixed_ms={p: phase_ms(per_rank, p, n) for p in FIXED_PHASES if p in per_rank},
    )


def _add_collectives(measured: StepPhases, add) -> None:
    """The collectives' parts: per group, its transfer and the wait in each collective;
    the link probe whole (a diagnostic)."""
    n = len(measured.gpus)
    collective, wait = measured.collective_ms, measured.wait_ms
    for transfer_name, group, waits in _COLLECTIVES:
        phases = [p for _, names in waits for p in names if p in collective]
        transfer = sum((collective[p] - wait[p] for p in phases), np.zeros(n))
        add(transfer_name, transfer, part_style(group))
        for shade, (name, names) in enumerate(waits, start=1):
            ms = sum((wait[p] for p in names if p in wait), np.zeros(n))
            add(name, ms, part_style(group, shade, waiting=True))
    if PROBE in collective:
        add(PROBE_PART, collective[PROBE], part_style("probe"))


def _optimizer_outside_compute(measured: StepPhases, per_rank: Mapping) -> bool:
    """Whether the recorded compute leaves the optimizer out (the timer does since the
    optimizer became a phase of its own; recordings made before count it as compute):
    the step, less everything else, has room for it on the median rank."""
    optimizer = measured.fixed_ms.get(OPTIMIZER)
    step = per_rank.get(STEP)
    if optimizer is None or step is None:
        return False
    others = (
        measured.compute_ms
        + measured.descheduled_ms
        + measured.host_ms
        + measured.data_ms
        + sum(measured.collective_ms.values(), np.zeros(len(measured.gpus)))
        + measured.fixed_ms.get(UNTIMED, 0.0)
    )
    room = np.asarray(step, dtype=np.float64) - others
    return bool(np.median(room - optimizer) > -0.5 * np.median(optimizer))


def window_parts(plans: Sequence[RoutingPlan]) -> RankPhases | None:
    """The mean per rank of each part over the measured steps of ``plans`` (ranks
    sorted); None when none of them measured compute."""
    return mean_parts([p for p in map(step_parts, plans) if p is not None])


def store_parts(rows: WindowRows, last: int | None = None) -> list[RankPhases]:
    """The parts of each step of a window of the run store's rows that measured a compute
    phase (`rank_parts`; rows by step, then rank, as `WindowRows` holds them), oldest
    first; only the ``last`` such steps when given."""
    step = np.asarray(rows.step)
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]]).tolist()
    out: list[RankPhases] = []
    for lo, hi in reversed(list(zip(starts, [*starts[1:], len(step)], strict=True))):
        if last is not None and len(out) == last:
            break
        # a phase none of the step's ranks measured is not in its measurements
        per_rank = {p: v[lo:hi] for p, v in rows.phase_ms.items() if np.isfinite(v[lo:hi]).any()}
        parts = rank_parts(int(step[lo]), rows.rank[lo:hi], rows.bag[lo:hi], per_rank)
        if parts is not None:
            out.append(parts)
    return out[::-1]


def mean_parts(each: Sequence[RankPhases]) -> RankPhases | None:
    """The mean per rank of each part over the steps ``each`` (ranks sorted); None for
    no step."""
    if not each:
        return None
    ranks = np.unique(np.concatenate([p.ranks for p in each]))
    names = list(dict.fromkeys(name for p in each for name in p.parts))
    styles = {name: style for p in each for name, style in p.styles.items()}
    sums = {name: np.full((len(each), len(ranks)), np.nan) for name in names}
    steps = np.full((len(each), len(ranks)), np.nan)
    for i, p in enumerate(each):
        rows = np.searchsorted(ranks, p.ranks)
        for name in names:
            # a part a step did not measure counts as 0 for the ranks that took part
            sums[name][i, rows] = p.parts.get(name, 0.0)
        if p.step_ms is not None:
            steps[i, rows] = p.step_ms
    # a rank absent from every step: NaN
    parts = {name: nan_reduce(np.nanmean, v, axis=0) for name, v in sums.items()}
    step_ms = nan_reduce(np.nanmean, steps, axis=0) if np.isfinite(steps).any() else None
    return RankPhases(
        ranks=ranks,
        parts=parts,
        styles=styles,
        step_ms=step_ms,
        steps=[s for p in each for s in p.steps],
        phase=each[-1].phase,
    )


def reorder(phases: RankPhases, ranks: Iterable[int]) -> RankPhases:
    """``phases`` with its ranks drawn in the order of ``ranks`` (e.g. a plan's bag order,
    to stand beside its load chart); ranks it lacks are left out."""
    order = np.asarray(list(ranks), dtype=np.int64)
    where = {r: i for i, r in enumerate(phases.ranks.tolist())}
    index = np.array([where[r] for r in order.tolist() if r in where], dtype=np.int64)
    return RankPhases(
        ranks=phases.ranks[index],
        parts={name: v[index] for name, v in phases.parts.items()},
        styles=phases.styles,
        step_ms=None if phases.step_ms is None else phases.step_ms[index],
        steps=phases.steps,
        phase=phases.phase,
    )


def bar_marker(style: PartStyle) -> dict:
    """A bar's plotly marker: its colour, hatched when it is waiting."""
    marker: dict = {"color": style.color}
    if style.waiting:
        marker["pattern"] = {"shape": palette.WAITING_PATTERN, "fgcolor": "#ffffff"}
    return marker


def _span(steps: list[int | None]) -> str:
    known = [s for s in steps if s is not None]
    if not known:
        return f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    if len(steps) == 1:
        return f"step {known[0]}"
    return f"mean of {len(steps)} steps ({min(known)}–{max(known)})"


def phase_figure(
    phases: RankPhases,
    flagged: dict[int, str] | None = None,
    title: str = "Where each rank's step went",
    validate: bool = True,
) -> go.Figure:
    """Stacked bars per rank (slots in ``phases.ranks`` order) of each part of its step,
    and the measured step as a tick above; ``flagged`` (rank -> verdict shown) are named
    above their bars and always labelled on the axis."""
    flagged = flagged or {}
    n = len(phases.ranks)
    slots = np.arange(n)
    names = [f"rank {r}" for r in phases.ranks.tolist()]
    data = [
        {
            "type": "bar",
            "x": slots,
            "y": ms,
            "name": name,
            "marker": bar_marker(phases.styles[name]),
            "hovertext": names,
            "hovertemplate": "%{hovertext}<br>" + name + " %{y:,.2f} ms<extra></extra>",
        }
        for name, ms in phases.parts.items()
    ]
    stacked = np.nansum(np.stack(list(phases.parts.values())), axis=0) if phases.parts else 0
    top = stacked if phases.step_ms is None else np.fmax(stacked, phases.step_ms)
    if phases.step_ms is not None:
        data.append(
            {
                "type": "scatter",
                "x": slots,
                "y": phases.step_ms,
                "mode": "markers",
                "name": "measured step",
                "marker": {"symbol": "line-ew-open", "size": 14, "color": "#212529"},
                "hovertext": names,
                "hovertemplate": "%{hovertext}<br>step %{y:,.2f} ms<extra></extra>",
            }
        )
    marked = [i for i, r in enumerate(phases.ranks.tolist()) if r in flagged]
    if marked:
        data.append(
            {
                "type": "scatter",
                "x": [int(slots[i]) for i in marked],
                "y": [float(np.nan_to_num(top[i])) for i in marked],
                "mode": "markers+text",
                "name": "flagged",
                "text": [f"{flagged[int(phases.ranks[i])]} · {phases.ranks[i]}" for i in marked],
                "textposition": "top center",
                "textfont": {"color": palette.HIGHLIGHT, "size": 12},
                "marker": {"symbol": "triangle-down", "size": 10, "color": palette.HIGHLIGHT},
                "cliponaxis": False,
                "customdata": [int(phases.ranks[i]) for i in marked],
                "hovertemplate": "rank %{customdata}: %{text}<extra></extra>",
            }
        )
    layout = {
        "title": {"text": f"{title} · {_span(phases.steps)}"},
        "barmode": "stack",
        "bargap": 0.15,
        "xaxis": {
            "title": {"text": "GPU rank"},
            "range": [-0.5, n - 0.5],
            "showgrid": False,
            **rank_ticks(phases.ranks, 520, flagged=flagged),
        },
        "yaxis": {"title": {"text": "ms"}},
        "legend": {"orientation": "h", "y": -0.25, "font": {"size": 11}},
        "height": 440,
        "margin": {"l": 60, "r": 20, "t": 70, "b": 60},
    }
    return build_figure(data, layout, validate)
