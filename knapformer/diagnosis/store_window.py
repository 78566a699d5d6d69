"""A window of the run store's rows as the straggler analysis's matrices, all at once.

`knapformer.diagnosis.measured.measure` reads one plan at a time; a reader of the run
store has, for a window of steps, one narrow row per rank per step (`WindowRows`) and
builds the same `RankSteps`, exchange-scope times and probe bandwidths from them with
numpy over the whole window (1,024 ranks x 1,000 steps in about half a second of CPU,
where a loop over steps took several). The figures are the ones `measure` defines,
computed by the same functions (`phase_ms`, `host_ms`; the waits as `group_waits` defines
them) over every row of the window at once, each collective's peers a run of rows: a step's,
or a bag's in a step (`_Runs`, by a sort where bags interleave), so that the verdicts on the store equal those on the plans of the same steps (both keep
float32 figures, as `RankFigures` does).

The usual window is dense (every step holds the same ranks in the same order): its
columns are then (steps, ranks) matrices, and the per-step reductions, sorts and the
rank x step grids run on them directly (`_Flat.width`); any other window takes the
general path by group ids, which gives the same figures. A million rows a column, the
window makes its large arrays one at a time and reuses its own copies in place: memory
a process has not touched yet costs a page fault per 4 KB, a large share of the time of
a process's first window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from knapformer.contract.nan_reduce import nan_reduce, nan_to_zero
from knapformer.contract.phases import (
    BAG_COLLECTIVES,
    COLLECTIVE_PHASES,
    COMPUTE_PHASES,
    DATA,
    DESCHEDULED,
    EXCHANGES,
    FIXED_PHASES,
    GC,
    GROUP_EXCHANGES,
    PROBE,
    STEP,
    host_ms,
    phase_ms,
)
from knapformer.diagnosis.rank_steps import RankSteps
from knapformer.diagnosis.stragglers import ScopeTimes
from knapformer.planning.compute_model import fit_compute


@dataclass(frozen=True)
class WindowRows:
    """One row per rank per step of a window (k rows, sorted by step, then rank) and one
    entry per step (s,). NaN marks a phase a row did not measure."""

    step: np.ndarray  # (k,) int
    rank: np.ndarray  # (k,) int
    bag: np.ndarray  # (k,) int, the bag's id in its step's plan
    phase_ms: Mapping[str, np.ndarray]  # phase -> (k,) ms
    work: np.ndarray  # (k,) work after routing at nominal speed (``work_after``)
    load: np.ndarray  # (k,) the plan's predicted time (``load_after``)
    moved_tokens: np.ndarray  # (k,) tokens it sent plus tokens it received
    steps: np.ndarray  # (s,) int, ascending
    mean_load: np.ndarray  # (s,) the ideal load (`PlanStats.mean_load`)
    floor: np.ndarray  # (s,) largest sequence workload over the largest bag capacity
    token_dim: np.ndarray  # (s,) (1 where the plan had none)
    shown_total: np.ndarray  # (s,) total work in the plan's `LoadUnit`
    load_axis: str = ""
    #: (k,) the rank's fastest link inside a node / across nodes in the step's link
    #: probe (GB/s; NaN: no probe that step, or no pair of that kind)
    best_intra_gbps: np.ndarray | None = None
    best_cross_gbps: np.ndarray | None = None


@dataclass(frozen=True)
class WindowFigures:
    """What `knapformer.diagnosis.stragglers.judge` reads, for a window of the store."""

    m: RankSteps
    scopes: ScopeTimes
    bandwidth: np.ndarray  # (r, s) relative bandwidth in the link probe


@dataclass(frozen=True)
class _Runs:
    """Rows by group: ``order`` puts them in the groups' order (None: they are in it),
    each group then a run of ``size`` rows from ``starts``."""

    order: np.ndarray | None
    starts: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, groups: np.ndarray, order: np.ndarray | None) -> _Runs:
        ordered = groups if order is None else groups[order]
        starts = np.concatenate(([0], np.flatnonzero(ordered[1:] != ordered[:-1]) + 1))
        return cls(order, starts, np.diff(starts, append=len(groups)))

    def ordered(self, a: np.ndarray) -> np.ndarray:
        """``a`` (k,) in the groups' order."""
        return a if self.order is None else a[self.order]


