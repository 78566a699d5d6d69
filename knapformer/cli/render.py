"""``knapformer animate`` (manim video of routing decisions) and ``knapformer report``
(self-contained HTML with the dashboard's plotly figures). manim, plotly and Playwright are
imported inside the commands so ``import knapformer`` stays light."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.cli.plans import read_plan_file

QUALITY_HELP = "low (854x480, 15 fps), medium (1280x720, 30 fps), high (1080p60) or 4k"


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command()(animate)
    app.command()(report)


def animate(
    plan: Annotated[Path, typer.Argument(help="Plan file: JSON, JSONL or legacy JSON.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output video (.mp4).")] = Path(
        "routing.mp4"
    ),
    step: Annotated[
        int | None, typer.Option(help="Step to animate (default: the last plan of the file).")
    ] = None,
    steps: Annotated[
        str | None, typer.Option(help="Chain steps A:B (inclusive; A: or :B open) in one video.")
    ] = None,
    quality: Annotated[str, typer.Option(help=QUALITY_HELP)] = "low",
    measure: Annotated[
        str, typer.Option(help="Block widths proportional to 'tokens' or 'workload'.")
    ] = "tokens",
    title: Annotated[str | None, typer.Option(help="Title shown above the scene.")] = None,
) -> None:
    """Render a video of routing decisions: sequences per GPU, chunks flying to their bags."""
    require("animate", "knapformer animate")
    from rich.console import Console

    from knapformer.cli.progress import progress
    from knapformer.plan_io import plans_in_range, select_step
    from visualization.output import check_output_file
    from visualization.render import QUALITIES, render_video

    if step is not None and steps is not None:
        raise UserError("give either --step or --steps, not both")
    if quality not in QUALITIES:
        raise UserError(f"--quality must be one of {', '.join(QUALITIES)}, not {quality!r}")
    if measure not in ("tokens", "workload"):
        raise UserError(f"--measure must be 'tokens' or 'workload', not {measure!r}")
    check_output_file(out, ".mp4")  # before reading plans and rendering for minutes
    result = read_plan_file(plan)
    plans = plans_in_range(result, steps) if steps else [select_step(result, step).plan]

    console = Console(stderr=True)
    started = time.perf_counter()
    label = f"rendering {len(plans)} step{'s' if len(plans) != 1 else ''} ({quality})"
    with progress(label, "animations", console, log_quarters=True) as on_progress:
        written = render_video(plans, out, quality, measure, title, on_progress)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    console.print(f"wrote {written} ({len(plans)} step(s), {quality}) in {seconds:.1f} s")


def report(
    plans: Annotated[Path, typer.Argument(help="Plan file: JSON, JSONL or legacy JSON.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output HTML file.")] = Path(
        "report.html"
    ),
    steps: Annotated[
        str | None,
        typer.Option(help="Steps A:B (inclusive) to include (default: the last plan)."),
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(help="Also export every figure as PNG into this directory (Chromium)."),
    ] = None,
) -> None:
    """Write a self-contained HTML report with the dashboard's plotly figures."""
    require("dashboard", "knapformer report", "plotly")
    from visualization.report import export_pngs, write_report

    result = read_plan_file(plans)
    written, figures = write_report(result, out, steps=steps, source=str(plans))
    print(f"wrote {written} ({len(figures)} figures)")
    if png is not None:
        try:
            files = export_pngs(written, png)
        except RuntimeError as err:
            raise UserError(str(err)) from None
        print(f"wrote {len(files)} PNG files to {png}")
