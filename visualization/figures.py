"""Plotly figures of routing plans, shared by the live dashboard and the static report.

Pure functions of plans (or of `knapformer.stats.StepSummary` lists): no Dash, no I/O.
Per-GPU arrays come from ``plan.stats`` and are indexed by position in ``plan.gpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import plotly.io as pio

from knapformer.errors import KnapformerError
from knapformer.plan import RoutingPlan, gpu_positions
from knapformer.stats import StepSummary, chunk_loads
from knapformer.units import LoadUnit, round_significant
from visualization import palette
from visualization.palette import AFTER as AFTER_COLOR
from visualization.palette import BEFORE as BEFORE_COLOR
from visualization.palette import HIGHLIGHT as HIGHLIGHT_COLOR

# A GPU whose measured/predicted ratio exceeds the median ratio by this much is flagged.
_STRAGGLER_FACTOR = 1.15
# Only the layout part of the template: its per-trace defaults would triple every figure.
_TEMPLATE = {"layout": pio.templates["plotly_white"].layout.to_plotly_json()}
_MARKERS_UP_TO = 400  # timeline points drawn with markers; beyond, lines only (fast SVG)
#: Per-GPU views (load bars, traffic heatmap) of a plan with more GPUs than this show whole
#: bags (or runs of bags) instead, and say so in their title: a 10,000-GPU heatmap would
#: be 10⁸ cells (a 1 GB page), and bars thinner than a pixel show nothing.
MAX_VIEW_GPUS = 128


@dataclass(frozen=True)
class GpuGroups:
    """Columns of a per-GPU view of a plan too large to draw GPU by GPU: whole bags, or
    runs of consecutive bags, so a group never splits a bag."""

    of_position: np.ndarray  # (num_gpus,) group of each GPU position of plan.gpus
    labels: list[str]  # (num_groups,) unique axis labels
    sizes: np.ndarray  # (num_groups,) GPUs per group
    note: str  # what the view shows instead of single GPUs


def gpu_groups(plan: RoutingPlan) -> GpuGroups | None:
    """How per-GPU views aggregate ``plan``; None when it is small enough to show per GPU."""
    num_gpus, num_bags = len(plan.gpus), len(plan.bags)
    if num_gpus <= MAX_VIEW_GPUS:
        return None
    per = math.ceil(num_bags / MAX_VIEW_GPUS)
    of_bag = np.arange(num_bags) // per
    count = int(of_bag[-1]) + 1
    if per == 1:
        labels = [plan.bag_label(b) for b in range(num_bags)]
        note = f"aggregated by bag: {num_gpus:,} GPUs in {num_bags:,} bags"
    else:
        labels = [f"bags {i * per}–{min((i + 1) * per, num_bags) - 1}" for i in range(count)]
        note = f"aggregated: {num_gpus:,} GPUs in {count:,} runs of {per} bags"
    of_position = of_bag[plan.stats.gpu_bag]
    return GpuGroups(of_position, labels, np.bincount(of_position, minlength=count), note)


def _group_max(groups: GpuGroups, values: np.ndarray) -> np.ndarray:
    """(num_groups,) largest of the per-GPU ``values`` in each group."""
    out = np.full(len(groups.labels), -np.inf)
    np.maximum.at(out, groups.of_position, values)
    return out


def _gpu_axis(plan: RoutingPlan) -> tuple[list[str], list[str], np.ndarray]:
    """Multicategory x (bag label, GPU label) in bag order and, per bar, the GPU's position
    in ``plan.gpus`` (bars are drawn bag by bag so each bag is one labelled group)."""
    pos = {g: i for i, g in enumerate(plan.gpus)}
    bags, gpus, index = [], [], []
    for bag_id, members in enumerate(plan.bags):
        for g in members:
            bags.append(plan.bag_label(bag_id))
            gpus.append(str(g))
            index.append(pos[g])
    return bags, gpus, np.asarray(index, dtype=np.int64)


def _check_seq(plan: RoutingPlan, seq: int | None) -> int | None:
    if seq is None:
        return None
    if not 0 <= seq < len(plan.sequences):
        raise KnapformerError(f"sequence {seq} is not in this plan (it has {len(plan.sequences)})")
    return int(seq)


def _title(plan: RoutingPlan, what: str) -> str:
    step = "" if plan.step is None else f" · step {plan.step}"
    return f"{what}{step} · {plan.topology}"


def _figure(data: list[dict], layout: dict, validate: bool) -> go.Figure:
    """A figure from trace and layout dicts. ``validate=False`` skips plotly's per-property
    validation (10x faster; the live dashboard uses it, tests check the specs validate)."""
    layout = {"template": _TEMPLATE, **layout}
    return go.Figure({"data": data, "layout": layout}, _validate=validate)


def bag_load_figure(
    plan: RoutingPlan, highlight_seq: int | None = None, validate: bool = True
) -> go.Figure:
    """Per-GPU load before and after balancing, grouped by bag, with the mean as capacity.

    ``highlight_seq`` marks the GPUs that receive that sequence's chunks (with each chunk's
    share of the workload) and the GPU it starts on.
    """
    seq = _check_seq(plan, highlight_seq)
    groups = gpu_groups(plan)
    if groups is not None:
        return _grouped_load_figure(plan, groups, seq, validate)
    st = plan.stats
    unit = LoadUnit.of(plan)
    bags, gpus, idx = _gpu_axis(plan)
    x = [bags, gpus]
    hover = [f"GPU {g} · {b}" for g, b in zip(gpus, bags, strict=True)]
    value = f"%{{y:,.3r}}{unit.suffix}"  # d3 format: 3 significant figures, thousands commas

    def load_bars(when: str, load, tokens, color: str) -> dict:
        return {
            "type": "bar",
            "x": x,
            "y": load[idx] * unit.factor,
            "name": when,
            "marker": {"color": color},
            "customdata": tokens[idx],
            "hovertext": hover,
            "hovertemplate": f"%{{hovertext}}<br>load {when} {value}<br>%{{customdata:,}} "
            "tokens<extra></extra>",
        }

    data = [
        load_bars("before", st.load_before, st.tokens_before, BEFORE_COLOR),
        load_bars("after", st.load_after, st.tokens_after, AFTER_COLOR),
        {
            "type": "scatter",
            "x": x,
            "y": np.full(len(idx), st.mean_load * unit.factor),
            "mode": "lines",
            "name": f"capacity (mean {unit.format(st.mean_load)})",
            "line": {"color": palette.CAPACITY, "dash": "dash", "width": 2},
            "hoverinfo": "skip",
        },
    ]
    if seq is not None:
        chunks = plan.chunks
        mine = np.flatnonzero(chunks.seq == seq)
        share = chunk_loads(plan, mine) * unit.factor
        label_of = dict(zip(gpus, bags, strict=True))
        dst_labels = [str(int(g)) for g in chunks.dst_gpu[mine]]
        src = str(int(plan.sequences.src_gpu[seq]))
        # Outline the "after" bars of the GPUs that receive a chunk.
        receiving = set(dst_labels)
        data[1]["marker"]["line"] = {
            "color": HIGHLIGHT_COLOR,
            "width": [3 if g in receiving else 0 for g in gpus],
        }
        data += [
            {
                "type": "bar",
                "x": [[label_of[g] for g in dst_labels], dst_labels],
                "y": share,
                "name": f"sequence {seq}",
                "marker": {"color": HIGHLIGHT_COLOR},
                "customdata": np.stack([chunks.offset[mine], chunks.length[mine]], axis=-1),
                "hovertemplate": (
                    f"sequence {seq}: chunk at %{{customdata[0]}}, %{{customdata[1]}} tokens"
                    f"<br>load {value}<extra></extra>"
                ),
                "width": 0.25,
            },
            {
                "type": "scatter",
                "x": [[label_of[src]], [src]],
                "y": [0],
                "mode": "markers",
                "name": f"sequence {seq} source",
                "marker": {"symbol": "triangle-up", "size": 14, "color": HIGHLIGHT_COLOR},
                "hovertemplate": f"sequence {seq} starts here<extra></extra>",
            },
        ]
    layout = {
        "title": {"text": _title(plan, "Load per GPU, grouped by bag")},
        "barmode": "group",
        "bargap": 0.15,
        "yaxis": {"title": {"text": f"modelled {unit.axis_title}"}},
        "xaxis": {"title": {"text": "GPU rank, grouped by bag"}},
        "legend": {"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        "margin": {"l": 60, "r": 20, "t": 70, "b": 60},
    }
    return _figure(data, layout, validate)


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
            "line": {"color": "#2f9e44", "dash": "dash", "width": 2},
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
        "title": {"text": _title(plan, f"Largest GPU load of each group · {groups.note}")},
        "barmode": "group",
        "bargap": 0.15,
        "yaxis": {"title": {"text": f"modelled {unit.axis_title}, most loaded GPU"}},
        "xaxis": {"title": {"text": "bags, in order"}, "type": "category"},
        "legend": {"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        "margin": {"l": 60, "r": 20, "t": 70, "b": 60},
    }
    return _figure(data, layout, validate)


def traffic_figure(
    plan: RoutingPlan, highlight_seq: int | None = None, validate: bool = True
) -> go.Figure:
    """Heatmap of tokens sent from each source GPU (rows) to each destination (columns).

    Colour is log10(1 + tokens) because the diagonal (tokens that stay) dwarfs the rest;
    hovering shows exact counts. ``highlight_seq`` outlines that sequence's chunk cells.
    """
    seq = _check_seq(plan, highlight_seq)
    groups = gpu_groups(plan)
    if groups is None:
        traffic = plan.stats.traffic
        labels = [f"GPU {g}" for g in plan.gpus]
    else:  # never the GPU x GPU matrix of a large plan
        labels = groups.labels
        traffic = plan.stats.traffic_between(groups.of_position, len(labels))
    data = [
        {
            "type": "heatmap",
            "z": np.log10(1.0 + traffic),
            "x": labels,
            "y": labels,
            "customdata": traffic,
            # An explicit list: plotly.js's own "Blues" runs dark to light.
            "colorscale": [[i / 8, c] for i, c in enumerate(plotly.colors.sequential.Blues)],
            "colorbar": {"title": {"text": "log10(1+tokens)"}},
            "hovertemplate": "%{y} → %{x}<br>%{customdata:,} tokens<extra></extra>",
            "name": "traffic",
        }
    ]
    if seq is not None:
        chunks = plan.chunks
        mine = np.flatnonzero(chunks.seq == seq)

        def cell(ranks: np.ndarray) -> list[str]:
            if groups is None:
                return [f"GPU {int(g)}" for g in ranks]
            at = groups.of_position[gpu_positions(plan.gpus)[ranks]]
            return [labels[int(g)] for g in at]

        data.append(
            {
                "type": "scatter",
                "x": cell(chunks.dst_gpu[mine]),
                "y": cell(chunks.src_gpu[mine]),
                "mode": "markers",
                "name": f"sequence {seq}",
                "marker": {
                    "symbol": "square-open",
                    "size": 14,
                    "color": HIGHLIGHT_COLOR,
                    "line": {"width": 3},
                },
                "customdata": chunks.length[mine],
                "hovertemplate": f"sequence {seq}: %{{customdata:,}} tokens<extra></extra>",
            }
        )
    what = "GPU→GPU traffic (tokens)" + ("" if groups is None else f" · {groups.note}")
    layout = {
        "title": {"text": _title(plan, what)},
        "xaxis": {"title": {"text": "destination"}, "type": "category"},
        "yaxis": {"title": {"text": "source"}, "type": "category", "autorange": "reversed"},
        "margin": {"l": 70, "r": 20, "t": 60, "b": 60},
        "showlegend": seq is not None,
    }
    return _figure(data, layout, validate)


# (name, colour, subplot row, hover format) of each timeline trace, in trace order.
_TIMELINE_TRACES = (
    ("before", BEFORE_COLOR, 1, ".3f"),
    ("after", AFTER_COLOR, 1, ".3f"),
    ("moved", palette.MOVED, 2, ".1%"),
    ("plan ms", palette.PLAN_TIME, 3, ".2f"),
)


def timeline_columns(
    summaries: list[StepSummary], start: int = 0
) -> list[tuple[list, list, list[int]]]:
    """(x, y, customdata) of each timeline trace for ``summaries[start:]``, in trace order,
    so a live view can append new steps to a figure it already shows."""
    tail = summaries[start:]
    x = [start + i if s.step is None else s.step for i, s in enumerate(tail)]
    index = list(range(start, start + len(tail)))
    return [
        (x, [s.imbalance_before for s in tail], index),
        (x, [s.imbalance_after for s in tail], index),
        (x, [s.moved_fraction for s in tail], index),
        (x, [s.plan_ms for s in tail], index),
    ]


def timeline_mode(count: int) -> str:
    """Trace mode of a timeline of ``count`` steps: markers only while few, because tens of
    thousands of SVG markers make every redraw of a long run take seconds."""
    return "lines+markers" if count <= _MARKERS_UP_TO else "lines"


def timeline_figure(
    summaries: list[StepSummary], selected_step: int | None = None, validate: bool = True
) -> go.Figure:
    """Imbalance before/after, moved-token fraction and planning time over steps.

    Three stacked panels sharing one x axis (step). Every point's ``customdata`` is its
    index in ``summaries`` (click → select). ``selected_step`` is an index into
    ``summaries``; it is marked with a vertical line across the panels.
    """
    mode = timeline_mode(len(summaries))
    data = []
    for (name, color, row, fmt), (x, y, index) in zip(
        _TIMELINE_TRACES, timeline_columns(summaries), strict=True
    ):
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
                "hovertemplate": f"step %{{x}}<br>{name} %{{y:{fmt}}}<extra></extra>",
                "xaxis": "x",
                "yaxis": "y" if row == 1 else f"y{row}",
            }
        )
    domains = {1: [0.70, 1.0], 2: [0.37, 0.63], 3: [0.0, 0.30]}
    titles = ("imbalance (max / mean load)", "moved tokens", "planning time (ms)")
    layout = {
        "height": 430,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 40},
        "hovermode": "x",
        "clickmode": "event",
        "legend": {"orientation": "h", "y": 1.06, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        "xaxis": {"anchor": "y3", "title": {"text": "step"}},
        "yaxis": {"domain": domains[1], "anchor": "x"},
        "yaxis2": {"domain": domains[2], "anchor": "x", "tickformat": ".1%"},
        "yaxis3": {"domain": domains[3], "anchor": "x"},
        "annotations": [
            {
                "text": title,
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": domains[row][1],
                "xanchor": "center",
                "yanchor": "bottom",
                "font": {"size": 13},
            }
            for row, title in enumerate(titles, start=1)
        ],
        "shapes": selection_shapes(summaries, selected_step),
    }
    return _figure(data, layout, validate)


def selection_shapes(summaries: list[StepSummary], selected: int | None) -> list[dict]:
    """The vertical line marking the selected index on the timeline (empty when none)."""
    if selected is None or not 0 <= selected < len(summaries):
        return []
    s = summaries[selected]
    x = selected if s.step is None else s.step
    return [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": x,
            "x1": x,
            "y0": 0,
            "y1": 1,
            "line": {"color": HIGHLIGHT_COLOR, "width": 2},
        }
    ]


def measured_phase(plan: RoutingPlan) -> str | None:
    """The phase of ``measurements.per_rank_ms`` compared with the model (None: none).

    The phase that stands for compute (`Measurements.compute_phase`, as calibration
    picks it); a plan that measured none of those shows its first measured phase.
    """
    if plan.measurements is None or not plan.measurements.per_rank_ms:
        return None
    return plan.measurements.compute_phase() or next(iter(plan.measurements.per_rank_ms))


def stragglers(plan: RoutingPlan) -> list[int]:
    """GPU ranks whose measured time per unit of predicted load exceeds the median by 15%."""
    phase = measured_phase(plan)
    if phase is None:
        return []
    measured = np.asarray(plan.measurements.per_rank_ms[phase], dtype=np.float64)
    predicted = plan.stats.load_after
    ok = predicted > 0
    if not ok.any():
        return []
    ratio = np.where(ok, measured / np.where(ok, predicted, 1.0), np.nan)
    median = float(np.nanmedian(ratio))
    slow = ok & (ratio > median * _STRAGGLER_FACTOR)
    return [int(plan.gpus[i]) for i in np.flatnonzero(slow)]


def predicted_vs_measured_figure(plan: RoutingPlan, validate: bool = True) -> go.Figure | None:
    """Predicted load after balancing vs measured time per GPU (None without measurements).

    The dashed line is measured = k · predicted with k the median ratio; GPUs above it by
    more than 15% are drawn as stragglers — slow for a reason the model does not explain.
    """
    phase = measured_phase(plan)
    if phase is None:
        return None
    st = plan.stats
    measured = np.asarray(plan.measurements.per_rank_ms[phase], dtype=np.float64)
    predicted = st.load_after
    slow = set(stragglers(plan))
    labels = [
        f"GPU {g} ({plan.bag_label(b)})"
        for g, b in zip(plan.gpus, st.gpu_bag.tolist(), strict=True)
    ]
    is_slow = np.array([g in slow for g in plan.gpus], dtype=bool)
    data = []
    for name, mask, color, symbol in (
        ("GPU", ~is_slow, AFTER_COLOR, "circle"),
        ("straggler", is_slow, HIGHLIGHT_COLOR, "x"),
    ):
        if mask.any():
            data.append(
                {
                    "type": "scatter",
                    "x": predicted[mask],
                    "y": measured[mask],
                    "text": [lbl for lbl, m in zip(labels, mask, strict=True) if m],
                    "mode": "markers",
                    "name": name,
                    "marker": {"color": color, "size": 9, "symbol": symbol},
                    "hovertemplate": (
                        "%{text}<br>predicted %{x:.4g}<br>measured %{y:.2f} ms<extra></extra>"
                    ),
                }
            )
    ok = predicted > 0
    if ok.any():
        k = float(np.median(measured[ok] / predicted[ok]))
        top = float(predicted.max())
        data.append(
            {
                "type": "scatter",
                "x": [0, top],
                "y": [0, k * top],
                "mode": "lines",
                "name": f"model fit ({k:.3g} ms per unit)",
                "line": {"dash": "dash", "color": palette.MODEL_FIT},
                "hoverinfo": "skip",
            }
        )
    layout = {
        "title": {"text": _title(plan, f"Predicted load vs measured {phase} time")},
        "xaxis": {"title": {"text": "predicted load after balancing"}},
        "yaxis": {"title": {"text": f"measured {phase} (ms)"}},
        "margin": {"l": 60, "r": 20, "t": 60, "b": 50},
    }
    return _figure(data, layout, validate)


def sequence_rows(plan: RoutingPlan) -> list[dict]:
    """One row per sequence: id, src_gpu, length, workload, bag, chunks, destinations.

    ``workload`` is in the plan's display unit (`LoadUnit`, 3 significant figures);
    ``destinations`` lists the destination GPU of each chunk in offset order, e.g. "4 5 6 7".
    """
    unit = LoadUnit.of(plan)
    seqs, chunks = plan.sequences, plan.chunks
    n = len(seqs)
    order = np.lexsort((chunks.offset, chunks.seq))
    counts = np.bincount(chunks.seq, minlength=n)
    starts = np.concatenate([[0], np.cumsum(counts)])
    dst = chunks.dst_gpu[order].tolist()
    src, length, workload, bag = (
        seqs.src_gpu.tolist(),
        seqs.length.tolist(),
        seqs.workload.tolist(),
        seqs.bag.tolist(),
    )
    return [
        {
            "id": i,
            "src_gpu": src[i],
            "length": length[i],
            "workload": round_significant(workload[i] * unit.factor),
            "bag": bag[i],
            "chunks": int(counts[i]),
            "destinations": " ".join(str(g) for g in dst[starts[i] : starts[i + 1]]),
        }
        for i in range(n)
    ]
