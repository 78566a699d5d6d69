"""Plotly figures of routing plans, shared by the live dashboard and the static report.

Pure functions of plans (or of `knapformer.contract.stats.StepSummary` lists): no Dash, no I/O.
Per-GPU arrays come from ``plan.stats`` and are indexed by position in ``plan.gpus``;
per-GPU axes lay GPUs out bag by bag by the label rule of `visualization.axes`, and
beyond `MAX_VIEW_GPUS` GPUs show groups of whole bags instead (`gpu_groups`).
"""

from __future__ import annotations

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import plotly.io as pio
from knapformer.visualization import palette
from knapformer.visualization.axes import (
    MAX_VIEW_GPUS,
    GpuGroups,
    bag_bands,
    bag_lines,
    boundary_lines,
    gpu_axis,
    gpu_groups,
    rank_ticks,
    thinned_ticks,
)
from knapformer.visualization.palette import AFTER as AFTER_COLOR
from knapformer.visualization.palette import BEFORE as BEFORE_COLOR
from knapformer.visualization.palette import HIGHLIGHT as HIGHLIGHT_COLOR

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.contract.stats import StepSummary, chunk_loads
from knapformer.contract.units import LoadUnit, round_significant_array
from knapformer.diagnosis.measured import MeasuredStep, measure
from knapformer.errors import KnapformerError

__all__ = ["MAX_VIEW_GPUS", "gpu_groups"]  # re-exported: the figures' size rule lives in axes

# Only the layout part of the template: its per-trace defaults would triple every figure.
_TEMPLATE = {"layout": pio.templates["plotly_white"].layout.to_plotly_json()}
_MARKERS_UP_TO = 400  # timeline points drawn with markers; beyond, lines only (fast SVG)
_BARGAP = 0.15
# Where the "after" bar of a slot is drawn: right of centre by half its width.
_AFTER_OFFSET = (1 - _BARGAP) / 4
#: Nominal plot area (width, height, px) of the traffic heatmap, for its label rule.
TRAFFIC_PLOT_PX = (520, 300)


def _check_seq(plan: RoutingPlan, seq: int | None) -> int | None:
    if seq is None:
        return None
    if not 0 <= seq < len(plan.sequences):
        raise KnapformerError(f"sequence {seq} is not in this plan (it has {len(plan.sequences)})")
    return int(seq)


def _title(plan: RoutingPlan, what: str) -> str:
    step = "" if plan.step is None else f" · step {plan.step}"
    return f"{what}{step} · {plan.topology}"


def _note(groups: GpuGroups) -> str:
    """What an aggregated view shows instead of single GPUs, as a second title line."""
    return f"<br><sup>{groups.note}</sup>"


def build_figure(data: list[dict], layout: dict, validate: bool) -> go.Figure:
    """A figure from trace and layout dicts. ``validate=False`` skips plotly's per-property
    validation (10x faster; the live dashboard uses it, tests check the specs validate)."""
    layout = {"template": _TEMPLATE, **layout}
    return go.Figure({"data": data, "layout": layout}, _validate=validate)


def empty_figure(message: str, validate: bool = True) -> go.Figure:
    """A figure with nothing to show: no axes (which would only show made-up ranges), the
    reason in the middle."""
    hidden = {"visible": False}
    layout = {
        "xaxis": hidden,
        "yaxis": hidden,
        "annotations": [
            {
                "text": message,
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "font": {"size": 14, "color": "#868e96"},
            }
        ],
        "margin": {"l": 20, "r": 20, "t": 20, "b": 20},
    }
    return build_figure([], layout, validate)


