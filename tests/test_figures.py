"""The plotly figure builders shared by the dashboard and the static report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from knapformer.visualization import palette
from knapformer.visualization.axes import LINE_PX
from knapformer.visualization.figures import (
    TRAFFIC_PLOT_PX,
    bag_load_figure,
    empty_figure,
    sequence_rows,
    timeline_columns,
    timeline_figure,
    traffic_figure,
)
from knapformer.visualization.straggler_figures import (
    predicted_vs_measured_figure,
    ratio_heatmap,
    wait_heatmap,
)

from knapformer.contract.plan_io import read_plans
from knapformer.contract.stats import StepSummary, bag_runs, linear_share, summarize
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.stragglers import analyse, rank_steps, row_medians
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.measured_plans import with_measurements


@pytest.fixture
def plan8(plan8_path):
    return read_plans(plan8_path, on_error="raise").plans[0]


@pytest.fixture
def steps50(steps50_path):
    return read_plans(steps50_path, on_error="raise").records


def _bag_order(plan):
    pos = {g: i for i, g in enumerate(plan.gpus)}
    return [pos[g] for m in plan.bags for g in m]


def test_bag_load_bars_are_grouped_by_bag_in_bag_order(plan8):
    fig = bag_load_figure(plan8)
    before, after, capacity = fig.data[:3]
    hover = list(before.hovertext)
    bag_labels = [h.split(" · ", 1)[1] for h in hover]
    gpu_labels = [h.split(" · ", 1)[0].removeprefix("GPU ") for h in hover]
    # One group per bag, labelled with its size; GPUs listed bag by bag.
    expected_groups = [
        f"bag {b} · {len(m)} GPU{'s' if len(m) > 1 else ''}" for b, m in enumerate(plan8.bags)
    ]
    assert list(dict.fromkeys(bag_labels)) == expected_groups
    assert gpu_labels == [str(g) for m in plan8.bags for g in m]
    order = _bag_order(plan8)
    st = plan8.stats  # not calibrated: loads relative to the mean GPU
    np.testing.assert_allclose(before.y, st.load_before[order] / st.mean_load)
    np.testing.assert_allclose(after.y, st.load_after[order] / st.mean_load)
    np.testing.assert_allclose(capacity.y, 1.0)
    assert fig.layout.yaxis.title.text == "modelled load (mean GPU = 1.00)"
    assert "bag 2 · 2 GPUs" in bag_labels and "bag 3 · 4 GPUs" in bag_labels
    # each bag is one shaded band over its GPUs' slots, named above it
    bands = [s for s in fig.layout.shapes if s.type == "rect"]
    assert [(b.x0 + 0.5, b.x1 - 0.5) for b in bands] == [(0, 0), (1, 1), (2, 3), (4, 7)]
    names = {a.text for a in fig.layout.annotations}
    assert set(expected_groups) <= names
    assert list(fig.layout.xaxis.ticktext) == gpu_labels  # every rank, horizontal
    assert fig.layout.xaxis.tickangle == 0


def test_highlighted_sequence_marks_only_its_chunks(plan8):
    # A sequence split over a multi-GPU bag, so there is more than one destination.
    seq = int(np.flatnonzero(np.bincount(plan8.chunks.seq) > 1)[0])
    fig = bag_load_figure(plan8, highlight_seq=seq)
    names = [t.name for t in fig.data]
    assert f"sequence {seq}" in names
    marks = fig.data[names.index(f"sequence {seq}")]
    dst = plan8.chunks.dst_gpu[plan8.chunks.seq == seq]
    ranks = [g for m in plan8.bags for g in m]
    assert sorted(ranks[x] for x in marks.x) == sorted(dst.tolist())
    assert sorted(np.asarray(marks.customdata)[:, 0].astype(int)) == sorted(dst.tolist())
    # each mark is that chunk's own cost on its GPU, not the GPU's whole load
    st = plan8.stats
    assert sum(marks.y) * st.mean_load == pytest.approx(plan8.sequences.workload[seq])
    linear = plan8.sequences.workload[seq] * linear_share(plan8)[seq]
    chunk_tokens = plan8.chunks.length[plan8.chunks.seq == seq]
    extra = (chunk_tokens - chunk_tokens.mean()) * linear / plan8.sequences.length[seq]
    np.testing.assert_allclose(np.diff(marks.y) * st.mean_load, np.diff(extra), atol=1e-12)
    # drawn as the top segment of the GPU's "after" bar, in the same bar position
    after = fig.data[1]
    tops = np.asarray(after.y)[np.asarray(marks.x)]
    np.testing.assert_allclose(np.asarray(marks.base, float) + np.asarray(marks.y), tops)
    assert marks.offsetgroup == after.offsetgroup == "after"
    assert after.marker.line.width is None  # no GPU's whole bar is outlined
    source = fig.data[names.index(f"sequence {seq} source")]
    assert [ranks[x] for x in source.x] == [plan8.sequences.src_gpu[seq]]
    with pytest.raises(ValueError, match="sequence 999"):
        bag_load_figure(plan8, highlight_seq=999)


def test_traffic_heatmap_holds_the_token_matrix_in_bag_order(plan8):
    seq = int(np.flatnonzero(np.bincount(plan8.chunks.seq) > 1)[0])
    fig = traffic_figure(plan8, highlight_seq=seq)
    heat = fig.data[0]
    order = _bag_order(plan8)
    traffic = plan8.stats.traffic[np.ix_(order, order)]
    np.testing.assert_array_equal(np.asarray(heat.customdata), traffic)
    assert list(heat.x) == list(heat.y) == [f"GPU {g}" for g in np.asarray(plan8.gpus)[order]]
    np.testing.assert_allclose(np.asarray(heat.z), np.log10(1 + traffic), atol=1e-4)
    # the colour bar speaks tokens: 0, 1, 10, ... up to the largest cell
    ticks = list(heat.colorbar.ticktext)
    assert ticks[:3] == ["0", "1", "10"] and int(ticks[-1].replace(",", "")) <= traffic.max()
    counts = [int(t.replace(",", "")) for t in ticks]
    np.testing.assert_allclose(heat.colorbar.tickvals, np.log10(1 + np.array(counts)))
    # lines at the bag boundaries, across both axes
    lines = {(s.x0, s.y0) for s in fig.layout.shapes if s.xref == "x"}
    assert {x for x, _ in lines} == {0.5, 1.5, 3.5}
    cells = fig.data[1]
    mine = plan8.chunks.seq == seq
    assert list(cells.x) == [f"GPU {g}" for g in plan8.chunks.dst_gpu[mine]]
    assert list(cells.y) == [f"GPU {g}" for g in plan8.chunks.src_gpu[mine]]
    assert len(traffic_figure(plan8).data) == 1


def test_up_to_128_gpus_every_gpu_is_a_cell_and_ticks_thin_by_the_rule():
    from knapformer.visualization.axes import MAX_VIEW_GPUS, stride

    from knapformer.planning.planner import plan_routing
    from knapformer.planning.workload import WorkloadModel

    lengths = [np.array([64 + (g * 37) % 900]) for g in range(MAX_VIEW_GPUS)]
    plan = plan_routing(lengths, "g1n32+g2n16+g4n8+g8n4", WorkloadModel(64, 0.4))
    fig = traffic_figure(plan, validate=False)
    heat = fig.data[0]
    assert np.asarray(heat.customdata).shape == (128, 128)
    assert np.asarray(heat.customdata).sum() == plan.stats.total_tokens
    ranks = [g for m in plan.bags for g in m]
    k = stride(128, LINE_PX, TRAFFIC_PLOT_PX[1])  # rows: a line's height each
    assert k > 1 and list(fig.layout.yaxis.ticktext) == [str(r) for r in ranks[::k]]
    bars = bag_load_figure(plan, validate=False)
    ticks = [int(t) for t in bars.layout.xaxis.ticktext]
    assert ticks == ranks[:: ranks.index(ticks[1])] and ticks[1] != ranks[1]
    assert "aggregated" not in bars.layout.title.text


def test_summarize_matches_plan_stats(steps50):
    record = steps50[7]
    s = summarize(record.plan, record.line)
    st = record.plan.stats
    assert (s.step, s.line, s.num_gpus) == (7, 8, 32)
    assert s.imbalance_before == pytest.approx(st.imbalance_before)
    assert s.imbalance_after == pytest.approx(st.imbalance_after)
    assert s.moved_fraction == pytest.approx(st.moved_fraction)
    assert s.speedup == pytest.approx(st.speedup)
    assert s.plan_ms == record.plan.measurements.plan_ms
    assert s.num_sequences == len(record.plan.sequences)
    assert not s.has_measurements


def test_timeline_points_carry_their_index_and_mark_the_selection(steps50):
    summaries = [summarize(r.plan, r.line) for r in steps50]
    fig = timeline_figure(summaries, selected_step=12)
    assert [t.name for t in fig.data] == ["before", "after", "moved", "plan ms"]
    assert list(fig.data[0].customdata) == list(range(50))
    assert list(fig.data[1].y) == [s.imbalance_after for s in summaries]
    (line,) = fig.layout.shapes
    assert line.x0 == line.x1 == summaries[12].step
    # Appending columns from `start` reproduces the tail of the full figure.
    tail = timeline_columns(summaries, start=45)
    assert tail[1][1] == list(fig.data[1].y[45:])
    assert tail[0][2] == list(range(45, 50))
    assert timeline_figure(summaries, selected_step=None).layout.shapes == ()


def test_timeline_uses_the_index_when_plans_have_no_step(steps50):
    summaries = [summarize(r.plan.model_copy(update={"step": None})) for r in steps50[:3]]
    assert isinstance(summaries[0], StepSummary)
    assert list(timeline_figure(summaries).data[0].x) == [0, 1, 2]


def test_predicted_vs_measured_labels_every_rank_and_flags_the_slow_one(plan8):
    rng = np.random.default_rng(0)
    plans = [with_measurements(plan8, rng, slow_rank=5, slow_factor=2.0) for _ in range(5)]
    window = [measure(p).figures() for p in plans]
    m = rank_steps(window)
    fig = predicted_vs_measured_figure(analyse(window), m)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["slow GPU"].text) == ["5"]
    assert sorted(by_name["ok"].text, key=int) == [str(g) for g in plan8.gpus if g != 5]
    slow_y = by_name["slow GPU"].y[0]
    assert slow_y == pytest.approx(np.median(m.compute_ms[5]))
    assert slow_y > 1.8 * np.median(by_name["ok"].y)
    fit = next(t for t in fig.data if t.name.startswith("as predicted"))
    per_work = np.median(m.compute_ms / m.predicted_shown)
    assert fit.y[1] / fit.x[1] == pytest.approx(per_work, rel=0.05)
    assert fit.x[0] > 0  # drawn over the predicted range, not from zero
    assert fig.layout.yaxis.title.text == "measured compute (ms)"


def test_predicted_axis_does_not_spread_ranks_given_the_same_work(plan8):
    # A balanced plan gives every rank the same work to a few parts in 10,000: the axis
    # must keep them in one column (±5 % of the median), and still widen to hold a rank
    # the plan gave twice the work.
    rng = np.random.default_rng(1)
    window = [measure(with_measurements(plan8, rng)).figures() for _ in range(5)]
    m = rank_steps(window)
    work = row_medians(m.predicted_shown)
    lo, hi = predicted_vs_measured_figure(analyse(window), m).layout.xaxis.range
    mid = float(np.median(work))
    assert lo <= 0.95 * mid + 1e-12 and hi >= 1.05 * mid - 1e-12
    assert lo <= work.min() and hi >= work.max()
    m.predicted_shown[3] *= 2.0
    lo, hi = predicted_vs_measured_figure(analyse(window), m).layout.xaxis.range
    work = row_medians(m.predicted_shown)
    assert hi >= work[3] and lo <= 0.95 * float(np.median(work)) + 1e-12


def test_sequence_rows_list_chunk_destinations_in_offset_order(plan8):
    rows = sequence_rows(plan8)
    assert [r["id"] for r in rows] == list(range(len(plan8.sequences)))
    ch = plan8.chunks
    for row in rows:
        mine = np.flatnonzero(ch.seq == row["id"])
        mine = mine[np.argsort(ch.offset[mine])]
        assert row["destinations"] == " ".join(str(g) for g in ch.dst_gpu[mine])
        assert row["chunks"] == len(mine)
        assert row["length"] == plan8.sequences.length[row["id"]]
        assert row["bag"] == plan8.sequences.bag[row["id"]]
        relative = plan8.sequences.workload[row["id"]] / plan8.stats.mean_load
        assert row["workload"] == pytest.approx(relative, rel=5e-3)


def test_unvalidated_fast_figures_are_valid_plotly(plan8, steps50):
    """The dashboard skips plotly's validation for speed; the specs must still be valid."""
    import plotly.graph_objects as go

    rng = np.random.default_rng(1)
    window = [measure(with_measurements(plan8, rng)).figures() for _ in range(3)]
    m = rank_steps(window)
    summaries = [summarize(r.plan) for r in steps50]
    measured_summaries = [summarize(with_measurements(plan8, rng)) for _ in range(3)]
    figures = [
        bag_load_figure(plan8, 1, validate=False),
        traffic_figure(plan8, 1, validate=False),
        timeline_figure(summaries, 3, validate=False),
        timeline_figure(measured_summaries, 1, validate=False),
        predicted_vs_measured_figure(analyse(window), m, validate=False),
        ratio_heatmap(m, validate=False),
        wait_heatmap(m, validate=False),
        empty_figure("no steps yet", validate=False),
    ]
    for fig in figures:
        checked = go.Figure(fig.to_plotly_json())  # raises ValueError on any bad property
        assert len(checked.data) == len(fig.data)
        assert checked.layout.template.layout.plot_bgcolor == "white"


