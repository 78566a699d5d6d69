"""The compute model's robust line (`knapformer.planning.line_fit`) at any scale: above
`EXACT_RANKS` ranks the overhead grid replaces the line through every pair, and finds what
the exact search finds: the planted slow rank, the true overhead and ms per unit of work,
and a window two readings fit alike."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.planning import line_fit
from knapformer.planning.compute_model import fit_compute

OVERHEAD_MS, MS_PER_WORK = 20.0, 100.0


def _window(ranks: int, steps: int, slow: dict[int, float], seed: int = 0, overhead=OVERHEAD_MS):
    """(work, compute) of ranks x steps: work rising from 0.2 to 1.6 by rank (so the
    overhead is separable), compute = load[s] * (overhead + rate * 100 ms * work) with 5 %
    noise per rank-step and a load that moves each step's ranks alike by 20 %."""
    rng = np.random.default_rng(seed)
    work = np.linspace(0.2, 1.6, ranks)[:, None]
    work = work * rng.uniform(0.9, 1.1, (ranks, steps))
    rate = np.ones(ranks)
    rate[list(slow)] = list(slow.values())
    load = rng.lognormal(0.0, 0.2, (1, steps))
    compute = load * (overhead + rate[:, None] * MS_PER_WORK * work)
    return work, compute * rng.lognormal(0.0, 0.05, (ranks, steps)), load[0]


def _truth(fit, load: np.ndarray) -> tuple[float, float]:
    """(overhead ms, ms per unit of work) of ``fit`` at the window's load of 1."""
    scale = np.median(fit.scale_ms / load)
    return scale * fit.overhead, scale


def test_a_1024_rank_window_finds_its_slow_rank_and_the_true_line():
    slow = 517
    work, compute, load = _window(1024, 16, {slow: 1.5})
    fit = fit_compute(work, compute)
    assert np.flatnonzero(~fit.agrees).tolist() == [slow]
    assert fit.rate[slow] == pytest.approx(1.5, abs=0.05)
    others = np.delete(fit.rate, slow)
    assert np.abs(others - 1.0).max() < 0.15
    overhead_ms, ms_per_work = _truth(fit, load)
    assert overhead_ms == pytest.approx(OVERHEAD_MS, rel=0.15)
    assert ms_per_work == pytest.approx(MS_PER_WORK, rel=0.05)
    assert not fit.ambiguous
    learnt = fit.learnt_speed  # what the history cost model would plan with
    assert learnt[slow] == pytest.approx(1 / 1.5, rel=0.05)
    assert (np.delete(learnt, slow) == 1.0).all()


def test_a_large_overhead_is_found_at_1024_ranks():
    # 60 ms of a compute of 80 to 220 ms: a line through the origin fits a band of ranks
    # only; the fit finds the line every healthy rank is on, and the overhead's size.
    work, compute, load = _window(1024, 10, {700: 2.0}, seed=1, overhead=60.0)
    fit = fit_compute(work, compute)
    assert np.flatnonzero(~fit.agrees).tolist() == [700]
    overhead_ms, ms_per_work = _truth(fit, load)
    assert overhead_ms == pytest.approx(60.0, rel=0.1)
    assert ms_per_work == pytest.approx(MS_PER_WORK, rel=0.05)
    assert fit.rate[700] == pytest.approx(2.0, abs=0.1)


def test_the_1024_rank_fit_agrees_with_the_exact_fit_of_a_subset():
    # What the pairs of 48 ranks (the slow one among them) say of the group is what the
    # grid says over all 1,024: the same rank off, the same line.
    slow = 300
    work, compute, load = _window(1024, 12, {slow: 1.4}, seed=3)
    whole = fit_compute(work, compute)
    subset = np.sort(np.append(np.random.default_rng(4).choice(1024, 47, replace=False), slow))
    subset = np.unique(subset)
    assert len(subset) <= line_fit.EXACT_RANKS  # searched by every pair
    part = fit_compute(work[subset], compute[subset])
    at = int(np.flatnonzero(subset == slow)[0])
    assert np.flatnonzero(~part.agrees).tolist() == [at]
    assert np.flatnonzero(~whole.agrees).tolist() == [slow]
    assert whole.rate[slow] == pytest.approx(part.rate[at], abs=0.05)
    assert _truth(whole, load) == pytest.approx(_truth(part, load), rel=0.15)


@pytest.mark.parametrize("seed", range(4))
def test_above_the_exact_size_the_grid_reads_a_window_as_every_pair_does(seed, monkeypatch):
    # Just above EXACT_RANKS both searches are cheap: the same ranks off, the same
    # overhead and slope (the refinement starts from the ranks on the line, not the line).
    slow = {5: 1.6, 40: 2.0, 77: 1.35}
    work, compute, _ = _window(96, 10, slow, seed=seed)
    grid = fit_compute(work, compute)
    monkeypatch.setattr(line_fit, "EXACT_RANKS", 10**9)
    exact = fit_compute(work, compute)
    assert np.flatnonzero(~grid.agrees).tolist() == sorted(slow)
    assert np.array_equal(grid.agrees, exact.agrees)
    assert grid.overhead == pytest.approx(exact.overhead, rel=1e-9)
    np.testing.assert_allclose(grid.scale_ms, exact.scale_ms, rtol=1e-9)
    assert grid.ambiguous == exact.ambiguous


@pytest.mark.parametrize("ranks", [96, 1024])
def test_a_window_two_lines_fit_alike_is_ambiguous_at_any_size(ranks, monkeypatch):
    # Half the ranks 1.6x slower than the other half: "the first half is slow" and "the
    # second half is slow" put as many ranks off, and fit as well. The grid must see the
    # two sets of ranks off as different sets (it compares them by their keys' sums).
    work, compute, _ = _window(ranks, 10, {i: 1.6 for i in range(0, ranks, 2)}, seed=7)
    fit = fit_compute(work, compute)
    assert fit.ambiguous and "ambiguous" in fit.note
    assert not fit.learnt_speed.min() < 1.0  # an ambiguous window learns no slow rank
    if ranks <= 96:  # the exact enumeration says so too
        monkeypatch.setattr(line_fit, "EXACT_RANKS", 10**9)
        assert fit_compute(work, compute).ambiguous


def test_without_separable_work_the_grid_tries_lines_through_the_origin():
    # Equal work: the overhead cannot be told apart, every line goes through the origin,
    # and the slow rank is found all the same.
    rng = np.random.default_rng(2)
    work = np.ones((200, 8))
    rate = np.ones(200)
    rate[123] = 1.8
    compute = MS_PER_WORK * rate[:, None] * work * rng.lognormal(0.0, 0.05, work.shape)
    fit = fit_compute(work, compute)
    assert not fit.separable and fit.overhead == 0.0
    assert np.flatnonzero(~fit.agrees).tolist() == [123]
    assert fit.rate[123] == pytest.approx(1.8, abs=0.1)


def test_ranks_with_no_figure_are_on_no_lines_count():
    work, compute, _ = _window(160, 8, {10: 1.5}, seed=5)
    compute[20:40] = np.nan  # twenty ranks never measured
    compute[50, :4] = np.nan  # one measured in half the steps
    fit = fit_compute(work, compute)
    assert np.flatnonzero(~fit.agrees).tolist() == [10, *range(20, 40)]
    assert np.isnan(fit.rate[20:40]).all() and np.isfinite(fit.rate[50])
    assert not fit.ambiguous