def bag_load_figure(
    plan: RoutingPlan,
    highlight_seq: int | None = None,
    validate: bool = True,
    flagged: dict[int, str] | None = None,
) -> go.Figure:
    """Per-GPU load before and after balancing, GPUs bag by bag on shaded bag bands
    (`visualization.axes`), with the mean as capacity.

    ``highlight_seq`` draws that sequence's chunks only: each chunk's own cost as a segment
    at the top of its GPU's "after" bar (with a marker above it, so a chunk of a few tokens
    is still found), and the GPU it starts on.

    A measured step also shows each GPU's measured compute (ms, right axis; see
    `knapformer.diagnosis.measured`); ``flagged`` ranks (rank -> verdict shown) are named
    above their bars and always labelled on the axis.
    """
    seq = _check_seq(plan, highlight_seq)
    groups = gpu_groups(plan)
    if groups is not None:
        return _grouped_load_figure(plan, groups, seq, validate)
    flagged = flagged or {}
    st = plan.stats
    unit = LoadUnit.of(plan)
    axis = gpu_axis(plan)
    n = len(axis.ranks)
    slots = np.arange(n)
    hover = [
        f"GPU {g} · {plan.bag_label(b)}"
        for g, b in zip(axis.ranks.tolist(), axis.bag.tolist(), strict=True)
    ]
    value = f"%{{y:,.3r}}{unit.suffix}"  # d3 format: 3 significant figures, thousands commas

    def load_bars(when: str, load, tokens, color: str) -> dict:
        return {
            "type": "bar",
            "x": slots,
            "y": load[axis.position] * unit.factor,
            "name": when,
            "offsetgroup": when,
            "marker": {"color": color},
            "customdata": tokens[axis.position],
            "hovertext": hover,
            "hovertemplate": f"%{{hovertext}}<br>load {when} {value}<br>%{{customdata:,}} "
            "tokens<extra></extra>",
        }

    data = [
        load_bars("before", st.load_before, st.tokens_before, BEFORE_COLOR),
        load_bars("after", st.load_after, st.tokens_after, AFTER_COLOR),
        {
            "type": "scatter",
            "x": [-0.5, n - 0.5],
            "y": [st.mean_load * unit.factor] * 2,
            "mode": "lines",
            "name": f"capacity (mean {unit.format(st.mean_load)})",
            "line": {"color": palette.CAPACITY, "dash": "dash", "width": 2},
            "hoverinfo": "skip",
        },
    ]
    if seq is not None:
        data += _chunk_marks(plan, seq, axis, unit, value)
    measured = measure(plan)
    if measured is not None:
        data.append(_measured_marks(measured, axis))
    tops = np.maximum(st.load_before, st.load_after)[axis.position] * unit.factor
    data += _flag_marks(axis.ranks, tops, flagged)
    bands = bag_bands(plan, axis)
    what = "Load per GPU, bags as bands" + (" · measured" if measured is not None else "")
    layout = {
        "title": {"text": _title(plan, what)},
        "barmode": "group",
        "bargap": _BARGAP,
        "yaxis": {"title": {"text": f"modelled {unit.axis_title}"}},
        "xaxis": {
            "title": {"text": "GPU rank (bags as shaded bands, named above)"},
            "range": [-0.5, n - 0.5],
            "showgrid": False,
            "zeroline": False,
            **rank_ticks(axis.ranks, flagged=flagged),
        },
        "legend": {"orientation": "h", "y": 1.16, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        "margin": {"l": 60, "r": 60 if measured is not None else 20, "t": 100, "b": 50},
        **bands,
    }
    if measured is not None:
        layout["yaxis2"] = {
            "title": {"text": f"measured {measured.phase} (ms)"},
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
            "showgrid": False,
        }
    return build_figure(data, layout, validate)


def _measured_marks(measured: MeasuredStep, axis) -> dict:
    """Each GPU's measured compute of the step, on the right axis, over its slot."""
    ms = measured.compute_ms[axis.position]
    return {
        "type": "scatter",
        "x": np.arange(len(axis.ranks)),
        "y": ms,
        "yaxis": "y2",
        "mode": "markers",
        "name": f"measured {measured.phase} (ms, right axis)",
        "marker": {"symbol": "diamond", "size": 8, "color": palette.STEP_TIME},
        "customdata": axis.ranks,
        "hovertemplate": f"GPU %{{customdata}}<br>measured {measured.phase} "
        "%{y:,.2f} ms<extra></extra>",
    }


def _flag_marks(ranks: np.ndarray, tops: np.ndarray, flagged: dict[int, str]) -> list[dict]:
    """A marker and the verdict above the slot of each ``flagged`` rank (slots hold
    ``ranks``, bars reach ``tops``)."""
    slots = [i for i, r in enumerate(ranks.tolist()) if r in flagged]
    if not slots:
        return []
    return [
        {
            "type": "scatter",
            "x": slots,
            "y": [float(tops[i]) for i in slots],
            "mode": "markers+text",
            "name": "flagged",
            "text": [f"{flagged[int(ranks[i])]} · {int(ranks[i])}" for i in slots],
            "textposition": "top center",
            "textfont": {"color": HIGHLIGHT_COLOR, "size": 12},
            "marker": {"symbol": "triangle-down", "size": 10, "color": HIGHLIGHT_COLOR},
            "cliponaxis": False,
            "customdata": [int(ranks[i]) for i in slots],
            "hovertemplate": "GPU %{customdata}: %{text}<extra></extra>",
        }
    ]


def tokens_figure(
    plan: RoutingPlan, validate: bool = True, flagged: dict[int, str] | None = None
) -> go.Figure:
    """Tokens per GPU before and after routing, GPUs bag by bag, with the planner's hard
    cap (``solver_options["max_tokens_per_gpu"]``) as a line when the plan had one; beyond
    `MAX_VIEW_GPUS` GPUs, the most tokens of any GPU of each group of bags."""
    flagged = flagged or {}
    st = plan.stats
    cap = plan.solver_options.get("max_tokens_per_gpu")
    groups = gpu_groups(plan)
    if groups is None:
        axis = gpu_axis(plan)
        x = np.arange(len(axis.ranks))
        before, after = st.tokens_before[axis.position], st.tokens_after[axis.position]
        hover = [f"GPU {g}" for g in axis.ranks.tolist()]
        xaxis = {
            "title": {"text": "GPU rank (bag order)"},
            "range": [-0.5, len(x) - 0.5],
            **rank_ticks(axis.ranks, flagged=flagged),
        }
        extra = {"shapes": bag_lines(axis)}
        note = ""
    else:
        x = groups.labels
        before = _group_max(groups, st.tokens_before)
        after = _group_max(groups, st.tokens_after)
        hover = list(x)
        xaxis = {"title": {"text": "bags, in order (ids)"}, "type": "category",
                 **thinned_ticks(groups.short, categories=x)}  # fmt: skip
        extra, note = {}, _note(groups)
    data = [
        {
            "type": "bar",
            "x": x,
            "y": values,
            "name": when,
            "marker": {"color": color},
            "hovertext": hover,
            "hovertemplate": f"%{{hovertext}}<br>%{{y:,}} tokens {when}<extra></extra>",
        }
        for when, values, color in (("before", before, BEFORE_COLOR), ("after", after, AFTER_COLOR))
    ]
    if groups is None:
        data += _flag_marks(axis.ranks, np.maximum(before, after), flagged)
    if cap is not None:
        ends = [-0.5, len(x) - 0.5] if groups is None else [x[0], x[-1]]
        data.append(
            {
                "type": "scatter",
                "x": ends,
                "y": [cap, cap],
                "mode": "lines",
                "name": f"cap: max_tokens_per_gpu = {cap:,}",
                "line": {"color": palette.CAP, "dash": "dot", "width": 2},
                "hoverinfo": "skip",
            }
        )
    layout = {
        "title": {"text": _title(plan, "Tokens per GPU") + note},
        "barmode": "group",
        "bargap": _BARGAP,
        "xaxis": {"showgrid": False, **xaxis},
        "yaxis": {"title": {"text": "tokens"}, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        "margin": {"l": 60, "r": 20, "t": 70, "b": 50},
        "height": 360,
        **extra,
    }
    return build_figure(data, layout, validate)


def _chunk_marks(plan: RoutingPlan, seq: int, axis, unit: LoadUnit, value: str) -> list[dict]:
    """Traces drawing sequence ``seq``'s chunks inside the "after" bars, and its source."""
    chunks = plan.chunks
    mine = np.flatnonzero(chunks.seq == seq)
    pos = gpu_positions(plan.gpus)
    where = axis.slot_of_position[pos[chunks.dst_gpu[mine]]]
    cost = chunk_loads(plan, mine) * unit.factor
    top = plan.stats.load_after[pos[chunks.dst_gpu[mine]]] * unit.factor
    src_slot = int(axis.slot_of_position[pos[plan.sequences.src_gpu[seq]]])
    info = np.stack([chunks.dst_gpu[mine], chunks.offset[mine], chunks.length[mine], cost], 1)
    name = f"sequence {seq}"
    chunk_hover = (
        f"{name}: chunk at %{{customdata[1]:,}}, %{{customdata[2]:,}} tokens on GPU "
        f"%{{customdata[0]}}<br>its load %{{customdata[3]:,.3r}}{unit.suffix}<extra></extra>"
    )
    return [
        {
            "type": "bar",
            "x": where,
            "y": cost,
            "base": top - cost,
            "name": name,
            "offsetgroup": "after",
            "marker": {"color": HIGHLIGHT_COLOR},
            "customdata": info,
            "hovertemplate": chunk_hover,
        },
        {
            "type": "scatter",
            "x": where + _AFTER_OFFSET,
            "y": top,
            "mode": "markers",
            "name": f"{name} chunks",
            "showlegend": False,
            "marker": {"symbol": "triangle-down", "size": 10, "color": HIGHLIGHT_COLOR},
            "cliponaxis": False,
            "customdata": info,
            "hovertemplate": chunk_hover,
        },
        {
            "type": "scatter",
            "x": [src_slot],
            "y": [0],
            "mode": "markers",
            "name": f"{name} source",
            "marker": {"symbol": "triangle-up", "size": 14, "color": HIGHLIGHT_COLOR},
            "cliponaxis": False,
            "hovertemplate": f"{name} starts on GPU {int(plan.sequences.src_gpu[seq])}"
            "<extra></extra>",
        },
    ]


def _group_max(groups: GpuGroups, values: np.ndarray) -> np.ndarray:
    """(num_groups,) largest of the per-GPU ``values`` in each group."""
    out = np.full(len(groups.labels), -np.inf)
    np.maximum.at(out, groups.of_position, values)
    return out


def _grouped_load_figure(
    plan: RoutingPlan, groups: GpuGroups, seq: int | None, validate: bool
) -> go.Figure:
    """`bag_load_figure` of a large plan: per group, its most loaded GPU (the makespan is
    the largest bar) and the tokens of all its GPUs."""
    st = plan.stats
    unit = LoadUnit.of(plan)
    x = groups.labels
    hover = [f"{label} ({size:,} GPUs)" for label, size in zip(x, groups.sizes, strict=True)]

    def load_bars(when: str, load, tokens, color: str) -> dict:
        return {
            "type": "bar",
            "x": x,
            "y": _group_max(groups, load) * unit.factor,
            "name": f"{when} (largest GPU)",
            "marker": {"color": color},
            "customdata": np.bincount(groups.of_position, weights=tokens, minlength=len(x)),
            "hovertext": hover,
            "hovertemplate": f"%{{hovertext}}<br>largest load {when} "
            f"%{{y:,.3r}}{unit.suffix}<br>"
            "%{customdata:,.0f} tokens in all<extra></extra>",
        }

    data = [
        load_bars("before", st.load_before, st.tokens_before, BEFORE_COLOR),
        load_bars("after", st.load_after, st.tokens_after, AFTER_COLOR),
        {
            "type": "scatter",
            "x": x,
            "y": np.full(len(x), st.mean_load * unit.factor),
            "mode": "lines",
            "name": f"capacity (mean {unit.format(st.mean_load)})",
            "line": {"color": palette.CAPACITY, "dash": "dash", "width": 2},
            "hoverinfo": "skip",
        },
    ]
    if seq is not None:
        pos = gpu_positions(plan.gpus)
        home = x[int(groups.of_position[pos[int(plan.sequences.src_gpu[seq])]])]
        receiving = {
            x[int(g)] for g in groups.of_position[pos[plan.chunks.dst_gpu]][plan.chunks.seq == seq]
        }
        data[1]["marker"]["line"] = {
            "color": HIGHLIGHT_COLOR,
            "width": [3 if label in receiving else 0 for label in x],
        }
        data.append(
            {
                "type": "scatter",
                "x": [home],
                "y": [0],
                "mode": "markers",
                "name": f"sequence {seq} source",
                "marker": {"symbol": "triangle-up", "size": 14, "color": HIGHLIGHT_COLOR},
                "hovertemplate": f"sequence {seq} starts here<extra></extra>",
            }
        )
    layout = {
        "title": {"text": _title(plan, "Largest GPU load of each group") + _note(groups)},
        "barmode": "group",
        "bargap": 0.15,
        "yaxis": {"title": {"text": f"modelled {unit.axis_title}, most loaded GPU"}},
        "xaxis": {
            "title": {"text": "bags, in order (ids)"},
            "type": "category",
            **thinned_ticks(groups.short, categories=x),
        },
        "legend": {"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        "margin": {"l": 60, "r": 20, "t": 70, "b": 60},
    }
    return build_figure(data, layout, validate)


def _token_ticks(largest: int) -> tuple[list[float], list[str]]:
    """Colour-bar ticks of a log10(1 + tokens) scale, labelled in tokens."""
    values = [0] + [10**e for e in range(int(np.log10(max(largest, 1))) + 1)]
    return [float(np.log10(1 + v)) for v in values], [f"{v:,}" for v in values]


def traffic_figure(
    plan: RoutingPlan, highlight_seq: int | None = None, validate: bool = True
) -> go.Figure:
    """Heatmap of tokens sent from each source GPU (rows) to each destination (columns),
    GPUs in bag order with lines at bag boundaries; beyond `MAX_VIEW_GPUS` GPUs, between
    groups of whole bags (`gpu_groups`, said in the title).

    Colour is log10(1 + tokens) because the diagonal (tokens that stay) dwarfs the rest;
    the colour bar is labelled in tokens and hovering shows exact counts.
    ``highlight_seq`` outlines the cells of that sequence's chunks.
    """
    seq = _check_seq(plan, highlight_seq)
    groups = gpu_groups(plan)
    if groups is None:
        axis = gpu_axis(plan)
        cell_of = axis.slot_of_position  # GPUs in bag order
        names = [f"GPU {g}" for g in axis.ranks.tolist()]
        ticks = [str(g) for g in axis.ranks.tolist()]
        shapes, what, note = boundary_lines(axis), "GPU", ""
    else:  # never the GPU x GPU matrix of a large plan
        cell_of, names, ticks = groups.of_position, groups.labels, groups.short
        shapes, what, note = [], "bags", _note(groups)
    # Category axes named after the cells, so hovering names them without a per-cell copy.
    matrix = plan.stats.traffic_between(cell_of, len(names))
    tickvals, ticktext = _token_ticks(int(matrix.max()))
    data = [
        {
            "type": "heatmap",
            "z": np.log10(1.0 + matrix).astype(np.float32),
            "x": names,
            "y": names,
            "zmin": 0.0,
            "zmax": max(tickvals[-1], float(np.log10(1.0 + matrix.max()))),
            "customdata": matrix.astype(np.int32),
            # An explicit list: plotly.js's own "Blues" runs dark to light.
            "colorscale": [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Blues)],
            "colorbar": {
                "title": {"text": "tokens<br>(log scale)"},
                "tickvals": tickvals,
                "ticktext": ticktext,
            },
            "hovertemplate": "%{y} → %{x}<br>%{customdata:,} tokens<extra></extra>",
            "name": "traffic",
        }
    ]
    if seq is not None:
        chunks = plan.chunks
        mine = np.flatnonzero(chunks.seq == seq)
        pos = gpu_positions(plan.gpus)
        data.append(
            {
                "type": "scatter",
                "x": [names[c] for c in cell_of[pos[chunks.dst_gpu[mine]]].tolist()],
                "y": [names[c] for c in cell_of[pos[chunks.src_gpu[mine]]].tolist()],
                "mode": "markers",
                "name": f"sequence {seq}",
                "marker": {
                    "symbol": "square-open",
                    "size": 14,
                    "color": HIGHLIGHT_COLOR,
                    "line": {"width": 3},
                },
                "customdata": chunks.length[mine],
                "hovertemplate": f"sequence {seq}: %{{customdata:,}} tokens, %{{y}} → %{{x}}"
                "<extra></extra>",
            }
        )
    x_px, y_px = TRAFFIC_PLOT_PX
    category = {"type": "category", "categoryorder": "array", "categoryarray": names}
    layout = {
        "title": {"text": _title(plan, "GPU→GPU traffic (tokens)") + note},
        "xaxis": {
            "title": {"text": f"destination {what} (bag order)"},
            "showgrid": False,
            **category,
            **thinned_ticks(ticks, x_px, categories=names),
        },
        "yaxis": {
            "title": {"text": f"source {what}"},
            "autorange": "reversed",
            "showgrid": False,
            **category,
            **thinned_ticks(ticks, y_px, vertical=True, categories=names),
        },
        "shapes": shapes,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 60},
        "showlegend": seq is not None,
        "legend": {"orientation": "h", "y": -0.25},
    }
    return build_figure(data, layout, validate)


# (name, colour, panel, hover format) of each timeline trace, in trace order; the last
# one only when the run measured its steps.
_TIMELINE_TRACES = (
    ("before", BEFORE_COLOR, 1, ".3f"),
    ("after", AFTER_COLOR, 1, ".3f"),
    ("moved", palette.MOVED, 2, ".1f"),  # in percent, so the axis picks its own precision
    ("plan ms", palette.PLAN_TIME, 3, ".2f"),
    ("step ms", palette.STEP_TIME, 4, ",.3r"),
)
_PANEL_TITLES = (
    "imbalance (max / mean load)",
    "moved tokens",
    "planning time (ms)",
    "measured step time (ms, slowest rank)",
)


def timeline_measured(summaries: list[StepSummary]) -> bool:
    """Whether a timeline of ``summaries`` has the measured step-time panel."""
    return any(s.step_ms is not None for s in summaries)


def timeline_columns(
    summaries: list[StepSummary], start: int = 0, measured: bool | None = None
) -> list[tuple[list, list, list[int]]]:
    """(x, y, customdata) of each timeline trace for ``summaries[start:]``, in trace order,
    so a live view can append new steps to a figure it already shows. ``measured``: with
    the step-time trace (default: when any summary has a step time)."""
    if measured is None:
        measured = timeline_measured(summaries)
    tail = summaries[start:]
    x = [start + i if s.step is None else s.step for i, s in enumerate(tail)]
    index = list(range(start, start + len(tail)))
    columns = [
        (x, [s.imbalance_before for s in tail], index),
        (x, [s.imbalance_after for s in tail], index),
        (x, [100.0 * s.moved_fraction for s in tail], index),
        (x, [s.plan_ms for s in tail], index),
    ]
    if measured:
        columns.append((x, [s.step_ms for s in tail], index))
    return columns


def timeline_mode(count: int) -> str:
    """Trace mode of a timeline of ``count`` steps: markers only while few, because tens of
    thousands of SVG markers make every redraw of a long run take seconds."""
    return "lines+markers" if count <= _MARKERS_UP_TO else "lines"


def timeline_figure(
    summaries: list[StepSummary], selected_step: int | None = None, validate: bool = True
) -> go.Figure:
    """Imbalance before/after, moved-token fraction, planning time and, when measured, the
    step's wall time over steps.

    Stacked panels sharing one x axis (step). Every point's ``customdata`` is its index in
    ``summaries`` (click → select). ``selected_step`` is an index into ``summaries``; it
    is marked with a vertical line across the panels. No steps: no axes, a message.
    """
    if not summaries:
        return empty_figure("no steps yet", validate)
    shapes = selection_shapes(summaries, selected_step)
    return timeline_of_columns(timeline_columns(summaries), shapes, validate=validate)


def timeline_of_columns(
    columns: list[tuple[list, list, list[int]]],
    shapes: list[dict],
    title: str | None = None,
    validate: bool = True,
) -> go.Figure:
    """The timeline's stacked panels of ``columns`` (`timeline_columns`' (x, y, customdata)
    per trace, the step-time trace last and optional), ``shapes`` drawn over them."""
    mode = timeline_mode(len(columns[0][0]))
    panels = 4 if len(columns) == len(_TIMELINE_TRACES) else 3
    data = []
    for (name, color, row, fmt), (x, y, index) in zip(_TIMELINE_TRACES, columns, strict=False):
        data.append(
            {
                "type": "scatter",
                "x": x,
                "y": y,
                "customdata": index,
                "mode": mode,
                "name": name,
                "line": {"color": color, "width": 1.5},
                "marker": {"size": 5},
                "hovertemplate": f"step %{{x}}<br>{name} %{{y:{fmt}}}"
                + ("%" if name == "moved" else "")
                + "<extra></extra>",
                "xaxis": "x",
                "yaxis": "y" if row == 1 else f"y{row}",
            }
        )
    gap = 0.07
    height = (1 - gap * (panels - 1)) / panels
    domains = {
        row: [1 - row * height - (row - 1) * gap, 1 - (row - 1) * (height + gap)]
        for row in range(1, panels + 1)
    }
    domains[panels][0] = 0.0
    layout = {
        "height": 430 if panels == 3 else 520,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 40},
        "hovermode": "x",
        "clickmode": "event",
        "legend": {"orientation": "h", "y": 1.06, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        "xaxis": {"anchor": f"y{panels}", "title": {"text": "step"}},
        "annotations": [
            {
                "text": _PANEL_TITLES[row - 1],
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": domains[row][1],
                "xanchor": "center",
                "yanchor": "bottom",
                "font": {"size": 13},
            }
            for row in range(1, panels + 1)
        ],
        "shapes": shapes,
    }
    if title:  # at the top, over the legend: in a half-width cell the legend reaches it
        layout["title"] = {"text": title, "y": 0.99, "yanchor": "top"}
        layout["margin"]["t"] = 110
    for row in range(1, panels + 1):
        layout["yaxis" if row == 1 else f"yaxis{row}"] = {"domain": domains[row], "anchor": "x"}
    layout["yaxis2"]["ticksuffix"] = "%"
    return build_figure(data, layout, validate)


def step_marker(x: float) -> dict:
    """A vertical line across a figure's panels at step ``x`` (the selected step)."""
    return {
        "type": "line",
        "xref": "x",
        "yref": "paper",
        "x0": x,
        "x1": x,
        "y0": 0,
        "y1": 1,
        "line": {"color": HIGHLIGHT_COLOR, "width": 2},
    }


def selection_shapes(summaries: list[StepSummary], selected: int | None) -> list[dict]:
    """The vertical line marking the selected index on the timeline (empty when none)."""
    if selected is None or not 0 <= selected < len(summaries):
        return []
    s = summaries[selected]
    return [step_marker(selected if s.step is None else s.step)]


_LABEL_CHARS = 64  # a row label's placement is cut here (a 1,024-GPU layout is long)


#: A run of consecutive steps on one partition (the partition timeline's bar): its
#: topology string, where its bags sat (`StepSummary.bags`; None where unknown), its
#: first and last step.
PartitionSpan = tuple[str | None, str | None, float, float]


def partition_labels(summaries: list[StepSummary]) -> list[str]:
    """Each step's row on the partition timeline (`partition_labels_of`)."""
    return partition_labels_of([(s.topology, s.bags) for s in summaries])


def partition_labels_of(partitions: list[tuple[str | None, str | None]]) -> list[str]:
    """Each (topology, bags) pair's row on the partition timeline: its topology string,
    and where its bags sat ("g1n4+g4n1 @ g4@0-3 g1@4-7") wherever that topology appears
    with bags in more than one place in ``partitions``: the same string with the big
    group moved is a change. Distinct placements always get distinct labels."""
    keys = [(topology or "?", bags) for topology, bags in partitions]
    placements: dict[str, dict] = {}
    for topo, bags in keys:
        placements.setdefault(topo, {})[bags] = None
    label_of: dict[tuple, str] = {}
    used: set[str] = set()
    for key in dict.fromkeys(keys):
        topo, bags = key
        label = topo
        if len(placements[topo]) > 1:
            where = bags or "?"
            if len(where) > _LABEL_CHARS:
                where = where[: _LABEL_CHARS - 1] + "…"
            label = f"{topo} @ {where}"
        base, k = label, 2
        while label in used:  # two long placements cut to one prefix
            label, k = f"{base} ({k})", k + 1
        used.add(label)
        label_of[key] = label
    return [label_of[key] for key in keys]


def topology_runs(summaries: list[StepSummary]) -> list[tuple[str, int, int]]:
    """Runs of consecutive steps on one partition (topology and placement of its bags):
    (row label of `partition_labels`, first index, last index) into ``summaries`` ("?"
    where a summary does not say)."""
    runs: list[tuple[str, int, int]] = []
    for i, label in enumerate(partition_labels(summaries)):
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1], i)
        else:
            runs.append((label, i, i))
    return runs