@dataclass(frozen=True)
class _Flat:
    """The window's rows with their step column and presence of each phase per step."""

    rows: WindowRows
    col: np.ndarray  # (k,) the row's step's column
    per_rank: dict[str, np.ndarray]  # phase -> (k,) float32 or float64 (`ms` widens it)
    present: dict[str, np.ndarray]  # phase -> (s,) bool
    #: ranks per step when every step holds the same ranks in the same order (the usual
    #: window: a (k,) column is then an (s, width) matrix), else None
    width: int | None

    @functools.cached_property
    def bag_groups(self) -> np.ndarray:
        """(k,) a group id per row: its step's bag."""
        bag = np.asarray(self.rows.bag, dtype=np.int64)
        # ids need not be contiguous (an unused id is an empty group): no sort
        return self.col * (int(bag.max()) + 1) + bag

    @functools.cached_property
    def bag_runs(self) -> _Runs:
        """The rows by `bag_groups` (the bag collectives' waits and scopes share them)."""
        return _Runs.of(self.bag_groups, _bag_order(self))

    @functools.cached_property
    def step_runs(self) -> _Runs:
        """The rows by step (they come by step: no sort)."""
        return _Runs.of(self.col, None)

    def ms(self, phase: str) -> np.ndarray:
        """(k,) float64 of a measured phase, a copy of its own (kept as stored, widened
        where it is used; its user may change it in place)."""
        return np.array(self.per_rank[phase], dtype=np.float64)

    def phase_in_step(self, phase: str) -> np.ndarray:
        """(k,) bool: the row's step measured ``phase``."""
        return (
            self.present[phase][self.col]
            if phase in self.present
            else np.zeros(len(self.col), bool)
        )


def _floating(values) -> np.ndarray:
    """``values`` as a float array: float32 as it is, anything else as float64."""
    array = np.asarray(values)
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float64)


def _divide(a: np.ndarray, b: np.ndarray, empty: float) -> np.ndarray:
    """``a / b``, ``empty`` where ``b`` is not > 0."""
    return np.where(b > 0, a / np.where(b > 0, b, 1.0), empty)


def _dense_width(rows: WindowRows) -> int | None:
    """The ranks per step when every step of ``rows`` holds the same ranks in the same
    order (then its columns reshape to (steps, ranks)), else None."""
    s, k = len(rows.steps), len(rows.step)
    if s == 0 or k == 0 or k % s:
        return None
    width = k // s
    rank = np.asarray(rows.rank).reshape(s, width)
    step = np.asarray(rows.step).reshape(s, width)
    same = (rank == rank[0]).all() and (step == np.asarray(rows.steps)[:, None]).all()
    return width if same else None


def _in_steps(values: np.ndarray, col: np.ndarray, s: int, width: int | None) -> np.ndarray:
    """(s,) bool: whether any row of each step holds True in ``values`` (k,) bool."""
    if width is not None:
        return values.reshape(s, width).any(axis=1)
    return np.bincount(col[values], minlength=s) > 0


def _measured_only(rows: WindowRows) -> _Flat:
    """The rows of the steps that measured a compute phase (`measure` skips the others)."""
    s = len(rows.steps)
    width = _dense_width(rows)
    col = np.repeat(np.arange(s), width) if width else np.searchsorted(rows.steps, rows.step)
    # a phase no row measured is left out, as a plan leaves it out of its measurements
    per_rank, present = {}, {}
    for p, v in rows.phase_ms.items():
        steps = _in_steps(np.isfinite(v), col, s, width)
        if steps.any():  # float32 stays (the store's ms): every use widens it exactly
            per_rank[p], present[p] = _floating(v), steps
    measured = np.zeros(s, bool)
    for p in COMPUTE_PHASES:
        if p in present:
            measured |= present[p]
    if measured.all():
        return _Flat(rows, col, per_rank, present, width)
    keep_row, keep = measured[col], np.flatnonzero(measured)

    def sub(a):
        return None if a is None else np.asarray(a)[keep_row]

    kept = WindowRows(
        **{
            name: sub(getattr(rows, name))
            for name in (
                "step",
                "rank",
                "bag",
                "work",
                "load",
                "moved_tokens",
                "best_intra_gbps",
                "best_cross_gbps",
            )
        },
        phase_ms={p: v[keep_row] for p, v in per_rank.items()},
        **{
            n: np.asarray(getattr(rows, n))[keep]
            for n in ("steps", "mean_load", "floor", "token_dim", "shown_total")
        },
        load_axis=rows.load_axis,
    )
    return _measured_only(kept)


