"""The dashboard's whole-run views in Debian's Chromium (headless) through Playwright, on a
run recorded with its store: a rank x step heatmap of compute rate, the ranks named slow
per segment, imbalance and lost time over the run, and a drill-down into one cell."""

from __future__ import annotations

import json

import pytest
from dashboard_page import dashboard_page
from knapformer.visualization.browser import find_chromium

from knapformer.runtime.recorder import PlanRecorder
from knapformer.testing.measured_plans import measured_run
from knapformer.testing.polling import wait_until

pytestmark = pytest.mark.browser
if find_chromium() is None:
    pytest.skip("no Chromium on this machine (make browser-deps)", allow_module_level=True)
pytest.importorskip("playwright.sync_api")

STEPS, SEGMENT, SLOW_FROM = 24, 4, 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """24 measured steps of 8 ranks, rank 5 twice as slow from step 12 on, recorded with a
    store in segments of 4 steps."""
    folder = tmp_path_factory.mktemp("whole") / "run"
    healthy = measured_run(SLOW_FROM, seed=3)
    slow = measured_run(STEPS, slow_rank=5, slow_factor=2.0, seed=3)[SLOW_FROM:]
    with PlanRecorder(folder / "plans.jsonl", every=8, store_segment_steps=SEGMENT) as rec:
        for plan in healthy + slow:
            rec.record(plan)
    return folder


@pytest.fixture(scope="module")
def page(run):
    with dashboard_page(run, "#run-heatmap .heatmaplayer") as pg:
        yield pg


def _trace(page, graph_id: str) -> dict:
    """The first drawn trace of a graph (typed arrays decoded) and its title."""
    return page.evaluate(
        f"""() => {{ const gd = document.querySelector('#{graph_id} .js-plotly-plot');
        const list = v => v === undefined ? [] : Array.from(v, e =>
            (e !== null && typeof e === 'object') ? Array.from(e) : e);
        const t = gd._fullData[0];
        return {{x: list(t.x), y: list(t.y), z: list(t.z), custom: list(t.customdata),
                 type: t.type, title: gd._fullLayout.title.text}}; }}"""
    )


def test_the_heatmap_shows_every_rank_and_segment_and_the_slow_rank(page):
    heat = _trace(page, "run-heatmap")
    assert heat["type"] == "heatmap"
    assert heat["y"] == [float(r) for r in range(8)]  # a row per rank: 8 fit the screen
    assert len(heat["x"]) == STEPS // SEGMENT
    rate = heat["custom"]
    before, after = SLOW_FROM // SEGMENT - 1, SLOW_FROM // SEGMENT
    assert rate[5][after] > 1.8 and rate[5][before] < 1.2
    assert max(rate[r][after] for r in range(8) if r != 5) < 1.2


def test_verdicts_and_imbalance_over_the_run(page):
    summary = page.inner_text("#run-summary")
    assert f"{STEPS} steps, 8 ranks, {STEPS // SEGMENT} segments" in summary
    assert f"rank 5 named slow in steps {SLOW_FROM}–{STEPS - 1}" in summary
    verdicts = _trace(page, "run-verdicts")
    assert set(verdicts["y"]) == {5} and min(verdicts["x"]) > SLOW_FROM
    steps = page.evaluate(
        "() => document.querySelector('#run-steps .js-plotly-plot')._fullData.map(t => t.name)"
    )
    assert steps[:2] == ["imbalance before", "imbalance after"]
    assert len(_trace(page, "run-steps")["x"]) == STEPS


#: Per whole-run graph: whether Plotly may grow its margins, and what of the figure
#: (colour bar, legend, tick labels, axis titles) lies outside the figure's own box.
_CUT_OFF_JS = """id => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  const box = gd.querySelector('.main-svg').getBoundingClientRect();
  const parts = gd.querySelectorAll('.colorbar, .legend, .xtick text, .ytick text, ' +
    '.y2tick text, .g-xtitle, .g-ytitle, .g-y2title');
  const out = Array.from(parts).filter(e => {
    const r = e.getBoundingClientRect();
    return r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1 ||
                           r.top < box.top - 1 || r.bottom > box.bottom + 1);
  }).map(e => e.getAttribute('class'));
  return {autoexpand: gd._fullLayout.margin.autoexpand, drawn: parts.length, out: out};
}"""


def test_the_whole_run_figures_keep_fixed_margins_that_hold_all_they_draw(page):
    # Margins that may grow cost Plotly a second pass over each figure; fixed ones must
    # still leave room for the colour bar, the legend and the labels on the edges.
    for graph in ("run-heatmap", "run-verdicts", "run-steps"):
        seen = page.evaluate(_CUT_OFF_JS, graph)
        assert seen["autoexpand"] is False, graph
        assert seen["drawn"] >= 4 and seen["out"] == [], (graph, seen)


