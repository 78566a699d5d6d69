"""The robust line of the affine compute model (`knapformer.planning.compute_model`): the
fixed overhead and ms per unit of work that most ranks of a window agree with, found by
consensus so that one slow rank cannot bend the line the others agree on.

1. Candidate lines (`consensus_line`), one of two searches by the window's size:

   - up to `EXACT_RANKS` ranks, **every pair**: the line through every pair of ranks'
     medians (work, compute) whose median work differs by at least `SEPARATION` (with a
     slope > 0 and an overhead in ``[0, MAX_OVERHEAD]`` times the median work), and the
     line through the origin and each rank;
   - above it, **an overhead grid**: for each overhead of `_GRID` (0 included), the
     line with that overhead through each rank. Every pair costs ranks² lines of
     ranks × steps each (400 s for 10 steps of 1,024 ranks); the grid costs `_GRID`
     passes over the window, and the lines of one overhead are scored together from
     the ranks' sorted offsets (`_anchor_lines`): 4,096 ranks × 60 steps in about a
     second. A pair's line has an overhead between two of the grid's (12 % apart): the
     refinement below moves it off the grid.

2. A rank **agrees** with a line when the median over steps of its compute over the
   line's is within `TOLERANCE`. The line kept is the one with the least sum over ranks
   of the squared log of that ratio, each rank's capped at log(`TOLERANCE`)² (a rank that
   disagrees costs the same however far off it is); ties go to the larger overhead. With
   a fixed overhead the healthy ranks lie on one line and a slow rank costs one cap;
   reading it instead as "the lightly loaded rank is slow" (a line through the origin)
   needs more ranks off the line, so it loses.
3. The overhead is refined over the agreeing ranks alone (`refine_overhead`: a grid,
   least squares on the log), and the agreeing set recomputed with it (by the caller),
   until it no longer changes.

Pure numpy, no state: `knapformer.planning.compute_model.fit_compute` is its one caller.
"""

from __future__ import annotations

import numpy as np

from knapformer.contract.nan_reduce import nan_reduce

#: Ranks' median work must differ by this much (relative to the median rank's) for the
#: fixed overhead to be told apart from the rate.
SEPARATION = 0.1
#: A rank agrees with a line when its compute is within this factor of the line's (the
#: median over the window's steps): above the noise of a median over a few steps on a
#: busy host, below `knapformer.diagnosis.stragglers.Thresholds.slow_ratio`.
TOLERANCE = 1.15
#: The largest overhead the fit considers, in units of the median rank's work: as much
#: work again. Beyond it a rank's rate is the small difference of two large numbers
#: (noise), and once the history cost model has equalised every rank's compute, a huge
#: overhead would "explain" equal times for unequal work and hide the slow rank.
MAX_OVERHEAD = 3.0
#: How close (in caps: one rank off a line costs 1) a line that puts other ranks off it
#: may fit for the window to be `knapformer.planning.compute_model.ComputeFit.ambiguous`.
RIVAL = 0.25
#: ... or within this many times what the noise of the ranks' medians moves a score by
#: (`_noise_caps`), when that is more: on a busy host a few steps cannot rank two lines
#: whose scores differ by less than their noise. Measured on kept demo runs on 2 cores:
#: g1n4 (heavy model) with rank 2 at 1.5x, after 3 steps the line with the healthy,
#: lightly loaded rank 0 off beat the true one by 0.39 caps while the noise was 0.29
#: caps, and rank 0 was named slow_gpu; at 2x the noise, no run of 94 named a healthy rank
#: and none named the slow one later.
NOISE_MARGIN = 2.0
#: The most ranks (with a figure) whose window tries the line through every pair: 2,016
#: pairs, 0.15 s for 64 ranks x 60 steps. Above it, the overhead grid (module doc).
EXACT_RANKS = 64
#: Candidate overheads of the refinement and of the grid search, times `MAX_OVERHEAD` x
#: the median work.
_GRID = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 61)])
#: Each rank's fixed random key: the sum of the keys of the ranks off a line names that
#: set (mod 2^64), so the grid search compares sets of thousands of ranks as numbers.
_KEY_SEED = 0x6B6E6170


