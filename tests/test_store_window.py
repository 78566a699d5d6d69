"""The straggler analysis over a window of store rows (`window_figures`, all steps at
once) says what it says over the same steps' plans (`measure`, one plan at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.contract.phases import RECORDED_PHASES
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.rank_steps import rank_steps
from knapformer.diagnosis.step_loss import window_losses
from knapformer.diagnosis.store_window import WindowRows, window_figures
from knapformer.diagnosis.stragglers import analyse, judge
from knapformer.testing.measured_plans import measured_run


def _rows(plans) -> WindowRows:
    """The plans' figures as the run store keeps them: one row per rank per step."""
    per_step = [(p, p.stats, len(p.gpus)) for p in plans]

    def cat(values) -> np.ndarray:
        return np.concatenate([np.asarray(v) for v in values])

    def phase(name: str) -> np.ndarray:
        got = [p.measurements.per_rank_ms.get(name) for p, _, _ in per_step]
        return cat(
            np.full(n, np.nan) if v is None else v
            for v, (_, _, n) in zip(got, per_step, strict=True)
        )

    return WindowRows(
        step=cat([np.full(n, p.step) for p, _, n in per_step]),
        rank=cat([p.gpus for p, _, _ in per_step]),
        bag=cat([st.gpu_bag for _, st, _ in per_step]),
        phase_ms={name: phase(name) for name in RECORDED_PHASES},
        work=cat([st.work_after for _, st, _ in per_step]),
        load=cat([st.load_after / st.mean_load for _, st, _ in per_step]),
        moved_tokens=cat([st.tokens_sent + st.tokens_received for _, st, _ in per_step]),
        steps=np.array([p.step for p in plans]),
        mean_load=np.ones(len(plans)),
        floor=np.array([measure(p).floor_load for p in plans]),
        token_dim=np.ones(len(plans)),
        shown_total=np.ones(len(plans)),
    )


@pytest.mark.parametrize(
    ("topology", "slow"),
    [
        ("g1n2+g2n1+g4n1", {"slow_rank": 5, "slow_factor": 2.0}),
        ("g2n2+g4n1", {}),
        ("g1n8", {"slow_rank": 2, "slow_factor": 2.0}),  # no multi-GPU bag: no bag scope
    ],
)
def test_store_rows_give_the_plans_verdicts(topology, slow):
    plans = measured_run(10, topology=topology, seed=3, **slow)
    figures = [measure(p).figures() for p in plans]
    on_plans = analyse(figures, None)
    w = window_figures(_rows(plans))
    on_rows = judge(w.m, w.scopes, w.bandwidth)
    assert [r.verdict for r in on_rows.ranks] == [r.verdict for r in on_plans.ranks]
    if slow:
        assert on_rows.straggler.rank == slow["slow_rank"]
    for a, b in zip(on_plans.ranks, on_rows.ranks, strict=True):
        for name, value in a.as_dict().items():
            if isinstance(value, float):
                assert b.as_dict()[name] == pytest.approx(value, rel=1e-6), name
            else:
                assert b.as_dict()[name] == value, name
    assert [v.as_dict() for v in on_rows.links] == [v.as_dict() for v in on_plans.links]
    m = rank_steps(figures)
    assert w.m.straggler == m.straggler
    for name in ("compute_ms", "wait_ms", "exchange_wait_ms", "step_ms", "host_ms"):
        np.testing.assert_allclose(getattr(w.m, name), getattr(m, name), rtol=1e-6)
    lost = [x.lost_ms for x in window_losses(w.m)]
    assert lost == pytest.approx([x.lost_ms for x in window_losses(m)], rel=1e-6)


def test_steps_without_a_compute_phase_are_left_out_as_by_the_plans():
    plans = measured_run(6, seed=4)
    rows = _rows(plans)
    unmeasured = rows.step == plans[2].step
    phases = {p: np.where(unmeasured, np.nan, v) for p, v in rows.phase_ms.items()}
    w = window_figures(WindowRows(**{**rows.__dict__, "phase_ms": phases}))
    assert w.m.steps == [p.step for p in plans if p.step != plans[2].step]


def test_a_window_where_no_step_measured_compute_has_no_steps():
    # A recorder without measurements: every phase column null. The reader then says so
    # in one line (`knapformer stragglers`), which needs this to return, not raise.
    rows = _rows(measured_run(3, seed=5))
    phases = {p: np.full_like(v, np.nan) for p, v in rows.phase_ms.items()}
    w = window_figures(WindowRows(**{**rows.__dict__, "phase_ms": phases}))
    assert w.m.steps == [] and w.scopes == {}


