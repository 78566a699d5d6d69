"""`knapformer animate`: render real videos with manim and decode them with PyAV."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
from knapformer.visualization import layout as L
from knapformer.visualization import palette
from knapformer.visualization.layout import BACKGROUND, layout_plan, to_pixels
from knapformer.visualization.scene import STEP_SECONDS, video_duration

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_json, write_jsonl
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.processes import CLI

ANIMATE = [*CLI, "animate"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ANIMATE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _decode(path: Path) -> tuple[list[np.ndarray], float, float]:
    """All frames as (H, W, 3) uint8 RGB arrays, the duration (s) and the frame rate."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        duration = container.duration / av.time_base
    return frames, duration, rate


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)


@pytest.fixture(scope="module")
def plan32():
    """32 GPUs in 8 bags of 4; GPU 0, in the top row, holds a long sequence whose chunks
    fly far (on the old upward arcs they crossed the "load" header)."""
    rng = np.random.default_rng(1)
    lengths = [[24000, 900], *(list(rng.integers(500, 6000, 2)) for _ in range(31))]
    return plan_routing(lengths, "g4n8", WorkloadModel(3072), step=7)


@pytest.fixture(scope="module")
def video32(tmp_path_factory, plan32) -> Path:
    """``plan32`` rendered at the default quality (no --quality)."""
    folder = tmp_path_factory.mktemp("video32")
    source, out = folder / "plan32.json", folder / "routing.mp4"
    write_json(source, plan32)
    done = _run(str(source), "-o", str(out), timeout=600)
    assert done.returncode == 0, done.stderr
    assert "medium" in done.stderr
    return out


def _frames(path: Path):
    """Decoded frames one at a time, as (H, W, 3) uint8 RGB arrays."""
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24")


def _text_runs(patch: np.ndarray, background: np.ndarray) -> list[int]:
    """Heights (px) of the runs of pixel rows of ``patch`` (h, w, 3) that hold text."""
    inked = (np.abs(patch.astype(float) - background).max(axis=2) > 80).any(axis=1)
    runs, length = [], 0
    for row in inked:
        if row:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return [*runs, length] if length else runs


@pytest.fixture(scope="module")
def video8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("video") / "routing.mp4"
    plan = Path(__file__).parent.parent / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json"
    done = _run(str(plan), "-o", str(out), "--quality", "low")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr and "Traceback" not in done.stderr
    return out


@pytest.mark.slow
def test_video_has_requested_size_and_duration(video8):
    frames, duration, rate = _decode(video8)
    assert frames[0].shape == (480, 854, 3)  # --quality low
    assert rate == 15
    expected = video_duration(1)
    assert duration == pytest.approx(expected, abs=1.5 / rate)
    assert len(frames) == pytest.approx(expected * rate, abs=1)


@pytest.mark.slow
def test_first_and_last_frames_differ(video8):
    frames, _, _ = _decode(video8)
    diff = np.abs(frames[0].astype(int) - frames[-1].astype(int))
    assert (diff.max(axis=2) > 40).mean() > 0.05  # a real change, not codec noise


@pytest.mark.slow
def test_last_frame_shows_chunks_where_the_plan_sends_them(video8, plan8_path):
    frames, _, _ = _decode(video8)
    last = frames[-1].astype(float)
    h, w = last.shape[:2]
    plan = read_plans(plan8_path, on_error="raise").plans[0]
    lay = layout_plan(plan)
    background = _rgb(BACKGROUND)
    checked_rows = set()
    for c in lay.chunk_blocks:
        if c.dst.width * w / 14.2 < 8:  # too narrow to sample away from the edges
            continue
        col, row = to_pixels(c.dst.x, c.dst.y, w, h)
        expected = c.opacity * _rgb(c.color) + (1 - c.opacity) * background
        got = last[row, col]
        assert np.abs(got - expected).max() < 48, (c.chunk, got, expected)
        checked_rows.add(c.dst_row)
    # Every GPU that receives chunks was checked, and each of those spots is coloured.
    receiving = {lay.rows.index(r) for r in lay.rows if plan.stats.tokens_after[r.pos] > 0}
    assert checked_rows == receiving
    # Control: past the end of each after row there is only background.
    for r, row in enumerate(lay.rows):
        ends = [c.dst.right for c in lay.chunk_blocks if c.dst_row == r]
        col, y = to_pixels(max(ends) + 0.3, row.y, w, h)
        assert np.abs(last[y, col] - background).max() < 30


