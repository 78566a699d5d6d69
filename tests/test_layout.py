"""The animation layout (plan → positions/sizes/colours), checked without rendering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from knapformer.visualization import layout as L
from knapformer.visualization.layout import layout_plan, sequence_color, to_pixels

from knapformer.contract.plan_io import read_plans
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel


@pytest.fixture
def plan8(plan8_path):
    return read_plans(plan8_path, on_error="raise").plans[0]


@pytest.fixture(scope="module")
def plan64():
    """64 GPUs, 2,000 sequences: many tiny text-like ones and some long video-like ones."""
    rng = np.random.default_rng(3)
    counts = rng.multinomial(2000 - 64, np.ones(64) / 64) + 1
    lengths = [
        np.concatenate([rng.integers(1, 300, c - c // 4), rng.integers(2000, 40000, c // 4)])
        for c in counts
    ]
    plan = plan_routing(lengths, "g1n16+g2n8+g4n4+g8n2", WorkloadModel(3072), step=5)
    assert len(plan.sequences) == 2000 and len(plan.gpus) == 64
    return plan


def _inside_frame(box: L.Box) -> bool:
    return (
        -L.FRAME_WIDTH / 2 <= box.left <= box.right <= L.FRAME_WIDTH / 2
        and -L.FRAME_HEIGHT / 2 <= box.bottom <= box.top <= L.FRAME_HEIGHT / 2
    )


def _row_sums(blocks, n_rows, region_key="row"):
    sums = np.zeros(n_rows)
    for b in blocks:
        sums[getattr(b, region_key)] += b.box.width if hasattr(b, "box") else b.dst.width
    return sums


def _check_common(plan, lay):
    n = len(plan.gpus)
    assert sorted(r.gpu for r in lay.rows) == sorted(plan.gpus)
    # Rows go bag by bag, top to bottom, never overlapping.
    assert [r.gpu for r in lay.rows] == [g for bag in plan.bags for g in bag]
    ys = [r.y for r in lay.rows]
    assert all(a - b >= r.height for a, b, r in zip(ys, ys[1:], lay.rows, strict=False))
    assert lay.rows[0].y + lay.rows[0].height / 2 <= L.ROWS_TOP + 1e-9
    assert lay.rows[-1].y - lay.rows[-1].height / 2 >= L.ROWS_BOTTOM - 1e-9
    # Each bracket spans exactly the rows of its bag's GPUs.
    for br, members in zip(lay.brackets, plan.bags, strict=True):
        inside = {r.gpu for r in lay.rows if br.bottom <= r.y <= br.top}
        assert inside == set(members)
    # Everything drawn lies inside the frame and in its region.
    for b in [*lay.seq_blocks, *lay.groups_before]:
        assert _inside_frame(b.box)
        assert L.BEFORE_X[0] - 1e-9 <= b.box.left and b.box.right <= L.BEFORE_X[1] + 1e-9
    for b in lay.groups_after:
        assert L.AFTER_X[0] - 1e-9 <= b.box.left and b.box.right <= L.AFTER_X[1] + 1e-9
    for c in lay.chunk_blocks:
        assert L.AFTER_X[0] - 1e-9 <= c.dst.left and c.dst.right <= L.AFTER_X[1] + 1e-9
        assert lay.rows[c.dst_row].gpu == plan.chunks.dst_gpu[c.chunk]
        assert lay.rows[c.src_row].gpu == plan.chunks.src_gpu[c.chunk]
        assert c.dst.y == lay.rows[c.dst_row].y and c.src.y == lay.rows[c.src_row].y
        assert c.moves == (plan.chunks.src_gpu[c.chunk] != plan.chunks.dst_gpu[c.chunk])
        assert c.color == sequence_color(c.seq) and c.seq == plan.chunks.seq[c.chunk]
    # After-region blocks of one row do not overlap.
    by_row: dict[int, list[tuple[float, float]]] = {}
    for c in lay.chunk_blocks:
        by_row.setdefault(c.dst_row, []).append((c.dst.left, c.dst.right))
    for g in lay.groups_after:
        by_row.setdefault(g.row, []).append((g.box.left, g.box.right))
    for spans in by_row.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(spans))
    # Load bars: proportional to the modelled load, capacity line at the mean load.
    stats = plan.stats
    before = np.array([b.width for b in lay.load_before])
    after = np.array([b.width for b in lay.load_after])
    loads_b = np.array([stats.load_before[r.pos] for r in lay.rows])
    loads_a = np.array([stats.load_after[r.pos] for r in lay.rows])
    k = (L.LOAD_BEFORE_X[1] - L.LOAD_BEFORE_X[0]) / max(loads_b.max(), loads_a.max())
    np.testing.assert_allclose(before, loads_b * k)
    np.testing.assert_allclose(after, loads_a * k)
    assert lay.capacity_x[0] == pytest.approx(L.LOAD_BEFORE_X[0] + stats.mean_load * k)
    assert lay.capacity_x[1] == pytest.approx(L.LOAD_AFTER_X[0] + stats.mean_load * k)
    assert len(lay.rows) == n


def test_eight_gpu_sample_draws_every_sequence_and_chunk(plan8):
    lay = layout_plan(plan8)
    _check_common(plan8, lay)
    assert lay.note is None and not lay.groups_before and not lay.groups_after
    assert sorted(b.seq for b in lay.seq_blocks) == list(range(len(plan8.sequences)))
    assert sorted(c.chunk for c in lay.chunk_blocks) == list(range(len(plan8.chunks)))
    # Widths are tokens on one scale for before and after: row totals ∝ tokens per GPU.
    n = len(lay.rows)
    before = _row_sums(lay.seq_blocks, n)
    after = np.zeros(n)
    for c in lay.chunk_blocks:
        after[c.dst_row] += c.dst.width
    tok_b = np.array([plan8.stats.tokens_before[r.pos] for r in lay.rows])
    tok_a = np.array([plan8.stats.tokens_after[r.pos] for r in lay.rows])
    scale = (L.BEFORE_X[1] - L.BEFORE_X[0]) / max(tok_b.max(), tok_a.max())
    np.testing.assert_allclose(before, tok_b * scale)
    np.testing.assert_allclose(after, tok_a * scale)
    # A chunk starts as its slice of the sequence block.
    blocks = {b.seq: b.box for b in lay.seq_blocks}
    for c in lay.chunk_blocks:
        seq = blocks[c.seq]
        assert seq.left - 1e-9 <= c.src.left and c.src.right <= seq.right + 1e-9
        off = plan8.chunks.offset[c.chunk] / plan8.sequences.length[c.seq]
        assert c.src.left == pytest.approx(seq.left + off * seq.width)
    # Both kinds of chunks occur in this plan and are styled differently.
    assert {c.moves for c in lay.chunk_blocks} == {True, False}
    assert L.STAYING_OPACITY < L.MOVING_OPACITY
    st = plan8.stats
    assert f"{st.imbalance_before:.2f} → {st.imbalance_after:.2f}" in lay.stats_text
    assert f"{st.moved_tokens:,}" in lay.stats_text
    assert all(r.label == f"GPU {r.gpu}" for r in lay.rows)


def test_workload_measure_makes_rows_proportional_to_load(plan8):
    lay = layout_plan(plan8, measure="workload", title="custom")
    _check_common(plan8, lay)
    assert lay.title == "custom"
    before = _row_sums(lay.seq_blocks, len(lay.rows))
    loads = np.array([plan8.stats.load_before[r.pos] for r in lay.rows])
    np.testing.assert_allclose(before / before.max(), loads / loads.max())


def test_sixty_four_gpus_two_thousand_sequences_stay_readable(plan64, plan8):
    lay = layout_plan(plan64)
    _check_common(plan64, lay)
    assert len(lay.seq_blocks) <= L.MAX_BLOCKS and len(lay.chunk_blocks) <= L.MAX_BLOCKS
    # Tiny sequences are grouped per GPU, and nothing is lost: drawn + grouped = all.
    nonempty = int((plan64.sequences.length > 0).sum())
    assert lay.grouped_sequences > 0
    assert len(lay.seq_blocks) + lay.grouped_sequences == nonempty
    assert sum(g.count for g in lay.groups_before) == lay.grouped_sequences
    assert f"{lay.grouped_sequences:,}" in lay.note  # counts carry thousands separators
    assert len({g.row for g in lay.groups_before}) == len(lay.groups_before)  # one per GPU
    drawn_chunks = len(lay.chunk_blocks) + sum(g.count for g in lay.groups_after)
    assert drawn_chunks == int((plan64.chunks.length > 0).sum())
    # Row totals (drawn + grouped) still match tokens per GPU.
    before = _row_sums([*lay.seq_blocks, *lay.groups_before], len(lay.rows))
    tok_b = np.array([plan64.stats.tokens_before[r.pos] for r in lay.rows])
    np.testing.assert_allclose(before / before.max(), tok_b / tok_b.max())
    # Labels thin out: at most MAX_GPU_LABELS GPU labels, bag labels never crowd.
    gpu_labels = [r for r in lay.rows if r.label]
    assert 0 < len(gpu_labels) <= L.MAX_GPU_LABELS
    shown = [(b.top + b.bottom) / 2 for b in lay.brackets if b.label]
    assert shown and len(shown) < len(lay.brackets)
    assert all(a - b >= L.MIN_LABEL_GAP for a, b in itertools.pairwise(shown))
    assert lay.label_font < layout_plan(plan8).label_font  # rows shrink, so do labels
    # Colours keep cycling past any fixed palette: the drawn sequences get many colours.
    assert len({b.color for b in lay.seq_blocks}) > 200


def test_legacy_plan_lays_out_like_its_converted_plan(legacy_path):
    result = read_plans(legacy_path, on_error="raise")
    plan = result.plans[0]
    lay = layout_plan(plan)
    _check_common(plan, lay)
    drawn = len(lay.chunk_blocks) + sum(g.count for g in lay.groups_after)
    assert drawn == int((plan.chunks.length > 0).sum())
    assert any(c.moves for c in lay.chunk_blocks)


def test_zero_length_sequences_get_no_block(plan8):
    lengths = [[0, 500, 0], [1200], [0], [64, 64]]
    plan = plan_routing(lengths, "g1n2+g2n1", WorkloadModel(3072))
    lay = layout_plan(plan)
    _check_common(plan, lay)
    zero = set(np.flatnonzero(plan.sequences.length == 0).tolist())
    assert zero and not zero & {b.seq for b in lay.seq_blocks}
    assert len(lay.seq_blocks) == len(plan.sequences) - len(zero)


def test_bad_measure_is_rejected(plan8):
    with pytest.raises(ValueError, match="'flops'"):
        layout_plan(plan8, measure="flops")  # type: ignore[arg-type]


def test_colours_are_valid_distinct_neighbours_and_unbounded():
    colours = [sequence_color(i) for i in range(3000)]
    assert all(len(c) == 7 and c[0] == "#" and int(c[1:], 16) >= 0 for c in colours)
    assert all(a != b for a, b in itertools.pairwise(colours))
    assert len(set(colours)) > 2500
    assert sequence_color(10**7).startswith("#")


def test_to_pixels_maps_frame_corners_and_centre():
    assert to_pixels(-L.FRAME_WIDTH / 2, L.FRAME_HEIGHT / 2, 854, 480) == (0, 0)
    assert to_pixels(L.FRAME_WIDTH / 2, -L.FRAME_HEIGHT / 2, 854, 480) == (853, 479)
    assert to_pixels(0, 0, 854, 480) == (427, 240)


def test_plan_with_only_empty_sequences_has_nothing_to_draw():
    plan = plan_routing([[0], [0, 0], [], []], "g1n2+g2n1", WorkloadModel(3072))
    lay = layout_plan(plan)
    assert len(lay.rows) == 4 and len(lay.brackets) == 3
    assert not lay.seq_blocks and not lay.chunk_blocks and not lay.groups_before
    assert all(b.width == 0 for b in [*lay.load_before, *lay.load_after])
    assert "moved 0 tokens" in lay.stats_text


def _plan_on(topology: str, per_gpu: list[list[int]]):
    return plan_routing(per_gpu, topology, WorkloadModel(3072), step=0)


@pytest.fixture(scope="module")
def lowres_g4n8():
    """The issue's case: 1,024 similar sequences (lowres) on g4n8, 4,096 chunks."""
    rng = np.random.default_rng(0)
    return _plan_on("g4n8", [list(rng.integers(1024, 1417, 32)) for _ in range(32)])


