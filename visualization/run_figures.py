"""Plotly figures of a whole run, from the run store's summaries: never one cell per rank
and step (100 M of them at 1,024 GPUs x 100,000 steps), always downsampled to the screen.

- `run_rate_heatmap`: rank x step of each rank's compute rate against its group's, from
  the per-segment summaries (`rank_windows`), binned to at most `MAX_ROWS` x `MAX_COLS`
  cells, each the worst (largest) rate of its bin, so one slow rank is never averaged
  away. A click on it names the steps of the cell, which the dashboard opens.
- `run_steps_figure`: imbalance before/after balancing and the time each step lost over
  the run (`steps`), binned to at most `MAX_POINTS` points per line, each its bin's
  largest (a spike stays visible).
- `run_verdicts_figure`: when each rank was named slow: per segment, the ranks whose rate
  was past the threshold in most of its steps (a marker each; a binned heatmap when there
  are too many markers to draw at once).
- `run_timeline_figure`: the plans' timeline (imbalance, moved tokens, planning time,
  measured step time) for every step of the store, not only the steps whose full plan was
  kept, binned as the lines above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from knapformer.visualization import palette
from knapformer.visualization.figures import (
    build_figure,
    empty_figure,
    step_marker,
    timeline_of_columns,
)
from knapformer.visualization.straggler_figures import ratio_colour_axis

#: The most rows (rank bins) and columns (step bins) a whole-run heatmap sends.
MAX_ROWS = 256
MAX_COLS = 600
#: The most points a line over the run sends.
MAX_POINTS = 2_000
#: The most (rank, segment) markers the verdicts over the run draw: SVG markers, one
#: element each, draw in tenths of a second up to this many; more become a heatmap (the
#: dashboard's plotly.js bundle has no WebGL traces: `knapformer.dashboard.plotly_bundle`).
MAX_MARKERS = 2_000


@dataclass(frozen=True)
class RunGrid:
    """Rank x step cells of a whole run: row i spans ranks ``rank_lo[i]..rank_hi[i]``,
    column j steps ``step_lo[j]..step_hi[j]``; ``rate`` (rows, cols) is each cell's
    largest median rate against the group (1 = the group's; NaN: no rank measured)."""

    rank_lo: np.ndarray
    rank_hi: np.ndarray
    step_lo: np.ndarray
    step_hi: np.ndarray
    rate: np.ndarray


def _edges(count: int, most: int) -> np.ndarray:
    """Start indices of at most ``most`` nearly equal bins over ``count`` items."""
    bins = max(1, min(count, most))
    return np.unique(np.linspace(0, count, bins + 1).astype(np.int64)[:-1])


def run_grid(
    ranks: np.ndarray,
    step_lo: np.ndarray,
    step_hi: np.ndarray,
    rate: np.ndarray,
    rows: int = MAX_ROWS,
    cols: int = MAX_COLS,
) -> RunGrid:
    """``rate`` (r, w) of sorted ``ranks`` (r,) over windows ``step_lo``..``step_hi`` (w,)
    binned to at most ``rows`` x ``cols`` cells, each its bin's largest rate."""
    rate = np.asarray(rate, dtype=np.float64)
    if rate.size == 0:
        empty = np.zeros(0, np.int64)
        return RunGrid(empty, empty, empty, empty, np.zeros((0, 0)))
    r_edges, c_edges = _edges(len(ranks), rows), _edges(len(step_lo), cols)
    filled = np.where(np.isnan(rate), -np.inf, rate)
    binned = np.maximum.reduceat(np.maximum.reduceat(filled, r_edges, axis=0), c_edges, axis=1)
    r_last = np.append(r_edges[1:], len(ranks)) - 1
    c_last = np.append(c_edges[1:], len(step_lo)) - 1
    return RunGrid(
        rank_lo=np.asarray(ranks)[r_edges],
        rank_hi=np.asarray(ranks)[r_last],
        step_lo=np.asarray(step_lo)[c_edges],
        step_hi=np.asarray(step_hi)[c_last],
        rate=np.where(np.isfinite(binned), binned, np.nan),
    )


def run_rate_heatmap(grid: RunGrid, validate: bool = True) -> dict:
    """The whole run's rank x step heatmap of compute rate (`RunGrid`); its cells carry
    their step range for a click to open."""
    if grid.rate.size == 0:
        return empty_figure("no measured step in the run store yet", validate)
    data = [
        _rate_cells(
            grid,
            "step ≈ %{x:,.0f} · rank ≈ %{y:,.0f}<br>largest median rate "
            "%{customdata:.2f}× the group's<br>(click: open these steps)<extra></extra>",
        )
    ]
    rows, cols = grid.rate.shape
    span = f"steps {int(grid.step_lo[0])}–{int(grid.step_hi[-1])}"
    binned = f"{rows} × {cols} cells, each its bin's slowest"
    layout = {
        "title": {"text": f"Compute rate over the whole run · {span} ({binned})"},
        "xaxis": {"title": {"text": "step"}, "showgrid": False},
        "yaxis": {"title": {"text": "rank"}, "autorange": "reversed", "showgrid": False},
        "height": 420,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
    }
    return build_figure(data, layout, validate)


def _rate_cells(grid: RunGrid, hover: str) -> dict:
    """A heatmap trace of ``grid``'s cells, coloured by log2 of their rate, each cell's
    rate in its ``customdata``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log2(grid.rate)
    return {
        "type": "heatmap",
        "z": z.astype(np.float32),
        "x": cell_centres(grid).tolist(),
        "y": ((grid.rank_lo + grid.rank_hi) / 2).tolist(),
        # one number a cell (a click carries it back as a number, where a list a
        # cell, sent as a typed array, arrives as an object)
        "customdata": grid.rate.astype(np.float32),
        **ratio_colour_axis("rate ×<br>group's"),
        "hoverongaps": False,
        "hovertemplate": hover,
    }


def cell_centres(grid: RunGrid) -> np.ndarray:
    """(cols,) the step at the middle of each column of ``grid`` (its x)."""
    return (grid.step_lo + grid.step_hi) / 2


def cell_steps(grid: RunGrid, x: float) -> tuple[int, int]:
    """The steps of the column of ``grid`` whose middle is nearest ``x`` (a click's)."""
    col = int(np.argmin(np.abs(cell_centres(grid) - x)))
    return int(grid.step_lo[col]), int(grid.step_hi[col])


def binned_note(count: int, bins: int) -> str:
    """A title's second, smaller line saying how ``count`` steps were binned into ``bins``
    points (nothing when each point is one step): on one line it ran past the figure."""
    if bins >= count:
        return ""
    return f"<br><sup>each point the largest of ~{count // bins:,} steps</sup>"


def _bins(values: np.ndarray, edges: np.ndarray, reduce) -> np.ndarray:
    filled = np.where(np.isnan(values), -np.inf, values)
    out = reduce.reduceat(filled, edges) if len(values) else filled
    return np.where(np.isfinite(out), out, np.nan)


def run_steps_figure(
    steps: np.ndarray,
    imbalance_before: np.ndarray,
    imbalance_after: np.ndarray,
    lost_ms: np.ndarray | None,
    validate: bool = True,
    most: int = MAX_POINTS,
) -> dict:
    """Imbalance before and after balancing (max/mean load, left axis) and what each step
    lost against an ideal one (ms, right axis) over the run, at most ``most`` points a
    line, each its bin's largest."""
    if len(steps) == 0:
        return empty_figure("no step in the run store yet", validate)
    edges = _edges(len(steps), most)
    x = np.asarray(steps)[edges].tolist()
    lines = [
        ("imbalance before", imbalance_before, palette.BEFORE, "y"),
        ("imbalance after", imbalance_after, palette.AFTER, "y"),
    ]
    if lost_ms is not None and np.isfinite(lost_ms).any():
        lines.append(("lost (ms)", lost_ms, palette.STEP_TIME, "y2"))
    data = [
        {
            "type": "scatter",  # 2,000 points at most: SVG draws them sooner than WebGL starts
            "mode": "lines",
            "name": name,
            "x": x,
            "y": _bins(np.asarray(values, np.float64), edges, np.maximum).tolist(),
            "line": {"color": colour, "width": 1.5},
            "yaxis": axis,
        }
        for name, values, colour, axis in lines
    ]
    title = f"Imbalance and lost time over the run · {len(steps):,} steps"
    layout = {
        "title": {"text": title + binned_note(len(steps), len(edges))},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "max / mean load"}},
        "yaxis2": {
            "title": {"text": "lost (ms)"},
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
        },
        "legend": {"orientation": "h", "y": -0.2},
        "height": 360,
        "margin": {"l": 60, "r": 60, "t": 60, "b": 60},
    }
    return build_figure(data, layout, validate)