@pytest.mark.slow
def test_first_frame_shows_the_before_state(video8, plan8_path):
    first = next(_frames(video8)).astype(float)
    h, w = first.shape[:2]
    lay = layout_plan(read_plans(plan8_path, on_error="raise").plans[0])
    checked = 0
    for b in lay.seq_blocks:
        if b.box.width * w / L.FRAME_WIDTH < 8:
            continue
        col, row = to_pixels(b.box.x, b.box.y, w, h)
        assert np.abs(first[row, col] - _rgb(b.color)).max() < 48, (b.seq, first[row, col])
        checked += 1
    assert checked >= len(lay.seq_blocks) // 2
    for bar in lay.load_before:  # the before load bars are there too
        col, row = to_pixels(bar.x, bar.y, w, h)
        assert np.abs(first[row, col] - _rgb(L.LOAD_BEFORE_COLOR)).max() < 48


@pytest.mark.slow
def test_labels_are_at_least_12_px_tall_at_32_gpus_at_the_default_quality(video32, plan32):
    first = next(_frames(video32))
    h, w = first.shape[:2]
    assert (w, h) == (1280, 720)
    lay = layout_plan(plan32)
    background = _rgb(BACKGROUND)

    def runs(right: float, width: float, y: float, lines: int) -> list[int]:
        half = L.label_extent(lines, lay.label_font) / 2
        left_px, top_px = to_pixels(right - width, y + half, w, h)
        right_px, bottom_px = to_pixels(right, y - half, w, h)
        return _text_runs(first[top_px:bottom_px, left_px:right_px], background)

    gpu_labels = [r for r in lay.rows if r.label]
    assert len(gpu_labels) >= 16  # at least every 2nd GPU of 32 is named
    for row in gpu_labels:
        got = runs(L.GPU_LABEL_RIGHT, L.GPU_LABEL_WIDTH, row.y, 1)
        assert len(got) == 1 and got[0] >= 12, (row.label, got)
    bag_labels = [b for b in lay.brackets if b.label]
    assert len(bag_labels) == len(lay.brackets) == 8
    for br in bag_labels:
        lines = br.label.count("\n") + 1
        got = runs(L.BAG_LABEL_RIGHT, L.BAG_LABEL_WIDTH, (br.top + br.bottom) / 2, lines)
        assert len(got) == lines and min(got) >= 12, (br.label, got)


@pytest.mark.slow
def test_chunks_in_flight_never_cross_the_headers(video32):
    # The header line ("before", "load", "after routing", "load") is grey text on the dark
    # background; a chunk flying over it would put a sequence's saturated colour there.
    frames = 0
    for frame in _frames(video32):
        h, w = frame.shape[:2]
        _, top = to_pixels(0, L.HEADER_Y + 0.15, w, h)
        _, bottom = to_pixels(0, L.HEADER_Y - 0.15, w, h)
        band = frame[top:bottom].astype(int)
        saturation = band.max(axis=2) - band.min(axis=2)
        assert saturation.max() < 40, frames
        frames += 1
    assert frames == pytest.approx(video_duration(1) * 30, abs=1)


@pytest.mark.slow
def test_capacity_line_is_drawn_in_the_dashboards_green(video32, plan32):
    *_, last = _frames(video32)
    h, w = last.shape[:2]
    lay = layout_plan(plan32)
    col, _ = to_pixels(lay.capacity_x[0], 0, w, h)
    _, top = to_pixels(0, lay.rows[0].y, w, h)
    _, bottom = to_pixels(0, lay.rows[-1].y, w, h)
    column = last[top:bottom, col - 2 : col + 3].astype(float).reshape(-1, 3)
    green = np.abs(column - _rgb(palette.CAPACITY)).max(axis=1) < 40
    assert green.sum() >= 20
    yellow = np.abs(column - _rgb("#ffd43b")).max(axis=1) < 60
    assert not yellow.any()