def test_footer_counts_and_names_what_is_grouped_before_and_after(lowres_g4n8, plan8):
    lay = layout_plan(lowres_g4n8)
    # Every sequence is drawn before routing, but most chunks are grouped after it: the
    # footer says so (it used to say "0 small sequences" next to mostly grey rows).
    assert lay.grouped_sequences == 0 and lay.grouped_chunks > len(lowres_g4n8.chunks) // 2
    assert sum(g.count for g in lay.groups_after) == lay.grouped_chunks
    assert f"{lay.grouped_chunks:,} small chunks after routing" in lay.note
    assert "sequence" not in lay.note
    # Singular when one item is grouped; both sides named when both are grouped.
    assert L._note(1, 0, 1) == "grey: 1 small sequence before routing, grouped per GPU"
    assert L._note(0, 1, 1) == "grey: 1 small chunk after routing, grouped per GPU"
    assert L._note(2, 3, 1) == (
        "grey: 2 small sequences before routing and 3 small chunks after routing, grouped per GPU"
    )
    assert layout_plan(plan8).note is None


@pytest.mark.parametrize("gpus", [8, 16, 32, 64, 128, 1024])
def test_labels_keep_their_size_and_thin_out_by_the_stated_rule(gpus):
    per_gpu = [[300 + 7 * g] for g in range(gpus)]
    topology = "g1n2+g2n1+g4n1" if gpus == 8 else f"g4n{gpus // 4}"
    lay = layout_plan(_plan_on(topology, per_gpu))
    assert lay.label_font >= L.MIN_LABEL_FONT
    pitch = lay.rows[0].y - lay.rows[1].y  # rows of one bag
    gap = L.label_gap(lay.label_font)
    k = lay.label_every
    # The rule: every k-th row, k the smallest that keeps labels `gap` apart.
    assert [r.label is not None for r in lay.rows] == [i % k == 0 for i in range(gpus)]
    assert k * pitch >= gap - 1e-9 and (k == 1 or (k - 1) * pitch < gap)
    assert (k > 1) == (lay.note is not None and f"every {L._ordinal(k)} GPU" in lay.note)
    shown = [r for r in lay.brackets if r.label]
    assert shown
    for a, b in itertools.pairwise(shown):
        extent = [L.label_extent(br.label.count("\n") + 1, lay.label_font) for br in (a, b)]
        mid = [(br.top + br.bottom) / 2 for br in (a, b)]
        assert mid[0] - mid[1] >= sum(extent) / 2 - 1e-9
    if gpus <= 32:
        assert k <= 2  # 32 GPUs: every 2nd GPU named, at full size


