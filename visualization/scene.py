"""The manim scene of one or more routing decisions (draws what `layout.py` decided).

Text uses manim's `Text` (Pango), never LaTeX. Few mobjects and no updaters keep the Cairo
renderer fast. Each step opens on its "before" state (sequences on their GPUs and the
before load bars, so a video's first frame, its thumbnail, shows the problem), holds it,
splits sequences into chunks, flies the chunks to their destination in one `LaggedStart`
(along arcs that stay inside the rows band), then shows the after load bars and figures.
"""

from __future__ import annotations

from collections.abc import Callable

from knapformer.visualization.layout import (
    AFTER_X,
    BACKGROUND,
    BAG_LABEL_RIGHT,
    BAG_LABEL_WIDTH,
    BEFORE_X,
    BRACKET_X,
    CAPACITY_COLOR,
    GPU_LABEL_RIGHT,
    GPU_LABEL_WIDTH,
    HEADER_Y,
    LEGEND_Y,
    LOAD_AFTER_COLOR,
    LOAD_AFTER_X,
    LOAD_BEFORE_COLOR,
    LOAD_BEFORE_X,
    NOTE_Y,
    STATS_Y,
    TITLE_Y,
    Box,
    SceneLayout,
    label_line_pitch,
)
from knapformer.visualization.palette import ANIMATION_MUTED_TEXT, ANIMATION_TEXT
from manim import (
    LEFT,
    DashedLine,
    FadeIn,
    FadeOut,
    GrowFromEdge,
    LaggedStart,
    Line,
    Rectangle,
    Scene,
    Text,
    VGroup,
)

# Seconds of each phase of one step; `step_duration` is what the video length follows.
# Multiples of 0.2 s give whole frames at 15, 30 and 60 fps, so durations add up exactly.
T_BEFORE, T_SPLIT, T_FLY, T_AFTER, T_HOLD, T_CLEAR = 2.0, 0.6, 2.0, 0.8, 1.4, 0.6
GHOST_OPACITY = 0.2  # sequences left behind on their source GPU once split
STEP_SECONDS = T_BEFORE + T_SPLIT + T_FLY + T_AFTER + T_HOLD
CALLS_PER_STEP = 5  # play/wait calls per step (progress reporting)
FONT = "DejaVu Sans"
LABEL_COLOR = "#ced4da"
# Font sizes of the texts other than the GPU / bag labels (`SceneLayout.label_font`): all
# at least `MIN_TEXT_PX` tall at the default 1280x720 (`CAP_HEIGHT_PER_FONT_SIZE`).
TITLE_FONT, HEADER_FONT, STATS_FONT, FOOTER_FONT = 20, 15, 14, 13


def video_duration(num_steps: int) -> float:
    """Seconds of the video of ``num_steps`` chained steps."""
    return num_steps * STEP_SECONDS + (num_steps - 1) * T_CLEAR


def total_calls(num_steps: int) -> int:
    return num_steps * CALLS_PER_STEP + (num_steps - 1)


def _rect(box: Box, color: str, opacity: float = 1.0, stroke: float = 0.0) -> Rectangle:
    rect = Rectangle(width=max(box.width, 1e-3), height=box.height)
    rect.set_fill(color, opacity=opacity).set_stroke("#ffffff", width=stroke, opacity=0.9)
    return rect.move_to([box.x, box.y, 0])


def _text(s: str, size: float, color: str = ANIMATION_TEXT, max_width: float | None = None) -> Text:
    t = Text(s, font=FONT, font_size=size, color=color)
    if max_width is not None and t.width > max_width:
        t.scale_to_fit_width(max_width)
    return t


