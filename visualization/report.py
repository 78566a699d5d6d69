"""A self-contained static HTML report of recorded plans, printed to PDF or its figures
exported as PNG on request (both with headless Chromium).

The figures are the dashboard's (`visualization.figures`); plotly.js is embedded inline once,
so the file opens offline. Every figure sits in ``<div class="figure" data-view=...
data-step=...>`` so tools (and tests) can find each view.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from knapformer.visualization import figures as F
from knapformer.visualization.browser import find_chromium, launch_chromium, missing_chromium
from knapformer.visualization.run_figures import TIMELINE_COLUMNS, run_timeline_figure
from knapformer.visualization.straggler_figures import straggler_views, window_views

from knapformer.contract.incident import Incident
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import ReadResult, plans_in_range
from knapformer.contract.run_store import as_numpy, read_table
from knapformer.contract.runfiles import safe_name
from knapformer.contract.stats import summarize
from knapformer.contract.units import LoadUnit
from knapformer.diagnosis.measured import MeasuredStep, RankFigures, measure
from knapformer.diagnosis.store_source import window_rows
from knapformer.diagnosis.store_window import window_figures
from knapformer.diagnosis.stragglers import WINDOW, judge
from knapformer.errors import KnapformerError, OptionError, file_error

#: What `knapformer report -o` writes, by the output's suffix.
REPORT_FORMATS = {".html": "html", ".htm": "html", ".pdf": "pdf"}
MAX_STEPS = 20  # per report: each step adds several figures and a table
MAX_TABLE_ROWS = 500  # sequence table rows per step; the rest is summarised


@dataclass(frozen=True)
class ReportFigure:
    name: str  # unique, used for the PNG file name, e.g. "step-12-traffic"
    view: str  # timeline | bag-load | traffic | ratio-heatmap | wait-heatmap | compute-wait
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
.incident { padding: 8px 12px; background: #fff5f5; border: 1px solid #e03131; color: #c92a2a;
  border-radius: 6px; font-weight: bold; }
.summary td, .summary th, .sequences td, .sequences th { padding: 2px 10px; text-align: right; }
.sequences { border-collapse: collapse; font-size: 0.85em; }
.sequences tr:nth-child(even) { background: #f1f3f5; }
details { margin: 1em 0; } .note { color: #868e96; }
.figure { margin: 1em 0; }
@media print { .figure, table.summary { break-inside: avoid; } h2 { break-after: avoid; } }
"""


def measured_window(measured: list[MeasuredStep | None], index: int) -> list[RankFigures]:
    """The figures of the last `WINDOW` measured steps up to ``index`` (empty when that
    step itself was not measured)."""
    if measured[index] is None:
        return []
    steps = [m for m in measured[: index + 1] if m is not None][-WINDOW:]
    return [m.figures() for m in steps]


def store_views(run: Path, step: int | None, run_start: int | None):
    """The verdict line and straggler figures of the `WINDOW` steps up to ``step`` from
    ``run``'s store (only those rows are read); None when it measured none of them."""
    if step is None:
        return None
    w = window_figures(window_rows(run, max(step - WINDOW + 1, 0), step))
    if not w.m.steps or w.m.steps[-1] != step:
        return None
    return window_views(w.m, judge(w.m, w.scopes, w.bandwidth), run_start)


def store_timeline(run: Path, selected_step: int | None):
    """The timeline of every step in ``run``'s store, ``selected_step`` marked."""
    table = read_table(run, "steps", columns=list(TIMELINE_COLUMNS))
    columns = {name: as_numpy(table[name]) for name in TIMELINE_COLUMNS}
    return run_timeline_figure(columns, selected_step)


def build_report(
    result: ReadResult,
    steps: str | None = None,
    source: str = "",
    incident: Incident | None = None,
    store: Path | None = None,
) -> tuple[str, list[ReportFigure]]:
    """HTML of the report of the plans in ``result`` (steps ``A:B``; default: the last plan);
    ``incident``: the run's failed step, shown first; ``store``: a run whose store gives
    the timeline and the straggler views (every step, whichever full plans were kept)."""
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

    if store is not None:  # every step, not only those whose full plan was kept
        add(store_timeline(store, chosen[-1].step), "timeline", None)
    else:
        selected = position[id(chosen[-1])]
        add(F.timeline_figure(summaries, selected_step=selected), "timeline", None)
    for plan in chosen:
        st = plan.stats
        label = "plan" if plan.step is None else f"Step {plan.step}"
        parts.append(f"<h2>{html.escape(label)}</h2>")
        unit = LoadUnit.of(plan)
        makespan = f"{unit.format(st.makespan_before)} → {unit.format(st.makespan_after)}"
        parts.append(
            "<table class='summary'><tr><th>GPUs</th><th>sequences</th><th>chunks</th>"
            "<th>imbalance before</th><th>after</th>"
            f"<th>makespan {html.escape(unit.axis_title.removeprefix('load '))}</th>"
            "<th>speedup</th><th>moved</th></tr>"
            f"<tr><td>{len(plan.gpus)}</td><td>{len(plan.sequences)}</td>"
            f"<td>{len(plan.chunks)}</td><td>{st.imbalance_before:.3f}</td>"
            f"<td>{st.imbalance_after:.3f}</td><td>{html.escape(makespan)}</td>"
            f"<td>{st.speedup:.2f}x</td>"
            f"<td>{st.moved_tokens:,} tokens ({st.moved_fraction:.0%})</td></tr></table>"
        )
        add(F.bag_load_figure(plan), "bag-load", plan)
        add(F.traffic_figure(plan), "traffic", plan)
        shown = None
        if store is not None:
            shown = store_views(store, plan.step, summaries[0].step)
        else:
            window = measured_window(measured, position[id(plan)])
            shown = straggler_views(window, summaries[0].step) if window else None
        if shown is not None:
            verdict, views = shown
            parts.append(f"<p class='verdict'>straggler: {html.escape(verdict)}</p>")
            for view, fig in views:
                add(fig, view, plan)
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
    if incident is not None:
        header += f"<p class='incident' role='alert'>{html.escape(incident.headline())}</p>"
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{header}{''.join(parts)}</body></html>\n"
    )
    return page, figures


