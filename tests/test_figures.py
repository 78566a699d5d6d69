"""The plotly figure builders shared by the dashboard and the static report."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.plan import Measurements
from knapformer.plan_io import read_plans
from knapformer.stats import StepSummary, linear_share, summarize
from visualization.figures import (
    bag_load_figure,
    predicted_vs_measured_figure,
    sequence_rows,
    stragglers,
    timeline_columns,
    timeline_figure,
    traffic_figure,
)


@pytest.fixture
def plan8(plan8_path):
    return read_plans(plan8_path, on_error="raise").plans[0]


@pytest.fixture
def steps50(steps50_path):
    return read_plans(steps50_path, on_error="raise").records


def test_bag_load_bars_are_grouped_by_bag_in_bag_order(plan8):
    fig = bag_load_figure(plan8)
    before, after, capacity = fig.data[:3]
    bag_labels, gpu_labels = (list(v) for v in before.x)
    # One group per bag, labelled with its size; GPUs listed bag by bag.
    expected_groups = [
        f"bag {b} · {len(m)} GPU{'s' if len(m) > 1 else ''}" for b, m in enumerate(plan8.bags)
    ]
    assert list(dict.fromkeys(bag_labels)) == expected_groups
    assert gpu_labels == [str(g) for m in plan8.bags for g in m]
    pos = {g: i for i, g in enumerate(plan8.gpus)}
    order = [pos[g] for m in plan8.bags for g in m]
    st = plan8.stats  # not calibrated: loads relative to the mean GPU
    np.testing.assert_allclose(before.y, st.load_before[order] / st.mean_load)
    np.testing.assert_allclose(after.y, st.load_after[order] / st.mean_load)
    np.testing.assert_allclose(capacity.y, 1.0)
    assert fig.layout.yaxis.title.text == "modelled load (mean GPU = 1.00)"
    assert "bag 2 · 2 GPUs" in bag_labels and "bag 3 · 4 GPUs" in bag_labels


def test_highlighted_sequence_marks_its_chunk_destinations(plan8):
    # A sequence split over a multi-GPU bag, so there is more than one destination.
    seq = int(np.flatnonzero(np.bincount(plan8.chunks.seq) > 1)[0])
    fig = bag_load_figure(plan8, highlight_seq=seq)
    names = [t.name for t in fig.data]
    assert f"sequence {seq}" in names
    marks = fig.data[names.index(f"sequence {seq}")]
    dst = plan8.chunks.dst_gpu[plan8.chunks.seq == seq]
    assert sorted(marks.x[1]) == sorted(str(g) for g in dst)
    # each mark is that chunk's own cost on its GPU, not the GPU's whole load
    st = plan8.stats
    assert sum(marks.y) * st.mean_load == pytest.approx(plan8.sequences.workload[seq])
    linear = plan8.sequences.workload[seq] * linear_share(plan8)[seq]
    chunk_tokens = plan8.chunks.length[plan8.chunks.seq == seq]
    extra = (chunk_tokens - chunk_tokens.mean()) * linear / plan8.sequences.length[seq]
    np.testing.assert_allclose(np.diff(marks.y) * st.mean_load, np.diff(extra), atol=1e-12)
    source = fig.data[names.index(f"sequence {seq} source")]
    assert list(source.x[1]) == [str(plan8.sequences.src_gpu[seq])]
    with pytest.raises(ValueError, match="sequence 999"):
        bag_load_figure(plan8, highlight_seq=999)


def test_traffic_heatmap_holds_the_token_matrix(plan8):
    seq = int(np.flatnonzero(np.bincount(plan8.chunks.seq) > 1)[0])
    fig = traffic_figure(plan8, highlight_seq=seq)
    heat = fig.data[0]
    np.testing.assert_array_equal(np.asarray(heat.customdata), plan8.stats.traffic)
    np.testing.assert_allclose(np.asarray(heat.z), np.log10(1 + plan8.stats.traffic))
    cells = fig.data[1]
    mine = plan8.chunks.seq == seq
    assert list(cells.x) == [f"GPU {g}" for g in plan8.chunks.dst_gpu[mine]]
    assert list(cells.y) == [f"GPU {g}" for g in plan8.chunks.src_gpu[mine]]
    assert len(traffic_figure(plan8).data) == 1


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


def test_predicted_vs_measured_flags_a_straggler(plan8):
    assert predicted_vs_measured_figure(plan8) is None
    # Measured time proportional to predicted load, except GPU 5 which takes twice as long.
    ms = plan8.stats.load_after * 10.0
    slow = plan8.gpus.index(5)
    ms[slow] *= 2
    measured = plan8.model_copy(
        update={"measurements": Measurements(plan_ms=1.0, per_rank_ms={"step": ms.tolist()})}
    )
    assert stragglers(measured) == [5]
    fig = predicted_vs_measured_figure(measured)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["straggler"].y) == [pytest.approx(ms[slow])]
    assert len(by_name["GPU"].x) == len(plan8.gpus) - 1
    fit = next(t for t in fig.data if t.name.startswith("model fit"))
    assert fit.y[1] / fit.x[1] == pytest.approx(10.0)


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

    ms = (plan8.stats.load_after * 3).tolist()
    measured = plan8.model_copy(
        update={"measurements": Measurements(plan_ms=1.0, per_rank_ms={"route": ms})}
    )
    summaries = [summarize(r.plan) for r in steps50]
    figures = [
        bag_load_figure(plan8, 1, validate=False),
        traffic_figure(plan8, 1, validate=False),
        timeline_figure(summaries, 3, validate=False),
        predicted_vs_measured_figure(measured, validate=False),
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