def test_long_timelines_drop_markers(steps50):
    summaries = [summarize(r.plan) for r in steps50]
    assert timeline_figure(summaries).data[0].mode == "lines+markers"
    long = timeline_figure(summaries * 10, validate=False)  # 500 steps
    assert {t.mode for t in long.data} == {"lines"}
    assert len(long.data[0].x) == 500


def test_measured_runs_gain_a_step_time_panel(plan8):
    rng = np.random.default_rng(2)
    plans = [with_measurements(plan8, rng) for _ in range(4)]
    summaries = [summarize(p) for p in plans]
    fig = timeline_figure(summaries)
    assert [t.name for t in fig.data][-1] == "step ms"
    assert list(fig.data[-1].y) == [max(p.measurements.per_rank_ms["step"]) for p in plans]
    assert fig.data[-1].yaxis == "y4"
    assert len(timeline_columns(summaries, 2)) == 5


def test_nothing_to_show_has_no_axes():
    for fig in (timeline_figure([]), empty_figure("no steps yet")):
        assert fig.layout.xaxis.visible is False and fig.layout.yaxis.visible is False
        assert [a.text for a in fig.layout.annotations] == ["no steps yet"]


def test_flagged_ranks_are_labelled_at_any_rank_count():
    from knapformer.visualization.axes import rank_ticks

    for count, length in ((32, 260), (1024, 1100)):
        ranks = np.arange(count)
        plain = rank_ticks(ranks, length, vertical=count == 32)["ticktext"]
        assert "17" not in plain  # thinned out without a flag
        ticks = rank_ticks(ranks, length, vertical=count == 32, flagged=[17])
        assert "17" in ticks["ticktext"]
        assert ticks["tickvals"] == sorted(ticks["tickvals"])
        # its neighbours that would overlap it give way
        assert "16" not in ticks["ticktext"] and "18" not in ticks["ticktext"]


