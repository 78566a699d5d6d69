"""The affine compute model (`knapformer.planning.compute_model`): a fixed overhead shared by
the group is told apart from each rank's rate, so a lightly loaded rank is not taken for a
slow one, and the fit says when the window cannot separate the overhead."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.planning.compute_model import DEPARTURE, SEPARATION, fit_compute


def _window(rates, work, overhead_ms=20.0, ms_per_work=100.0, noise=0.03, load=None, seed=0):
    """(work, compute) of ranks × steps: compute = load[s] * (overhead + rate * work * k)."""
    rng = np.random.default_rng(seed)
    work = np.asarray(work, dtype=np.float64)
    rates = np.asarray(rates, dtype=np.float64)[:, None]
    load = np.ones(work.shape[1]) if load is None else np.asarray(load)
    compute = load * (overhead_ms + rates * work * ms_per_work)
    return work, compute * rng.lognormal(0.0, noise, work.shape)


def _uneven_work(ranks: int, steps: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = np.linspace(0.2, 1.6, ranks)[:, None]  # a light rank and a heavy one
    return base * rng.uniform(0.9, 1.1, (ranks, steps))


def test_a_lightly_loaded_healthy_rank_is_not_slow():
    # The origin-line ratio would make rank 0 (a fifth of the median work, so mostly fixed
    # overhead) look about twice as slow; the affine rates keep every rank at 1.
    work, compute = _window([1.0] * 6, _uneven_work(6, 12))
    origin = np.median(compute / work, axis=1)
    assert origin[0] / np.median(origin) > 1.5  # what the old ratio said
    fit = fit_compute(work, compute)
    assert fit.separable
    assert fit.rate == pytest.approx(np.ones(6), abs=0.1)
    assert fit.overhead_ms == pytest.approx(20.0, rel=0.35)


@pytest.mark.parametrize("slow", [0, 3, 5])
def test_a_slow_rank_is_found_wherever_its_load(slow):
    rates = [1.0] * 6
    rates[slow] = 2.0
    work, compute = _window(rates, _uneven_work(6, 12), noise=0.05, seed=slow)
    fit = fit_compute(work, compute)
    assert fit.rate[slow] > 1.6
    assert all(fit.rate[i] < 1.2 for i in range(6) if i != slow)


def test_the_machine_load_of_a_step_moves_every_rank_alike_and_is_divided_out():
    load = np.tile([1.0, 3.0, 0.5, 10.0], 3)  # tenfold swings between steps
    rates = [1.0, 1.0, 1.5, 1.0, 1.0]
    work, compute = _window(rates, _uneven_work(5, 12), load=load)
    fit = fit_compute(work, compute)
    assert fit.rate[2] == pytest.approx(1.5, abs=0.15)
    assert fit.scale_ms[3] / fit.scale_ms[0] == pytest.approx(10.0, rel=0.15)


def test_equal_work_cannot_separate_the_overhead_and_says_so():
    work = np.ones((4, 8))
    work, compute = _window([1.0, 1.0, 2.0, 1.0], work)
    fit = fit_compute(work, compute)
    assert not fit.separable and fit.overhead == 0.0
    assert "not separable" in fit.note and f"{SEPARATION:.0%}" in fit.note
    assert fit.rate[2] > 1.5  # with equal work the slow rank is found all the same


def test_missing_figures_are_left_out():
    work, compute = _window([1.0] * 4, _uneven_work(4, 6))
    compute[1, :] = np.nan
    work[2, 0] = 0.0
    fit = fit_compute(work, compute)
    assert np.isnan(fit.rate[1]) and np.isfinite(fit.rate[2])
    empty = fit_compute(np.zeros((3, 2)), np.zeros((3, 2)))
    assert np.isnan(empty.rate).all() and not empty.separable


def _measured_shape(seed: int, steps: int, noise: float, slow: float = 2.0):
    """A window shaped like the demo's `--world-size 4 --topology g1n4 --slow-rank 2`:
    work relative to the mean 0.15, 0.55, 2.86, 0.45 (rank 2 holds a video no bag can
    split), a fixed 13 ms, ~31 ms per unit of relative work, rank 2's whole compute
    ``slow`` times longer (as `knapformer.local.slowdown` sleeps), per-rank-and-step noise
    and a load that moves every rank of a step alike."""
    rng = np.random.default_rng(seed)
    work = np.array([0.15, 0.55, 2.86, 0.45])[:, None] * rng.uniform(0.95, 1.05, (4, steps))
    compute = 13.0 + 31.0 * work
    compute[2] *= slow
    compute *= rng.lognormal(0.0, noise, compute.shape) * rng.lognormal(0.0, 0.2, (1, steps))
    return work, compute


def test_the_demo_shaped_window_reads_as_a_fixed_overhead_and_one_slow_rank():
    # Two readings fit such a window: a fixed overhead and rank 2 slow (ranks 0, 1, 3 on
    # one line), or no overhead and rank 0 slow (which needs more ranks off the line).
    hits = 0
    for seed in range(40):
        fit = fit_compute(*_measured_shape(seed, steps=10, noise=0.1))
        hits += bool(fit.rate[2] > 1.5 and all(fit.rate[i] < 1.3 for i in (0, 1, 3)))
    assert hits >= 38
    fit = fit_compute(*_measured_shape(0, steps=10, noise=0.02))
    assert fit.overhead_ms == pytest.approx(13.0, rel=0.3)
    assert fit.agrees.tolist() == [True, True, False, True]
    assert fit.speed.tolist()[:2] == [1.0, 1.0] and fit.speed[2] < 0.6


def test_a_healthy_demo_shaped_window_names_nobody_and_learns_nominal_speeds():
    for seed in range(20):
        fit = fit_compute(*_measured_shape(seed, steps=8, noise=0.1, slow=1.0))
        assert (fit.speed == 1.0).sum() >= 3
        assert np.all(fit.rate < 1.3)


def _light_rank_window(excess: float, steps: int = 8):
    """5 ranks, two lightly loaded (0.6 and 0.55 of the median work, as the 1-GPU bags of
    the demo's g1n2+g2n1), with a fixed overhead of 0.4 work units. Rank 0's compute is
    ``excess`` times the group's line in every step but the first."""
    work = np.tile(np.array([0.6, 0.55, 1.0, 1.4, 1.4])[:, None], (1, steps))
    compute = 30.0 * (0.4 + work)
    compute[0, 1:] *= excess
    return work, compute


def test_a_light_ranks_compute_noise_is_not_taken_for_a_slow_rate():
    # Its rate is its compute less the overhead over its small work: a 25 % excess of
    # compute reads as a rate of 1.4. The compute does not depart by 30 %: nominal.
    fit = fit_compute(*_light_rank_window(1.25))
    assert fit.rate[0] > DEPARTURE and fit.rate_departs[0]
    assert not fit.departs.any()
    assert fit.learnt_speed.tolist() == [1.0] * 5
    # A rank whose compute departs (1.5x) is learnt, at the inverse of its rate.
    fit = fit_compute(*_light_rank_window(1.5))
    assert fit.departs.tolist() == [True, False, False, False, False]
    assert fit.learnt_speed[0] == pytest.approx(1 / fit.rate[0])
    assert fit.learnt_speed[0] < 0.6


def test_a_rank_learnt_slow_stays_learnt_while_its_rate_departs():
    fit = fit_compute(*_light_rank_window(1.25))  # the rate departs, the compute does not
    held = fit.learnt(np.array([True, False, False, False, False]))
    assert held[0] == pytest.approx(1 / fit.rate[0]) and held[0] < 0.8
    assert held[1:].tolist() == [1.0] * 4
    assert fit.learnt(np.array([False, True, False, False, False])).tolist() == [1.0] * 5


def test_a_rank_whose_slowness_costs_little_is_not_learnt_slow():
    # Rank 0 holds a sliver of the work: twice the line's compute is 15 ms of 162 (the
    # longest), below MATERIAL; the same factor on rank 2 costs 102 ms and is learnt.
    work = np.tile(np.array([0.1, 1.0, 3.0, 5.0, 5.0])[:, None], (1, 8))
    for slow, learnt in ((0, False), (2, True)):
        compute = 30.0 * (0.4 + work)
        compute[slow] *= 2.0
        fit = fit_compute(work, compute)
        assert fit.departs[slow] and fit.departs.sum() == 1
        assert fit.material[slow] == learnt and fit.material.sum() == learnt
        assert (fit.learnt_speed[slow] < 0.6) == learnt
        assert np.delete(fit.learnt_speed, slow).tolist() == [1.0] * 4


def test_an_ambiguous_window_learns_no_slow_rank():
    # Five steps of a clean g1n4 demo run on 2 cores (rank 2 holds a sequence no bag can
    # split): the line through ranks 1-3 leaves the light rank 0 off it (its small batches
    # cost more per unit of work than the workload model says), and a line with a larger
    # overhead through ranks 0, 1 and 3 leaves rank 2 off it instead, fitting as well.
    share = [
        [0.031, 0.043, 0.035, 0.045, 0.037],
        [0.133, 0.136, 0.147, 0.127, 0.141],
        [0.714, 0.706, 0.700, 0.716, 0.713],
        [0.121, 0.115, 0.119, 0.111, 0.108],
    ]
    compute = [[13.1, 10.9, 11.6, 10.8, 9.1], [19.6, 17.8, 15.4, 13.8, 15.7],
               [76.0, 76.9, 57.8, 63.6, 62.3], [18.5, 14.5, 14.9, 13.2, 12.4]]  # fmt: skip
    fit = fit_compute(share, compute)
    assert fit.ambiguous and "ambiguous" in fit.note
    assert fit.rate[2] >= DEPARTURE  # the line chosen would read rank 2 as slow
    assert fit.learnt_speed.tolist() == [1.0] * 4


def test_a_window_whose_lines_differ_by_less_than_its_noise_is_ambiguous():
    # The first three steps of a g1n4 demo run (heavy model, 2 busy cores) with rank 2's
    # GPU at 1.5x: the line that puts the light rank 0 off fits better than the true one
    # (rank 2 off), by less than what the step-to-step scatter moves the scores by. It
    # named the healthy rank 0 slow_gpu before the noise counted.
    share = [[0.047, 0.064, 0.052], [0.195, 0.198, 0.209],
             [0.607, 0.594, 0.592], [0.151, 0.144, 0.148]]  # fmt: skip
    compute = [[78.3, 55.5, 44.8], [95.0, 103.3, 71.8],
               [376.8, 314.1, 268.3], [81.8, 73.0, 56.4]]  # fmt: skip
    fit = fit_compute(share, compute)
    assert fit.agrees.tolist() == [False, True, True, True]
    assert fit.ambiguous and fit.learnt_speed.tolist() == [1.0] * 4
    # The same medians without the scatter: the better line wins on its score alone.
    steady = np.median(np.asarray(compute), axis=1, keepdims=True).repeat(3, axis=1)
    work = np.median(np.asarray(share), axis=1, keepdims=True).repeat(3, axis=1)
    quiet = fit_compute(work, steady)
    assert quiet.agrees.tolist() == [False, True, True, True] and not quiet.ambiguous
