"""Where each rank's step went: per-rank stacked bars of compute parts, the transfer
inside collectives and the waiting in each collective, for one step or a window.

Built from `knapformer.diagnosis.measured`, which defines every part: compute, host
work (planning without its gather, recording, the loop's ``host`` phase), the wait for
the next batch (``data``), on the CPU the time the thread waited for a core
(``descheduled``), the time in a collective and the wait in it. The recorded
``compute`` holds none of the others (`knapformer.runtime.timing`), so when it is the
measured compute phase the stack of a rank adds up to its measured ``step``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from knapformer.visualization import palette
from knapformer.visualization.axes import rank_ticks
from knapformer.visualization.figures import build_figure

from knapformer.contract.nan_reduce import nan_reduce
from knapformer.contract.phases import COLLECTIVE_PHASES
from knapformer.contract.plan import RoutingPlan
from knapformer.diagnosis.measured import measure

#: Colour of each part, by name (the waits by collective).
_WAIT_COLOR = dict(zip(COLLECTIVE_PHASES, palette.WAITING, strict=True))
TRANSFER_PART = "transfer in collectives"
HOST_PART = "host work (planning, recording, loop, GC)"
DATA_PART = "waiting for data"
DESCHEDULED_PART = "waiting for a core (CPU)"


@dataclass(frozen=True)
class RankPhases:
    """Milliseconds per rank of each part of a step (arrays (n,), indexed like ``ranks``),
    parts in stacking order (bottom first); NaN where a rank was not in a step."""

    ranks: np.ndarray  # (n,) GPU ranks, in the order the figure draws them
    parts: dict[str, np.ndarray]  # part name -> (n,) ms
    colors: dict[str, str]  # part name -> colour
    step_ms: np.ndarray | None  # (n,) the measured step
    steps: list[int | None]  # the steps it covers
    phase: str  # the measured phase standing for compute


def step_parts(plan: RoutingPlan) -> RankPhases | None:
    """The parts of ``plan``'s step per rank (ranks in ``plan.gpus`` order); None when it
    measured no compute phase."""
    measured = measure(plan)
    if measured is None:
        return None
    n = len(plan.gpus)
    parts: dict[str, np.ndarray] = {}
    colors: dict[str, str] = {}
    if measured.phase == "compute":  # the step's other parts lie outside it
        for name, ms, color in (
            (HOST_PART, measured.host_ms, palette.HOST_WORK),
            (DATA_PART, measured.data_ms, palette.DATA_WAIT),
            (DESCHEDULED_PART, measured.descheduled_ms, palette.DESCHEDULED),
        ):
            if np.any(ms > 0):
                parts[name], colors[name] = ms, color
        name = "compute (model and the rest)"
    else:
        name = f"compute ({measured.phase})"
    parts = {name: np.clip(measured.compute_ms, 0.0, None), **parts}
    colors[name] = palette.AFTER
    if measured.collective_ms:
        transfer = sum(
            (measured.collective_ms[c] - measured.wait_ms[c] for c in measured.collective_ms),
            np.zeros(n),
        )
        parts[TRANSFER_PART], colors[TRANSFER_PART] = transfer, palette.TRANSFER
    for c, wait in measured.wait_ms.items():
        parts[f"waiting: {c}"], colors[f"waiting: {c}"] = wait, _WAIT_COLOR[c]
    return RankPhases(
        ranks=measured.gpus,
        parts=parts,
        colors=colors,
        step_ms=measured.step_ms,
        steps=[plan.step],
        phase=measured.phase,
    )


def window_parts(plans: Sequence[RoutingPlan]) -> RankPhases | None:
    """The mean per rank of each part over the measured steps of ``plans`` (ranks
    sorted); None when none of them measured compute."""
    each = [p for p in map(step_parts, plans) if p is not None]
    if not each:
        return None
    ranks = np.unique(np.concatenate([p.ranks for p in each]))
    names = list(dict.fromkeys(name for p in each for name in p.parts))
    colors = {name: color for p in each for name, color in p.colors.items()}
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
        colors=colors,
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
        colors=phases.colors,
        step_ms=None if phases.step_ms is None else phases.step_ms[index],
        steps=phases.steps,
        phase=phases.phase,
    )


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
            "marker": {"color": phases.colors[name]},
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