def test_wait_scale_leaves_out_warm_up_steps(plan8):
    from knapformer.visualization.straggler_figures import WARMUP_STEPS

    rng = np.random.default_rng(2)
    window = []
    for step in range(6):
        plan = with_measurements(plan8.model_copy(update={"step": step}), rng)
        figures = measure(plan).figures()
        if step == 0:  # gloo's set-up: every rank but one waits 6 s
            figures.wait_ms[1:] += 6000.0
        window.append(figures)
    m = rank_steps(window)
    late = float(np.nanmax(m.wait_ms[:, WARMUP_STEPS:]))
    fig = wait_heatmap(m, run_start=0)
    assert fig.data[0].zmax == pytest.approx(late) and late < 1000
    assert "warm-up" in fig.data[0].colorbar.title.text
    assert wait_heatmap(m).data[0].zmax > 6000  # without a run start, every step counts
    assert wait_heatmap(rank_steps(window[3:]), run_start=0).data[0].zmax == pytest.approx(
        float(np.nanmax(m.wait_ms[:, 3:]))
    )


def test_compute_wait_spreads_a_balanced_plans_ranks(plan8):
    from knapformer.visualization.straggler_figures import compute_wait_figure

    rng = np.random.default_rng(1)
    window = [
        measure(with_measurements(plan8, rng, slow_rank=5, slow_factor=2.0)).figures()
        for _ in range(5)
    ]
    m = rank_steps(window)
    fig = compute_wait_figure(analyse(window), m)
    by_name = {t.name: t for t in fig.data}
    ok, slow = by_name["ok"], by_name["slow GPU"]
    assert [int(r) for r, _ in slow.customdata] == [5]
    assert slow.x[0] > 1.8 * max(ok.x) and slow.y[0] < min(ok.y)
    # predicted work stacks them in one column; measured compute and wait do not
    assert np.ptp(row_medians(m.predicted_shown)) < 0.01 * np.median(m.predicted_shown)
    assert np.ptp(ok.x) > 1.0 and np.ptp(ok.y) > 1.0
    # both axes start where the data does: every point inside, little room around them
    points = [t for t in fig.data if t.type == "scatter" and t.mode != "lines"]
    for axis, name in ((fig.layout.xaxis, "x"), (fig.layout.yaxis, "y")):
        values = np.concatenate([np.asarray(getattr(t, name), float) for t in points])
        low, high = axis.range
        assert low <= values.min() and values.max() <= high
        assert values.min() - low <= 0.1 * (high - low), (name, axis.range, values.min())
        assert low >= 0
    line = next(t for t in fig.data if t.mode == "lines")
    assert min(line.y) >= fig.layout.yaxis.range[0] and min(line.x) >= fig.layout.xaxis.range[0]


