"""The affine compute model: a rank's measured compute is a fixed overhead plus its rate
times the work the plan gave it, fitted over a window of steps.

    compute[i, s] = scale[s] * (overhead + rate[i] * work[i, s])

- ``work[i, s]``: the work the plan gave rank i in step s at nominal speed
  (`knapformer.contract.stats.PlanStats.work_after`), in any unit;
- ``overhead``: what every step costs every rank whatever its work (kernel launches,
  norms, the optimizer, Python), in the same unit as the work, shared by the group;
- ``rate[i]``: rank i's time per unit of work relative to the group's (the median rank
  is 1; 2 = it takes twice as long per unit of work);
- ``scale[s]``: ms per unit of work in step s. It is fitted per step because the
  machine's load moves every rank alike (another job, a busy host): dividing it out
  leaves what sets one rank apart from its peers.

Why affine: a ratio ``compute / work`` (a line through the origin) makes a rank given
little work look slow (its fixed overhead is divided by little work) and a rank given a
lot look fast, whatever its hardware.

The fit (`fit_compute`) is robust to a minority of slow ranks: for each candidate
overhead on a grid, every step's scale is the median over ranks of
``compute / (overhead + work)``, each rank's **cost ratio** is the median over steps of
``compute / (scale · (overhead + work))``, and the overhead kept is the one whose cost
ratios stay closest to 1 for most ranks (squared log, capped at `OUTLIER` so a slow
rank weighs no more than any other misfit). Then ``rate[i]`` is the median over steps of
``(compute / scale - overhead) / work``, divided by the median rank's.

The overhead is separable only where work differs between ranks of a step by at least
`SEPARATION` (the fit then has two points of one line to go on). Where no step's work
differs that much the overhead is taken as 0 and `ComputeFit.separable` is False: with
equal work the overhead cannot change which rank is slow.

Pure numpy: the history cost model (`knapformer.planning.history`) learns speeds from it,
the straggler diagnosis (`knapformer.diagnosis.stragglers`) judges ranks by it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

#: Work of ranks in one step must differ by this much (relative to the step's median
#: work) for the fixed overhead to be told apart from the rate.
SEPARATION = 0.1
#: A rank whose cost ratio is off by more than this factor counts as a fixed misfit.
OUTLIER = 1.1
#: Candidate overheads, relative to the median work of a rank in a step: 0, then 0.001x to
#: `MAX_OVERHEAD` on a log grid.
_GRID = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 61)])  # x MAX_OVERHEAD
#: The largest overhead the fit considers: as much as the median rank's work, i.e. half
#: its compute. Beyond it a rank's rate is the small difference of two large numbers
#: (noise), and once the history cost model has equalised every rank's compute, a huge
#: overhead would "explain" equal times for unequal work and hide the slow rank.
MAX_OVERHEAD = 1.0


@dataclass(frozen=True)
class ComputeFit:
    """An affine fit of a window: ``ranks`` rows (positions given to `fit_compute`) by
    ``steps`` columns. NaN marks a rank with no usable figure."""

    overhead: float  # in work units, shared by the group
    overhead_ms: float  # median over the steps of scale[s] * overhead
    separable: bool  # False: overhead taken as 0 (see the module doc)
    note: str  # one line on how the overhead was found
    scale_ms: np.ndarray  # (s,) ms per unit of work in each step
    rate: np.ndarray  # (r,) median rate relative to the group's (1 = typical)
    cost: np.ndarray  # (r,) median of measured / predicted compute (1 = as predicted)
    rate_steps: np.ndarray  # (r, s) the rate in each step
    predicted_ms: np.ndarray  # (r, s) compute a rank at the group's rate would take

    @property
    def speed(self) -> np.ndarray:
        """(r,) relative speed, the inverse of the rate (1 where unknown)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            speed = 1.0 / self.rate
        return np.where(np.isfinite(speed) & (speed > 0), speed, 1.0)

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None)."""
        return {
            "overhead": self.overhead,
            "overhead_ms": _plain(self.overhead_ms),
            "separable": self.separable,
            "note": self.note,
            "rate": [_plain(v) for v in self.rate.tolist()],
            "cost": [_plain(v) for v in self.cost.tolist()],
        }


def fit_compute(work: ArrayLike, compute_ms: ArrayLike) -> ComputeFit:
    """Fit the affine model to ``work`` (r, s) and ``compute_ms`` (r, s), rank by step.

    A figure with work <= 0, compute <= 0 or either not finite is left out. A window with
    no usable figure gives rates and costs of NaN."""
    w = np.asarray(work, dtype=np.float64)
    c = np.asarray(compute_ms, dtype=np.float64)
    if w.ndim == 1:
        w, c = w[:, None], c[:, None]
    if w.shape != c.shape:
        raise ValueError(f"work {w.shape} and compute {c.shape} differ in shape")
    valid = np.isfinite(w) & np.isfinite(c) & (w > 0) & (c > 0)
    w, c = np.where(valid, w, np.nan), np.where(valid, c, np.nan)
    r, s = w.shape
    if not valid.any():
        nan_r, nan_s = np.full(r, np.nan), np.full(s, np.nan)
        return ComputeFit(0.0, 0.0, False, "no measured step", nan_s, nan_r, nan_r,
                          np.full((r, s), np.nan), np.full((r, s), np.nan))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN, on purpose
        typical = np.nanmedian(w, axis=0)  # (s,)
        spread = np.nanmax(np.abs(w / typical - 1.0), axis=0)  # (s,)
        separable = bool(np.nansum(spread >= SEPARATION) >= 1)
        if separable:
            grid = _GRID * float(np.nanmedian(typical))
            losses = np.array([_loss(w, c, a) for a in grid])
            overhead = _middle_of_best(grid, losses)
            note = (
                f"overhead fitted: work differs by >= {SEPARATION:.0%} between ranks in "
                f"{int(np.sum(spread >= SEPARATION))} of {s} step(s)"
            )
        else:
            overhead = 0.0
            note = (
                f"overhead not separable: in every step each rank's work is within "
                f"{SEPARATION:.0%} of the median (taken as 0; with equal work it does not "
                "change which rank is slow)"
            )
        scale = _scale(w, c, overhead)  # (s,)
        predicted = scale * (overhead + w)  # (r, s)
        cost_steps = c / predicted
        rate_steps = (c / scale - overhead) / w
        rate = np.nanmedian(rate_steps, axis=1)
        typical_rate = np.nanmedian(rate)
        if np.isfinite(typical_rate) and typical_rate > 0:
            rate, rate_steps = rate / typical_rate, rate_steps / typical_rate
        cost = np.nanmedian(cost_steps, axis=1)
        overhead_ms = float(np.nanmedian(scale * overhead))
    return ComputeFit(
        overhead=float(overhead),
        overhead_ms=overhead_ms,
        separable=separable,
        note=note,
        scale_ms=scale,
        rate=rate,
        cost=cost,
        rate_steps=rate_steps,
        predicted_ms=predicted,
    )


def _scale(w: np.ndarray, c: np.ndarray, overhead: float) -> np.ndarray:
    """(s,) each step's ms per unit of work: the median rank's ``c / (overhead + w)``."""
    return np.nanmedian(c / (overhead + w), axis=0)


def _loss(w: np.ndarray, c: np.ndarray, overhead: float) -> float:
    """How far the ranks' cost ratios are from 1 under ``overhead``: the sum over ranks of
    the squared log of the median ratio, each capped at log(`OUTLIER`)²."""
    ratio = c / (_scale(w, c, overhead) * (overhead + w))
    per_rank = np.nanmedian(np.log(ratio), axis=1)
    per_rank = per_rank[np.isfinite(per_rank)]
    return float(np.minimum(per_rank**2, np.log(OUTLIER) ** 2).sum())


def _middle_of_best(grid: np.ndarray, losses: np.ndarray) -> float:
    """The overhead in the middle (on the grid) of the stretch of candidates around the
    best whose loss is within 1 % of a rank's cap of it: a flat loss gives the middle of
    its flat stretch, not its smallest overhead."""
    best = int(np.argmin(losses))
    near = losses <= losses[best] + 0.01 * np.log(OUTLIER) ** 2
    low = high = best
    while low > 0 and near[low - 1]:
        low -= 1
    while high < len(grid) - 1 and near[high + 1]:
        high += 1
    return float(grid[(low + high) // 2])


def _plain(value: float) -> float | None:
    return value if np.isfinite(value) else None
