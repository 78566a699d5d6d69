"""Plotly figures of measured steps: which rank is slow, and who waits for it.

Built from the rank × step matrices and verdicts of `knapformer.stragglers` (every figure
is defined once, in `knapformer.measured`), for the dashboard and the report. Rank axes
follow the label rule of `visualization.axes`.
"""

from __future__ import annotations

import numpy as np
import plotly.colors
import plotly.graph_objects as go

from knapformer.stragglers import RankSteps, StragglerReport
from visualization.axes import rank_ticks
from visualization.figures import AFTER_COLOR, HIGHLIGHT_COLOR, build_figure

#: The compute-ratio heatmap's colour runs over log2(ratio) in ±RATIO_OCTAVES: blue =
#: faster than predicted, white = as predicted, red = slower (2x and beyond: full red).
RATIO_OCTAVES = 1.0
_DIVERGING = [[0.0, "#1c7ed6"], [0.5, "#f8f9fa"], [1.0, "#e03131"]]
_SEQUENTIAL = [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Oranges)]
#: Nominal height of a heatmap's plot area (px), for its rank-label rule.
HEATMAP_PLOT_PX = 260
#: Up to this many ranks every point of predicted vs measured carries its rank as text;
#: beyond, only ranks with a verdict other than ok do (every point names it on hover).
LABEL_EVERY_RANK_UP_TO = 64
VERDICT_STYLE = {  # name shown, colour, marker
    "ok": ("ok", AFTER_COLOR, "circle"),
    "data_imbalance": ("data imbalance", "#f08c00", "diamond"),
    "slow_gpu": ("slow GPU", HIGHLIGHT_COLOR, "x"),
}


def _steps_x(m: RankSteps) -> list[int]:
    """Column positions: the step numbers, or the column index where a plan had none."""
    return [i if s is None else s for i, s in enumerate(m.steps)]


def _span(m: RankSteps) -> str:
    x = _steps_x(m)
    return f"step {x[0]}" if len(x) == 1 else f"steps {x[0]}–{x[-1]}"


def _rank_step_heatmap(
    m: RankSteps, z: np.ndarray, title: str, colorbar: str, hover: str, style: dict, validate
) -> go.Figure:
    rows = np.arange(len(m.ranks))
    data = [
        {
            "type": "heatmap",
            "z": z,
            "x": _steps_x(m),
            "y": rows,
            # per cell: compute ms, wait ms, rank, compute ratio
            "customdata": np.stack(
                [m.compute_ms, m.wait_ms, np.repeat(m.ranks[:, None], z.shape[1], 1), m.ratio], -1
            ),
            "colorbar": {"title": {"text": colorbar}},
            "hovertemplate": "rank %{customdata[2]} · step %{x}<br>" + hover + "<extra></extra>",
            "hoverongaps": False,
            **style,
        }
    ]
    layout = {
        "title": {"text": f"{title} · {_span(m)}"},
        "xaxis": {"title": {"text": "step"}, "showgrid": False},
        "yaxis": {
            "title": {"text": "rank"},
            "range": [len(rows) - 0.5, -0.5],
            "showgrid": False,
            **rank_ticks(m.ranks, HEATMAP_PLOT_PX, vertical=True),
        },
        "height": 380,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
    }
    return build_figure(data, layout, validate)


def ratio_heatmap(m: RankSteps, validate: bool = True) -> go.Figure:
    """Rank × step heatmap of measured compute ÷ predicted (1 = as the plan predicted for
    the work it gave; red: slower). Ranks not in a step's plan are left blank."""
    octaves = np.linspace(-RATIO_OCTAVES, RATIO_OCTAVES, 5)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log2(m.ratio)
    return _rank_step_heatmap(
        m,
        z,
        f"Measured compute ÷ predicted ({', '.join(m.phases)})",
        "measured ÷<br>predicted",
        "measured ÷ predicted %{customdata[3]:.2f}<br>compute %{customdata[0]:,.3r} ms",
        {
            "zmin": -RATIO_OCTAVES,
            "zmax": RATIO_OCTAVES,
            "colorscale": _DIVERGING,
            "colorbar": {
                "title": {"text": "measured ÷<br>predicted"},
                "tickvals": octaves.tolist(),
                "ticktext": [f"{2**o:.2g}" for o in octaves],
            },
        },
        validate,
    )


