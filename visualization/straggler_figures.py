"""Plotly figures of measured steps: which rank is slow, and who waits for it.

Built from the rank × step matrices and verdicts of `knapformer.diagnosis.stragglers` (every figure
is defined once, in `knapformer.diagnosis.measured`), for the dashboard and the report. Rank axes
follow the label rule of `visualization.axes`.
"""

from __future__ import annotations

import numpy as np
import plotly.colors
import plotly.graph_objects as go
from knapformer.visualization import palette
from knapformer.visualization.axes import rank_ticks
from knapformer.visualization.figures import build_figure

from knapformer.diagnosis.stragglers import RankSteps, StragglerReport, row_medians

#: The compute-ratio heatmap's colour runs over log2(ratio) in ±RATIO_OCTAVES: blue =
#: faster than predicted, white = as predicted, red = slower (2x and beyond: full red).
RATIO_OCTAVES = 1.0
_DIVERGING = [[0.0, palette.FASTER], [0.5, palette.AS_PREDICTED], [1.0, palette.SLOWER]]
_SEQUENTIAL = [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Oranges)]
#: Nominal height of a heatmap's plot area (px), for its rank-label rule.
HEATMAP_PLOT_PX = 260
#: Measured steps a rank × step heatmap shows at most, and its most cells (`heatmap_steps`).
HEATMAP_STEPS = 64
HEATMAP_CELLS = 32_768
#: Up to this many ranks every point of predicted vs measured carries its rank as text;
#: beyond, only ranks with a verdict other than ok do (every point names it on hover).
LABEL_EVERY_RANK_UP_TO = 64
VERDICT_STYLE = {  # name shown, colour, marker
    "ok": ("ok", palette.AFTER, "circle"),
    "data_imbalance": ("data imbalance", palette.DATA_IMBALANCE, "diamond"),
    "slow_gpu": ("slow GPU", palette.HIGHLIGHT, "x"),
}


def _steps_x(m: RankSteps) -> list[int]:
    """Column positions: the step numbers, or the column index where a plan had none."""
    return [i if s is None else s for i, s in enumerate(m.steps)]


def _span(m: RankSteps) -> str:
    x = _steps_x(m)
    return f"step {x[0]}" if len(x) == 1 else f"steps {x[0]}–{x[-1]}"


def heatmap_steps(ranks: int) -> int:
    """How many measured steps a rank × step heatmap shows: `HEATMAP_STEPS`, fewer when
    that would pass `HEATMAP_CELLS` cells (32 steps at 1,024 ranks), never under 8."""
    return max(8, min(HEATMAP_STEPS, HEATMAP_CELLS // max(ranks, 1)))


def _rank_step_heatmap(
    m: RankSteps, z: np.ndarray, title: str, hover: str, style: dict, validate: bool
) -> go.Figure:
    # Rows are categories named after their rank: hovering names it without a per-cell copy.
    names = [f"rank {r}" for r in m.ranks.tolist()]
    data = [
        {
            "type": "heatmap",
            "z": z.astype(np.float32),
            "x": _steps_x(m),
            "y": names,
            "hovertemplate": "%{y} · step %{x}<br>" + hover + "<extra></extra>",
            "hoverongaps": False,
            **style,
        }
    ]
    layout = {
        "title": {"text": f"{title} · {_span(m)}"},
        "xaxis": {"title": {"text": "step"}, "showgrid": False},
        "yaxis": {
            "title": {"text": "rank"},
            "type": "category",
            "categoryorder": "array",
            "categoryarray": names,
            "autorange": "reversed",
            "showgrid": False,
            **rank_ticks(m.ranks, HEATMAP_PLOT_PX, vertical=True, categories=names),
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
        "measured ÷ predicted %{customdata[0]:.2f}<br>compute %{customdata[1]:,.3r} ms",
        {
            "customdata": np.stack([m.ratio, m.compute_ms], axis=-1).astype(np.float32),
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
        "waited %{z:,.3r} ms",
        {
            "zmin": 0.0,
            "zmax": max(top, 1e-9),
            "colorscale": _SEQUENTIAL,
            "colorbar": {"title": {"text": "wait (ms)"}},
        },
        validate,
    )


#: The predicted-work axis spans at least ±MIN_SPAN_SHARE of the median rank's work, so
#: that ranks given the same work to a few parts in 10,000 stand in one column instead
#: of being spread across the axis as if the plan had treated them differently.
MIN_SPAN_SHARE = 0.05


def _predicted_span(x: np.ndarray) -> tuple[float, float]:
    """The x range of the predicted-vs-measured figure: the ranks' predicted work, widened
    to ±`MIN_SPAN_SHARE` of the median when the ranks were given about the same work."""
    mid = float(np.median(x))
    lo, hi = float(x.min()), float(x.max())
    return min(lo, mid * (1 - MIN_SPAN_SHARE)), max(hi, mid * (1 + MIN_SPAN_SHARE))


def predicted_vs_measured_figure(
    report: StragglerReport, m: RankSteps, validate: bool = True
) -> go.Figure:
    """One point per rank: predicted work (at nominal speed, in the plans' `LoadUnit`)
    against measured compute, medians over the window, each point labelled with its rank
    (`LABEL_EVERY_RANK_UP_TO`) and coloured by its verdict. The dashed line is "as the
    typical rank": measured = k · predicted with k the median ratio, drawn over the
    x range (`_predicted_span`), so the axes zoom in on the ranks instead of on zero. Above the
    line: slower than predicted; to the right: given more work."""
    x = row_medians(m.predicted_shown)
    y = row_medians(m.compute_ms)
    verdict = {r.rank: r.verdict for r in report.ranks}
    ranks = m.ranks.tolist()
    label_all = len(ranks) <= LABEL_EVERY_RANK_UP_TO
    # Neighbours along x take turns above and below their points, so that the labels of
    # ranks that measured alike do not print over each other.
    turn = np.empty(len(ranks), dtype=object)
    turn[np.argsort(np.nan_to_num(x), kind="stable")] = [
        "top center" if i % 2 == 0 else "bottom center" for i in range(len(ranks))
    ]
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
                "textposition": turn[mask].tolist(),
                "textfont": {"size": 12, "color": color},
                "name": name,
                "marker": {"color": color, "size": 10 if key != "ok" else 8, "symbol": symbol},
                "hovertemplate": "rank %{customdata}<br>predicted %{x:,.3r}<br>measured "
                "%{y:,.3r} ms<extra>" + name + "</extra>",
            }
        )
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0)
    x_range = None
    if ok.any():
        k = float(np.median(y[ok] / x[ok]))
        lo, hi = _predicted_span(x[ok])
        x_range = [lo, hi]
        data.append(
            {
                "type": "scatter",
                "x": [lo, hi],
                "y": [k * lo, k * hi],
                "mode": "lines",
                "name": "as predicted (median rank)",
                "line": {"dash": "dash", "color": palette.MODEL_FIT},
                "hoverinfo": "skip",
            }
        )
    phases = ", ".join(m.phases)
    layout = {
        "title": {"text": f"Predicted vs measured compute per rank · {_span(m)} (medians)"},
        "xaxis": {
            "title": {"text": f"predicted work at nominal speed, {m.load_axis}"},
            "range": x_range,
        },
        "yaxis": {"title": {"text": f"measured {phases} (ms)"}},
        "height": 420,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 50},
    }
    return build_figure(data, layout, validate)
