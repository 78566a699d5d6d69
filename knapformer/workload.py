"""The DiT workload model: cost of a sequence of L tokens.

``workload(L) = scale * (24*L*d^2 + gamma*4*L^2*d) / 1e12``: the linear layers grow with
L, attention with L^2, and gamma weighs attention against the linear layers. With the
default ``scale=1`` the unit is TFLOP-like; ``calibrate`` fits ``scale`` and ``gamma`` so
that workloads predict measured latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class WorkloadModel:
    token_dim: int
    gamma: float = 0.4
    scale: float = 1.0

    def __post_init__(self) -> None:
        if int(self.token_dim) <= 0:
            raise ValueError(f"token_dim must be positive, got {self.token_dim}")
        if not np.isfinite(self.gamma) or self.gamma < 0:
            raise ValueError(f"gamma must be finite and >= 0, got {self.gamma}")
        if not np.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"scale must be finite and > 0, got {self.scale}")

    def workload(self, lengths: ArrayLike) -> np.ndarray:
        """Workload of each length; shape of ``lengths``, float64."""
        length = np.asarray(lengths, dtype=np.float64)
        d = float(self.token_dim)
        return self.scale * (24.0 * length * d * d + self.gamma * 4.0 * length * length * d) / 1e12

    @classmethod
    def calibrate(
        cls, lengths: ArrayLike, latencies: ArrayLike, token_dim: int
    ) -> tuple[WorkloadModel, float]:
        """Least-squares fit of ``scale`` and ``gamma`` from (length, latency) pairs.

        latency ~= a * linear(L) + b * attention(L) with a = scale, b = scale * gamma, a
        linear problem. Returns the model and its relative RMS error (RMS residual divided
        by the mean latency).
        """
        length = np.asarray(lengths, dtype=np.float64).ravel()
        latency = np.asarray(latencies, dtype=np.float64).ravel()
        if length.shape != latency.shape:
            raise ValueError(
                f"got {length.size} lengths but {latency.size} latencies; they must pair up"
            )
        if length.size < 2:
            raise ValueError("calibration needs at least 2 (length, latency) pairs")
        if not (np.isfinite(length).all() and np.isfinite(latency).all()):
            raise ValueError("lengths and latencies must be finite numbers")
        if np.unique(length[length > 0]).size < 2:
            raise ValueError("calibration needs at least 2 distinct positive lengths")
        d = float(token_dim)
        linear = 24.0 * length * d * d / 1e12
        attention = 4.0 * length * length * d / 1e12
        design = np.stack([linear, attention], axis=1)
        # Column scaling keeps the normal equations well conditioned.
        norms = np.linalg.norm(design, axis=0)
        norms[norms == 0] = 1.0
        coef, *_ = np.linalg.lstsq(design / norms, latency, rcond=None)
        a, b = coef / norms
        if a <= 0:
            raise ValueError(
                "the fit gives a non-positive linear term; the measurements do not grow "
                "with length as the model expects"
            )
        b = max(b, 0.0)  # attention cost cannot be negative
        model = cls(token_dim=int(token_dim), gamma=float(b / a), scale=float(a))
        residual = model.workload(length) - latency
        mean = float(np.mean(np.abs(latency))) or 1.0
        error = float(np.sqrt(np.mean(residual**2)) / mean)
        return model, error
