"""Render routing plans to an MP4 with manim (Cairo renderer, PyAV writer, no display).

manim writes into a temporary media directory that is removed afterwards; the finished file
is moved to the requested path. manim's own logging and progress bars are silenced; callers
get progress through ``on_progress(done, total)``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from knapformer.visualization.layout import Measure, layout_plan
from knapformer.visualization.output import check_output_file

from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError

QUALITIES = {
    "low": "low_quality",  # 854x480, 15 fps
    "medium": "medium_quality",  # 1280x720, 30 fps: the default
    "high": "high_quality",  # 1920x1080, 60 fps
    "4k": "fourk_quality",  # 3840x2160, 60 fps
}
#: The quality at which every text of the animation is at least
#: `visualization.layout.MIN_TEXT_PX` tall.
DEFAULT_QUALITY = "medium"


def render_video(
    plans: list[RoutingPlan],
    out: str | Path,
    quality: str = DEFAULT_QUALITY,
    measure: Measure = "tokens",
    title: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Render ``plans`` (chained, in order) into the MP4 ``out``; returns its path."""
    if quality not in QUALITIES:
        raise KnapformerError(f"quality must be one of {', '.join(QUALITIES)}, not {quality!r}")
    if not plans:
        raise KnapformerError("no plan to render")
    out = check_output_file(out, ".mp4")
    layouts = [layout_plan(p, measure=measure, title=title) for p in plans]

    from knapformer.visualization.scene import RoutingScene
    from manim import tempconfig  # heavy import, only when rendering

    logging.getLogger("manim").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="knapformer-manim-") as media:
        options = {
            "quality": QUALITIES[quality],
            "media_dir": media,
            "output_file": "routing",
            "disable_caching": True,  # hashing every mobject costs more than it saves here
            "verbosity": "WARNING",
            "progress_bar": "none",
            "write_to_movie": True,
            "format": "mp4",
            "renderer": "cairo",
            "preview": False,
        }
        with tempconfig(options):
            scene = RoutingScene(layouts, on_progress=on_progress)
            scene.render()
            movie = Path(scene.renderer.file_writer.movie_file_path)
        if not movie.is_file():
            raise RuntimeError(f"manim did not write a video (expected {movie})")
        shutil.move(str(movie), out)
    return out