@pytest.mark.slow
def test_steps_chain_several_plans_into_one_video(tmp_path):
    # Small, different plans keep this render short; steps 10..12 in the file, 11:12 chosen.
    model = WorkloadModel(3072)
    lengths = {
        10: [[500], [500], [500]],
        11: [[9000, 300], [200], [4000]],
        12: [[300], [200, 8000, 500], [100, 100]],
    }
    plans = [plan_routing(v, "g1n1+g2n1", model, step=s) for s, v in lengths.items()]
    source = tmp_path / "three.jsonl"
    write_jsonl(source, plans)
    out = tmp_path / "two.mp4"
    done = _run(
        str(source), "--steps", "11:12", "-o", str(out), "--measure", "workload", "--quality", "low"
    )
    assert done.returncode == 0, done.stderr
    frames, duration, rate = _decode(out)
    assert duration == pytest.approx(video_duration(2), abs=1.5 / rate)
    assert frames[0].shape == (480, 854, 3)
    # The end of the first step and the end of the video show different plans.
    end_first = frames[round(STEP_SECONDS * rate) - 1].astype(int)
    diff = np.abs(end_first - frames[-1].astype(int)).max(axis=2)
    assert (diff > 40).mean() > 0.02


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quality", "ultra"], "--quality must be one of low, medium, high, 4k, not 'ultra'"),
        (["--measure", "flops"], "--measure must be 'tokens' or 'workload', not 'flops'"),
        (["--step", "1", "--steps", "1:2"], "either --step or --steps"),
        (["--step", "99"], "step 99 is not in the file"),
        (["--steps", "5"], "--steps must look like A:B"),
        (["--steps", "4:2"], "the last step is before the first"),
        (["-o", "out.gif"], "output must be an .mp4 file"),
    ],
)
def test_user_errors_are_one_line(plan8_path, tmp_path, capsys, args, message):
    if "-o" not in args:
        args = [*args, "-o", str(tmp_path / "x.mp4")]
    assert main(["animate", str(plan8_path), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.mp4").exists()


def test_missing_plan_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["animate", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.mp4")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.json" in err and err.count("\n") == 1


def _bracket_ink(frame: np.ndarray, x: float, y: float) -> float:
    """How far from the background the bracket column is at scene height ``y`` (the
    largest colour difference within 2 px of the column)."""
    h, w = frame.shape[:2]
    col, row = to_pixels(x, y, w, h)
    patch = frame[row, max(col - 2, 0) : col + 3].astype(float)
    return float(np.abs(patch - _rgb(BACKGROUND)).max())


@pytest.mark.slow
def test_each_step_draws_its_own_bags(tmp_path):
    # Two steps on 8 GPUs whose partitions differ: 6 bags, then 3.
    model = WorkloadModel(3072)
    rng = np.random.default_rng(5)
    plans = [
        plan_routing([list(rng.integers(300, 3000, 2)) for _ in range(8)], topo, model, step=s)
        for s, topo in enumerate(("g1n4+g2n2", "g2n2+g4n1"))
    ]
    source, out = tmp_path / "alternating.jsonl", tmp_path / "alternating.mp4"
    write_jsonl(source, plans)
    done = _run(str(source), "--steps", "0:1", "-o", str(out), "--quality", "low")
    assert done.returncode == 0, done.stderr
    frames, _, rate = _decode(out)
    ends = [frames[round(STEP_SECONDS * rate) - 1], frames[-1]]  # each step's last frame
    layouts = [layout_plan(p) for p in plans]
    assert [len(lay.brackets) for lay in layouts] == [6, 3]
    for frame, lay in zip(ends, layouts, strict=True):
        # each bag's bracket is drawn, and there is a gap between two bags
        for br in lay.brackets:
            assert _bracket_ink(frame, L.BRACKET_X, (br.top + br.bottom) / 2) > 80, br.bag
        for upper, lower in itertools.pairwise(lay.brackets):
            assert _bracket_ink(frame, L.BRACKET_X, (upper.bottom + lower.top) / 2) < 30
    # a gap of the first step's bags lies inside a bag of the second: its frame is inked
    first, second = layouts
    gaps = [(a.bottom + b.top) / 2 for a, b in itertools.pairwise(first.brackets)]
    inside = [y for y in gaps if any(br.bottom < y < br.top for br in second.brackets)]
    assert inside
    for y in inside:
        assert _bracket_ink(ends[1], L.BRACKET_X, y) > 80