def _compute(flat: _Flat) -> tuple[np.ndarray, list[str]]:
    """(k,) each row's ms in its step's compute phase, and that phase per step."""
    s = len(flat.rows.steps)
    phase_of = np.full(s, -1)
    for i, p in enumerate(COMPUTE_PHASES):
        if p in flat.present:
            phase_of = np.where((phase_of < 0) & flat.present[p], i, phase_of)
    compute = np.full(len(flat.col), np.nan)
    for i, p in enumerate(COMPUTE_PHASES):
        take = phase_of[flat.col] == i
        if take.any():
            compute[take] = flat.per_rank[p][take]
    return compute, [COMPUTE_PHASES[i] for i in phase_of]


def _per_row(flat: _Flat, compute: np.ndarray) -> tuple[dict[str, Callable], np.ndarray]:
    """The per-row figures `RankFigures` keeps, each as a maker of its float64 values (the
    caller makes them one at a time, a million rows each, and keeps them in float32 as
    `RankFigures` does, ``shown`` in float64), and each row's wait in all its collectives
    together (float64, which names the straggler)."""
    rows, col, per_rank, k = flat.rows, flat.col, flat.per_rank, len(flat.col)
    # summed as they come, in `COLLECTIVE_PHASES` order (the order of a plan's sums)
    total_wait, exchange_wait = np.zeros(k), np.zeros(k)
    for p in COLLECTIVE_PHASES:
        if p not in per_rank:
            continue
        if p in BAG_COLLECTIVES:
            wait = _run_waits(flat.ms(p), flat.bag_runs)
        elif flat.width is not None:
            wait = _step_waits(flat.ms(p), flat.width)  # its own copy, changed in place
        else:
            wait = _run_waits(flat.ms(p), flat.step_runs)
        total_wait += wait
        if p in EXCHANGES:
            exchange_wait += wait
    step_ms = np.where(flat.phase_in_step(STEP), per_rank.get(STEP, np.nan), np.nan)
    step_ms = np.maximum(step_ms - phase_ms(per_rank, PROBE, k), 0)
    work_total = np.bincount(col, weights=rows.work, minlength=len(rows.steps))[col]
    share = _divide(np.asarray(rows.work, np.float64), work_total, 0.0)
    token_dim = np.asarray(rows.token_dim, np.float64)[col]
    made = {
        "compute_ms": lambda: compute,
        "wait_ms": lambda: total_wait,
        "share": lambda: share,
        "load": lambda: _divide(np.asarray(rows.load, np.float64), rows.mean_load[col], 0.0),
        "step_ms": lambda: step_ms,
        "data_ms": lambda: phase_ms(per_rank, DATA, k),
        "host_ms": lambda: host_ms(per_rank, k),
        "gc_ms": lambda: phase_ms(per_rank, GC, k),
        "descheduled_ms": lambda: phase_ms(per_rank, DESCHEDULED, k),
        "exchange_ms": lambda: sum((phase_ms(per_rank, p, k) for p in EXCHANGES), np.zeros(k)),
        "exchange_wait_ms": lambda: exchange_wait,
        "exchange_values": lambda: np.asarray(rows.moved_tokens, np.float64) * 2 * token_dim,
    }
    # float64, as the plan's stats multiply it: float32 share x shown total
    made["shown"] = lambda: share.astype(np.float32).astype(np.float64) * rows.shown_total[col]
    return made, total_wait


def _step_waits(t: np.ndarray, width: int) -> np.ndarray:
    """`group_waits` of ``t`` (k,) float64 grouped by step when every step holds
    ``width`` rows (`_Flat.width`): each row's time past its step's earliest, by a
    reduction along the rows of an (s, width) matrix instead of an unbuffered scatter
    (the same values). ``t`` becomes the waits (in place: a million rows a collective)."""
    wait = t.reshape(-1, width)
    # NaN-skipping: a step nobody measured has NaN where `group_waits` has inf, and
    # neither is finite
    first = np.fmin.reduce(wait, axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):  # inf - inf: a hostile row, zeroed below
        wait -= first
    wait[~((width >= 2) & np.isfinite(first[:, 0]))] = 0.0
    return nan_to_zero(wait, copy=False).reshape(-1)


def _run_waits(t: np.ndarray, runs: _Runs) -> np.ndarray:
    """`knapformer.diagnosis.measured.group_waits` of ``t`` (k,) float64 by the groups of
    ``runs``: each row's time past its group's earliest (0 alone in its group, or in one
    nobody measured), by a reduction over each run instead of an unbuffered scatter over
    a million rows (the same values)."""
    if not len(t):
        return np.zeros(0)
    t = runs.ordered(t)
    first = np.minimum.reduceat(np.where(np.isnan(t), np.inf, t), runs.starts)
    has = (runs.size >= 2) & np.isfinite(first)
    wait = np.where(np.repeat(has, runs.size), t - np.repeat(first, runs.size), 0.0)
    wait = nan_to_zero(wait, copy=False)
    if runs.order is None:
        return wait
    out = np.empty_like(wait)
    out[runs.order] = wait
    return out


