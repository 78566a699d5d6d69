"""Per-rank verdicts over a window of measured steps (knapformer.diagnosis.stragglers)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.stragglers import THRESHOLDS, WINDOW, Thresholds, analyse, rank_steps
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.measured_plans import measured_run, with_measurements


def _figures(plans):
    return [measure(p).figures() for p in plans]


def _named(report) -> dict[int, str]:
    return {r.rank: r.verdict for r in report.ranks if r.verdict != "ok"}


@pytest.mark.parametrize(
    ("slow_rank", "factor", "noise", "seed"),
    [(5, 2.0, 0.05, 0), (1, 2.0, 0.10, 1), (3, 1.5, 0.10, 2), (6, 1.5, 0.15, 3)],
)
def test_an_injected_slow_rank_is_named_within_10_steps_and_nobody_else(
    slow_rank, factor, noise, seed
):
    plans = measured_run(30, slow_rank=slow_rank, slow_factor=factor, noise=noise, seed=seed)
    figures = _figures(plans)
    first = None
    for k in range(1, len(figures) + 1):
        named = _named(analyse(figures[:k]))
        assert set(named) <= {slow_rank}, f"after {k} steps: {named}"
        if named and first is None:
            first = k
            assert named == {slow_rank: "slow_gpu"}
        if first is not None:
            assert named == {slow_rank: "slow_gpu"}, f"rank dropped after {k} steps"
    assert first is not None and first <= 10
    verdict = next(r for r in analyse(figures).ranks if r.rank == slow_rank)
    assert verdict.ratio == pytest.approx(factor, rel=0.15)
    assert verdict.last_arrivals >= 0.8 * verdict.steps  # the others waited for it
    others = [r for r in analyse(figures).ranks if r.rank != slow_rank]
    assert all(r.wait_ms > 10 * verdict.wait_ms for r in others)


def test_one_bad_step_names_nobody():
    plans = measured_run(12, noise=0.05, seed=4)
    rng = np.random.default_rng(9)
    plans[6] = with_measurements(plans[6], rng, slow_rank=2, slow_factor=3.0)
    report = analyse(_figures(plans))
    assert _named(report) == {}
    assert next(r for r in report.ranks if r.rank == 2).slow_steps == 1


def test_too_few_steps_for_a_verdict():
    # slow_gpu waits for `min_steps_gpu` steps, the other verdicts for `min_steps`.
    assert THRESHOLDS.min_steps_gpu > THRESHOLDS.min_steps
    figures = _figures(measured_run(THRESHOLDS.min_steps_gpu, slow_rank=4, slow_factor=3.0))
    assert _named(analyse(figures[:-1])) == {}
    assert _named(analyse(figures)) == {4: "slow_gpu"}
    floor = _figures(
        measured_run(THRESHOLDS.min_steps, topology="g1n4", codes="g1b1i1024f17s1,g3b4i256f1s0")
    )
    assert _named(analyse(floor[:-1])) == {}
    assert _named(analyse(floor)) == {0: "layout_floor"}


def test_a_rank_holding_a_sequence_no_bag_can_split_is_the_layout_floor_not_a_slow_gpu():
    # One video per step on GPU 0 of g1n4: no bag can split it, so GPU 0 stays heavy.
    plans = measured_run(6, topology="g1n4", codes="g1b1i1024f17s1,g3b4i256f1s0", seed=5)
    assert min(p.stats.imbalance_after for p in plans) > 2
    report = analyse(_figures(plans))
    assert _named(report) == {0: "layout_floor"}
    heavy = report.ranks[0]
    assert heavy.decided_by == "predicted_load" and heavy.at_floor_steps == 6
    assert heavy.predicted_load >= THRESHOLDS.heavy_load
    assert heavy.ratio == pytest.approx(1.0, abs=0.15)  # it took what the plan predicted
    assert report.straggler.rank == 0


def test_a_slow_gpu_the_planner_already_unloads_is_still_a_slow_gpu():
    """With learned speeds the slow GPU gets less work; its compute per unit of work
    (predicted share at nominal speed) still shows it is slow, and the plan does not
    overload it (so: not data_imbalance)."""
    model = WorkloadModel(3072, 0.4)
    rng = np.random.default_rng(6)
    mix = parse_mix("g8b4i512f1s0")
    speed = [1.0] * 8
    speed[3] = 0.5
    plans = [
        with_measurements(
            plan_routing(sample_lengths(mix, rng), "g1n8", model, step=s, gpu_speed=speed),
            rng,
            speeds={3: 0.5},
        )
        for s in range(8)
    ]
    report = analyse(_figures(plans))
    assert _named(report) == {3: "slow_gpu"}
    slow = report.ranks[3]
    assert slow.predicted_share < 0.75 / 8  # fed less
    assert slow.ratio == pytest.approx(2.0, rel=0.15)
    assert slow.predicted_load < THRESHOLDS.heavy_load


def test_the_window_describes_the_run_now():
    slow = measured_run(10, slow_rank=2, slow_factor=2.0, seed=7)
    healthy = measured_run(WINDOW, seed=8)
    figures = _figures(slow + healthy)
    assert _named(analyse(figures)) == {}  # the last WINDOW steps: recovered
    # the whole run: slow in 10 of 30 steps is not persistent; in 10 of 15 it is
    assert _named(analyse(figures, window=None)) == {}
    assert _named(analyse(figures[:15], window=None)) == {2: "slow_gpu"}
    assert _named(analyse(figures[:15], window=None, thresholds=Thresholds(persistence=0.7))) == {}


def test_rank_steps_lines_up_ranks_across_plans_of_other_groups():
    a = _figures(measured_run(2, seed=10))
    b = _figures(measured_run(1, topology="g1n4", codes="g4b4i256f1s0", seed=11))
    m = rank_steps(a + b)
    assert m.ranks.tolist() == list(range(8))
    assert m.ratio.shape == (8, 3)
    assert np.isnan(m.ratio[4:, 2]).all() and np.isfinite(m.ratio[:4, 2]).all()
    np.testing.assert_allclose(m.wait_ms[:, 0], a[0].wait_ms)
    report = analyse(a + b)
    assert [r.steps for r in report.ranks] == [3] * 4 + [2] * 4


def test_as_dict_is_plain_json_with_missing_figures_as_null():
    import json

    report = analyse(_figures(measured_run(3, seed=12)))
    rows = json.loads(json.dumps([r.as_dict() for r in report.ranks], allow_nan=False))
    assert [row["rank"] for row in rows] == list(range(8))
    assert {"rank", "verdict", "predicted_share", "measured_ms", "ratio", "wait_ms"} <= set(rows[0])
    idle = dataclasses.replace(report.ranks[0], ratio=float("nan"))
    assert idle.as_dict()["ratio"] is None


def test_an_ambiguous_window_names_no_rank_slow_by_its_rate():
    from knapformer.diagnosis.measured import RankFigures

    # The window of tests/test_compute_model.py's ambiguous case (a clean g1n4 demo run):
    # two lines fit as well, one with rank 2 off it, one with rank 0. Rank 2 is named for
    # the layout floor it holds, and nobody slow_gpu.
    share = np.array(
        [
            [0.031, 0.043, 0.035, 0.045, 0.037],
            [0.133, 0.136, 0.147, 0.127, 0.141],
            [0.714, 0.706, 0.700, 0.716, 0.713],
            [0.121, 0.115, 0.119, 0.111, 0.108],
        ]
    )
    compute = np.array(
        [
            [13.1, 10.9, 11.6, 10.8, 9.1],
            [19.6, 17.8, 15.4, 13.8, 15.7],
            [76.0, 76.9, 57.8, 63.6, 62.3],
            [18.5, 14.5, 14.9, 13.2, 12.4],
        ]
    )
    figures = [
        RankFigures(step=s, gpus=np.arange(4, dtype=np.int32), phase="compute",
                    compute_ms=compute[:, s], predicted_share=share[:, s],
                    predicted_load=4 * share[:, s], wait_ms=compute[:, s].max() - compute[:, s],
                    straggler=2, shown_total=1.0, load_axis="work",
                    step_ms=np.full(4, 1.2 * compute[:, s].max()), floor_load=4 * share[2, s],
                    at_floor=np.arange(4) == 2)
        for s in range(5)
    ]  # fmt: skip
    report = analyse(figures)
    assert report.fit.ambiguous
    assert _named(report) == {2: "layout_floor"}
    # ... which kept rank 2 (its rate past slow_ratio on the line chosen) from slow_gpu;
    # with every rate below it, the ambiguity withholds nothing (the CLI says "no straggler")
    assert report.ranks[2].ratio >= THRESHOLDS.slow_ratio and report.withheld_by_ambiguity
    below = [dataclasses.replace(r, ratio=min(r.ratio, 1.2)) for r in report.ranks]
    assert not dataclasses.replace(report, ranks=below).withheld_by_ambiguity
    # the same window with rank 2 at 1.6x in every step is not ambiguous: named
    slow = [dataclasses.replace(f, compute_ms=f.compute_ms * [1, 1, 1.6, 1]) for f in figures]
    assert _named(analyse(slow)) == {2: "slow_gpu"}


def test_nan_reduce_gives_nan_for_a_slice_without_values_and_never_warns():
    import warnings

    from knapformer.contract.nan_reduce import nan_reduce

    m = np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, np.nan]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = nan_reduce(np.nanmedian, m, axis=1)
        cols = nan_reduce(np.nanmax, m, axis=0)
        assert np.isnan(nan_reduce(np.nanmean, m[1]))
        assert np.isnan(nan_reduce(np.nanmin, np.zeros(0)))
        assert nan_reduce(np.nanmedian, np.zeros((0, 3)), axis=0).shape == (3,)
    assert rows[0] == 2.0 and np.isnan(rows[1])
    assert cols[0] == 1.0 and np.isnan(cols[1]) and cols[2] == 3.0
    assert nan_reduce(np.nanmax, [np.inf, np.nan]) == np.inf  # only NaN means "no value"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nan_reduce_median_is_numpys_on_every_axis_and_leaves_its_input(dtype):
    # One sort per call, along a contiguous copy, counts from one isnan pass: numpy's
    # values, slices with no value NaN, and the caller's array never sorted in place.
    import warnings

    from knapformer.contract.nan_reduce import nan_reduce

    rng = np.random.default_rng(5)
    for shape in [(7, 9), (1, 6), (6, 1), (3, 4, 5)]:
        for share in (0.0, 0.3, 0.9):
            x = rng.normal(size=shape).astype(dtype)
            x[rng.random(shape) < share] = np.nan
            kept = x.copy()
            for axis in range(x.ndim):
                got = nan_reduce(np.nanmedian, x, axis=axis)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # numpy warns on an all-NaN slice
                    expected = np.nanmedian(x.astype(np.float64), axis=axis)
                assert np.array_equal(got, expected, equal_nan=True), (shape, share, axis)
            assert np.array_equal(x, kept, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nan_to_zero_gives_numpys_nan_to_num(dtype):
    from knapformer.contract.nan_reduce import nan_to_zero

    values = np.array([1.5, np.nan, np.inf, -np.inf, -2.0, 0.0], dtype=dtype)
    expected = np.nan_to_num(np.asarray(values, np.float64))
    out = nan_to_zero(values)
    assert out.dtype == np.float64 and np.array_equal(out, expected)
    assert np.isnan(values[1])  # a copy by default
    assert np.array_equal(nan_to_zero([np.nan, 2]), [0.0, 2.0])  # a list too
    own = np.asarray(values, np.float64).copy()
    assert nan_to_zero(own, copy=False) is own and np.array_equal(own, expected)


def test_the_diagnosis_never_touches_the_process_wide_warning_filters(monkeypatch):
    """The dashboard analyses in its server's threads, where ``warnings.catch_warnings``
    (process-wide filters) races. A window with ranks absent from a step and phases
    nobody measured (all-NaN rows and columns) must analyse without it and warn nothing."""
    import warnings

    from knapformer.diagnosis.step_loss import step_losses, summarise
    from knapformer.planning.compute_model import fit_compute

    def refuse(*args, **kwargs):
        raise AssertionError("warnings.catch_warnings is not thread-safe")

    a = _figures(measured_run(4, slow_rank=1, slow_factor=2.0, seed=13))
    b = _figures(measured_run(1, topology="g1n4", codes="g4b4i256f1s0", seed=14))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(warnings, "catch_warnings", refuse)
        for window in (a + b, b, a[:1]):
            report = analyse(window)
            m = rank_steps(window)
            summarise(step_losses(window, m))
            fit_compute(m.predicted_shown, m.compute_ms).material  # noqa: B018
        assert report.ranks


def _slow_bag_exchanges(plan, ranks: set[int], ms: float, slow_link: int | None = None):
    """``plan`` with ``ms`` more in each Ulysses exchange for every rank of ``ranks`` (the
    bag's exchanges slow by their timings), and a link probe of every round in which each
    pair takes 1 ms, or 8 ms where ``slow_link`` is one end."""
    from knapformer.contract.probe import LinkProbe, probe_partners, probe_round_count

    per_rank = {k: list(v) for k, v in plan.measurements.per_rank_ms.items()}
    for phase in ("pre_attn", "post_attn"):
        for i, g in enumerate(plan.gpus):
            if g in ranks:
                per_rank[phase][i] += ms
    n = len(plan.gpus)
    rounds = list(range(probe_round_count(n)))
    times = [
        [8.0 if slow_link in (plan.gpus[i], plan.gpus[p]) else 1.0 for i, p in
         enumerate(probe_partners(n, r))]
        for r in rounds
    ]  # fmt: skip
    probe = LinkProbe(bytes=2**20, rounds=rounds, ms=times, node=[0] * n)
    measurements = plan.measurements.model_copy(
        update={"per_rank_ms": per_rank, "link_probe": probe}
    )
    return plan.model_copy(update={"measurements": measurements})


def test_a_slow_bag_exchange_is_a_slow_link_scope_unless_the_probe_clears_its_ranks():
    """The exchange-scope verdict is the timings' fallback; the link probe measures each
    rank's links alone. Exchanges slow while the probe finds every link of the bag's
    ranks healthy (on an oversubscribed host, peers waiting for a core) name nothing."""
    from knapformer.diagnosis.stragglers import describe_link

    plans = measured_run(8, seed=15)
    bag = {2, 3}  # g1n2+g2n1+g4n1: the 2-GPU bag
    assert any(set(b) == bag for b in plans[0].bags)

    def scope(report):
        return next(v for v in report.links if set(v.ranks) == bag)

    timed_only = [
        p.model_copy(update={"measurements": _slow_bag_exchanges(p, bag, 500.0).measurements
                             .model_copy(update={"link_probe": None})})
        for p in plans
    ]  # fmt: skip
    report = analyse(_figures(timed_only))
    assert scope(report).verdict == "slow_link" and not scope(report).cleared_by_probe
    assert [set(v.ranks) for v in report.slow_links] == [bag]

    cleared = analyse(_figures([_slow_bag_exchanges(p, bag, 500.0) for p in plans]))
    assert scope(cleared).verdict == "ok" and scope(cleared).cleared_by_probe
    assert cleared.slow_links == [] and _named(cleared) == {}
    assert "probe finds every link of these ranks healthy" in describe_link(scope(cleared))

    # the probe finds rank 3's link slow: the rank is named, and its scope stays slow
    slow = analyse(_figures([_slow_bag_exchanges(p, bag, 500.0, slow_link=3) for p in plans]))
    assert _named(slow) == {3: "slow_link"}
    assert scope(slow).verdict == "slow_link" and not scope(slow).cleared_by_probe


def test_the_probe_never_clears_the_group_s_exchanges():
    """The probe compares each rank's links with the group's: a network slow for every
    rank looks healthy to it, so the group's slow routing all-to-alls stay named."""
    plans = []
    for p in measured_run(8, seed=16):
        healthy_probe = _slow_bag_exchanges(p, set(), 0.0)
        per_rank = dict(healthy_probe.measurements.per_rank_ms)
        for phase in ("route", "reverse_route"):
            per_rank[phase] = [t + 500.0 for t in per_rank[phase]]
        m = healthy_probe.measurements.model_copy(update={"per_rank_ms": per_rank})
        plans.append(p.model_copy(update={"measurements": m}))
    report = analyse(_figures(plans))
    assert [v.scope for v in report.slow_links] == ["group"]
    assert not report.links[0].cleared_by_probe and _named(report) == {}


def test_the_headline_never_calls_a_rank_past_the_slow_ratio_as_predicted():
    from knapformer.diagnosis.stragglers import THRESHOLDS, headline

    # rank 5 twice as slow, but only 3 measured steps: too few to name it slow_gpu yet
    early = analyse([measure(p).figures() for p in measured_run(3, slow_rank=5, slow_factor=2)])
    assert early.straggler is None
    line = headline(early)
    assert line.startswith("none named yet: rank 5's rate is") and "takes about" not in line
    assert f"at least {THRESHOLDS.min_steps_gpu} measured steps" in line
    # enough steps: named, with what it costs
    late = analyse([measure(p).figures() for p in measured_run(8, slow_rank=5, slow_factor=2)])
    assert headline(late).startswith("slow_gpu: rank 5 (major: costs ")
    clean = analyse([measure(p).figures() for p in measured_run(8, noise=0.02)])
    assert headline(clean) == "none: every rank takes about the time the plan predicts"


def _window(share: np.ndarray, rate: np.ndarray, steps: int = 8, step_ms: float = 400.0):
    """Measured figures of 4 ranks over ``steps`` steps: each rank's compute its share of
    200 ms times its rate, plus 3 ms of overhead, with a little noise."""
    from knapformer.diagnosis.measured import RankFigures

    rng = np.random.default_rng(0)
    balanced = np.ones(len(share))  # the plan's predicted load: as the ideal everywhere
    out = []
    for s in range(steps):
        compute = 3.0 + 200.0 * share * rate * rng.lognormal(0.0, 0.02, len(share))
        out.append(
            RankFigures(step=s, gpus=np.arange(len(share), dtype=np.int32), phase="compute",
                        compute_ms=compute, predicted_share=share, predicted_load=balanced,
                        wait_ms=compute.max() - compute, straggler=int(np.argmax(compute)),
                        shown_total=1.0, load_axis="work", step_ms=np.full(len(share), step_ms))
        )  # fmt: skip
    return out


def test_a_rank_given_little_work_is_not_named_by_its_rate_alone():
    from knapformer.diagnosis.stragglers import THRESHOLDS, headline

    # rank 0 reads 1.8x on 4 % of the work: under half the median rank's work, its rate
    # rests on too little to name it for what costs the step a few ms
    light = analyse(_window(np.array([0.04, 0.14, 0.71, 0.11]), np.array([1.8, 1, 1, 1])))
    r0 = light.ranks[0]
    assert r0.ratio > 1.5 and not r0.rate_readable and r0.verdict == "ok"
    assert "too little to read a rate from" in headline(light)
    # the same rate on an equal share is named, however little it costs (minor)
    equal = analyse(_window(np.full(4, 0.25), np.array([1.5, 1, 1, 1]), step_ms=2000.0))
    assert equal.ranks[0].verdict == "slow_gpu" and equal.ranks[0].severity == "minor"
    assert equal.ranks[0].cost_share < THRESHOLDS.material
    # and a light rank whose rate costs the step enough is named after all
    costly = analyse(
        _window(np.array([0.04, 0.14, 0.71, 0.11]), np.array([4, 1, 1, 1]), step_ms=60.0)
    )
    assert costly.ranks[0].verdict == "slow_gpu" and costly.ranks[0].severity == "major"
