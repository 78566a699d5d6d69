import numpy as np
import pytest

from knapformer.workload import WorkloadModel


def test_workload_formula_is_vectorised():
    model = WorkloadModel(token_dim=3072, gamma=0.4)
    lengths = np.array([0, 1, 1000, 16384])
    d = 3072.0
    expected = (24 * lengths * d * d + 0.4 * 4 * lengths.astype(float) ** 2 * d) / 1e12
    np.testing.assert_allclose(model.workload(lengths), expected, rtol=1e-12)
    assert model.workload(lengths).shape == (4,)


def test_calibrate_recovers_scale_and_gamma_from_noisy_measurements():
    rng = np.random.default_rng(0)
    truth = WorkloadModel(token_dim=1024, gamma=0.7, scale=2.5e-3)
    lengths = rng.integers(256, 32768, size=400)
    latencies = truth.workload(lengths) * rng.normal(1.0, 0.02, size=lengths.size)
    model, error = WorkloadModel.calibrate(lengths, latencies, token_dim=1024)
    assert model.gamma == pytest.approx(0.7, rel=0.05)
    assert model.scale == pytest.approx(2.5e-3, rel=0.05)
    assert 0.005 < error < 0.05  # about the injected 2 % noise


def test_calibrate_rejects_bad_input():
    with pytest.raises(ValueError, match="pair up"):
        WorkloadModel.calibrate([1, 2, 3], [1.0, 2.0], token_dim=64)
    with pytest.raises(ValueError, match="distinct"):
        WorkloadModel.calibrate([5, 5, 5], [1.0, 1.0, 1.0], token_dim=64)
    with pytest.raises(ValueError, match="token_dim"):
        WorkloadModel(token_dim=0)
