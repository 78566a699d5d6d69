"""Where everything goes in the routing animation: a pure function of a plan.

`layout_plan(plan)` returns positions, sizes and colours in manim scene units (the frame is
`FRAME_WIDTH` x `FRAME_HEIGHT`, origin at its centre, y up). No manim import: the scene only
draws what this module decides, so tests check the picture without rendering a video, and
`to_pixels` maps scene units to pixel coordinates of a rendered frame.

Screen plan (left to right): bag brackets and labels, GPU labels, the "before" region (each
GPU's sequences as blocks), the before load bars, the "after" region (chunks at their
destination GPU), the after load bars. Rows go bag by bag so a bracket spans contiguous rows.

Labels stay legible at any GPU count: GPU and bag labels never shrink below
`MIN_LABEL_FONT` (at least `MIN_TEXT_PX`, 12 px, tall at the default 1280x720), and are
thinned instead by one rule: every k-th GPU row is labelled, k the smallest number that
keeps labels `MIN_LABEL_GAP` apart (all GPUs up to ~30 GPUs, every 2nd at 32-60, every
3rd at 64, ...); a bag is labelled when its label fits below the previous one. The
footer states k.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from knapformer.visualization import palette

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.contract.stats import before_after
from knapformer.contract.units import LoadUnit
from knapformer.errors import KnapformerError

Measure = Literal["tokens", "workload"]

FRAME_WIDTH = 128 / 9  # manim's default 16:9 frame (14.22 x 8 units)
FRAME_HEIGHT = 8.0

# Horizontal bands (scene units).
BAG_LABEL_RIGHT = -6.28
BAG_LABEL_WIDTH = 0.8  # from the frame's left margin to BAG_LABEL_RIGHT
BRACKET_X = -6.18
GPU_LABEL_RIGHT = -5.15
GPU_LABEL_WIDTH = 0.95
BEFORE_X = (-5.05, -0.65)
LOAD_BEFORE_X = (-0.5, 0.4)
AFTER_X = (0.9, 5.5)
LOAD_AFTER_X = (5.65, 6.55)
# Vertical bands.
TITLE_Y = 3.62
HEADER_Y = 3.08
ROWS_TOP, ROWS_BOTTOM = 2.8, -2.95
STATS_Y = -3.25
LEGEND_Y = -3.56
NOTE_Y = -3.84

BACKGROUND = palette.ANIMATION_BACKGROUND
GROUP_COLOR = palette.GROUPED  # tiny sequences grouped into one block per GPU
LOAD_BEFORE_COLOR = palette.BEFORE
LOAD_AFTER_COLOR = palette.AFTER
CAPACITY_COLOR = palette.CAPACITY
MOVING_OPACITY = 1.0
STAYING_OPACITY = 0.42  # staying chunks are drawn faded and without outline
BAG_GAP = 0.45  # gap between bags, in row heights
MAX_ROW_HEIGHT = 0.55
MAX_GPU_LABELS = 32
# Label text: manim font size -> cap height in scene units (DejaVu Sans, measured); at
# 720p a scene unit is 90 px, so a font size of 1 gives capitals of 0.95 px.
CAP_HEIGHT_PER_FONT_SIZE = 0.0105
#: Every text of the animation is at least this tall (px) at the default quality
#: (1280x720): the smallest font, 13 (the footer), has capitals of 12.3 px there.
MIN_TEXT_PX = 12
MIN_LABEL_FONT = 14.0  # caps of 0.147 units: 13.2 px at 720p (the default), 8.8 px at 480p
MAX_LABEL_FONT = 16.0
MIN_LABEL_GAP = 0.19  # scene units between the centres of two one-line labels
LABEL_LINE_SPACING = 1.2  # lines of a two-line label, in `MIN_LABEL_GAP`s
MIN_BLOCK_WIDTH = 0.03  # narrower sequences/chunks are grouped (about 2 px at 480p)
MAX_BLOCKS = 1200  # cap on drawn sequence blocks and on drawn chunk blocks
FLIGHT_ARC = 0.6  # radians of a chunk's flight arc, when it fits inside the rows band


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
    path_arc: float = 0.0  # radians of the flight arc (manim's ``path_arc``); 0 = straight

    @property
    def opacity(self) -> float:
        return MOVING_OPACITY if self.moves else STAYING_OPACITY


@dataclass(frozen=True)
class SceneLayout:
    measure: Measure
    title: str
    stats_text: str
    legend_text: str
    note: str | None  # what is grouped into grey blocks and how labels are thinned
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
    label_every: int = 1  # every k-th GPU row carries a label


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


def label_font(row_pitch: float) -> float:
    """Font size of GPU and bag labels for rows ``row_pitch`` apart: larger while rows are
    tall, never below `MIN_LABEL_FONT`."""
    return float(min(MAX_LABEL_FONT, max(MIN_LABEL_FONT, row_pitch * 34)))


def label_gap(font: float) -> float:
    """Distance between the centres of two one-line labels of ``font`` (scene units)."""
    return MIN_LABEL_GAP * font / MIN_LABEL_FONT


def label_line_pitch(font: float) -> float:
    """Distance between the lines of a two-line bag label (a little more than between two
    labels, so a descender never touches the next line's capitals)."""
    return LABEL_LINE_SPACING * label_gap(font)


def label_extent(lines: int, font: float) -> float:
    """Height a label of ``lines`` lines claims in the label column (scene units)."""
    return label_gap(font) + (lines - 1) * label_line_pitch(font)


def _rows(plan: RoutingPlan) -> tuple[list[Row], list[Bracket], float, int]:
    """Rows (bag by bag), bag brackets, the row pitch and k (every k-th GPU labelled)."""
    pos = {g: i for i, g in enumerate(plan.gpus)}
    n, nb = len(plan.gpus), len(plan.bags)
    unit = min(MAX_ROW_HEIGHT, (ROWS_TOP - ROWS_BOTTOM) / (n + BAG_GAP * (nb - 1)))
    used = unit * (n + BAG_GAP * (nb - 1))
    top = (ROWS_TOP + ROWS_BOTTOM) / 2 + used / 2  # centre the rows vertically
    font = label_font(unit)
    gap = label_gap(font)
    label_every = max(math.ceil(n / MAX_GPU_LABELS), math.ceil(gap / unit - 1e-9))
    rows, brackets = [], []
    y = top
    last_bottom = math.inf  # lower edge of the last bag label shown
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
        # Two lines where the bracket is tall enough, else the short form, else none.
        lines = 2 if bag_top - y >= label_extent(2, font) else 1
        extent = label_extent(lines, font)
        label = None
        if mid + extent / 2 <= last_bottom:
            label = plan.bag_label(bag_id, "\n") if lines == 2 else f"bag {bag_id}"
            last_bottom = mid - extent / 2
        brackets.append(
            Bracket(bag=bag_id, top=bag_top - unit * 0.05, bottom=y + unit * 0.05, label=label)
        )
    return rows, brackets, unit, label_every


def flight_arc(x0: float, y0: float, x1: float, y1: float, height: float) -> float:
    """Signed arc (radians, manim's ``path_arc``) of a block of ``height`` flying from
    (x0, y0) to (x1, y1): `FLIGHT_ARC`, bulging toward the middle of the rows band, and
    flatter where that bulge would leave the band (over the headers or the figures).

    A positive arc bulges to the right of the direction of travel. The arc lies between
    its chord and the parallel line through its apex, the sagitta ``chord/2·tan(arc/4)``
    away, so bounding that keeps the whole flight inside the band.
    """
    dx, dy = x1 - x0, y1 - y0
    chord = math.hypot(dx, dy)
    if chord == 0.0:
        return 0.0
    lo, hi = ROWS_BOTTOM + height / 2, ROWS_TOP - height / 2
    right_y = -dx / chord  # y of the unit normal on the right of travel
    sign = 1.0 if right_y * ((lo + hi) / 2 - (y0 + y1) / 2) >= 0 else -1.0
    bulge_y = sign * right_y
    sagitta = chord / 2 * math.tan(FLIGHT_ARC / 4)
    room = hi - max(y0, y1) if bulge_y > 0 else min(y0, y1) - lo
    if abs(bulge_y) * sagitta > room:
        sagitta = max(room, 0.0) / abs(bulge_y)
    return sign * 4 * math.atan(2 * sagitta / chord)


@dataclass(frozen=True)
class _Widths:
    """Where each sequence and chunk sits and how wide it is drawn (scene units).

    Arrays are indexed by sequence id (``seq_*``) or chunk id (``chunk_*``); rows are
    indices into the row list."""

    seq_row: np.ndarray  # (n_seq,) row of the sequence's source GPU
    seq_width: np.ndarray  # (n_seq,)
    chunk_src_row: np.ndarray  # (n_chunks,)
    chunk_dst_row: np.ndarray  # (n_chunks,)
    chunk_width: np.ndarray  # (n_chunks,)
    chunk_offset_share: np.ndarray  # (n_chunks,) chunk offset / sequence length
    block_height: float
    colors: list[str]  # (n_seq,)


def layout_plan(
    plan: RoutingPlan, measure: Measure = "tokens", title: str | None = None
) -> SceneLayout:
    """Positions, sizes and colours of every drawn element of ``plan``'s animation.

    Block widths are proportional to tokens or to workload (``measure``), on one scale shared
    by the before and after regions, so a row's length is its GPU's load in that measure.
    Built in parts: rows and bag brackets, sequence blocks, chunk blocks, load bars, texts.
    """
    if measure not in ("tokens", "workload"):
        raise KnapformerError(f"measure must be 'tokens' or 'workload', not {measure!r}")
    rows, brackets, unit, label_every = _rows(plan)
    widths = _widths(plan, measure, rows, unit)
    seq_blocks, groups_before, seq_left, seq_drawn = _sequence_blocks(plan, widths, rows)
    chunk_blocks, groups_after, grouped_chunks = _chunk_blocks(
        plan, widths, rows, seq_left, seq_drawn
    )
    load_before, load_after, capacity_x = _load_bars(plan, rows, widths.block_height)
    grouped_seqs = int((~seq_drawn & (plan.sequences.length > 0)).sum())
    return SceneLayout(
        measure=measure,
        title=title or _default_title(plan),
        stats_text=_stats_text(plan),
        legend_text=LEGEND,
        note=_note(grouped_seqs, grouped_chunks, label_every),
        rows=rows,
        brackets=brackets,
        seq_blocks=seq_blocks,
        chunk_blocks=chunk_blocks,
        groups_before=groups_before,
        groups_after=groups_after,
        load_before=load_before,
        load_after=load_after,
        capacity_x=capacity_x,
        label_font=label_font(unit),
        grouped_sequences=grouped_seqs,
        grouped_chunks=grouped_chunks,
        label_every=label_every,
    )


def _widths(plan: RoutingPlan, measure: Measure, rows: list[Row], unit: float) -> _Widths:
    """Rows and widths of sequences and chunks on one scale: the longest row (before or
    after routing) fills its region."""
    seqs, chunks = plan.sequences, plan.chunks
    n = len(plan.gpus)
    row_of_pos = np.empty(n, dtype=np.int64)
    for r, row in enumerate(rows):
        row_of_pos[row.pos] = r
    pos_of_gpu = gpu_positions(plan.gpus)

    def row_of(ranks: np.ndarray) -> np.ndarray:
        return row_of_pos[pos_of_gpu[np.asarray(ranks)]]

    length = np.asarray(seqs.length, dtype=np.float64)
    seq_amount = np.asarray(seqs.workload, dtype=np.float64) if measure == "workload" else length
    c_seq = np.asarray(chunks.seq, dtype=np.int64)
    c_len = np.asarray(chunks.length, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(length[c_seq] > 0, c_len / length[c_seq], 0.0)
        offset_share = np.where(length[c_seq] > 0, chunks.offset / length[c_seq], 0.0)
    chunk_amount = seq_amount[c_seq] * share

    seq_row = row_of(seqs.src_gpu)
    chunk_dst_row = row_of(chunks.dst_gpu)
    before_total = np.bincount(seq_row, weights=seq_amount, minlength=n)
    after_total = np.bincount(chunk_dst_row, weights=chunk_amount, minlength=n)
    peak = max(float(before_total.max(initial=0.0)), float(after_total.max(initial=0.0)))
    scale = (BEFORE_X[1] - BEFORE_X[0]) / peak if peak > 0 else 0.0
    return _Widths(
        seq_row=seq_row,
        seq_width=seq_amount * scale,
        chunk_src_row=row_of(chunks.src_gpu),
        chunk_dst_row=chunk_dst_row,
        chunk_width=chunk_amount * scale,
        chunk_offset_share=offset_share,
        block_height=unit * 0.8,
        colors=[sequence_color(i) for i in range(len(seqs))],
    )


def _group_blocks(
    cursor: np.ndarray, width: np.ndarray, count: np.ndarray, rows: list[Row], height: float
) -> list[SeqBlock]:
    """One grey block per row holding grouped items, placed at the row's ``cursor``."""
    blocks = []
    for r in np.flatnonzero(count):
        box = Box(cursor[r] + width[r] / 2, rows[r].y, width[r], height)
        blocks.append(SeqBlock(-1, int(r), box, GROUP_COLOR, int(count[r])))
    return blocks


def _sequence_blocks(
    plan: RoutingPlan, w: _Widths, rows: list[Row]
) -> tuple[list[SeqBlock], list[SeqBlock], np.ndarray, np.ndarray]:
    """Sequences on their source GPU before routing, in id order; tiny ones are grouped per
    GPU at the end of the row. Returns (blocks, groups, left edge (n_seq,), drawn (n_seq,))."""
    n_seq = len(plan.sequences)
    length = plan.sequences.length
    drawn = w.seq_width >= _threshold(w.seq_width[w.seq_width > 0], MAX_BLOCKS)
    blocks = []
    left = np.zeros(n_seq)
    cursor = np.full(len(rows), BEFORE_X[0])
    group_w, group_count = np.zeros(len(rows)), np.zeros(len(rows), dtype=np.int64)
    for s in np.lexsort((np.arange(n_seq), ~drawn)):  # drawn first, then by id
        r, width = w.seq_row[s], w.seq_width[s]
        if drawn[s]:
            left[s] = cursor[r]
            box = Box(cursor[r] + width / 2, rows[r].y, width, w.block_height)
            blocks.append(SeqBlock(seq=int(s), row=int(r), box=box, color=w.colors[s]))
            cursor[r] += width
        elif length[s] > 0:
            group_w[r] += width
            group_count[r] += 1
    groups = _group_blocks(cursor, group_w, group_count, rows, w.block_height)
    return blocks, groups, left, drawn


def _chunk_blocks(
    plan: RoutingPlan, w: _Widths, rows: list[Row], seq_left: np.ndarray, seq_drawn: np.ndarray
) -> tuple[list[ChunkBlock], list[SeqBlock], int]:
    """Chunks: a drawn chunk keeps its place inside its sequence block (src) and is stacked
    at its destination row in sequence order (dst); others join the destination's grey
    group. Returns (blocks, groups, how many chunks were grouped)."""
    chunks = plan.chunks
    c_seq = np.asarray(chunks.seq, dtype=np.int64)
    candidate = seq_drawn[c_seq] & (w.chunk_width > 0)
    drawn = candidate & (w.chunk_width >= _threshold(w.chunk_width[candidate], MAX_BLOCKS))
    blocks = []
    cursor = np.full(len(rows), AFTER_X[0])
    group_w, group_count = np.zeros(len(rows)), np.zeros(len(rows), dtype=np.int64)
    for c in np.lexsort((np.arange(len(chunks)), c_seq, ~drawn)):
        d, width = w.chunk_dst_row[c], w.chunk_width[c]
        if not drawn[c]:
            if chunks.length[c] > 0:
                group_w[d] += width
                group_count[d] += 1
            continue
        s = c_seq[c]
        src_left = seq_left[s] + w.chunk_offset_share[c] * w.seq_width[s]
        src = Box(src_left + width / 2, rows[w.chunk_src_row[c]].y, width, w.block_height)
        dst = Box(cursor[d] + width / 2, rows[d].y, width, w.block_height)
        cursor[d] += width
        moves = bool(chunks.src_gpu[c] != chunks.dst_gpu[c])
        arc = flight_arc(src.x, src.y, dst.x, dst.y, w.block_height) if moves else 0.0
        blocks.append(
            ChunkBlock(
                int(c), int(s), int(w.chunk_src_row[c]), int(d), src, dst, w.colors[s], moves, arc
            )
        )
    groups = _group_blocks(cursor, group_w, group_count, rows, w.block_height)
    return blocks, groups, int(group_count.sum())


def _load_bars(
    plan: RoutingPlan, rows: list[Row], height: float
) -> tuple[list[Box], list[Box], tuple[float, float]]:
    """Per-row load bars before and after, and the capacity line's x in each band. They
    always show modelled workload (the quantity the balancer evens out)."""
    stats = plan.stats
    load_peak = max(stats.makespan_before, stats.makespan_after)
    lscale = (LOAD_BEFORE_X[1] - LOAD_BEFORE_X[0]) / load_peak if load_peak > 0 else 0.0
    load_before, load_after = [], []
    for row in rows:
        for loads, band, out in (
            (stats.load_before, LOAD_BEFORE_X, load_before),
            (stats.load_after, LOAD_AFTER_X, load_after),
        ):
            width = float(loads[row.pos]) * lscale
            out.append(Box(band[0] + width / 2, row.y, width, height))
    cap = stats.mean_load * lscale
    return load_before, load_after, (LOAD_BEFORE_X[0] + cap, LOAD_AFTER_X[0] + cap)


LEGEND = (
    "bright, outlined: chunk moves   ·   faded: chunk stays   ·   "
    f"{palette.CAPACITY_NAME} line: capacity (mean load)"
)


def _counted(count: int, noun: str) -> str:
    """``1 small chunk``, ``1,024 small chunks``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _note(grouped_sequences: int, grouped_chunks: int, label_every: int) -> str | None:
    """The footer's second line: what the grey blocks hold (before and after routing
    separately: small chunks of large sequences are grouped too) and the label rule."""
    parts = []
    grouped = []
    if grouped_sequences:
        grouped.append(f"{_counted(grouped_sequences, 'small sequence')} before routing")
    if grouped_chunks:
        grouped.append(f"{_counted(grouped_chunks, 'small chunk')} after routing")
    if grouped:
        parts.append(f"{palette.GROUPED_NAME}: " + " and ".join(grouped) + ", grouped per GPU")
    if label_every > 1:
        parts.append(f"GPU labels: every {_ordinal(label_every)} GPU")
    return "   ·   ".join(parts) or None


def _default_title(plan: RoutingPlan) -> str:
    step = f"step {plan.step}" if plan.step is not None else "routing plan"
    title = f"{step} · {plan.topology} · {len(plan.gpus)} GPUs · {len(plan.sequences)} sequences"
    return f"{plan.run} · {title}" if plan.run else title


def _stats_text(plan: RoutingPlan) -> str:
    stats, load = plan.stats, LoadUnit.of(plan)
    return (
        f"imbalance (max/mean) {before_after(stats.imbalance_before, stats.imbalance_after, '.2f')}"
        f"   ·   makespan {load.format(stats.makespan_before)} → "
        f"{load.format(stats.makespan_after)}"
        f" ({stats.speedup:.2f}x)   ·   moved {stats.moved_tokens:,} tokens"
        f" ({stats.moved_fraction:.0%})"
    )
