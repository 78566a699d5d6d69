"""The calibration figures of visualization/calibration.py."""

from __future__ import annotations

import numpy as np
import pytest
from knapformer.visualization.calibration import length_fit_figure

from knapformer.planning.workload import WorkloadModel


def test_length_fit_shows_the_points_and_the_model_split_into_its_parts():
    model = WorkloadModel(token_dim=3072, gamma=0.6, scale=12.5)
    lengths = np.array([256.0, 1024.0, 8192.0, 32768.0])
    measured = model.workload(lengths) * np.array([1.1, 0.95, 1.0, 1.02])
    fig = length_fit_figure(lengths, measured, model, title="H100")
    points, fit, linear, attention = fig.data
    assert points.x.tolist() == lengths.tolist() and points.y.tolist() == measured.tolist()
    grid = np.asarray(fit.x)
    assert grid[0] == lengths.min() and grid[-1] == pytest.approx(lengths.max())
    assert np.asarray(fit.y) == pytest.approx(model.workload(grid), rel=1e-12)
    assert np.asarray(linear.y) + np.asarray(attention.y) == pytest.approx(np.asarray(fit.y))
    # attention grows with L², the linear layers with L: attention overtakes at large L
    share = np.asarray(attention.y) / np.asarray(fit.y)
    assert np.all(np.diff(share) > 0)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert "γ = 0.6" in fig.layout.title.text and fig.layout.title.text.startswith("H100")