def consensus_line(
    w: np.ndarray,
    c: np.ndarray,
    medians: tuple[np.ndarray, np.ndarray],
    typical: float,
    separable: bool,
) -> tuple[float, float, bool]:
    """(overhead, ms per unit of work, ambiguous) of the line the ranks of the window
    ``w``, ``c`` (r, s) agree with best; ``medians``: the (work, compute) medians (k,)
    of the ranks that have them. Ambiguous: another line, with as many ranks off it but
    other ones, fits about as well (`_rival_line`)."""
    work_r, compute_r = medians
    if len(work_r) > EXACT_RANKS:
        return _grid_line(w, c, typical, separable)
    lines = _candidates(work_r, compute_r, typical)
    if not separable:
        lines = [(0.0, slope) for overhead, slope in lines if overhead == 0.0]
    fits = _line_fits(w, c, lines)
    best = _consensus(lines, fits)
    overhead, slope = lines[best]
    ambiguous = _rival_line(fits, best, _noise_caps(w, c, overhead, slope))
    return overhead, slope, ambiguous


def _candidates(work: np.ndarray, compute: np.ndarray, typical: float) -> list[tuple]:
    """(overhead, ms per unit of work) of the candidate lines through the ranks' medians
    ``work`` (k,) and ``compute`` (k,): through the origin and each rank, and through every
    pair of ranks far enough apart in work whose line has a slope > 0 and an overhead in
    [0, MAX_OVERHEAD x typical]."""
    lines = [(0.0, float(ci / wi)) for wi, ci in zip(work, compute, strict=True)]
    # every pair i < j at once, in the order of a loop over i then j
    i, j = np.triu_indices(len(work), k=1)
    dw = work[j] - work[i]
    apart = np.abs(dw) >= SEPARATION * typical
    i, j, dw = i[apart], j[apart], dw[apart]
    slope = (compute[j] - compute[i]) / dw
    rising = slope > 0
    i, slope = i[rising], slope[rising]
    overhead = compute[i] / slope - work[i]
    kept = (overhead > 0.0) & (overhead <= MAX_OVERHEAD * typical)
    lines += zip(overhead[kept].tolist(), slope[kept].tolist(), strict=True)
    return lines


def _log_residuals(w: np.ndarray, c: np.ndarray, overhead: float, slope: float) -> np.ndarray:
    """(r, s) log(compute / the line's) of each rank in each step."""
    return np.log(c / (slope * (overhead + w)))


def _residuals(w: np.ndarray, c: np.ndarray, overhead: float, slope: float) -> np.ndarray:
    """(r,) each rank's median over steps of log(compute / the line's)."""
    return nan_reduce(np.nanmedian, _log_residuals(w, c, overhead, slope), axis=1)


def agreeing(w: np.ndarray, c: np.ndarray, overhead: float, slope: float) -> np.ndarray:
    """(r,) bool: the ranks within `TOLERANCE` of the line (NaN: no)."""
    return _within_tolerance(_residuals(w, c, overhead, slope))


def _within_tolerance(residuals: np.ndarray) -> np.ndarray:
    """(r,) bool: the ranks whose median log residual (r,) is within `TOLERANCE`."""
    return np.isfinite(residuals) & (np.abs(residuals) <= np.log(TOLERANCE))


