"""Plotly figures of measured steps: which rank is slow, and who waits for it.

Built from the rank × step matrices and verdicts of `knapformer.diagnosis.stragglers` (every figure
is defined once, in `knapformer.diagnosis.measured`), for the dashboard and the report. Rank axes
follow the label rule of `visualization.axes`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import plotly.colors
import plotly.graph_objects as go
from knapformer.visualization import palette
from knapformer.visualization.axes import data_range, rank_ticks
from knapformer.visualization.figures import build_figure
from knapformer.visualization.phase_figures import bar_marker, part_style

from knapformer.diagnosis.measured import RankFigures
from knapformer.diagnosis.step_loss import (
    PART_INFO,
    PARTS,
    StepLoss,
    describe_loss,
    summarise,
    window_losses,
)
from knapformer.diagnosis.stragglers import (
    RankSteps,
    StragglerReport,
    analyse,
    headline,
    rank_steps,
    row_medians,
)

#: The compute-ratio heatmap's colour runs over log2(ratio) in ±RATIO_OCTAVES: blue =
#: faster than predicted, white = as predicted, red = slower (2x and beyond: full red).
RATIO_OCTAVES = 1.0
_DIVERGING = [[0.0, palette.FASTER], [0.5, palette.AS_PREDICTED], [1.0, palette.SLOWER]]


def ratio_colour_axis(title: str) -> dict:
    """A heatmap's colour keys over log2(ratio) in ±RATIO_OCTAVES, its colour bar titled
    ``title`` and ticked in ratios (0.5 … 2)."""
    octaves = np.linspace(-RATIO_OCTAVES, RATIO_OCTAVES, 5)
    return {
        "zmin": -RATIO_OCTAVES,
        "zmax": RATIO_OCTAVES,
        "colorscale": _DIVERGING,
        "colorbar": {
            "title": {"text": title},
            "tickvals": octaves.tolist(),
            "ticktext": [f"{2**o:.2g}" for o in octaves],
        },
    }


_SEQUENTIAL = [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Oranges)]
#: Nominal height of a heatmap's plot area (px), for its rank-label rule.
HEATMAP_PLOT_PX = 260
#: Up to this many ranks every point of predicted vs measured carries its rank as text;
#: beyond, only ranks with a verdict other than ok do (every point names it on hover).
LABEL_EVERY_RANK_UP_TO = 64
VERDICT_STYLE = {  # name shown, colour, marker; every verdict of `stragglers.VERDICTS`
    "ok": ("ok", palette.AFTER, "circle"),
    "data_imbalance": ("data imbalance", palette.DATA_IMBALANCE, "diamond"),
    "layout_floor": ("layout floor", palette.LAYOUT_FLOOR, "square"),
    "slow_link": ("slow link", palette.SLOW_LINK, "triangle-up"),
    "slow_input": ("slow input", palette.SLOW_INPUT, "star"),
    "slow_host": ("slow host", palette.SLOW_HOST, "cross"),
    "slow_gpu": ("slow GPU", palette.HIGHLIGHT, "x"),
}


def _steps_x(m: RankSteps) -> list[int]:
    """Column positions: the step numbers, or the column index where a plan had none."""
    return [i if s is None else s for i, s in enumerate(m.steps)]


def _span(m: RankSteps) -> str:
    x = _steps_x(m)
    return f"step {x[0]}" if len(x) == 1 else f"steps {x[0]}–{x[-1]}"


def _rank_step_heatmap(
    m: RankSteps,
    z: np.ndarray,
    title: str,
    hover: str,
    style: dict,
    validate: bool,
    flagged: Iterable[int] = (),
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
            **rank_ticks(m.ranks, HEATMAP_PLOT_PX, True, names, flagged),
        },
        "height": 380,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
    }
    return build_figure(data, layout, validate)


def ratio_heatmap(m: RankSteps, validate: bool = True, flagged: Iterable[int] = ()) -> go.Figure:
    """Rank × step heatmap of measured compute ÷ predicted (1 = as the plan predicted for
    the work it gave; red: slower). Ranks not in a step's plan are left blank; the
    ``flagged`` ranks are labelled at any rank count."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log2(m.ratio)
    return _rank_step_heatmap(
        m,
        z,
        f"Measured compute ÷ predicted ({', '.join(m.phases)})",
        "measured ÷ predicted %{customdata[0]:.2f}<br>compute %{customdata[1]:,.3r} ms",
        {
            "customdata": np.stack([m.ratio, m.compute_ms], axis=-1).astype(np.float32),
            **ratio_colour_axis("measured ÷<br>predicted"),
        },
        validate,
        flagged,
    )