#: The `steps` columns `run_timeline_figure` draws.
TIMELINE_COLUMNS = (
    "step",
    "imbalance_before",
    "imbalance_after",
    "moved_tokens",
    "total_tokens",
    "plan_ms",
    "step_ms",
)


def run_timeline_figure(
    columns: dict[str, np.ndarray],
    selected_step: int | None = None,
    validate: bool = True,
    most: int = MAX_POINTS,
) -> dict:
    """The timeline of every step in ``columns`` (the store's `TIMELINE_COLUMNS`), at most
    ``most`` points a line, each its bin's largest; ``selected_step`` marked."""
    steps = np.asarray(columns["step"])
    if len(steps) == 0:
        return empty_figure("no step in the run store yet", validate)
    edges = _edges(len(steps), most)
    total = np.asarray(columns["total_tokens"], np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        moved = np.where(total > 0, 100.0 * columns["moved_tokens"] / total, 0.0)
    lines = [columns["imbalance_before"], columns["imbalance_after"], moved, columns["plan_ms"]]
    step_ms = np.asarray(columns["step_ms"], np.float64)
    if np.isfinite(step_ms).any():
        lines.append(step_ms)
    x = steps[edges].tolist()
    index = list(range(len(x)))
    binned = [(x, _bins(np.asarray(v, np.float64), edges, np.maximum).tolist(), index)
              for v in lines]  # fmt: skip
    title = f"Every step in the run store · {len(steps):,} steps"
    title += binned_note(len(steps), len(edges))
    shapes = [] if selected_step is None else [step_marker(selected_step)]
    return timeline_of_columns(binned, shapes, title, validate)


def run_verdicts_figure(
    ranks: np.ndarray,
    step_lo: np.ndarray,
    step_hi: np.ndarray,
    named: np.ndarray,
    rate: np.ndarray,
    validate: bool = True,
) -> dict:
    """Per segment (``step_lo``..``step_hi``, w), the ranks (r,) ``named`` (r, w) slow in
    it, at their median ``rate`` (r, w): when each straggler started and stopped. A marker
    each, or past `MAX_MARKERS` of them a heatmap binned as `run_grid`'s."""
    rows, cols = np.nonzero(named)
    if not len(rows):
        return empty_figure("no rank named slow in any segment of the run", validate)
    layout = {
        "title": {"text": f"Ranks named slow over the run: {len(np.unique(rows)):,} rank(s)"},
        "xaxis": {"title": {"text": "step"}, "range": [float(step_lo[0]), float(step_hi[-1])]},
        "yaxis": {"title": {"text": "rank"}, "autorange": "reversed"},
        "height": 300,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
    }
    if len(rows) > MAX_MARKERS:
        grid = run_grid(ranks, step_lo, step_hi, np.where(named, rate, np.nan))
        trace = _rate_cells(
            grid,
            "steps ≈ %{x:,.0f} · rank ≈ %{y:,.0f}<br>largest median rate of a rank named "
            "slow: %{customdata:.2f}× the group's<extra></extra>",
        )
        trace["showscale"] = False  # the whole-run heatmap's colour bar reads for both
        return build_figure([trace], layout, validate)
    data = [
        {
            "type": "scatter",
            "mode": "markers",
            "x": ((step_lo[cols] + step_hi[cols]) / 2).tolist(),
            "y": np.asarray(ranks)[rows].tolist(),
            "customdata": np.stack([step_lo[cols], step_hi[cols], rate[rows, cols]], -1),
            "marker": {"color": palette.HIGHLIGHT, "symbol": "square", "size": 7},
            "hovertemplate": "rank %{y} · steps %{customdata[0]:.0f}–%{customdata[1]:.0f}"
            "<br>median rate %{customdata[2]:.2f}× the group's<extra></extra>",
            "name": "slow",
        }
    ]
    layout["yaxis"] |= _rank_ticks(ranks[rows])
    return build_figure(data, layout, validate)


def _rank_ticks(named: np.ndarray) -> dict:
    """A tick at each named rank when there are a few (never a fractional rank)."""
    shown = np.unique(named)
    if len(shown) > 24:
        return {"tickformat": "d"}
    top, bottom = float(shown[0]) - 1, float(shown[-1]) + 1
    return {
        "tickmode": "array",
        "tickvals": shown.tolist(),
        "autorange": False,
        "range": [bottom, top],
    }
