"""Figures of a workload-model calibration: predicted vs measured (``knapformer calibrate
--plot``; one point per measurement, the y = x line of a perfect model), and measured
time against sequence length with the fitted curve (``bench/gpu.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

if TYPE_CHECKING:
    from knapformer.tools.calibrate import Calibration
    from knapformer.workload import WorkloadModel


def calibration_figure(cal: Calibration, title: str | None = None) -> go.Figure:
    """Scatter of predicted (x) vs measured (y) ms with the y = x line."""
    measured = np.asarray(cal.measured, dtype=np.float64)
    predicted = np.asarray(cal.predicted, dtype=np.float64)
    fig = go.Figure()
    fig.add_scatter(
        x=predicted,
        y=measured,
        text=list(cal.labels),
        mode="markers",
        name="measurement",
        marker={"size": 7, "color": "#1c7ed6", "opacity": 0.8},
        hovertemplate="%{text}<br>predicted %{x:.3f} ms<br>measured %{y:.3f} ms<extra></extra>",
    )
    top = float(max(measured.max(initial=0.0), predicted.max(initial=0.0)))
    fig.add_scatter(
        x=[0.0, top],
        y=[0.0, top],
        mode="lines",
        name="perfect model (y = x)",
        line={"dash": "dash", "color": "#2f9e44"},
        hoverinfo="skip",
    )
    what = "per sequence" if cal.source == "csv" else f"per GPU, phase {cal.phase}"
    heading = (
        f"Calibration ({what}): k = {cal.scale:.4g} ms/unit, γ = {cal.gamma:.3g}, "
        f"rel. RMS error {cal.rel_rms_error:.1%}"
    )
    fig.update_layout(
        title=heading if title is None else f"{title} — {heading}",
        xaxis_title="predicted (ms)",
        yaxis_title="measured (ms)",
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 60, "b": 50},
    )
    return fig


def length_fit_figure(
    lengths: np.ndarray, measured_ms: np.ndarray, model: WorkloadModel, title: str | None = None
) -> go.Figure:
    """Measured ms per sequence against its length (log-log), with the fitted model and
    its two parts: linear layers ``scale·24·L·d²/1e12`` and attention
    ``scale·γ·4·L²·d/1e12``. ``lengths`` and ``measured_ms`` are (n,) and pair up."""
    lengths = np.asarray(lengths, dtype=np.float64)
    measured = np.asarray(measured_ms, dtype=np.float64)
    grid = np.geomspace(lengths.min(), lengths.max(), 64)
    linear, attention = model.terms(grid)
    fig = go.Figure()
    fig.add_scatter(
        x=lengths,
        y=measured,
        mode="markers",
        name="measured",
        marker={"size": 9, "color": "#1c7ed6"},
        hovertemplate="L = %{x:.0f}<br>%{y:.4g} ms<extra></extra>",
    )
    parts = (
        ("fit", model.workload(grid), {"color": "#2f9e44", "width": 2}),
        ("linear layers", model.scale * linear, {"color": "#868e96", "dash": "dot"}),
        ("attention", model.scale * model.gamma * attention, {"color": "#e8590c", "dash": "dash"}),
    )
    for name, values, line in parts:
        fig.add_scatter(x=grid, y=values, mode="lines", name=name, line=line, hoverinfo="skip")
    heading = (
        f"d = {model.token_dim}: γ = {model.gamma:.3g}, scale = {model.scale:.4g} ms per "
        "workload unit"
    )
    fig.update_layout(
        title=heading if title is None else f"{title} — {heading}",
        xaxis={"title": "sequence length (tokens)", "type": "log"},
        yaxis={"title": "ms per sequence", "type": "log"},
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 60, "b": 50},
    )
    return fig