#: The first steps of a run wait for reasons no rank is to blame for (process-group
#: set-up, allocator warm-up, compilation: gloo's first collective takes seconds), so
#: they are left out of the wait heatmap's colour scale (their cells saturate).
WARMUP_STEPS = 2


def warm_columns(m: RankSteps, run_start: int | None) -> np.ndarray:
    """(s,) bool: the columns of ``m`` past the run's warm-up, i.e. steps from
    ``run_start + WARMUP_STEPS`` on (``run_start``: the run's first step; None: all
    columns count). When every column is warm-up, all of them count."""
    return _warm(_steps_x(m), run_start)


def _warm(steps: list[int], run_start: int | None) -> np.ndarray:
    """(s,) bool: which of ``steps`` are past the warm-up (`warm_columns`)."""
    if run_start is None:
        return np.ones(len(steps), dtype=bool)
    warm = np.array([s >= run_start + WARMUP_STEPS for s in steps], dtype=bool)
    return warm if warm.any() else np.ones(len(steps), dtype=bool)


def wait_heatmap(
    m: RankSteps,
    validate: bool = True,
    flagged: Iterable[int] = (),
    run_start: int | None = None,
) -> go.Figure:
    """Rank × step heatmap of the time each rank waited in collectives (ms): the others
    wait for a straggler, so its own row stays pale. The colour scale runs up to the
    largest wait past the run's warm-up (`warm_columns`: ``run_start`` is the run's first
    step), so set-up steps do not wash out the rest; hovering shows every cell's value."""
    warm = warm_columns(m, run_start)
    shown = m.wait_ms[:, warm]
    top = float(np.nanmax(shown)) if np.isfinite(shown).any() else 1.0
    title = "wait (ms)"
    if not warm.all():
        title += "<br><sup>scale leaves out<br>warm-up steps</sup>"
    return _rank_step_heatmap(
        m,
        m.wait_ms,
        "Waiting in collectives (ms)",
        "waited %{z:,.3r} ms",
        {
            "zmin": 0.0,
            "zmax": max(top, 1e-9),
            "colorscale": _SEQUENTIAL,
            "colorbar": {"title": {"text": title}},
        },
        validate,
        flagged,
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


def _rank_points(
    report: StragglerReport, ranks: np.ndarray, x: np.ndarray, y: np.ndarray, hover: str
) -> list[dict]:
    """One scatter trace per verdict of points (``x``, ``y``) per rank (all (r,)), each
    labelled with its rank (every rank up to `LABEL_EVERY_RANK_UP_TO`, else the flagged
    ones) and hovering ``hover`` (a plotly template; ``%{customdata}`` is the rank)."""
    verdict = {r.rank: r.verdict for r in report.ranks}
    ranks_list = ranks.tolist()
    label_all = len(ranks_list) <= LABEL_EVERY_RANK_UP_TO
    # Neighbours along x take turns above and below their points, so that the labels of
    # ranks that measured alike do not print over each other.
    turn = np.empty(len(ranks_list), dtype=object)
    turn[np.argsort(np.nan_to_num(x), kind="stable")] = [
        "top center" if i % 2 == 0 else "bottom center" for i in range(len(ranks_list))
    ]
    data = []
    for key, (name, color, symbol) in VERDICT_STYLE.items():
        mask = np.array([verdict.get(r) == key for r in ranks_list], dtype=bool)
        if not mask.any():
            continue
        text = [str(r) if label_all or key != "ok" else "" for r in ranks[mask].tolist()]
        data.append(
            {
                "type": "scatter",
                "x": x[mask],
                "y": y[mask],
                "text": text,
                "customdata": ranks[mask],
                "mode": "markers+text",
                "textposition": turn[mask].tolist(),
                "textfont": {"size": 12, "color": color},
                "name": name,
                "marker": {"color": color, "size": 10 if key != "ok" else 8, "symbol": symbol},
                "hovertemplate": hover + "<extra>" + name + "</extra>",
            }
        )
    return data


def predicted_vs_measured_figure(
    report: StragglerReport, m: RankSteps, validate: bool = True
) -> go.Figure:
    """One point per rank: predicted work (at nominal speed, in the plans' `LoadUnit`)
    against measured compute, medians over the window, each point labelled with its rank
    (`LABEL_EVERY_RANK_UP_TO`) and coloured by its verdict. The dashed line is "as the
    typical rank": measured = k · predicted with k the median ratio, drawn over the
    x range (`_predicted_span`), so the axes zoom in on the ranks instead of on zero. Above the
    line: slower than predicted; to the right: given more work. A balanced plan gives
    every rank the same work, so its points stand in one column: `compute_wait_figure`
    spreads them."""
    x = row_medians(m.predicted_shown)
    y = row_medians(m.compute_ms)
    data = _rank_points(
        report,
        m.ranks,
        x,
        y,
        "rank %{customdata}<br>predicted %{x:,.3r}<br>measured %{y:,.3r} ms",
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


def compute_wait_figure(report: StragglerReport, m: RankSteps, validate: bool = True) -> go.Figure:
    """One point per rank: its measured compute (x) against its time waiting in
    collectives (y), medians over the window, labelled and coloured by verdict. Both axes
    are measured, so the points spread however evenly the plan shared the work (predicted
    vs measured stacks a balanced plan's ranks in one column). A rank the others wait for
    sits bottom right; the dashed line is the median rank's compute + wait, where ranks
    whose step took as long lie (every rank's step ends at the same all-reduce)."""
    x = row_medians(m.compute_ms)
    y = row_medians(m.wait_ms)
    ratios = row_medians(m.ratio)
    data = _rank_points(
        report,
        m.ranks,
        x,
        y,
        "rank %{customdata}<br>compute %{x:,.3r} ms<br>waiting %{y:,.3r} ms",
    )
    for trace in data:  # the compute ratio on hover too: why a rank computes longer
        mask = np.isin(m.ranks, trace["customdata"])
        trace["customdata"] = np.stack([m.ranks[mask], ratios[mask]], axis=-1)
        trace["hovertemplate"] = (
            trace["hovertemplate"]
            .replace("%{customdata}", "%{customdata[0]}")
            .replace("<extra>", "<br>measured ÷ predicted %{customdata[1]:.2f}<extra>")
        )
    ok = np.isfinite(x) & np.isfinite(y)
    x_range, y_range = data_range(x[ok]), data_range(y[ok])
    if ok.any() and x_range is not None and y_range is not None:
        total = float(np.median(x[ok] + y[ok]))
        # the line x + y = total, inside the data's box (axes start where the data does)
        lo, hi = max(x_range[0], total - y_range[1]), min(x_range[1], total - y_range[0])
        if lo < hi:
            data.append(
                {
                    "type": "scatter",
                    "x": [lo, hi],
                    "y": [total - lo, total - hi],
                    "mode": "lines",
                    "name": f"same step time as the median rank ({total:,.1f} ms)",
                    "line": {"dash": "dash", "color": palette.MODEL_FIT},
                    "hoverinfo": "skip",
                }
            )
    phases = ", ".join(m.phases)
    layout = {
        "title": {"text": f"Compute and waiting per rank · {_span(m)} (medians)"},
        "xaxis": {"title": {"text": f"measured {phases} (ms)"}, "range": x_range},
        "yaxis": {"title": {"text": "waiting in collectives (ms)"}, "range": y_range},
        "height": 420,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 50},
        "legend": {"orientation": "h", "y": -0.2},
    }
    return build_figure(data, layout, validate)


#: How each part of a step's loss (`step_loss.PARTS`, named by `step_loss.PART_INFO`) is
#: drawn: in the hues of the per-rank phase stacks.
LOSS_STYLE = {
    "layout_floor": part_style("plan"),
    "solver_gap": part_style("plan", 1),
    "slow_ranks": part_style("compute"),
    "input": part_style("host", 2),
    "host": part_style("host"),
    "communication": part_style("exchanges"),
    "exchange_waits": part_style("exchanges", 1, waiting=True),
    "gather": part_style("sync", 1),
    "allreduce": part_style("sync"),
    "optimizer": part_style("compute", 1),
    "descheduled": part_style("cpu", 1),
    "untimed": part_style("cpu"),
    "other": part_style("cpu", 2),
}


def step_loss_figure(
    losses: list[StepLoss], run_start: int | None = None, validate: bool = True
) -> go.Figure:
    """What each step lost against an ideal one (`knapformer.diagnosis.step_loss`): per
    step, the ideal (a line), and on top of it the parts of the loss stacked in `PARTS`
    order (bars, ms), up to the measured step (a line): the last part, ``other``, closes
    the stack on it (drawn downwards when negative: the parts overlapped). The y range
    leaves out the run's warm-up steps (`warm_columns`; ``run_start``: the run's first
    step), whose set-up waits would flatten the rest; the title gives the medians over the
    warm steps (`describe_loss`)."""
    x = [i if loss.step is None else loss.step for i, loss in enumerate(losses)]
    warm = _warm(x, run_start)
    measured = np.array([loss.measured_ms for loss in losses], dtype=float)
    ideal = np.array([loss.ideal_ms for loss in losses], dtype=float)
    base = np.nan_to_num(ideal)
    data: list[dict] = []
    low, high = [base], [base]  # every bar's bottom and top, for the y range
    for part in PARTS:
        name = PART_INFO[part].label
        y = np.array([loss.part_ms[part] for loss in losses], dtype=float)
        data.append(
            {
                "type": "bar",
                "x": x,
                "y": y,
                "base": base.copy(),
                "name": name,
                "marker": bar_marker(LOSS_STYLE[part]),
                "hovertemplate": f"step %{{x}} · {name}: %{{y:,.3r}} ms<extra></extra>",
            }
        )
        base = base + np.nan_to_num(y)
        low.append(base)
        high.append(base)
    for name, y, style in (
        ("ideal step", ideal, {"color": palette.MODEL_FIT, "dash": "dash"}),
        ("measured step", measured, {"color": palette.STEP_TIME}),
    ):
        data.append(
            {
                "type": "scatter",
                "x": x,
                "y": y,
                "mode": "lines+markers",
                "name": name,
                "line": style,
                "hovertemplate": f"step %{{x}} · {name}: %{{y:,.3r}} ms<extra></extra>",
            }
        )
        high.append(np.nan_to_num(y))
    shown_low = np.concatenate([v[warm] for v in low]) if len(x) else np.zeros(1)
    shown_high = np.concatenate([v[warm] for v in high]) if len(x) else np.ones(1)
    lo, hi = min(0.0, float(shown_low.min())), float(shown_high.max())
    pad = 0.05 * max(hi - lo, 1e-9)
    title = "What each step lost against an ideal one (ms)"
    if len(x):
        title += f" · {f'step {x[0]}' if len(x) == 1 else f'steps {x[0]}–{x[-1]}'}"
    warm_losses = [loss for loss, w in zip(losses, warm, strict=True) if w]
    title += f"<br><sup>{describe_loss(summarise(warm_losses))}"
    if not warm.all():
        title += "; warm-up steps left out of the scale"
    layout = {
        "title": {"text": title + "</sup>"},
        "barmode": "overlay",
        "bargap": 0.15,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "ms"}, "range": [lo, hi + pad]},
        "height": 420,
        "margin": {"l": 70, "r": 20, "t": 80, "b": 50},
        "legend": {"orientation": "h", "y": -0.2},
    }
    return build_figure(data, layout, validate)


