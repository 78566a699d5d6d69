"""``knapformer animate`` (manim video of routing decisions) and ``knapformer report``
(self-contained HTML with the dashboard's plotly figures, or a PDF of it). manim, plotly
and Playwright are imported inside the commands so ``import knapformer`` stays light."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError, text_option
from knapformer.cli.extras import require
from knapformer.cli.plans import PLAN_ARGUMENT, read_plan_file
from knapformer.cli.source import SOURCE_HELP
from knapformer.contract.incident import run_incident
from knapformer.contract.runfiles import single_run, writable_folder
from knapformer.errors import KnapformerError
from knapformer.visualization.layout import MIN_TEXT_PX
from knapformer.visualization.render import (
    DEFAULT_QUALITY,  # no manim import: that waits for a render
)

QUALITY_HELP = (
    f"low (854x480, 15 fps), medium (1280x720, 30 fps; labels at least {MIN_TEXT_PX} px "
    "tall), high (1080p60) or 4k"
)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command()(animate)
    app.command()(report)


def animate(
    plan: Annotated[Path, typer.Argument(metavar="PLAN", help=PLAN_ARGUMENT)],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output video (.mp4).")] = Path(
        "routing.mp4"
    ),
    step: Annotated[
        int | None,
        typer.Option(
            callback=bounded, help="Step to animate (default: the last plan of the file)."
        ),
    ] = None,
    steps: Annotated[
        str | None, typer.Option(help="Chain steps A:B (inclusive; A: or :B open) in one video.")
    ] = None,
    quality: Annotated[str, typer.Option(help=QUALITY_HELP)] = DEFAULT_QUALITY,
    measure: Annotated[
        str, typer.Option(help="Block widths proportional to 'tokens' or 'workload'.")
    ] = "tokens",
    title: Annotated[str | None, typer.Option(help="Title shown above the scene.")] = None,
) -> None:
    """Render a video of routing decisions: sequences per GPU, chunks flying to their bags."""
    require("animate", "knapformer animate")
    from rich.console import Console

    from knapformer.cli.progress import progress
    from knapformer.contract.plan_io import plans_in_range, select_step
    from knapformer.visualization.output import check_output_file
    from knapformer.visualization.render import QUALITIES, render_video

    text_option(title, "--title")
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
    plans: Annotated[Path, typer.Argument(metavar="PLANS", help=PLAN_ARGUMENT)],
    out: Annotated[
        Path,
        typer.Option(
            "-o", "--out", help="Output file: .html (self-contained) or .pdf (needs Chromium)."
        ),
    ] = Path("report.html"),
    steps: Annotated[
        str | None,
        typer.Option(help="Steps A:B (inclusive) to include (default: the last plan)."),
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(help="Also export every figure as PNG into this directory (Chromium)."),
    ] = None,
    source: Annotated[str, typer.Option(help=SOURCE_HELP)] = "auto",
) -> None:
    """Write a report with the dashboard's plotly figures: self-contained HTML, or a PDF
    printed by headless Chromium."""
    require("dashboard", "knapformer report", "plotly")
    from knapformer.diagnosis.store_source import use_store  # pyarrow: not at start-up
    from knapformer.visualization.report import (
        browser_problem,
        export_pngs,
        print_pdf,
        report_format,
        write_report,
    )

    pdf = report_format(out) == "pdf"
    if pdf:  # refuse before reading anything: a .pdf must not receive HTML
        problem = browser_problem("a PDF report")
        if problem is not None:
            raise UserError(f"{problem}; or write HTML: -o {out.with_suffix('.html')}")
        if not out.parent.exists():
            raise UserError(f"output directory {str(out.parent)!r} does not exist")
    if png is not None:  # before writing the report: --png must name a usable folder
        writable_folder(png, "`png`")
    run = single_run(plans)
    store = run if use_store(run, source) else None
    result = read_plan_file(plans)
    with tempfile.TemporaryDirectory(prefix="knapformer-report-") as scratch:
        html = Path(scratch) / "report.html" if pdf else out
        incident = _incident(plans)
        written, figures = write_report(
            result, html, steps=steps, source=str(plans), incident=incident, store=store
        )
        if pdf:
            try:
                written = print_pdf(written, out)
            except RuntimeError as err:
                raise UserError(str(err)) from None
        print(f"wrote {out} ({len(figures)} figures{', PDF' if pdf else ''})")
        if png is not None:
            try:
                files = export_pngs(html, png)
            except RuntimeError as err:
                raise UserError(str(err)) from None
            print(f"wrote {len(files)} PNG files to {png}")


def _incident(plans: Path):
    """The run's incident, if it has a readable one (an unreadable one is said on stderr:
    the report is made without it)."""
    try:
        return run_incident(single_run(plans))
    except KnapformerError as err:
        print(f"the run's incident is left out: {err}", file=sys.stderr)
        return None
