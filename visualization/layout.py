"""Where everything goes in the routing animation: a pure function of a plan.

`layout_plan(plan)` returns positions, sizes and colours in manim scene units (the frame is
`FRAME_WIDTH` x `FRAME_HEIGHT`, origin at its centre, y up). No manim import: the scene only
draws what this module decides, so tests check the picture without rendering a video, and
`to_pixels` maps scene units to pixel coordinates of a rendered frame.

Screen plan (left to right): bag brackets and labels, GPU labels, the "before" region (each
GPU's sequences as blocks), the before load bars, the "after" region (chunks at their
destination GPU), the after load bars. Rows go bag by bag so a bracket spans contiguous rows.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from knapformer.plan import RoutingPlan, gpu_positions
from knapformer.units import LoadUnit

Measure = Literal["tokens", "workload"]

FRAME_WIDTH = 128 / 9  # manim's default 16:9 frame (14.22 x 8 units)
FRAME_HEIGHT = 8.0

# Horizontal bands (scene units).
BAG_LABEL_RIGHT = -6.2
BRACKET_X = -6.08
GPU_LABEL_RIGHT = -5.35
BEFORE_X = (-5.25, -0.65)
LOAD_BEFORE_X = (-0.5, 0.4)
AFTER_X = (0.9, 5.5)
LOAD_AFTER_X = (5.65, 6.55)
# Vertical bands.
TITLE_Y = 3.62
HEADER_Y = 3.08
ROWS_TOP, ROWS_BOTTOM = 2.8, -2.95
STATS_Y = -3.3
LEGEND_Y = -3.72

BACKGROUND = "#101318"
GROUP_COLOR = "#7d838c"  # tiny sequences grouped into one block per GPU
LOAD_BEFORE_COLOR = "#b0b7c3"
LOAD_AFTER_COLOR = "#2a6fdb"
CAPACITY_COLOR = "#ffd43b"
MOVING_OPACITY = 1.0
STAYING_OPACITY = 0.42  # staying chunks are drawn faded and without outline
BAG_GAP = 0.45  # gap between bags, in row heights
MAX_ROW_HEIGHT = 0.55
MAX_GPU_LABELS = 32
MIN_LABEL_GAP = 0.26  # scene units between two bag labels; closer ones are skipped
MIN_BLOCK_WIDTH = 0.03  # narrower sequences/chunks are grouped (about 2 px at 480p)
MAX_BLOCKS = 1200  # cap on drawn sequence blocks and on drawn chunk blocks


@dataclass(frozen=True)
class Box:
    """Axis-aligned rectangle: centre (x, y) and size, in scene units."""

    x: float
    y: float
    width: float
    height: float

    @property
    def left(self) -> float:
        return self.x - self.width / 2

    @property
    def right(self) -> float:
        return self.x + self.width / 2

    @property
    def top(self) -> float:
        return self.y + self.height / 2

    @property
    def bottom(self) -> float:
        return self.y - self.height / 2


@dataclass(frozen=True)
class Row:
    """One GPU: ``pos`` is its index in ``plan.gpus``; ``label`` is None when thinned out."""

    gpu: int
    pos: int
    y: float
    height: float
    label: str | None


@dataclass(frozen=True)
class Bracket:
    bag: int
    top: float
    bottom: float
    label: str | None


@dataclass(frozen=True)
class SeqBlock:
    """A sequence on its source GPU before routing (``seq`` = -1: grouped tiny sequences)."""

    seq: int
    row: int  # index into SceneLayout.rows
    box: Box
    color: str
    count: int = 1  # sequences in the block


@dataclass(frozen=True)
class ChunkBlock:
    """A chunk: ``src`` is its piece of the sequence block, ``dst`` its place after routing."""

    chunk: int
    seq: int
    src_row: int
    dst_row: int
    src: Box
    dst: Box
    color: str
    moves: bool

    @property
    def opacity(self) -> float:
        return MOVING_OPACITY if self.moves else STAYING_OPACITY


@dataclass(frozen=True)
class SceneLayout:
    measure: Measure
    title: str
    stats_text: str
    legend_text: str
    note: str | None  # e.g. how many tiny sequences were grouped
    rows: list[Row]
    brackets: list[Bracket]
    seq_blocks: list[SeqBlock]  # drawn sequences (not grouped)
    chunk_blocks: list[ChunkBlock]  # drawn chunks (not grouped)
    groups_before: list[SeqBlock]  # one grey block per GPU holding grouped sequences
    groups_after: list[SeqBlock]  # one grey block per GPU holding grouped chunks
    load_before: list[Box]  # per row
    load_after: list[Box]
    capacity_x: tuple[float, float]  # capacity line (mean load) in each load region
    label_font: float  # font size of GPU / bag labels
    grouped_sequences: int = 0
    grouped_chunks: int = 0


def sequence_color(i: int) -> str:
    """Colour of sequence ``i``: hues stepped by the golden ratio so neighbours differ and
    any number of sequences gets a colour; lightness/saturation alternate for more spread."""
    hue = (i * 0.6180339887498949) % 1.0
    light = (0.52, 0.64, 0.44)[i % 3]
    sat = (0.78, 0.62)[(i // 3) % 2]
    r, g, b = colorsys.hls_to_rgb(hue, light, sat)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def to_pixels(x: float, y: float, width_px: int, height_px: int) -> tuple[int, int]:
    """Scene point → (column, row) pixel of a ``width_px`` x ``height_px`` frame."""
    col = (x + FRAME_WIDTH / 2) / FRAME_WIDTH * width_px
    row = (FRAME_HEIGHT / 2 - y) / FRAME_HEIGHT * height_px
    return min(max(int(col), 0), width_px - 1), min(max(int(row), 0), height_px - 1)


def _threshold(widths: np.ndarray, cap: int) -> float:
    """Smallest drawn width: MIN_BLOCK_WIDTH, raised so at most ``cap`` blocks are drawn."""
    if widths.size <= cap:
        return MIN_BLOCK_WIDTH
    kth = np.partition(widths, widths.size - cap)[widths.size - cap]
    return max(MIN_BLOCK_WIDTH, float(np.nextafter(kth, np.inf)))


def _rows(plan: RoutingPlan) -> tuple[list[Row], list[Bracket], float]:
    pos = {g: i for i, g in enumerate(plan.gpus)}
    n, nb = len(plan.gpus), len(plan.bags)
    unit = min(MAX_ROW_HEIGHT, (ROWS_TOP - ROWS_BOTTOM) / (n + BAG_GAP * (nb - 1)))
    used = unit * (n + BAG_GAP * (nb - 1))
    top = (ROWS_TOP + ROWS_BOTTOM) / 2 + used / 2  # centre the rows vertically
    label_every = math.ceil(n / MAX_GPU_LABELS)
    rows, brackets = [], []
    y = top
    last_label_y = math.inf
    for bag_id, members in enumerate(plan.bags):
        if bag_id:
            y -= unit * BAG_GAP
        bag_top = y
        for g in members:
            i = len(rows)
            label = f"GPU {g}" if i % label_every == 0 else None
            rows.append(Row(gpu=g, pos=pos[g], y=y - unit / 2, height=unit * 0.8, label=label))
            y -= unit
        mid = (bag_top + y) / 2
        label = None
        if last_label_y - mid >= MIN_LABEL_GAP:
            # Two lines where the bracket is tall enough, else the short form.
            label = plan.bag_label(bag_id, "\n") if bag_top - y >= 0.5 else f"bag {bag_id}"
            last_label_y = mid
        brackets.append(
            Bracket(bag=bag_id, top=bag_top - unit * 0.05, bottom=y + unit * 0.05, label=label)
        )
    return rows, brackets, unit


def layout_plan(
    plan: RoutingPlan, measure: Measure = "tokens", title: str | None = None
) -> SceneLayout:
    """Positions, sizes and colours of every drawn element of ``plan``'s animation.

    Block widths are proportional to tokens or to workload (``measure``), on one scale shared
    by the before and after regions, so a row's length is its GPU's load in that measure.
    """
    if measure not in ("tokens", "workload"):
        raise ValueError(f"measure must be 'tokens' or 'workload', not {measure!r}")
    stats = plan.stats
    seqs, chunks = plan.sequences, plan.chunks
    n = len(plan.gpus)
    rows, brackets, unit = _rows(plan)
    row_of_pos = np.empty(n, dtype=np.int64)
    for r, row in enumerate(rows):
        row_of_pos[row.pos] = r
    pos_of_gpu = gpu_positions(plan.gpus)

    length = np.asarray(seqs.length, dtype=np.float64)
    seq_amount = np.asarray(seqs.workload, dtype=np.float64) if measure == "workload" else length
    c_seq = np.asarray(chunks.seq, dtype=np.int64)
    c_len = np.asarray(chunks.length, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(length[c_seq] > 0, c_len / length[c_seq], 0.0)
    chunk_amount = seq_amount[c_seq] * share

    src_row = row_of_pos[pos_of_gpu[np.asarray(seqs.src_gpu)]]
    c_src_row = row_of_pos[pos_of_gpu[np.asarray(chunks.src_gpu)]]
    c_dst_row = row_of_pos[pos_of_gpu[np.asarray(chunks.dst_gpu)]]
    before_total = np.bincount(src_row, weights=seq_amount, minlength=n)
    after_total = np.bincount(c_dst_row, weights=chunk_amount, minlength=n)
    peak = max(float(before_total.max(initial=0.0)), float(after_total.max(initial=0.0)))
    region = BEFORE_X[1] - BEFORE_X[0]
    scale = region / peak if peak > 0 else 0.0
    seq_w, chunk_w = seq_amount * scale, chunk_amount * scale
    block_h = unit * 0.8

    # Sequences: tiny ones are grouped per GPU at the end of the row.
    seq_min = _threshold(seq_w[seq_w > 0], MAX_BLOCKS)
    seq_drawn = seq_w >= seq_min
    colors = [sequence_color(i) for i in range(len(seqs))]
    seq_blocks, groups_before = [], []
    seq_left = np.zeros(len(seqs))
    cursor = np.full(n, BEFORE_X[0])
    order = np.lexsort((np.arange(len(seqs)), ~seq_drawn))  # drawn first, then by id
    group_w, group_count = np.zeros(n), np.zeros(n, dtype=np.int64)
    for s in order:
        r = src_row[s]
        if seq_drawn[s]:
            seq_left[s] = cursor[r]
            box = Box(cursor[r] + seq_w[s] / 2, rows[r].y, seq_w[s], block_h)
            seq_blocks.append(SeqBlock(seq=int(s), row=int(r), box=box, color=colors[s]))
            cursor[r] += seq_w[s]
        elif length[s] > 0:
            group_w[r] += seq_w[s]
            group_count[r] += 1
    for r in np.flatnonzero(group_count):
        box = Box(cursor[r] + group_w[r] / 2, rows[r].y, group_w[r], block_h)
        groups_before.append(SeqBlock(-1, int(r), box, GROUP_COLOR, int(group_count[r])))

    # Chunks: a drawn chunk keeps its place inside its sequence block (src) and is stacked
    # at its destination row in sequence order (dst); others join the destination's group.
    offset_in_seq = np.asarray(chunks.offset, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        offset_share = np.where(length[c_seq] > 0, offset_in_seq / length[c_seq], 0.0)
    candidate = seq_drawn[c_seq] & (chunk_w > 0)
    chunk_min = _threshold(chunk_w[candidate], MAX_BLOCKS)
    chunk_drawn = candidate & (chunk_w >= chunk_min)
    chunk_blocks, groups_after = [], []
    cursor = np.full(n, AFTER_X[0])
    group_w, group_count = np.zeros(n), np.zeros(n, dtype=np.int64)
    for c in np.lexsort((np.arange(len(chunks)), c_seq, ~chunk_drawn)):
        d = c_dst_row[c]
        if not chunk_drawn[c]:
            if c_len[c] > 0:
                group_w[d] += chunk_w[c]
                group_count[d] += 1
            continue
        s = c_seq[c]
        src_left = seq_left[s] + offset_share[c] * seq_w[s]
        src = Box(src_left + chunk_w[c] / 2, rows[c_src_row[c]].y, chunk_w[c], block_h)
        dst = Box(cursor[d] + chunk_w[c] / 2, rows[d].y, chunk_w[c], block_h)
        cursor[d] += chunk_w[c]
        moves = bool(chunks.src_gpu[c] != chunks.dst_gpu[c])
        chunk_blocks.append(
            ChunkBlock(int(c), int(s), int(c_src_row[c]), int(d), src, dst, colors[s], moves)
        )
    for r in np.flatnonzero(group_count):
        box = Box(cursor[r] + group_w[r] / 2, rows[r].y, group_w[r], block_h)
        groups_after.append(SeqBlock(-1, int(r), box, GROUP_COLOR, int(group_count[r])))

    # Load bars always show modelled workload (the quantity the balancer evens out).
    load_peak = max(stats.makespan_before, stats.makespan_after)
    lscale = (LOAD_BEFORE_X[1] - LOAD_BEFORE_X[0]) / load_peak if load_peak > 0 else 0.0
    load_before, load_after = [], []
    for row in rows:
        for loads, band, out in (
            (stats.load_before, LOAD_BEFORE_X, load_before),
            (stats.load_after, LOAD_AFTER_X, load_after),
        ):
            w = float(loads[row.pos]) * lscale
            out.append(Box(band[0] + w / 2, row.y, w, block_h))
    cap = stats.mean_load * lscale
    capacity_x = (LOAD_BEFORE_X[0] + cap, LOAD_AFTER_X[0] + cap)

    grouped_seqs = int((~seq_drawn & (length > 0)).sum())
    note = None
    if grouped_seqs or groups_after:
        note = f"grey: {grouped_seqs} small sequences grouped per GPU"
    step = f"step {plan.step}" if plan.step is not None else "routing plan"
    default_title = f"{step} · {plan.topology} · {n} GPUs · {len(seqs)} sequences"
    if plan.run:
        default_title = f"{plan.run} · {default_title}"
    load_unit = LoadUnit.of(plan)
    stats_text = (
        f"imbalance (max/mean) {stats.imbalance_before:.2f} → {stats.imbalance_after:.2f}"
        f"   ·   makespan {load_unit.format(stats.makespan_before)} → "
        f"{load_unit.format(stats.makespan_after)}"
        f" ({stats.speedup:.2f}x)   ·   moved {stats.moved_tokens:,} tokens"
        f" ({stats.moved_fraction:.0%})"
    )
    legend = (
        "bright, outlined: chunk moves   ·   faded: chunk stays"
        "   ·   yellow line: capacity (mean load)"
    )
    label_font = float(min(16.0, max(6.0, unit * 34)))
    return SceneLayout(
        measure=measure,
        title=title or default_title,
        stats_text=stats_text,
        legend_text=legend,
        note=note,
        rows=rows,
        brackets=brackets,
        seq_blocks=seq_blocks,
        chunk_blocks=chunk_blocks,
        groups_before=groups_before,
        groups_after=groups_after,
        load_before=load_before,
        load_after=load_after,
        capacity_x=capacity_x,
        label_font=label_font,
        grouped_sequences=grouped_seqs,
        grouped_chunks=int(group_count.sum()),
    )