def test_the_layout_and_plotly_js_are_fetched_once_each_from_the_pages_preloads(page):
    # started as the page is read (a <link rel=preload>), and taken from there by Dash's
    # own requests: a preload they did not match would be a second request of each
    fetched = page.evaluate(
        "() => performance.getEntriesByType('resource').map(e => [e.name, e.initiatorType])"
    )
    assert [how for url, how in fetched if url.endswith("/_dash-layout")] == ["link"]
    assert [how for url, how in fetched if "/plotly.min.js" in url] == ["link"]


def test_a_click_opens_that_cells_steps(page):
    box = page.locator("#run-heatmap .nsewdrag").first.bounding_box()
    # the last column: steps 20..23, where rank 5 is slow
    page.mouse.click(box["x"] + box["width"] * 0.95, box["y"] + box["height"] * 0.5)
    wait_until(lambda: "steps 20–23" in page.inner_text("#drill-label"), 60)
    assert "rank 5" in page.inner_text("#drill-label")
    drilled = _trace(page, "drill-heatmap")
    assert drilled["x"] == [20.0, 21.0, 22.0, 23.0]
    assert all(row[0] > 1.5 for row in drilled["custom"][5:6])


def test_the_header_names_the_straggler_from_every_step_of_the_store(page):
    # the plans keep every 8th step; the store every step: 20 steps, 12 of them slow
    card = page.inner_text("#stat-straggler")
    assert card.startswith("slow_gpu: rank 5"), card
    assert "in 12 of 20 steps" in card, card


#: Notes, when ``#bag-load`` first enters the page, whether the whole-run heatmap was
#: drawn by then (a MutationObserver sees each change of the page as it happens).
_ORDER_JS = """
window.__bagLoadAfterHeatmap = null;
new MutationObserver((_changes, observer) => {
  if (!document.getElementById('bag-load')) { return; }
  const gd = document.querySelector('#run-heatmap .js-plotly-plot');
  window.__bagLoadAfterHeatmap = Boolean(gd && gd.data && gd.data.length > 0);
  observer.disconnect();
}).observe(document, {childList: true, subtree: true});
"""


def test_the_per_step_views_come_after_the_whole_run_views_and_work(page, run):
    # a second page of the same server, watched from its first change on
    pg = page.context.browser.new_page(viewport={"width": 1400, "height": 1600})
    try:
        pg.add_init_script(_ORDER_JS)
        pg.goto(page.url)
        pg.wait_for_selector("#bag-load .main-svg .bars", timeout=120_000)
        assert pg.evaluate("window.__bagLoadAfterHeatmap") is True
        # laid out late, they follow the run like any: its newest plan, in full
        lines = (run / "plans.jsonl").read_text().splitlines()
        newest = f"step {json.loads(lines[-1])['step']} · {len(lines)} of {len(lines)}"
        wait_until(lambda: newest in pg.inner_text("#step-label"), 60)
        # every step of the store, and how many of them kept a full plan
        assert pg.inner_text("#stat-steps") == f"{STEPS} ({len(lines)} full plans)"
        assert pg.locator("#seq-table").count() == 1
        assert pg.locator("#run-picker").count() == 1
    finally:
        pg.close()


#: Each trace of each figure on the page: its graph, the type it asks for, the type drawn.
_TRACE_TYPES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap(
  gd => (gd.data || []).map((t, i) => [gd.parentElement.id, t.type || 'scatter',
                                       gd._fullData[i].type]))"""


def test_every_figure_draws_its_own_trace_types_with_the_plotly_js_served(page):
    from knapformer.dashboard.page_index import PLOTLY_PATH
    from knapformer.dashboard.plotly_bundle import served

    # the page's plotly.js is the bundle the server says it serves (the full one has
    # WebGL traces, the cartesian one has not)
    said = page.evaluate("async url => (await fetch(url)).headers.get('X-Plotly-Bundle')",
                         PLOTLY_PATH)  # fmt: skip
    assert said.split()[0] == served().name
    has_gl = page.evaluate("() => 'scattergl' in Plotly.PlotSchema.get().traces")
    assert has_gl == (served().name == "full")
    # a bundle without a trace type draws it as a scatter, silently: every figure of both
    # the whole-run and the per-step views must draw the types it asks for
    page.wait_for_selector("#bag-load .main-svg .bars", timeout=120_000)
    drawn = page.evaluate(_TRACE_TYPES_JS)
    graphs = {graph for graph, _, _ in drawn}
    assert {"run-heatmap", "run-verdicts", "run-steps", "bag-load"} <= graphs
    assert {asked for _, asked, _ in drawn} >= {"heatmap", "scatter", "bar"}
    assert [(g, a, d) for g, a, d in drawn if a != d] == []