class RoutingScene(Scene):
    """Animates ``layouts`` one after another; ``on_progress(done, total)`` after each call."""

    def __init__(
        self,
        layouts: list[SceneLayout],
        on_progress: Callable[[int, int], None] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.layouts = layouts
        self.on_progress = on_progress
        self._done = 0
        self._total = total_calls(len(layouts))

    def _tick(self) -> None:
        self._done += 1
        if self.on_progress is not None:
            self.on_progress(self._done, self._total)

    def play(self, *args, **kwargs):  # manim's wait() goes through play() too
        super().play(*args, **kwargs)
        self._tick()

    def _play_or_wait(self, animations: list, run_time: float) -> None:
        """manim refuses play() without animations (e.g. a plan with only empty sequences);
        waiting instead keeps every step the same length."""
        if animations:
            self.play(*animations, run_time=run_time)
        else:
            self.wait(run_time)

    def construct(self) -> None:
        self.camera.background_color = BACKGROUND
        for i, lay in enumerate(self.layouts):
            if i:
                self.play(FadeOut(*self.mobjects), run_time=T_CLEAR)
            self._step(lay)

    def _frame(self, lay: SceneLayout) -> VGroup:
        """Title, headers, GPU labels, bag brackets, capacity lines (static during a step)."""
        parts = VGroup()
        parts.add(_text(lay.title, TITLE_FONT, max_width=13.4).move_to([0, TITLE_Y, 0]))
        unit = "tokens" if lay.measure == "tokens" else "workload"
        for label, band in (
            (f"before · {unit} per GPU", BEFORE_X),
            ("load", LOAD_BEFORE_X),
            ("after routing", AFTER_X),
            ("load", LOAD_AFTER_X),
        ):
            head = _text(label, HEADER_FONT, ANIMATION_MUTED_TEXT, max_width=band[1] - band[0])
            parts.add(head.move_to([(band[0] + band[1]) / 2, HEADER_Y, 0]))
        for row in lay.rows:
            if row.label:
                t = _text(row.label, lay.label_font, LABEL_COLOR, max_width=GPU_LABEL_WIDTH)
                parts.add(t.move_to([GPU_LABEL_RIGHT - t.width / 2, row.y, 0]))
        for br in lay.brackets:
            tick = 0.07
            parts.add(
                Line([BRACKET_X + tick, br.top, 0], [BRACKET_X, br.top, 0]),
                Line([BRACKET_X, br.top, 0], [BRACKET_X, br.bottom, 0]),
                Line([BRACKET_X, br.bottom, 0], [BRACKET_X + tick, br.bottom, 0]),
            )
            if br.label:
                # One Text per line, `label_line_pitch` apart, as the layout reserved.
                lines = br.label.split("\n")
                pitch = label_line_pitch(lay.label_font)
                top = (br.top + br.bottom) / 2 + (len(lines) - 1) * pitch / 2
                for i, line in enumerate(lines):
                    t = _text(line, lay.label_font, LABEL_COLOR, max_width=BAG_LABEL_WIDTH)
                    parts.add(t.move_to([BAG_LABEL_RIGHT - t.width / 2, top - i * pitch, 0]))
        top, bottom = lay.rows[0].y + lay.rows[0].height, lay.rows[-1].y - lay.rows[-1].height
        for x in lay.capacity_x:
            parts.add(
                DashedLine([x, top, 0], [x, bottom, 0], dash_length=0.08).set_stroke(
                    CAPACITY_COLOR, width=3
                )
            )
        for text, y in ((lay.legend_text, LEGEND_Y), (lay.note, NOTE_Y)):
            if text:
                line = _text(text, FOOTER_FONT, ANIMATION_MUTED_TEXT, max_width=13.4)
                parts.add(line.move_to([0, y, 0]))
        return parts

    def _step(self, lay: SceneLayout) -> None:
        seqs = {b.seq: _rect(b.box, b.color) for b in lay.seq_blocks}
        groups_before = [_rect(b.box, b.color, 0.8) for b in lay.groups_before]
        blocks = VGroup(*seqs.values(), *groups_before)
        loads_before = [_rect(b, LOAD_BEFORE_COLOR, 0.9) for b in lay.load_before if b.width > 0]
        # The "before" state is there from the step's first frame (the video's thumbnail);
        # added at once: animating text in would deep-copy every glyph.
        self.add(self._frame(lay), blocks, *loads_before)
        self.wait(T_BEFORE)

        # Split: chunk pieces appear over their sequence, which stays behind as a faint ghost
        # so the final frame still shows the "before" state.
        targets = []
        for c in lay.chunk_blocks:
            piece = _rect(c.src, c.color, c.opacity, 1.5 if c.moves else 0.0)
            piece.stretch_to_fit_width(max(c.src.width - 0.012, 1e-3))  # hairline gap
            targets.append((piece, c))
        pieces = VGroup(*(p for p, _ in targets))
        split = [blocks.animate.set_fill(opacity=GHOST_OPACITY)] if len(blocks) else []
        split += [FadeIn(pieces)] if targets else []
        self._play_or_wait(split, T_SPLIT)

        groups_after = [_rect(b.box, b.color, 0.8) for b in lay.groups_after]
        moves = [
            piece.animate(path_arc=c.path_arc).move_to([c.dst.x, c.dst.y, 0])
            for piece, c in targets
        ]
        fly = [LaggedStart(*moves, lag_ratio=0.6 / max(len(moves), 1))] if moves else []
        fly += [FadeIn(VGroup(*groups_after))] if groups_after else []
        self._play_or_wait(fly, T_FLY)

        loads_after = [_rect(b, LOAD_AFTER_COLOR, 0.9) for b in lay.load_after if b.width > 0]
        stats = _text(lay.stats_text, STATS_FONT, max_width=13.4).move_to([0, STATS_Y, 0])
        self.add(stats)
        self._play_or_wait([GrowFromEdge(m, LEFT) for m in loads_after], T_AFTER)
        self.wait(T_HOLD)
