"""Predicted-vs-measured figure of a workload-model calibration (``knapformer calibrate
--plot``): one point per measurement, the y = x line of a perfect model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

if TYPE_CHECKING:
    from knapformer.tools.calibrate import Calibration


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
