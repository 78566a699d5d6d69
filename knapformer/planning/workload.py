"""The DiT workload model: cost of a sequence of L tokens.

``workload(L) = scale * (24*L*d^2 + gamma*4*L^2*d) / 1e12``: the linear layers grow with
L, attention with L^2, and gamma weighs attention against the linear layers. With the
default ``scale=1`` the unit is TFLOP-like (``unit="model"``); ``calibrate`` (and
`fit_scale_gamma`, the same relative least-squares fit on per-GPU sums of
`WorkloadModel.terms`) fits ``scale`` and ``gamma`` so that workloads predict measured
latencies, and the model it returns says so (``unit="ms"``).

Under Ulysses sequence parallelism a GPU of a g-GPU bag runs the linear layers on the c
tokens of the chunk it holds and attention on the whole sequence for H/g of the heads, so
its cost for a sequence of L tokens is ``scale * (24*c*d^2 + gamma*4*L^2*d/g) / 1e12``
(`chunk_cost`); the g chunks add up to the workload. See docs/concepts.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from knapformer.contract.limits import MAX_TOKEN_DIM, check_count
from knapformer.errors import KnapformerError


@dataclass(frozen=True)
class WorkloadModel:
    token_dim: int
    gamma: float = 0.4
    scale: float = 1.0
    #: What a workload is measured in: "ms" once ``scale`` is a calibrated time scale.
    unit: Literal["model", "ms"] = "model"

    def __post_init__(self) -> None:
        if int(self.token_dim) <= 0:
            raise KnapformerError(f"token_dim must be positive, got {self.token_dim}")
        check_count(int(self.token_dim), MAX_TOKEN_DIM, "token_dim")
        if not np.isfinite(self.gamma) or self.gamma < 0:
            raise KnapformerError(f"gamma must be finite and >= 0, got {self.gamma}")
        if not np.isfinite(self.scale) or self.scale <= 0:
            raise KnapformerError(f"scale must be finite and > 0, got {self.scale}")
        if self.unit not in ("model", "ms"):
            raise KnapformerError(f"unit must be 'model' or 'ms', got {self.unit!r}")

    def terms(self, lengths: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(linear, attention) cost terms of each length, each of ``lengths``' shape, float64.

        ``linear = 24*L*d^2/1e12`` and ``attention = 4*L^2*d/1e12``, so that
        ``workload = scale * (linear + gamma * attention)``. Calibration fits ``scale`` and
        ``gamma`` on these terms (summed per GPU when a GPU computes several sequences).
        """
        length = np.asarray(lengths, dtype=np.float64)
        d = float(self.token_dim)
        return 24.0 * length * d * d / 1e12, 4.0 * length * length * d / 1e12

    def workload(self, lengths: ArrayLike) -> np.ndarray:
        """Workload of each length; shape of ``lengths``, float64.

        Evaluated as the published formula is written (not as ``scale * (linear + gamma *
        attention)`` from `terms`): the rounding then matches other implementations of
        it bit for bit, which greedy's near-ties depend on.
        """
        length = np.asarray(lengths)
        if length.dtype.kind not in "iu":
            length = length.astype(np.float64)
        # Integer lengths are cast inside each product (the same values as a float copy of
        # them, one step-sized array fewer: its pages cost ~0.5 ms at 4,096 GPUs).
        d = float(self.token_dim)
        # ``scale * (24*L*d*d + gamma*4*L*L*d) / 1e12``, step by step in that order (the same
        # roundings), into two arrays rather than one temporary per operation.
        linear = np.multiply(24.0, length)
        linear *= d
        linear *= d
        attention = np.multiply(self.gamma * 4.0, length)
        attention *= length
        attention *= d
        linear += attention
        linear *= self.scale
        linear /= 1e12
        return linear

    def linear_share(self, lengths: ArrayLike) -> np.ndarray:
        """Fraction of each length's workload spent in the linear layers (the rest is
        attention): ``24*d / (24*d + 4*gamma*L)``; shape of ``lengths``, float64 in (0, 1]."""
        length = np.asarray(lengths, dtype=np.float64)
        d = float(self.token_dim)
        return 24.0 * d / (24.0 * d + 4.0 * self.gamma * length)

    def chunk_cost(self, seq_lengths: ArrayLike, chunk_lengths: ArrayLike, bag_sizes: ArrayLike):
        """Cost on one GPU of a chunk of c tokens of a sequence of L tokens in a bag of g GPUs
        under Ulysses: ``scale * (24*c*d^2 + gamma*4*L^2*d/g) / 1e12``. Arguments broadcast
        (e.g. each (n,)); float64. The g chunks of a sequence add up to its workload."""
        seq = np.asarray(seq_lengths, dtype=np.float64)
        chunk = np.asarray(chunk_lengths, dtype=np.float64)
        g = np.asarray(bag_sizes, dtype=np.float64)
        d = float(self.token_dim)
        return self.scale * (24.0 * chunk * d * d + self.gamma * 4.0 * seq * seq * d / g) / 1e12

    @classmethod
    def calibrate(
        cls, lengths: ArrayLike, latencies: ArrayLike, token_dim: int
    ) -> tuple[WorkloadModel, float]:
        """Fit ``scale`` and ``gamma`` from (length, latency) pairs (see `fit_scale_gamma`).

        ``lengths`` and ``latencies`` are (n,) and pair up; latencies must be > 0. Returns
        the model and its relative RMS error (RMS residual divided by the mean latency).
        """
        length = np.asarray(lengths, dtype=np.float64).ravel()
        latency = np.asarray(latencies, dtype=np.float64).ravel()
        if length.shape != latency.shape:
            raise KnapformerError(
                f"got {length.size} lengths but {latency.size} latencies; they must pair up"
            )
        if not np.isfinite(length).all():
            raise KnapformerError("lengths must be finite numbers")
        if np.unique(length[length > 0]).size < 2:
            raise KnapformerError("calibration needs at least 2 distinct positive lengths")
        linear, attention = cls(token_dim=int(token_dim)).terms(length)
        scale, gamma, error = fit_scale_gamma(linear, attention, latency)
        return cls(token_dim=int(token_dim), gamma=gamma, scale=scale, unit="ms"), error