def write_report(
    result: ReadResult,
    out: str | Path,
    steps: str | None = None,
    source: str = "",
    incident: Incident | None = None,
    store: Path | None = None,
) -> tuple[Path, list[ReportFigure]]:
    """Write the report HTML to ``out``; returns its path and the figures it holds."""
    out = Path(out)
    if not out.parent.exists():
        raise KnapformerError(f"output directory {str(out.parent)!r} does not exist")
    page, figures = build_report(result, steps, source, incident, store)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as err:
        raise file_error(out, err, "cannot write") from err
    return out, figures


def report_format(out: str | Path) -> str:
    """``"html"`` or ``"pdf"``, from the suffix of ``out``; other suffixes are refused."""
    suffix = Path(out).suffix.lower()
    if suffix not in REPORT_FORMATS:
        raise KnapformerError(
            f"output must be an .html or .pdf file, not {str(out)!r} (the suffix says which)"
        )
    return REPORT_FORMATS[suffix]


def browser_problem(what: str) -> str | None:
    """Why ``what`` (e.g. "a PDF report") cannot drive Chromium here, or None."""
    if find_chromium() is None:
        return f"{what} needs Chromium: {missing_chromium()}"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"{what} needs the Python package playwright (pip install playwright)"
    return None


def _open_report(browser, report: Path, timeout_s: float, width: int = 1200):
    """A page showing the report file ``report`` once every figure is drawn."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(Path(report).resolve().as_uri(), timeout=timeout_s * 1000)
    page.wait_for_function(
        "[...document.querySelectorAll('div.figure')].every(d => d.querySelector('.main-svg'))",
        timeout=timeout_s * 1000,
    )
    return page


def print_pdf(report: str | Path, pdf: str | Path, timeout_s: float = 60) -> Path:
    """Print the report file ``report`` (HTML) to the PDF ``pdf`` with headless Chromium:
    A4 landscape, backgrounds kept, every figure drawn first. Raises RuntimeError when
    Chromium or Playwright is missing (`browser_problem`)."""
    problem = browser_problem("a PDF report")
    if problem is not None:
        raise RuntimeError(problem)
    from playwright.sync_api import sync_playwright

    pdf = Path(pdf)
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            # The width of an A4 landscape page at 96 dpi, so figures are laid out to fit.
            page = _open_report(browser, Path(report), timeout_s, width=1123)
            page.emulate_media(media="print")
            try:
                page.pdf(path=str(pdf), format="A4", landscape=True, print_background=True)
            except Exception as err:  # Playwright wraps the OSError of an unwritable path
                raise file_error(pdf, OSError(str(err)), "cannot write") from err
        finally:
            browser.close()
    return pdf


def export_pngs(report: str | Path, png_dir: str | Path, timeout_s: float = 60) -> list[Path]:
    """Screenshot every figure of the report file ``report`` into ``png_dir`` (one PNG per
    figure, named after it) with headless Chromium. Raises RuntimeError when Chromium or
    Playwright is missing."""
    problem = browser_problem("PNG export")
    if problem is not None:
        raise RuntimeError(f"{problem}; the report was written")
    from playwright.sync_api import sync_playwright

    png_dir = Path(png_dir)
    try:
        png_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise file_error(png_dir, err, "cannot create the folder") from err
    written = []
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = _open_report(browser, Path(report), timeout_s)
            for element in page.query_selector_all("div.figure"):
                name = safe_name(element.get_attribute("data-name") or "", "figure")
                path = png_dir / f"{name}.png"
                try:
                    element.screenshot(path=str(path))
                except Exception as err:  # Playwright wraps the OSError of an unwritable path
                    reason = str(err).strip().splitlines()[0] if str(err).strip() else err
                    raise KnapformerError(f"{path}: cannot write: {reason}") from err
                written.append(path)
        finally:
            browser.close()
    return written