def topology_figure(
    summaries: list[StepSummary], selected: int | None = None, validate: bool = True
) -> go.Figure:
    """Which partition each step used: one row per partition (its topology string, and
    where its bags sat where the same string was placed differently: `partition_labels`),
    a bar over the steps of each run of steps that used it, the selected step (an index
    into ``summaries``) marked. Drawn from runs of steps, so a long run costs a few
    points."""
    if not summaries:
        return empty_figure("no steps yet", validate)
    x_of = [i if s.step is None else s.step for i, s in enumerate(summaries)]
    spans = [
        (summaries[first].topology, summaries[first].bags, x_of[first], x_of[last])
        for _, first, last in topology_runs(summaries)
    ]
    return partition_figure(spans, selection_shapes(summaries, selected), validate)


def partition_figure(
    spans: list[PartitionSpan], shapes: list[dict], validate: bool = True
) -> go.Figure:
    """`topology_figure` of runs of steps (`PartitionSpan`, in step order; a run store
    keeps them for every step), ``shapes`` (the selected step's marker) over them."""
    if not spans:
        return empty_figure("no steps yet", validate)
    labels = partition_labels_of([(topology, bags) for topology, bags, _, _ in spans])
    runs = [(label, x0, x1) for label, (_, _, x0, x1) in zip(labels, spans, strict=True)]
    rows = list(dict.fromkeys(labels))
    topologies = len({topology or "?" for topology, _, _, _ in spans})
    data = []
    for k, topo in enumerate(rows):
        xs, ys = [], []
        for name, first, last in runs:
            if name == topo:
                # a run of one step still shows as a short bar: ±0.4 step around it
                xs += [first - 0.4, last + 0.4, None]
                ys += [topo, topo, None]
        color = plotly.colors.qualitative.D3[k % len(plotly.colors.qualitative.D3)]
        data.append(
            {
                "type": "scatter",
                "x": xs,
                "y": ys,
                "mode": "lines",
                "name": topo,
                "line": {"color": color, "width": 12},
                "hovertemplate": f"{topo}<br>step %{{x:.0f}}<extra></extra>",
            }
        )
    changes = len(runs) - 1
    placed = f" in {len(rows)} placements" if len(rows) > topologies else ""
    title = (
        f"Partition per step · {topologies} topolog{'y' if topologies == 1 else 'ies'}"
        f"{placed}, {changes} change{'' if changes == 1 else 's'}"
    )
    layout = {
        "title": {"text": title},
        "height": 120 + 28 * len(rows),
        "showlegend": False,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"type": "category", "categoryorder": "array", "categoryarray": rows,
                  "autorange": "reversed", "automargin": True},
        "margin": {"l": 20, "r": 20, "t": 40, "b": 40},
        "shapes": shapes,
    }  # fmt: skip
    return build_figure(data, layout, validate)