@pytest.mark.parametrize("width", [1, 2, 7])
def test_a_dense_window_takes_the_waits_and_presence_the_scatter_gives(width):
    # Every step holding the same ranks, the per-step reductions run on an (s, width)
    # matrix; they must give, bit for bit, what the scatter over group ids gives.
    from knapformer.diagnosis.measured import group_waits
    from knapformer.diagnosis.store_window import _in_steps, _step_waits

    rng = np.random.default_rng(width)
    steps = 9
    t = rng.lognormal(0, 1, steps * width)
    t[rng.random(t.size) < 0.2] = np.nan
    t[2 * width : 3 * width] = np.nan  # a step nobody measured
    t[4 * width] = np.inf  # hostile: as the scatter takes it
    col = np.repeat(np.arange(steps), width)
    waits = _step_waits(t.copy(), width)
    assert waits.dtype == np.float64
    with np.errstate(invalid="ignore"):  # inf - inf in the scatter too
        assert np.array_equal(waits, group_waits(t, col))
    finite = np.isfinite(t)
    assert np.array_equal(_in_steps(finite, col, steps, width), _in_steps(finite, col, steps, None))
    assert not _in_steps(finite, col, steps, width)[2]


@pytest.mark.parametrize("interleaved", [False, True])
def test_waits_by_runs_of_a_group_are_the_scatters(interleaved):
    # The bag collectives' waits reduce each bag's run of rows (after a sort where bags
    # interleave); bit for bit what the scatter over group ids gives, singletons,
    # unmeasured groups, unused ids and a hostile inf included.
    from knapformer.diagnosis.measured import group_waits
    from knapformer.diagnosis.store_window import _run_waits, _Runs

    rng = np.random.default_rng(11)
    group = np.sort(rng.integers(0, 40, 300)) * 2  # odd ids unused: empty groups
    if interleaved:
        group = rng.permutation(group)
    t = rng.lognormal(0, 1, group.size)
    t[rng.random(t.size) < 0.2] = np.nan
    t[group == group[7]] = np.nan  # a group nobody measured
    t[3] = np.inf
    order = np.argsort(group, kind="stable") if interleaved else None
    runs = _Runs.of(group, order)
    assert (runs.size >= 1).all() and runs.size.sum() == group.size
    with np.errstate(invalid="ignore"):  # inf - inf, in both
        waits, scatter = _run_waits(t.copy(), runs), group_waits(t, group)
    assert waits.dtype == np.float64 and np.array_equal(waits, scatter)
    assert (waits > 0).any() and (waits == 0).any()
    assert _run_waits(np.zeros(0), _Runs.of(np.zeros(0, np.int64), None)).shape == (0,)


def test_a_dense_window_orders_its_bags_as_a_sort_of_the_whole_window():
    from knapformer.diagnosis.store_window import _bag_order, _measured_only

    rows = _rows(measured_run(5, topology="g1n2+g2n1+g4n1", seed=6))
    # each bag's ranks in a row (the usual layout): in order already
    flat = _measured_only(rows)
    assert flat.width == 8 and _bag_order(flat) is None
    assert np.array_equal(np.argsort(flat.bag_groups, kind="stable"), np.arange(len(rows.step)))
    # bag ids against the ranks' order: one sort per step gives the whole window's sort
    flat = _measured_only(WindowRows(**{**rows.__dict__, "bag": rows.bag.max() - rows.bag}))
    assert np.array_equal(_bag_order(flat), np.argsort(flat.bag_groups, kind="stable"))


def test_a_dense_window_gives_what_the_general_path_gives(monkeypatch):
    import dataclasses

    import knapformer.diagnosis.store_window as store_window

    rows = _rows(measured_run(8, topology="g1n2+g2n1+g4n1", seed=7, slow_rank=5, slow_factor=2.0))
    dense = window_figures(rows)
    monkeypatch.setattr(store_window, "_dense_width", lambda rows: None)
    general = window_figures(rows)
    for field in dataclasses.fields(dense.m):
        a, b = getattr(dense.m, field.name), getattr(general.m, field.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), field.name
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), field.name
            for key in a:
                assert np.array_equal(a[key], b[key], equal_nan=True), (field.name, key)
        elif field.name != "fit":
            assert a == b, field.name
    assert dense.scopes.keys() == general.scopes.keys()
    for key, (cost, no_wait) in dense.scopes.items():
        assert np.array_equal(cost, general.scopes[key][0], equal_nan=True), key
        assert np.array_equal(no_wait, general.scopes[key][1]), key
    assert np.array_equal(dense.bandwidth, general.bandwidth, equal_nan=True)
    said = [judge(w.m, w.scopes, w.bandwidth) for w in (dense, general)]
    assert [r.as_dict() for r in said[0].ranks] == [r.as_dict() for r in said[1].ranks]
    assert said[0].straggler.rank == 5