def test_ordinals():
    assert [L._ordinal(k) for k in (1, 2, 3, 4, 11, 12, 13, 21, 22, 102)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "102nd",
    ]  # fmt: skip


def test_flights_stay_inside_the_rows_band(plan64, lowres_g4n8, plan8):
    paths = pytest.importorskip("manim.utils.paths")
    alphas = np.linspace(0, 1, 41)
    for plan in (plan64, lowres_g4n8, plan8):
        lay = layout_plan(plan)
        blocks = lay.chunk_blocks
        arcs = np.array([c.path_arc for c in blocks])
        assert (arcs != 0).any()
        starts = np.array([[c.src.x, c.src.y, 0.0] for c in blocks])
        ends = np.array([[c.dst.x, c.dst.y, 0.0] for c in blocks])
        half = np.array([c.src.height / 2 for c in blocks])
        # Every chunk's flight as the animation draws it: manim's path for its arc, taken
        # for all chunks of one arc at once (a plan has a few distinct arcs).
        top, bottom = np.full(len(blocks), -np.inf), np.full(len(blocks), np.inf)
        for arc in np.unique(arcs):
            mine = arcs == arc
            path = paths.path_along_arc(float(arc))
            ys = np.array([path(starts[mine], ends[mine], a)[:, 1] for a in alphas])
            top[mine], bottom[mine] = ys.max(axis=0), ys.min(axis=0)
        # The block (centre ± half its height) never leaves the band: never over the
        # headers above it or the figures below it.
        above = np.flatnonzero(top + half > L.ROWS_TOP + 1e-6)
        below = np.flatnonzero(bottom - half < L.ROWS_BOTTOM - 1e-6)
        assert above.size == 0, [blocks[i] for i in above[:3]]
        assert below.size == 0, [blocks[i] for i in below[:3]]
        staying = np.array([not c.moves for c in blocks])
        assert (arcs[staying] == 0).all()  # staying chunks slide straight along their row