#: The sequence table's columns, in order (the dashboard's and the report's).
SEQUENCE_COLUMNS = ("id", "src_gpu", "length", "workload", "bag", "chunks", "destinations")


def sequence_columns(plan: RoutingPlan) -> dict[str, np.ndarray]:
    """The numeric columns of the sequence table, one value per sequence (n_seq,): id,
    src_gpu, length, workload (in the plan's `LoadUnit`, 3 significant figures), bag and
    the number of chunks."""
    unit = LoadUnit.of(plan)
    seqs = plan.sequences
    n = len(seqs)
    workload = seqs.workload * unit.factor
    return {
        "id": np.arange(n),
        "src_gpu": seqs.src_gpu,
        "length": seqs.length,
        "workload": round_significant_array(workload),
        "bag": seqs.bag,
        "chunks": np.bincount(plan.chunks.seq, minlength=n),
    }


def chunk_destinations(plan: RoutingPlan, ids: np.ndarray | None = None) -> list[str]:
    """For each sequence of ``ids`` (default: all), the destination GPU of each of its
    chunks in offset order, e.g. "4 5 6 7"."""
    chunks = plan.chunks
    n = len(plan.sequences)
    order = np.lexsort((chunks.offset, chunks.seq))
    starts = np.concatenate([[0], np.cumsum(np.bincount(chunks.seq, minlength=n))])
    dst = chunks.dst_gpu[order].tolist()
    ids = np.arange(n) if ids is None else np.asarray(ids, dtype=np.int64)
    return [" ".join(map(str, dst[starts[i] : starts[i + 1]])) for i in ids.tolist()]


def sequence_rows(
    plan: RoutingPlan, ids: np.ndarray | None = None, columns: dict | None = None
) -> list[dict]:
    """One row per sequence of ``ids`` (default: all), keyed by `SEQUENCE_COLUMNS`
    (``columns``: the plan's `sequence_columns`, when the caller has them already).

    ``workload`` is in the plan's display unit (`LoadUnit`, 3 significant figures);
    ``destinations`` lists the destination GPU of each chunk in offset order, e.g. "4 5 6 7".
    """
    columns = sequence_columns(plan) if columns is None else columns
    ids = columns["id"] if ids is None else np.asarray(ids, dtype=np.int64)
    values = {name: column[ids].tolist() for name, column in columns.items()}
    values["destinations"] = chunk_destinations(plan, ids)
    return [{name: values[name][k] for name in SEQUENCE_COLUMNS} for k in range(len(ids))]