def _stragglers(total_wait: np.ndarray, flat: _Flat) -> list[int | None]:
    """Per step, the rank that waited least (the first in row order on a tie), None when
    nobody waited (`measure`'s straggler)."""
    s, k = len(flat.rows.steps), len(flat.col)
    least = np.full(s, np.inf)
    np.minimum.at(least, flat.col, total_wait)
    position = np.where(total_wait == least[flat.col], np.arange(k), k)
    first = np.full(s, k, dtype=np.int64)
    np.minimum.at(first, flat.col, position)
    waited = np.bincount(flat.col, weights=total_wait, minlength=s) > 0
    ranks = np.asarray(flat.rows.rank)[np.minimum(first, k - 1)]
    return [int(r) if w else None for r, w in zip(ranks.tolist(), waited.tolist(), strict=True)]


#: Steps a block of `_grid`'s transpose holds.
_BLOCK = 64


def _grid(
    values: np.ndarray, row: np.ndarray, col: np.ndarray, shape: tuple, narrow: bool = False
) -> np.ndarray:
    """(r, s) float64 of per-row ``values`` (through float32 first when ``narrow``), NaN
    where a rank was not in a step: a transpose when every step holds every rank in rank
    order (the usual window)."""
    r, s = shape
    if len(values) == r * s and (row.reshape(s, r) == np.arange(r)).all():
        # by blocks of steps that stay in the cache (one transpose of a 1,024 x 1,000
        # window took 7x longer), each narrowed on its own (no float32 copy of it all)
        out, by_step = np.empty(shape), values.reshape(s, r)
        for first in range(0, s, _BLOCK):
            block = by_step[first : first + _BLOCK]
            out[:, first : first + _BLOCK] = (block.astype(np.float32) if narrow else block).T
        return out
    out = np.full(shape, np.nan)
    out[row, col] = values.astype(np.float32) if narrow else values
    return out