def fit_scale_gamma(
    linear: ArrayLike, attention: ArrayLike, latencies: ArrayLike
) -> tuple[float, float, float]:
    """Fit ``latency ~= scale * (linear + gamma * attention)``; returns (scale, gamma, error).

    ``linear``, ``attention`` and ``latencies`` are (n,): the `WorkloadModel.terms` of each
    measured item (a sequence, or the sum over what one GPU computes) and its time.
    ``error`` is the relative RMS error: RMS residual divided by the mean latency.

    The problem is linear in ``(a, b) = (scale, scale * gamma)``. It minimises the
    *relative* residuals ``sum(((fit - latency) / latency)**2)`` rather than the absolute
    ones: timing noise grows with the time, so plain least squares would let the few
    longest items (where attention dominates) decide alone and leave the linear term,
    which dominates short items, to chance.
    """
    lin = np.asarray(linear, dtype=np.float64).ravel()
    att = np.asarray(attention, dtype=np.float64).ravel()
    latency = np.asarray(latencies, dtype=np.float64).ravel()
    if not lin.shape == att.shape == latency.shape:
        raise KnapformerError(
            f"got {lin.size} linear terms, {att.size} attention terms and {latency.size} "
            "measured times; they must pair up"
        )
    if latency.size < 2:
        raise KnapformerError("calibration needs at least 2 measured times")
    if not (np.isfinite(lin).all() and np.isfinite(att).all() and np.isfinite(latency).all()):
        raise KnapformerError("measured times and workload terms must be finite numbers")
    if (latency <= 0).any():
        i = int(np.flatnonzero(latency <= 0)[0])
        raise KnapformerError(f"measured time #{i + 1} is {latency[i]:g} ms; times must be > 0")
    design = np.stack([lin, att], axis=1) / latency[:, None]
    # Column scaling keeps the least-squares problem well conditioned.
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    coef, *_ = np.linalg.lstsq(design / norms, np.ones_like(latency), rcond=None)
    a, b = coef / norms
    if not a > 0:
        raise KnapformerError(
            "the fit gives a non-positive time per linear-layer FLOP; the measured times do "
            "not grow with the workload as the model expects"
        )
    gamma = max(float(b), 0.0) / float(a)  # attention cost cannot be negative
    residual = float(a) * (lin + gamma * att) - latency
    mean = float(np.mean(np.abs(latency)))
    return float(a), gamma, float(np.sqrt(np.mean(residual**2)) / mean)