def test_phase_breakdown_adds_up_to_each_ranks_step(plan8):
    from knapformer.visualization.phase_figures import phase_figure, step_parts, window_parts

    rng = np.random.default_rng(3)
    plans = [with_measurements(plan8, rng, slow_rank=5, slow_factor=2.0) for _ in range(3)]
    parts = step_parts(plans[-1])
    np.testing.assert_allclose(sum(parts.parts.values()), parts.step_ms)
    assert next(iter(parts.parts)) == "compute (the model's)"
    waits = [p for p in parts.parts if p.startswith("waiting:")]
    assert waits == ["waiting: route, reverse_route", "waiting: pre_attn, post_attn",
                     "waiting: gather", "waiting: allreduce"]  # fmt: skip
    # every wait is hatched in the hue of its collective's group, its transfer solid
    assert all(parts.styles[w].waiting for w in waits)
    exchanges, sync = (set(palette.PHASE_GROUPS[g]) for g in ("exchanges", "sync"))
    assert parts.styles["transfer: token exchanges"].color in exchanges
    assert not parts.styles["transfer: token exchanges"].waiting
    assert {parts.styles[w].color for w in waits[:2]} <= exchanges
    assert {parts.styles[w].color for w in waits[2:]} <= sync
    # at most eight hues, and no two groups share a shade
    assert len(palette.PHASE_GROUPS) <= 8
    shades = [c for group in palette.PHASE_GROUPS.values() for c in group]
    assert len(shades) == len(set(shades))
    mean = window_parts(plans)
    np.testing.assert_allclose(sum(mean.parts.values()), mean.step_ms)
    fig = phase_figure(mean, {5: "slow GPU"})
    flagged = next(t for t in fig.data if t.name == "flagged")
    assert list(flagged.customdata) == [5] and "slow GPU · 5" in flagged.text
    assert step_parts(plan8) is None  # nothing measured