def test_flight_arc_bulges_toward_the_middle_and_flattens_at_the_edges():
    mid = (L.ROWS_TOP + L.ROWS_BOTTOM) / 2
    h = 0.1
    # A long flight along the top row bulges down, along the bottom row up, at full arc.
    assert L.flight_arc(-4, L.ROWS_TOP - h, 4, L.ROWS_TOP - h, h) == pytest.approx(L.FLIGHT_ARC)
    assert L.flight_arc(-4, L.ROWS_BOTTOM + h, 4, L.ROWS_BOTTOM + h, h) == pytest.approx(
        -L.FLIGHT_ARC
    )
    # Through the middle there is room either way: the full arc.
    assert abs(L.flight_arc(-4, mid, 4, mid, h)) == pytest.approx(L.FLIGHT_ARC)
    # Corner to corner, any bulge would leave the band: the flight is straight.
    corner = L.flight_arc(-4, L.ROWS_TOP - h / 2, 4, L.ROWS_BOTTOM + h / 2, h)
    assert corner == pytest.approx(0.0, abs=1e-9)
    # Half-way there, it is flattened but still curved.
    half = L.flight_arc(-4, L.ROWS_TOP - h / 2, 4, L.ROWS_BOTTOM + 0.2 + h / 2, h)
    assert 0 < abs(half) < L.FLIGHT_ARC


def test_animation_and_dashboard_draw_capacity_in_one_colour(plan8):
    from knapformer.visualization import palette
    from knapformer.visualization.figures import bag_load_figure

    fig = bag_load_figure(plan8)
    capacity = next(t for t in fig.data if t.name.startswith("capacity"))
    assert capacity.line.color == L.CAPACITY_COLOR == palette.CAPACITY
    assert [t.marker.color for t in fig.data[:2]] == [L.LOAD_BEFORE_COLOR, L.LOAD_AFTER_COLOR]
    lay = layout_plan(plan8)
    assert f"{palette.CAPACITY_NAME} line: capacity" in lay.legend_text
    assert "yellow" not in lay.legend_text