def wait_heatmap(m: RankSteps, validate: bool = True) -> go.Figure:
    """Rank × step heatmap of the time each rank waited in collectives (ms): the others
    wait for a straggler, so its own row stays pale."""
    top = float(np.nanmax(m.wait_ms)) if np.isfinite(m.wait_ms).any() else 1.0
    return _rank_step_heatmap(
        m,
        m.wait_ms,
        "Waiting in collectives (ms)",
        "wait (ms)",
        "waited %{customdata[1]:,.3r} ms",
        {"zmin": 0.0, "zmax": max(top, 1e-9), "colorscale": _SEQUENTIAL},
        validate,
    )


def _row_medians(matrix: np.ndarray) -> np.ndarray:
    out = np.full(len(matrix), np.nan)
    for i, row in enumerate(matrix):
        finite = row[np.isfinite(row)]
        if finite.size:
            out[i] = np.median(finite)
    return out


def predicted_vs_measured_figure(
    report: StragglerReport, m: RankSteps, validate: bool = True
) -> go.Figure:
    """One point per rank: predicted work (at nominal speed, in the plans' `LoadUnit`)
    against measured compute, medians over the window, each point labelled with its rank
    (`LABEL_EVERY_RANK_UP_TO`) and coloured by its verdict. The dashed line is "as the
    typical rank": measured = k · predicted with k the median ratio, drawn over the
    predicted range only, so the axes zoom in on the ranks instead of on zero. Above the
    line: slower than predicted; to the right: given more work."""
    x = _row_medians(m.predicted_shown)
    y = _row_medians(m.compute_ms)
    verdict = {r.rank: r.verdict for r in report.ranks}
    ranks = m.ranks.tolist()
    label_all = len(ranks) <= LABEL_EVERY_RANK_UP_TO
    data = []
    for key, (name, color, symbol) in VERDICT_STYLE.items():
        mask = np.array([verdict.get(r) == key for r in ranks], dtype=bool)
        if not mask.any():
            continue
        text = [str(r) if label_all or key != "ok" else "" for r in m.ranks[mask].tolist()]
        data.append(
            {
                "type": "scatter",
                "x": x[mask],
                "y": y[mask],
                "text": text,
                "customdata": m.ranks[mask],
                "mode": "markers+text",
                "textposition": "top center",
                "textfont": {"size": 12, "color": color},
                "name": name,
                "marker": {"color": color, "size": 10 if key != "ok" else 8, "symbol": symbol},
                "hovertemplate": "rank %{customdata}<br>predicted %{x:,.3r}<br>measured "
                "%{y:,.3r} ms<extra>" + name + "</extra>",
            }
        )
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0)
    if ok.any():
        k = float(np.median(y[ok] / x[ok]))
        lo, hi = float(x[ok].min()), float(x[ok].max())
        if hi - lo < 1e-9 * max(hi, 1.0):
            lo, hi = lo * 0.99, hi * 1.01
        data.append(
            {
                "type": "scatter",
                "x": [lo, hi],
                "y": [k * lo, k * hi],
                "mode": "lines",
                "name": "as predicted (median rank)",
                "line": {"dash": "dash", "color": "#495057"},
                "hoverinfo": "skip",
            }
        )
    phases = ", ".join(m.phases)
    layout = {
        "title": {"text": f"Predicted vs measured compute per rank · {_span(m)} (medians)"},
        "xaxis": {"title": {"text": f"predicted work at nominal speed, {m.load_axis}"}},
        "yaxis": {"title": {"text": f"measured {phases} (ms)"}},
        "height": 420,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 50},
    }
    return build_figure(data, layout, validate)