def test_tokens_view_draws_the_cap_and_the_topology_timeline_its_runs(steps50):
    from knapformer.visualization.figures import tokens_figure, topology_figure, topology_runs

    plan = plan_routing([[900, 40], [30], [500, 500], [10]], "g1n2+g2n1", WorkloadModel(256),
                        max_tokens_per_gpu=1200)  # fmt: skip
    fig = tokens_figure(plan)
    cap = next(t for t in fig.data if t.name.startswith("cap"))
    assert list(cap.y) == [1200, 1200]
    assert max(fig.data[1].y) <= 1200
    assert not any(t.name.startswith("cap") for t in tokens_figure(plan.model_copy(
        update={"solver_options": {}})).data)  # fmt: skip
    topos = ["g1n4+g2n2", "g1n4+g2n2", "g2n2+g4n1", "g1n4+g2n2"]
    summaries = [
        dataclasses.replace(summarize(r.plan), topology=t)
        for r, t in zip(steps50[:4], topos, strict=True)
    ]
    assert topology_runs(summaries) == [("g1n4+g2n2", 0, 1), ("g2n2+g4n1", 2, 2),
                                        ("g1n4+g2n2", 3, 3)]  # fmt: skip
    fig = topology_figure(summaries, selected=2)
    assert "2 topologies, 2 changes" in fig.layout.title.text
    assert [t.name for t in fig.data] == ["g1n4+g2n2", "g2n2+g4n1"]
    assert fig.layout.shapes[0].x0 == summaries[2].step