def _positions(rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct ranks and each row's index among them, by counting (ranks are
    small non-negative numbers; a sort of a million rows took a tenth of a second)."""
    seen = np.bincount(rank) > 0
    index = np.cumsum(seen) - 1
    return np.flatnonzero(seen).astype(np.int64), index[rank]


def window_figures(rows: WindowRows) -> WindowFigures:
    """The matrices, exchange-scope times and probe bandwidths of ``rows``."""
    flat = _measured_only(rows)
    rows, col = flat.rows, flat.col
    ranks, row = _positions(np.asarray(rows.rank, np.int64))
    shape = (len(ranks), len(rows.steps))
    compute, phases = _compute(flat)
    made, total_wait = _per_row(flat, compute)
    out = {name: _grid(make(), row, col, shape, name != "shown") for name, make in made.items()}
    del made  # and the per-row arrays its makers hold (the fit and the scopes need memory)
    fixed = {}
    for p in FIXED_PHASES:
        if p in flat.present and flat.present[p].any():
            ms = np.where(flat.phase_in_step(p), phase_ms(flat.per_rank, p, len(col)), np.nan)
            fixed[p] = _grid(ms, row, col, shape, narrow=True)
    floor_load = _divide(np.asarray(rows.floor, np.float64), rows.mean_load, np.nan)
    at_floor = np.zeros(shape, bool)
    at_floor[row, col] = (rows.load >= 0.99 * rows.floor[col]) & (floor_load[col] > 1.0)
    fit = fit_compute(out["share"], out["compute_ms"])
    m = RankSteps(
        ranks=ranks,
        steps=[int(x) for x in rows.steps],
        ratio=fit.rate_steps,
        compute_ms=out["compute_ms"],
        wait_ms=out["wait_ms"],
        predicted_share=out["share"],
        predicted_load=out["load"],
        predicted_shown=out["shown"],
        straggler=_stragglers(total_wait, flat),
        phases=list(dict.fromkeys(phases)),
        load_axis=rows.load_axis,
        fit=fit,
        **{
            name: out[name]
            for name in (
                "step_ms",
                "data_ms",
                "host_ms",
                "gc_ms",
                "descheduled_ms",
                "exchange_ms",
                "exchange_wait_ms",
                "exchange_values",
            )
        },
        at_floor=at_floor,
        floor_load=floor_load,
        fixed_ms=fixed,
    )
    # the compute the exchanges serve by the wall clock, as `measure` gives `link_steps`
    wall = compute + phase_ms(flat.per_rank, DESCHEDULED, len(col))
    scopes = _scope_times(flat, wall)
    return WindowFigures(m, scopes, _relative_bandwidth(flat, ranks, row, shape))


def _scope_times(flat: _Flat, wall: np.ndarray) -> ScopeTimes:
    """Per exchange scope (the group of each step for its routing, each bag of two or
    more GPUs for its Ulysses exchanges), its cost and no-wait time in every step that
    measured its exchanges (`knapformer.diagnosis.measured.link_steps`)."""
    out: ScopeTimes = {}
    if not len(flat.col):  # no step measured its compute: no scope to time
        return out
    for scope, phases in (("group", GROUP_EXCHANGES), ("bag", BAG_COLLECTIVES)):
        runs = flat.step_runs if scope == "group" else flat.bag_runs
        ordered, starts, size = runs.ordered, runs.starts, runs.size
        step = ordered(flat.col)[starts]
        measured = [p for p in phases if p in flat.present]
        exchanged = np.zeros(len(starts), bool)
        no_wait = np.zeros(len(starts))
        for p in measured:
            exchanged |= flat.present[p][step]
            ms = nan_to_zero(flat.ms(p), copy=False)
            no_wait += np.minimum.reduceat(ordered(ms), starts)
        compute = np.fmax.reduceat(ordered(wall), starts)
        keep = np.flatnonzero(exchanged & (size >= 2))
        ranks = ordered(np.asarray(flat.rows.rank, np.int64))
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = np.where(compute > 0, no_wait / compute, np.nan)
        for key, members in _scope_keys(scope, ranks, starts, size, keep).items():
            out[key] = (cost[members], no_wait[members])
    return out


def _bag_order(flat: _Flat) -> np.ndarray | None:
    """The rows in the order of `_Flat.bag_groups` (stable); None when they are in it
    already (each bag's ranks in a row, the usual layout). Rows come by step, so in a
    dense window one sort per step of its bag ids, at once, gives the order of a sort of
    the whole window."""
    groups = flat.bag_groups
    if (groups[1:] >= groups[:-1]).all():
        return None
    if flat.width is None:
        return np.argsort(flat.bag_groups, kind="stable")
    bags = np.asarray(flat.rows.bag).reshape(-1, flat.width)
    within = np.argsort(bags, axis=1, kind="stable")
    return (within + (np.arange(len(bags)) * flat.width)[:, None]).reshape(-1)


def _scope_keys(
    scope: str, ranks: np.ndarray, starts: np.ndarray, size: np.ndarray, keep: np.ndarray
) -> dict[tuple[str, tuple[int, ...]], np.ndarray]:
    """(scope, its ranks) -> the groups (indices, in step order) of ``keep`` that are
    that scope; a group's ranks are read once per distinct scope, not once per step."""
    if keep.size == 0:  # no group of this scope (only one-GPU bags): nothing to split
        return {}
    running = np.concatenate(([0], np.cumsum(ranks)))
    cum = running[starts + size] - running[starts]
    # a group is told by its first rank and size (its ranks' sum checks it): one key
    first_rank, sizes, sums = ranks[starts][keep], size[keep], cum[keep]
    key = first_rank.astype(np.int64) * (int(sizes.max(initial=0)) + 1) + sizes
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if (sums != sums[first][inverse]).any():  # bags that share a first rank and size
        signature = np.stack([first_rank, sizes, sums], axis=1)
        _, first, inverse = np.unique(signature, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")  # each scope's groups together, in step order
    bounds = np.cumsum(np.bincount(inverse, minlength=len(first)))[:-1]
    out = {}
    for at, groups in zip(first.tolist(), np.split(keep[order], bounds), strict=True):
        g = keep[at]
        out[(scope, tuple(ranks[starts[g] : starts[g] + size[g]].tolist()))] = groups
    return out


def _relative_bandwidth(
    flat: _Flat, ranks: np.ndarray, row: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """(r, s) each rank's best link over the median rank's of the same kind, the worse of
    its kinds (`knapformer.diagnosis.probed.relative_bandwidth`); NaN without a probe."""
    out = np.full(shape, np.nan)
    for best in (flat.rows.best_intra_gbps, flat.rows.best_cross_gbps):
        if best is None:
            continue
        grid = np.full(shape, np.nan)
        grid[row, flat.col] = np.asarray(best, np.float64)
        reference = nan_reduce(np.nanmedian, grid, axis=0)  # (s,)
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = np.where(reference > 0, grid / reference, np.nan)
        out = np.fmin(out, relative)
    return out
