import numpy as np
import pytest

from knapformer.planning.workload import WorkloadModel, fit_scale_gamma


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


def test_terms_split_the_workload():
    model = WorkloadModel(token_dim=512, gamma=0.3, scale=2.0)
    lengths = np.array([[0, 7], [300, 9000]])
    linear, attention = model.terms(lengths)
    assert linear.shape == attention.shape == (2, 2)
    np.testing.assert_allclose(linear, 24 * lengths * 512.0**2 / 1e12)
    np.testing.assert_allclose(attention, 4 * lengths.astype(float) ** 2 * 512 / 1e12)
    np.testing.assert_allclose(model.workload(lengths), 2.0 * (linear + 0.3 * attention))


def test_fit_minimises_relative_residuals():
    """Noise proportional to the time: the fit is the relative least-squares optimum (zero
    gradient of sum(((fit - t) / t)^2)), not the absolute one, which differs here."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(64, 16384, size=300)
    truth = WorkloadModel(token_dim=256, gamma=0.5, scale=3.0)
    latencies = truth.workload(lengths) * rng.normal(1.0, 0.1, size=lengths.size)
    linear, attention = truth.terms(lengths)
    scale, gamma, _ = fit_scale_gamma(linear, attention, latencies)
    a, b = scale, scale * gamma
    rel = (a * linear + b * attention - latencies) / latencies
    grad = np.array([np.sum(rel * linear / latencies), np.sum(rel * attention / latencies)])
    scale_free = np.array(
        [np.sum(np.abs(linear / latencies)), np.sum(np.abs(attention / latencies))]
    )
    assert np.all(np.abs(grad) < 1e-9 * scale_free)
    absolute = np.linalg.lstsq(np.stack([linear, attention], axis=1), latencies, rcond=None)[0]
    assert abs(absolute[0] - a) > 1e-3 * a  # the two objectives really disagree here
    # One fit: WorkloadModel.calibrate is the same fit on per-sequence terms.
    model, _ = WorkloadModel.calibrate(lengths, latencies, token_dim=256)
    assert (model.scale, model.gamma) == pytest.approx((scale, gamma), rel=1e-12)


def test_calibrate_rejects_bad_input():
    with pytest.raises(ValueError, match="pair up"):
        WorkloadModel.calibrate([1, 2, 3], [1.0, 2.0], token_dim=64)
    with pytest.raises(ValueError, match="distinct"):
        WorkloadModel.calibrate([5, 5, 5], [1.0, 1.0, 1.0], token_dim=64)
    with pytest.raises(ValueError, match="token_dim"):
        WorkloadModel(token_dim=0)
    with pytest.raises(ValueError, match="times must be > 0"):
        WorkloadModel.calibrate([5, 6, 7], [1.0, 0.0, 1.0], token_dim=64)