def flagged_ranks(report: StragglerReport) -> dict[int, str]:
    """Rank -> the name of its verdict, for the ranks ``report`` flags (not ``ok``)."""
    return {r.rank: VERDICT_STYLE[r.verdict][0] for r in report.named}


def straggler_views(
    window: list[RankFigures], run_start: int | None = None, validate: bool = True
) -> tuple[str, list[tuple[str, go.Figure]]]:
    """The verdict line and the straggler figures (view name, figure) of a window of
    measured steps, as the dashboard shows them: the compute-ratio and wait heatmaps
    (flagged ranks labelled; the wait scale without the warm-up of a run starting at step
    ``run_start``), compute vs waiting per rank, and what each step lost against an ideal
    one (`step_loss_figure`). For the static report."""
    return window_views(rank_steps(window), analyse(window, None), run_start, validate)


def window_views(
    m: RankSteps, report: StragglerReport, run_start: int | None = None, validate: bool = True
) -> tuple[str, list[tuple[str, go.Figure]]]:
    """`straggler_views` of a window's matrices ``m`` and its verdicts ``report`` (from
    plans, or from the run store's rows)."""
    flagged = flagged_ranks(report)
    return headline(report), [
        ("ratio-heatmap", ratio_heatmap(m, validate, flagged)),
        ("wait-heatmap", wait_heatmap(m, validate, flagged, run_start)),
        ("compute-wait", compute_wait_figure(report, m, validate)),
        ("step-loss", step_loss_figure(window_losses(m), run_start, validate)),
    ]