def _line_fits(w: np.ndarray, c: np.ndarray, lines: list[tuple]) -> list[tuple]:
    """Per line of ``lines``: how well the ranks agree with it, in caps (the sum over
    ranks of the squared log residual, each capped at log(`TOLERANCE`)²: a rank off the
    line costs 1 however far off, so one slow rank cannot pull the line), and the ranks
    off it (at the cap)."""
    cap = np.log(TOLERANCE) ** 2
    # A line through the origin only shifts every log residual by -log(slope): the
    # ranks' medians of log(c / w) are taken once for all of them (r lines over r ranks
    # and s steps would otherwise cost r * r * s: 30 s at 1,024 ranks and 300 steps).
    through_origin = _residuals(w, c, 0.0, 1.0) if any(o == 0.0 for o, _ in lines) else None
    fits = []
    for line in lines:
        if line[0] == 0.0 and through_origin is not None:
            res = through_origin - np.log(line[1])
        else:
            res = _residuals(w, c, *line)
        capped = np.minimum(np.where(np.isfinite(res), res**2, 0.0), cap)
        fits.append((float(capped.sum()) / cap, frozenset(np.flatnonzero(capped >= cap).tolist())))
    return fits


def _consensus(lines: list[tuple], fits: list[tuple]) -> int:
    """The index of the line the ranks agree with best (`_line_fits`); ties: the larger
    overhead (every step has a fixed cost; the origin is the special case)."""
    return min(range(len(lines)), key=lambda i: (round(fits[i][0], 6), -lines[i][0]))


def _grid_line(
    w: np.ndarray, c: np.ndarray, typical: float, separable: bool
) -> tuple[float, float, bool]:
    """`consensus_line` by the overhead grid (module doc): the lines of every overhead of
    `_GRID` through every rank, scored as `_line_fits` scores them, the best kept as
    `_consensus` keeps it and a rival looked for as `_rival_line` does."""
    overheads = _GRID * MAX_OVERHEAD * typical if separable else np.zeros(1)
    keys = np.random.default_rng(_KEY_SEED).integers(0, 2**63, w.shape[0], dtype=np.uint64)
    lines = [_anchor_lines(_residuals(w, c, o, 1.0), keys) for o in overheads]
    score, off, key, offset = (np.concatenate(part) for part in zip(*lines, strict=True))
    overhead = np.repeat(overheads, [len(part[0]) for part in lines])
    if not len(score):  # no rank with a median offset (the caller has one)
        return 0.0, 1.0, False
    best = int(np.lexsort((-overhead, np.round(score, 6)))[0])
    slope = float(np.exp(offset[best]))
    margin = max(RIVAL, NOISE_MARGIN * _noise_caps(w, c, float(overhead[best]), slope))
    rival = (off == off[best]) & (key != key[best]) & (score <= score[best] + margin)
    return float(overhead[best]), slope, bool(off[best] > 0 and rival.any())


