"""The affine compute model: a rank's measured compute is a fixed overhead plus its rate
times the work the plan gave it, fitted over a window of steps.

    compute[i, s] = scale[s] * (overhead + rate[i] * work[i, s])

- ``work[i, s]``: the work the plan gave rank i in step s at nominal speed
  (`knapformer.contract.stats.PlanStats.work_after`), in any unit;
- ``overhead``: what every step costs every rank whatever its work (kernel launches,
  norms, the optimizer, Python), in the same unit as the work, shared by the group;
- ``rate[i]``: rank i's time per unit of work relative to the group's (the ranks that
  agree on one line are 1; 2 = it takes twice as long per unit of work);
- ``scale[s]``: ms per unit of work in step s. It is fitted per step because the
  machine's load moves every rank alike (another job, a busy host): dividing it out
  leaves what sets one rank apart from its peers.

Why affine: a ratio ``compute / work`` (a line through the origin) makes a rank given
little work look slow (its fixed overhead is divided by little work) and a rank given a
lot look fast, whatever its hardware.

The fit (`fit_compute`) goes by consensus, so that one slow rank cannot bend the line the
others agree on: each rank's **medians** over the window (work and compute) take out the
step-to-step noise (a busy host moves single steps by tens of %), and the line most ranks
agree with (within `TOLERANCE`), its overhead refined over them, is the group's
(`knapformer.planning.line_fit`: which lines are tried, how they are scored, and how a
window of thousands of ranks is searched in about a second).

Then each step's ``scale[s]`` is the median over the agreeing ranks of
``compute / (overhead + work)``, and ``rate[i, s] = (compute / scale - overhead) / work``;
a rank's rate is its median over the steps. The agreeing ranks are the group: their rate
is 1 up to noise, and `ComputeFit.speed` takes them for nominal.

The overhead is separable only when two ranks' median work differs by at least
`SEPARATION` of the median. Otherwise it is taken as 0 and `ComputeFit.separable` is
False: with equal work the overhead cannot change which rank is slow.

Pure numpy: the history cost model (`knapformer.planning.history`) learns speeds from it,
the straggler diagnosis (`knapformer.diagnosis.stragglers`) judges ranks by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from knapformer.contract.nan_reduce import nan_reduce
from knapformer.planning.line_fit import (
    SEPARATION,
    TOLERANCE,
    agreeing,
    centred_slope,
    consensus_line,
    refine_overhead,
)

#: A rank whose compute is this far from what the group's line predicts for its work
#: (slower or faster) in a step departs from the group in that step: above the
#: step-to-step noise of a busy host (tens of %), below an injected or real slowdown worth
#: acting on. The straggler diagnosis's `slow_ratio` (there, of the rate).
DEPARTURE = 1.3
#: The share of a window's steps a rank must depart in (the same way) before its speed
#: is taken for other than nominal; and the fewest steps that can show it.
PERSISTENCE = 0.75
MIN_STEPS = 5
#: A rank is learnt slow only when what that costs (its compute beyond the line's, the
#: median over the window) is at least this share of the longest compute: a lightly
#: loaded rank off the line by its small-batch inefficiency costs the step nothing. The
#: straggler diagnosis's `material` (there, of the step).
MATERIAL = 0.1
_ROUNDS = 4  # refinements of the agreeing set (it settles in one or two)


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
    agrees: np.ndarray | None = None  # (r,) bool: on the group's line (within TOLERANCE)
    cost_steps: np.ndarray | None = None  # (r, s) measured / predicted compute in each step
    #: another line, with as many ranks off it but other ones, fits within
    #: `knapformer.planning.line_fit.RIVAL` caps of this one's, or within the noise of the
    #: window's medians: the window cannot say which ranks are off
    ambiguous: bool = False

    @property
    def speed(self) -> np.ndarray:
        """(r,) relative speed: 1 for a rank that agrees with the group's line (what sets
        it apart is noise) or is unknown, else the inverse of its rate."""
        with np.errstate(divide="ignore", invalid="ignore"):
            speed = 1.0 / self.rate
        speed = np.where(np.isfinite(speed) & (speed > 0), speed, 1.0)
        return speed if self.agrees is None else np.where(self.agrees, 1.0, speed)

    @property
    def departs(self) -> np.ndarray:
        """(r,) bool: the rank's compute departs from what the group's line predicts for
        its work by `DEPARTURE` (the same way) in at least `PERSISTENCE` of its measured
        steps, at least `MIN_STEPS` of them, and in its median: a difference the window
        shows, not noise of a few steps.

        Judged on the compute, not on the rate: a rank's rate is its compute less the
        overhead, over its work, so the step-to-step noise of a lightly loaded rank's
        compute shows in its rate magnified by (overhead + work) / work (1.6x for a rank
        given 60 % of the median work at the demo's overhead). In clean demo runs on 4
        ranks of g1n2+g2n1 (2 cores), judged on the rate a healthy 1-GPU-bag rank was
        learnt slow in 10 of 69 runs; judged on the compute, in 2 (where its compute was
        1.5x the line's for 5 steps running, another job's CPU contention)."""
        if self.cost_steps is None:  # a fit made by hand, without them: the rate
            return self.rate_departs
        return _persistent(self.cost_steps, self.cost)

    @property
    def material(self) -> np.ndarray:
        """(r,) bool: the rank's compute beyond what the group's line predicts for its
        work (median over the steps) is at least `MATERIAL` of the longest compute (the
        median over the steps of the slowest rank's); True for a fit made by hand."""
        if self.cost_steps is None:
            return np.ones(len(self.rate), dtype=bool)
        compute = self.cost_steps * self.predicted_ms
        excess = nan_reduce(np.nanmedian, compute - self.predicted_ms, axis=1)
        longest = nan_reduce(np.nanmedian, nan_reduce(np.nanmax, compute, axis=0))
        return np.nan_to_num(excess, nan=-np.inf) >= MATERIAL * longest

    @property
    def rate_departs(self) -> np.ndarray:
        """(r,) bool: as `departs`, of the rate: the rank's time per unit of work departs
        from the group's. What keeps a rank learnt slow (`learnt`): once the planner gives
        it less work, its compute nears the group's and no longer departs, its rate does."""
        return _persistent(self.rate_steps, self.rate)

    @property
    def learnt_speed(self) -> np.ndarray:
        """(r,) the speed the history cost model plans with, for a window seen alone:
        `learnt` with no rank learnt slow before."""
        return self.learnt(None)

    def learnt(self, slow_before: np.ndarray | None) -> np.ndarray:
        """(r,) the speed the history cost model plans with: the inverse of the rate for a
        rank slower than the group that `departs` from it, or that was learnt slow before
        (``slow_before``, (r,) bool) and whose rate still departs; 1 for every other. A
        window too short or too noisy to tell a rank apart leaves it nominal, so a healthy
        rank is never fed by the noise of a few steps. Never faster than 1: on measured runs
        a "fast" rank was a lightly loaded one whose fixed overhead the window could not
        separate, and feeding it more work would make it the straggler."""
        held = np.zeros(len(self.rate), dtype=bool)
        if slow_before is not None:
            held = np.asarray(slow_before, dtype=bool) & self.rate_departs
        # An ambiguous window learns no new slow rank: which one it is, it cannot say.
        slow = held if self.ambiguous else (self.departs & self.material) | held
        return np.where(slow & (self.speed < 1.0), self.speed, 1.0)

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None)."""
        return {
            "overhead": self.overhead,
            "overhead_ms": _plain(self.overhead_ms),
            "separable": self.separable,
            "note": self.note,
            "rate": [_plain(v) for v in self.rate.tolist()],
            "cost": [_plain(v) for v in self.cost.tolist()],
            "agrees": None if self.agrees is None else self.agrees.tolist(),
        }


def fit_compute(work: ArrayLike, compute_ms: ArrayLike) -> ComputeFit:
    """Fit the affine model to ``work`` (r, s) and ``compute_ms`` (r, s), rank by step.

    A figure with work <= 0, compute <= 0 or either not finite is left out. A window with
    no usable figure gives rates and costs of NaN."""
    w, c, valid = _usable(work, compute_ms)
    r, s = w.shape
    if not valid.any():
        nan_r, nan_s = np.full(r, np.nan), np.full(s, np.nan)
        return ComputeFit(0.0, 0.0, False, "no measured step", nan_s, nan_r, nan_r,
                          np.full((r, s), np.nan), np.full((r, s), np.nan),
                          np.zeros(r, dtype=bool), np.full((r, s), np.nan))  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):
        work_r = nan_reduce(np.nanmedian, w, axis=1)  # (r,)
        compute_r = nan_reduce(np.nanmedian, c, axis=1)
        known = np.isfinite(work_r) & np.isfinite(compute_r)
        typical = float(np.median(work_r[known]))
        separable = _spread(work_r[known]) >= SEPARATION
        medians = work_r[known], compute_r[known]
        overhead, slope, ambiguous = consensus_line(w, c, medians, typical, separable)
        overhead, agrees = _settle(w, c, overhead, slope, typical, separable)
        scale = nan_reduce(np.nanmedian, c[agrees] / (overhead + w[agrees]), axis=0)  # (s,)
        predicted = scale * (overhead + w)  # (r, s)
        rate_steps = (c / scale - overhead) / w
        rate = nan_reduce(np.nanmedian, rate_steps, axis=1)
        cost_steps = c / predicted
        cost = nan_reduce(np.nanmedian, cost_steps, axis=1)
        overhead_ms = nan_reduce(np.nanmedian, scale * overhead)
    return ComputeFit(
        overhead=float(overhead),
        overhead_ms=overhead_ms,
        separable=separable,
        note=_note(overhead_ms, int(agrees.sum()), int(known.sum()), separable, ambiguous),
        scale_ms=scale,
        rate=rate,
        cost=cost,
        rate_steps=rate_steps,
        predicted_ms=predicted,
        agrees=agrees,
        cost_steps=cost_steps,
        ambiguous=ambiguous,
    )


def _usable(work: ArrayLike, compute_ms: ArrayLike):
    """(work, compute, usable) as (r, s) float arrays (a 1-D window is one step), NaN where
    a figure is not usable: work or compute <= 0 or not finite."""
    w = np.asarray(work, dtype=np.float64)
    c = np.asarray(compute_ms, dtype=np.float64)
    if w.ndim == 1:
        w, c = w[:, None], c[:, None]
    if w.shape != c.shape:
        raise ValueError(f"work {w.shape} and compute {c.shape} differ in shape")
    valid = np.isfinite(w) & np.isfinite(c) & (w > 0) & (c > 0)
    return np.where(valid, w, np.nan), np.where(valid, c, np.nan), valid


def _settle(w, c, overhead: float, slope: float, typical: float, separable: bool):
    """(overhead, agreeing ranks (r,) bool) once the consensus line's overhead is refined
    over the ranks that agree with it and the agreeing set recomputed, until that set no
    longer changes (at most `_ROUNDS` times; an empty set keeps the last one)."""
    agrees = agreeing(w, c, overhead, slope)
    for _ in range(_ROUNDS):
        if separable and agrees.sum() >= 2:
            overhead = refine_overhead(w[agrees], c[agrees], typical)
        slope = centred_slope(w[agrees], c[agrees], overhead)
        again = agreeing(w, c, overhead, slope)
        if (again == agrees).all():
            break
        agrees = again if again.any() else agrees
    return overhead, agrees


def _note(overhead_ms: float, agree: int, known: int, separable: bool, ambiguous: bool) -> str:
    """`ComputeFit.note`: how the overhead was found."""
    note = (
        f"overhead {overhead_ms:.3g} ms per step, fitted on the line {agree} of "
        f"{known} ranks agree with (within {TOLERANCE - 1:.0%})"
        if separable
        else f"overhead not separable: every rank's median work is within {SEPARATION:.0%} "
        "of the others' (taken as 0; with equal work it does not change which rank is slow)"
    )
    if ambiguous:
        note += "; ambiguous: another line, with other ranks off it, fits about as well"
    return note


def _persistent(figure: np.ndarray, median: np.ndarray) -> np.ndarray:
    """(r,) bool: ``figure`` (r, s), a rank's ratio to the group's in each step, is at
    least `DEPARTURE` (or at most its inverse) in `PERSISTENCE` of the rank's finite
    steps, at least `MIN_STEPS` of them, and ``median`` (r,) is too, the same way."""
    counted = np.isfinite(figure).sum(axis=1)
    with np.errstate(invalid="ignore"):
        slow = (figure >= DEPARTURE).sum(axis=1), median >= DEPARTURE
        fast = (figure <= 1 / DEPARTURE).sum(axis=1), median <= 1 / DEPARTURE
    enough = (counted >= MIN_STEPS) & np.isfinite(median)
    need = PERSISTENCE * np.maximum(counted, 1)
    return enough & (((slow[0] >= need) & slow[1]) | ((fast[0] >= need) & fast[1]))


def _spread(work: np.ndarray) -> float:
    """How far apart the ranks' median works are, relative to the median one."""
    if len(work) < 2:
        return 0.0
    return float((work.max() - work.min()) / np.median(work))


def _plain(value: float) -> float | None:
    return value if np.isfinite(value) else None
