"""A self-contained static HTML report of recorded plans, and PNG export of its figures.

The figures are the dashboard's (`visualization.figures`); plotly.js is embedded inline once,
so the file opens offline. Every figure sits in ``<div class="figure" data-view=...
data-step=...>`` so tools (and tests) can find each view.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from knapformer.errors import KnapformerError, OptionError, file_error
from knapformer.measured import MeasuredStep, RankFigures, measure
from knapformer.plan import RoutingPlan
from knapformer.plan_io import ReadResult, plans_in_range
from knapformer.stats import summarize
from knapformer.stragglers import WINDOW, analyse, rank_steps
from visualization import figures as F
from visualization.browser import find_chromium, launch_chromium, missing_chromium
from visualization.straggler_figures import predicted_vs_measured_figure

MAX_STEPS = 20  # per report: each step adds several figures and a table
MAX_TABLE_ROWS = 500  # sequence table rows per step; the rest is summarised


@dataclass(frozen=True)
class ReportFigure:
    name: str  # unique, used for the PNG file name, e.g. "step-12-traffic"
    view: str  # timeline | bag-load | traffic | predicted-vs-measured
    step: int | None


def _table(plan: RoutingPlan) -> str:
    rows = F.sequence_rows(plan)
    if not rows:
        return "<p>No sequences.</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>"
        for r in rows[:MAX_TABLE_ROWS]
    )
    more = ""
    if len(rows) > MAX_TABLE_ROWS:
        more = f"<p class='note'>First {MAX_TABLE_ROWS} of {len(rows)} sequences shown.</p>"
    return (
        f"<table class='sequences'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        + more
    )


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #212529; }
h1 { font-size: 1.5em; } h2 { margin-top: 2em; border-bottom: 1px solid #dee2e6; }
.summary td, .summary th, .sequences td, .sequences th { padding: 2px 10px; text-align: right; }
.sequences { border-collapse: collapse; font-size: 0.85em; }
.sequences tr:nth-child(even) { background: #f1f3f5; }
details { margin: 1em 0; } .note { color: #868e96; }
.figure { margin: 1em 0; }
"""


def measured_window(measured: list[MeasuredStep | None], index: int) -> list[RankFigures]:
    """The figures of the last `WINDOW` measured steps up to ``index`` (empty when that
    step itself was not measured)."""
    if measured[index] is None:
        return []
    steps = [m for m in measured[: index + 1] if m is not None][-WINDOW:]
    return [m.figures() for m in steps]


def build_report(
    result: ReadResult, steps: str | None = None, source: str = ""
) -> tuple[str, list[ReportFigure]]:
    """HTML of the report of the plans in ``result`` (steps ``A:B``; default: the last plan)."""
    chosen = plans_in_range(result, steps) if steps else [result.records[-1].plan]
    if len(chosen) > MAX_STEPS:
        raise OptionError(
            f"`steps` {steps!r} selects {len(chosen)} plans; a report holds at most {MAX_STEPS}"
        )
    summaries = [summarize(r.plan, r.line) for r in result.records]
    measured = [measure(r.plan) for r in result.records]
    position = {id(r.plan): i for i, r in enumerate(result.records)}
    figures: list[ReportFigure] = []
    parts: list[str] = []
    plotly_js: list[bool] = [True]  # inline plotly.js with the first figure only

    def add(fig, view: str, plan: RoutingPlan | None) -> None:
        step = None if plan is None else plan.step
        name = view if plan is None else f"step-{step if step is not None else 'x'}-{view}"
        while any(f.name == name for f in figures):
            name += "-2"
        figures.append(ReportFigure(name, view, step))
        div = fig.to_html(
            full_html=False, include_plotlyjs=plotly_js[0], config={"displaylogo": False}
        )
        plotly_js[0] = False
        parts.append(
            f"<div class='figure' data-view='{view}' data-step='{'' if step is None else step}'"
            f" data-name='{html.escape(name)}'>{div}</div>"
        )

    selected = chosen[-1].step
    add(F.timeline_figure(summaries, selected_step=selected), "timeline", None)
    for plan in chosen:
        st = plan.stats
        label = "plan" if plan.step is None else f"Step {plan.step}"
        parts.append(f"<h2>{html.escape(label)}</h2>")
        parts.append(
            "<table class='summary'><tr><th>GPUs</th><th>sequences</th><th>chunks</th>"
            "<th>imbalance before</th><th>after</th><th>speedup</th><th>moved</th></tr>"
            f"<tr><td>{len(plan.gpus)}</td><td>{len(plan.sequences)}</td>"
            f"<td>{len(plan.chunks)}</td><td>{st.imbalance_before:.3f}</td>"
            f"<td>{st.imbalance_after:.3f}</td><td>{st.speedup:.2f}x</td>"
            f"<td>{st.moved_tokens:,} tokens ({st.moved_fraction:.0%})</td></tr></table>"
        )
        add(F.bag_load_figure(plan), "bag-load", plan)
        add(F.traffic_figure(plan), "traffic", plan)
        window = measured_window(measured, position[id(plan)])
        if window:
            add(
                predicted_vs_measured_figure(analyse(window, None), rank_steps(window)),
                "predicted-vs-measured",
                plan,
            )
        parts.append(f"<details><summary>Sequences ({len(plan.sequences)})</summary>")
        parts.append(_table(plan) + "</details>")

    first = chosen[0]
    title = f"KnapFormer routing report · {first.topology}"
    if first.run:
        title += f" · {first.run}"
    steps_text = ", ".join("-" if p.step is None else str(p.step) for p in chosen)
    header = (
        f"<h1>{html.escape(title)}</h1><p class='note'>{html.escape(source)} · "
        f"{len(result.records)} plan(s) in the file · steps shown: {html.escape(steps_text)}"
        "</p>"
    )
    if result.problems:
        header += f"<p class='note'>{len(result.problems)} unreadable record(s) skipped.</p>"
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{header}{''.join(parts)}</body></html>\n"
    )
    return page, figures


def write_report(
    result: ReadResult, out: str | Path, steps: str | None = None, source: str = ""
) -> tuple[Path, list[ReportFigure]]:
    """Write the report HTML to ``out``; returns its path and the figures it holds."""
    out = Path(out)
    if not out.parent.exists():
        raise KnapformerError(f"output directory {str(out.parent)!r} does not exist")
    page, figures = build_report(result, steps, source)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as err:
        raise file_error(out, err, "cannot write") from err
    return out, figures


def export_pngs(report: str | Path, png_dir: str | Path, timeout_s: float = 60) -> list[Path]:
    """Screenshot every figure of the report file ``report`` into ``png_dir`` (one PNG per
    figure, named after it) with headless Chromium. Raises RuntimeError when Chromium or
    Playwright is missing."""
    if find_chromium() is None:
        raise RuntimeError(
            f"PNG export needs Chromium: {missing_chromium()}; the HTML report was written"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise RuntimeError(
            "PNG export needs the Python package playwright (pip install playwright)"
        ) from None
    png_dir = Path(png_dir)
    try:
        png_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise file_error(png_dir, err, "cannot create the folder") from err
    written = []
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(Path(report).resolve().as_uri(), timeout=timeout_s * 1000)
            page.wait_for_function(
                "[...document.querySelectorAll('div.figure')].every("
                "d => d.querySelector('.main-svg'))",
                timeout=timeout_s * 1000,
            )
            for element in page.query_selector_all("div.figure"):
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", element.get_attribute("data-name") or "")
                path = png_dir / f"{name}.png"
                element.screenshot(path=str(path))
                written.append(path)
        finally:
            browser.close()
    return written