def _anchor_lines(offsets: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, ...]:
    """The lines of one overhead through each rank, from the ranks' median log(compute /
    (overhead + work)) ``offsets`` (r,; NaN: no figure, on no line's count): per line
    (k,) its score in caps (`_line_fits`), how many ranks are off it, the sum of their
    ``keys`` (which ranks) and its log ms per unit of work. All k lines in k log k: the
    ranks within log(`TOLERANCE`) of a line are a run of the sorted offsets, and their
    squared residuals follow from running sums."""
    finite = np.isfinite(offsets)
    order = np.argsort(offsets[finite], kind="stable")
    at, key = offsets[finite][order], keys[finite][order]
    x = at - at[len(at) // 2] if len(at) else at  # centred: the running sums stay small
    sum1, sum2 = (np.concatenate([[0.0], np.cumsum(v)]) for v in (x, x * x))
    key_sum = np.concatenate([np.zeros(1, np.uint64), np.cumsum(key, dtype=np.uint64)])
    reach = np.log(TOLERANCE)
    lo = np.searchsorted(x, x - reach, side="right")  # the run strictly within reach
    hi = np.searchsorted(x, x + reach, side="left")
    near = hi - lo
    squares = (sum2[hi] - sum2[lo]) - 2 * x * (sum1[hi] - sum1[lo]) + near * x * x
    off = len(x) - near
    score = np.maximum(squares, 0.0) / reach**2 + off
    return score, off, key_sum[-1] - (key_sum[hi] - key_sum[lo]), at


def _noise_caps(w: np.ndarray, c: np.ndarray, overhead: float, slope: float) -> float:
    """How much (in caps, `_line_fits`) the noise of the ranks' medians alone moves the
    score of the line (``overhead``, ``slope``): the sum over the ranks on it of the
    squared standard error of their median log residual. The scatter is pooled over those
    ranks (it is the host's, and a few steps give each rank too few to judge alone), after
    each step's common swing is taken out, as `fit_compute`'s per-step scale takes it."""
    every = _log_residuals(w, c, overhead, slope)  # (r, s), once: `agreeing` and the rows on
    on = _within_tolerance(nan_reduce(np.nanmedian, every, axis=1))
    if on.sum() < 2:
        return 0.0
    res = every[on]  # (k, s)
    own = res - nan_reduce(np.nanmedian, res, axis=0)
    counted = np.isfinite(own).sum(axis=1)
    dof = int(np.maximum(counted - 1, 0).sum())
    if dof < 1:
        return 0.0
    variance = float(np.nansum((own - nan_reduce(np.nanmean, own, axis=1)[:, None]) ** 2)) / dof
    # the variance of a median of n normal values is (pi / 2) variance / n
    se2 = np.pi / 2 * variance / np.maximum(counted[counted > 0], 1)
    return float(se2.sum()) / np.log(TOLERANCE) ** 2


def _rival_line(fits: list[tuple], chosen: int, noise: float) -> bool:
    """Whether another line puts as many ranks off it as line ``chosen`` does, but other
    ones, and fits within `RIVAL` caps of it, or `NOISE_MARGIN` times ``noise`` caps
    (`_noise_caps`) when that is more (`_line_fits`). Measured on g1n4 with rank 2
    slowed 2x (2 cores): the line through the origin and ranks 1-3 (rank 0 off) beat the
    one that left rank 2 off by 0.1 cap, and the history model learnt the healthy rank 0
    slow."""
    score, off = fits[chosen]
    margin = max(RIVAL, NOISE_MARGIN * noise)
    return bool(off) and any(
        len(other) == len(off) and other != off and other_score <= score + margin
        for other_score, other in fits
    )


def centred_slope(w: np.ndarray, c: np.ndarray, overhead: float) -> float:
    """The ms per unit of work that centres ranks ``w``, ``c`` (k, s) on the line with
    ``overhead``: the exp of the mean of their median log(compute / (overhead + work))."""
    offsets = nan_reduce(np.nanmedian, np.log(c / (overhead + w)), axis=1)
    return float(np.exp(nan_reduce(np.nanmean, offsets)))


def refine_overhead(w: np.ndarray, c: np.ndarray, typical: float) -> float:
    """The overhead that puts the agreeing ranks ``w``, ``c`` (k, s) closest to one line
    (least squares on the log over the grid; the middle of a flat stretch)."""
    grid = _GRID * MAX_OVERHEAD * typical
    losses = []
    for overhead in grid:
        offsets = nan_reduce(np.nanmedian, np.log(c / (overhead + w)), axis=1)
        losses.append(float(np.nansum((offsets - nan_reduce(np.nanmean, offsets)) ** 2)))
    return _middle_of_best(grid, np.asarray(losses))


def _middle_of_best(grid: np.ndarray, losses: np.ndarray) -> float:
    """The overhead in the middle (on the grid) of the stretch of candidates around the
    best whose loss is within 1 % of a rank's tolerance of it: a flat loss gives the
    middle of its flat stretch, not its smallest overhead."""
    best = int(np.argmin(losses))
    near = losses <= losses[best] + 0.01 * np.log(TOLERANCE) ** 2
    low = high = best
    while low > 0 and near[low - 1]:
        low -= 1
    while high < len(grid) - 1 and near[high + 1]:
        high += 1
    return float(grid[(low + high) // 2])