def test_topology_timeline_keys_steps_by_where_their_bags_sat(steps50):
    from knapformer.visualization.figures import topology_figure, topology_runs

    assert bag_runs([[0], [1], [2], [3], [4, 5, 6, 7]]) == "g1@0-3 g4@4-7"
    assert bag_runs([[0, 1, 2, 3], [4], [5], [6, 7]]) == "g4@0-3 g1@4-5 g2@6-7"
    assert summarize(steps50[0].plan).bags == bag_runs(steps50[0].plan.bags)
    # One topology string, the group of 4 first on ranks 4-7, then on 0-3, then back.
    where = ["g1@0-3 g4@4-7", "g1@0-3 g4@4-7", "g4@0-3 g1@4-7", "g1@0-3 g4@4-7"]
    summaries = [
        dataclasses.replace(summarize(r.plan), topology="g1n4+g4n1", bags=b)
        for r, b in zip(steps50[:4], where, strict=True)
    ]
    late, early = "g1n4+g4n1 @ g1@0-3 g4@4-7", "g1n4+g4n1 @ g4@0-3 g1@4-7"
    assert topology_runs(summaries) == [(late, 0, 1), (early, 2, 2), (late, 3, 3)]
    fig = topology_figure(summaries)
    assert "1 topology in 2 placements, 2 changes" in fig.layout.title.text
    assert [t.name for t in fig.data] == [late, early]
    assert list(fig.layout.yaxis.categoryarray) == [late, early]
    # The same placement throughout: one row, labelled by the topology alone.
    same = [dataclasses.replace(s, bags=where[0]) for s in summaries]
    assert topology_runs(same) == [("g1n4+g4n1", 0, 3)]


def test_phase_breakdown_shows_host_data_and_descheduled_beside_compute(plan8):
    from knapformer.visualization.phase_figures import DESCHEDULED_PART, step_parts

    # The timer's compute holds none of host work, the wait for data or (on the CPU) the
    # time the thread waited for a core: each is its own part and the stack is the step.
    plan = with_measurements(plan8, np.random.default_rng(4))
    per_rank = dict(plan.measurements.per_rank_ms)
    n = len(plan.gpus)
    extra = {"data": np.full(n, 3.0), "host": np.arange(n, dtype=float),
             "descheduled": np.linspace(1.0, 8.0, n)}  # fmt: skip
    for name, ms in extra.items():
        per_rank[name] = ms.tolist()
    per_rank["step"] = (np.asarray(per_rank["step"]) + sum(extra.values())).tolist()
    measured = plan.model_copy(
        update={"measurements": plan.measurements.model_copy(update={"per_rank_ms": per_rank})}
    )
    parts = step_parts(measured)
    np.testing.assert_allclose(sum(parts.parts.values()), parts.step_ms)
    np.testing.assert_allclose(parts.parts[DESCHEDULED_PART], extra["descheduled"])
    np.testing.assert_allclose(parts.parts["compute (the model's)"], per_rank["compute"])
