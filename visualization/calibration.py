"""Figures of a workload-model calibration: predicted vs measured (``knapformer calibrate
--plot``; one point per measurement, the y = x line of a perfect model), and measured
time against sequence length with the fitted curve (``bench/gpu.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from knapformer.visualization import palette

if TYPE_CHECKING:
    from knapformer.planning.workload import WorkloadModel
    from knapformer.tools.calibrate import Calibration


def calibration_figure(cal: Calibration, title: str | None = None) -> go.Figure:
    """Scatter of predicted (x) vs measured (y) ms with the y = x line, on log axes: equal
    distances from the line are equal relative errors, at 1 ms as at 1 s. The title says
    when the fit is not usable (`Calibration.unusable_reason`)."""
    measured = np.asarray(cal.measured, dtype=np.float64)
    predicted = np.asarray(cal.predicted, dtype=np.float64)
    fig = go.Figure()
    fig.add_scatter(
        x=predicted,
        y=measured,
        text=list(cal.labels),
        mode="markers",
        name="measurement",
        marker={"size": 7, "color": palette.MEASURED, "opacity": 0.8},
        hovertemplate="%{text}<br>predicted %{x:.3f} ms<br>measured %{y:.3f} ms<extra></extra>",
    )
    both = np.concatenate([measured, predicted])
    positive = both[both > 0]
    low, top = (float(positive.min()), float(positive.max())) if positive.size else (1.0, 1.0)
    fig.add_scatter(
        x=[low, top],
        y=[low, top],
        mode="lines",
        name="perfect model (y = x)",
        line={"dash": "dash", "color": palette.MODEL_FIT},
        hoverinfo="skip",
    )
    what = "per sequence" if cal.source == "csv" else f"per GPU, phase {cal.phase}"
    heading = (
        f"Calibration ({what}): k = {cal.scale:.4g} ms/unit, γ = {cal.gamma:.3g}, "
        f"rel. RMS error {cal.rel_rms_error:.1%}, R² = {cal.r2:.2f}"
    )
    if cal.unusable_reason is not None:
        heading += " — NOT USABLE"
    return _log_log(fig, heading, title, "predicted (ms)", "measured (ms)")


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
        marker={"size": 9, "color": palette.MEASURED},
        hovertemplate="L = %{x:.0f}<br>%{y:.4g} ms<extra></extra>",
    )
    parts = (
        ("fit", model.workload(grid), {"color": palette.MODEL_FIT, "width": 2}),
        ("linear layers", model.scale * linear, {"color": palette.LINEAR_PART, "dash": "dot"}),
        (
            "attention",
            model.scale * model.gamma * attention,
            {"color": palette.ATTENTION_PART, "dash": "dash"},
        ),
    )
    for name, values, line in parts:
        fig.add_scatter(x=grid, y=values, mode="lines", name=name, line=line, hoverinfo="skip")
    heading = (
        f"d = {model.token_dim}: γ = {model.gamma:.3g}, scale = {model.scale:.4g} ms per "
        "workload unit"
    )
    return _log_log(fig, heading, title, "sequence length (tokens)", "ms per sequence")


def _log_log(fig: go.Figure, heading: str, title: str | None, x: str, y: str) -> go.Figure:
    """``fig`` with log axes titled ``x`` and ``y``, and ``heading`` (the fit's figures)
    after the caller's ``title``, if any."""
    fig.update_layout(
        title=heading if title is None else f"{title} — {heading}",
        xaxis={"title": x, "type": "log"},
        yaxis={"title": y, "type": "log"},
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 60, "b": 50},
    )
    return fig
