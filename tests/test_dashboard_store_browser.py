"""The dashboard's per-step views of a run recorded with ``every=10`` and its store, in
Debian's Chromium (headless) through Playwright: the timeline holds every step of the
store, a step without a full plan shows the nearest one and says so, and the page
follows the store as its segments close while the run goes on."""

from __future__ import annotations

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

PLANS = measured_run(48, seed=6)
#: Each wait's limit: generous, the machine's load varies tenfold.
WITHIN_S = 90


def _record(path, plans) -> None:
    with PlanRecorder(path, every=10, store_segment_steps=8) as rec:
        for plan in plans:
            rec.record(plan)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The first 40 steps: full plans of steps 0, 10, 20 and 30, store rows of all 40."""
    folder = tmp_path_factory.mktemp("every10") / "run"
    _record(folder / "plans.jsonl", PLANS[:40])
    return folder


@pytest.fixture(scope="module")
def page(run):
    with dashboard_page(run, "#timeline .scatterlayer .trace") as pg:
        yield pg


def _after_line(page) -> dict:
    """The timeline's "after" trace as drawn, and the steps its marker stands on."""
    return page.evaluate(
        """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
        const t = gd._fullData.find(d => d.name === 'after');
        return {x: Array.from(t.x), y: Array.from(t.y),
                marks: gd._fullLayout.shapes.map(s => s.x0)}; }"""
    )


def _label(page) -> str:
    return page.inner_text("#step-label") + " " + page.inner_text("#follow-note")


def test_the_timeline_holds_every_step_and_the_plans_agree(page):
    wait_until(lambda: len(_after_line(page)["x"]) == 40, WITHIN_S, "40 steps drawn")
    line = _after_line(page)
    assert line["x"] == list(range(40))
    for plan in PLANS[:40:10]:  # where a full plan was kept, the store agrees with it
        assert line["y"][plan.step] == pytest.approx(plan.stats.imbalance_after, rel=1e-6)
    assert page.inner_text("#stat-steps") == "40 (4 full plans)"
    wait_until(lambda: _label(page).startswith("step 30 · 4 of 4 full plans"), WITHIN_S)
    assert "following live (4 full plans of 40 steps)" in _label(page)
    assert line["marks"] == [30]


def test_a_click_between_kept_plans_shows_the_nearest_and_says_so(page):
    def point_of_step(step: int) -> list[float]:
        return page.evaluate(
            """(step) => { const gd = document.querySelector('#timeline .js-plotly-plot');
            const fl = gd._fullLayout, box = gd.getBoundingClientRect();
            const t = gd._fullData.find(d => d.name === 'after');
            const i = Array.from(t.x).indexOf(step);
            return [box.left + fl.xaxis._offset + fl.xaxis.l2p(t.x[i]),
                    box.top + fl.yaxis._offset + fl.yaxis.l2p(t.y[i])]; }""",
            step,
        )

    # hover first, as a user would; a second try covers a click during a redraw
    page.locator("#timeline").scroll_into_view_if_needed()  # under the whole-run views
    for attempt in range(2):
        x, y = point_of_step(18)
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        try:
            wait_until(lambda: _label(page).startswith("step 20 ·"), 5 if not attempt else 60)
            break
        except TimeoutError:
            if attempt:
                raise
    assert "step 18 has no full plan (the recorder kept 4 full plans of 40 steps)" in (_label(page))
    assert "showing the nearest full plan, step 20" in _label(page)
    wait_until(lambda: _after_line(page)["marks"] == [20], WITHIN_S, "the marker at step 20")
    assert not page.locator("#follow input").is_checked()


def test_typing_a_step_without_a_full_plan_shows_the_nearest(page):
    box = page.locator("#step-input")
    box.fill("13")
    box.press("Enter")
    wait_until(lambda: _label(page).startswith("step 10 ·"), WITHIN_S, "step 10 shown")
    assert "step 13 has no full plan" in _label(page)
    bag_load = page.evaluate(
        "() => document.querySelector('#bag-load .js-plotly-plot')._fullLayout.title.text"
    )
    assert "step 10" in bag_load  # the views show the full plan named


def test_the_page_follows_the_store_as_the_run_goes_on(page, run):
    page.locator("#follow input").check()
    _record(run / "plans.jsonl", PLANS[40:])  # the run resumes: 8 more steps, one plan
    wait_until(lambda: len(_after_line(page)["x"]) == 48, WITHIN_S, "48 steps drawn")
    assert _after_line(page)["x"] == list(range(48))
    wait_until(lambda: page.inner_text("#stat-steps") == "48 (5 full plans)", WITHIN_S)
    wait_until(lambda: _label(page).startswith("step 40 · 5 of 5 full plans"), WITHIN_S)
