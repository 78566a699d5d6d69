"""The live dashboard driven in Debian's Chromium (headless) through Playwright.

One server (on a folder holding a growing run and a finished one) and one browser page
for the whole module; the tests run in file order and each appends to the growing file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from knapformer.plan_io import parse_plan_line
from visualization.browser import find_chromium, launch_chromium

pytestmark = pytest.mark.browser

CHROMIUM = find_chromium()
LIVE_WITHIN_S = 5.0

if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (make browser-deps)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def lines50():
    return (
        (Path(__file__).parent.parent / "sample_plans" / "joint32_50steps.jsonl")
        .read_text()
        .splitlines()
    )


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, lines50):
    root = tmp_path_factory.mktemp("runs")
    shutil.copy(
        Path(__file__).parent.parent / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json",
        root / "mixed8.json",
    )
    os.utime(root / "mixed8.json", (1e9, 1e9))  # older: the live run is the default
    (root / "live").mkdir()
    (root / "live" / "plans.jsonl").write_text("\n".join(lines50[:5]) + "\n")
    return root


@pytest.fixture(scope="module")
def live_file(runs_dir):
    return runs_dir / "live" / "plans.jsonl"


@pytest.fixture(scope="module")
def page(runs_dir):
    from dashboard.server import start_server

    handle = start_server(runs_dir, port=0)
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1600})
            pg.goto(handle.url)
            pg.wait_for_selector("#bag-load .main-svg .bars", timeout=30_000)
            yield pg
        finally:
            browser.close()
            handle.stop()


def _append(path: Path, *lines: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def _figure(page, graph_id: str):
    """Name, x and y of each drawn trace (``_fullData``: typed arrays already decoded)."""
    return page.evaluate(
        f"""() => {{ const gd = document.querySelector('#{graph_id} .js-plotly-plot');
        const list = v => v === undefined ? [] : Array.from(v, e =>
            (e !== null && typeof e === 'object') ? Array.from(e) : e);
        return {{data: gd._fullData.map(t => ({{name: t.name, x: list(t.x), y: list(t.y)}})),
                 title: gd._fullLayout.title.text}}; }}"""
    )


def _wait_for(check, timeout=LIVE_WITHIN_S):
    """Poll ``check()`` until it is truthy; return seconds taken (fails after timeout)."""
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except Exception:
            pass  # the page may be mid-update; try again
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s: {check.__doc__}")
        time.sleep(0.1)


def test_page_shows_one_bar_group_per_bag(page, lines50):
    plan = parse_plan_line(lines50[4])
    fig = _figure(page, "bag-load")
    groups = list(dict.fromkeys(fig["data"][0]["x"][0]))
    assert groups == [
        f"bag {b} · {len(m)} GPU{'s' if len(m) > 1 else ''}" for b, m in enumerate(plan.bags)
    ]
    assert len(groups) == 15
    # The group labels are drawn on the page, not only present in the data.
    drawn = page.locator("#bag-load text").all_text_contents()
    assert "bag 14 · 8 GPUs" in drawn and "bag 0 · 1 GPU" in drawn
    assert page.inner_text("#stat-steps") == "5"
    assert page.inner_text("#stat-run") == "joint32-mixed"
    assert "step 4" in fig["title"]


def test_appended_lines_update_step_count_and_bars(page, live_file, lines50):
    _append(live_file, *lines50[5:8])

    def updated():
        """steps 8 and the bars of step 7"""
        return (
            page.inner_text("#stat-steps") == "8" and "step 7" in _figure(page, "bag-load")["title"]
        )

    _wait_for(updated)
    plan = parse_plan_line(lines50[7])
    pos = {g: i for i, g in enumerate(plan.gpus)}
    order = [pos[g] for m in plan.bags for g in m]
    after = _figure(page, "bag-load")["data"][1]["y"]
    # not calibrated: loads are shown relative to the mean GPU
    np.testing.assert_allclose(after, plan.stats.load_after[order] / plan.stats.mean_load)
    latest = f"{plan.stats.imbalance_before:.3f} → {plan.stats.imbalance_after:.3f}"
    assert page.inner_text("#stat-imbalance") == latest


def test_scrubbing_back_selects_an_older_step_and_stays_there(page, live_file, lines50):
    page.locator("#step-slider [role=slider]").first.focus()
    page.keyboard.press("Home")

    def at_step0():
        """step 0 shown"""
        return "step 0" in _figure(page, "bag-load")["title"]

    _wait_for(at_step0)
    assert page.inner_text("#step-label").startswith("step 0 ·")
    assert not page.locator("#follow input").is_checked()
    _append(live_file, lines50[8])

    def counted():
        """steps 9"""
        return page.inner_text("#stat-steps") == "9"

    _wait_for(counted)
    time.sleep(1.5)  # another tick or two: the view must not jump to the new step
    assert at_step0()
    assert page.inner_text("#step-label").startswith("step 0 ·")
    # Following again jumps to the newest step.
    page.locator("#follow input").check()

    def newest():
        """step 8 shown"""
        return "step 8" in _figure(page, "bag-load")["title"]

    _wait_for(newest)


def test_clicking_the_timeline_selects_that_step(page):
    def point_of_step3():
        return page.evaluate(
            """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
            const fl = gd._fullLayout, box = gd.getBoundingClientRect();
            const t = gd._fullData[1], i = Array.from(t.customdata).indexOf(3);
            return [box.left + fl.xaxis._offset + fl.xaxis.l2p(t.x[i]),
                    box.top + fl.yaxis._offset + fl.yaxis.l2p(t.y[i])]; }"""
        )

    def at_step3():
        """step 3 shown"""
        return "step 3" in _figure(page, "bag-load")["title"]

    # Click where step 3 of the "after" line is drawn (hover first, as a user would; a
    # second try covers a click landing while the chart is being redrawn).
    for attempt in range(2):
        x, y = point_of_step3()
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        try:
            _wait_for(at_step3, timeout=LIVE_WITHIN_S if attempt else 2.5)
            break
        except AssertionError:
            if attempt:
                raise
    assert page.inner_text("#step-label").startswith("step 3 ·")
    assert not page.locator("#follow input").is_checked()
    page.locator("#follow input").check()


def test_selecting_a_sequence_highlights_its_chunks(page):
    # The table's first page lists sequences 0..; pick one in a multi-GPU bag.
    ids = page.locator("#seq-table td[data-dash-column=id]").all_inner_texts()
    chunks = page.locator("#seq-table td[data-dash-column=chunks]").all_inner_texts()
    row = next((i for i, c in enumerate(chunks) if int(c) > 1), 0)
    seq = int(ids[row])
    page.locator("#seq-table input[type=radio]").nth(row).check()

    def highlighted():
        """the sequence is drawn in both views"""
        bars = [t["name"] for t in _figure(page, "bag-load")["data"]]
        cells = [t["name"] for t in _figure(page, "traffic")["data"]]
        return f"sequence {seq}" in bars and f"sequence {seq}" in cells

    _wait_for(highlighted)
    marks = next(t for t in _figure(page, "bag-load")["data"] if t["name"] == f"sequence {seq}")
    dests = page.locator("#seq-table td[data-dash-column=destinations]").nth(row).inner_text()
    assert sorted(marks["x"][1]) == sorted(dests.split())


def test_malformed_line_shows_a_notice_and_the_page_keeps_working(page, live_file, lines50):
    _append(live_file, '{"schema_version": 1, "oops', lines50[9])  # line 10 bad, 11 good

    def noticed():
        """notice names line 10 and step 9 arrived"""
        notice = page.inner_text("#notice")
        return (
            "plans.jsonl:10:" in notice
            and "not valid JSON" in notice
            and page.inner_text("#stat-steps") == "10"
        )

    _wait_for(noticed)
    assert page.locator("#notice").is_visible()
    assert page.inner_text("#stat-skipped") == "1"
    _wait_for(lambda: "step 9" in _figure(page, "bag-load")["title"])


def test_run_picker_switches_to_another_run(page):
    page.locator("#run-picker").click()
    page.get_by_text("mixed8.json", exact=True).last.click()

    def switched():
        """the 8-GPU plan with 4 bags is shown"""
        groups = set(_figure(page, "bag-load")["data"][0]["x"][0])
        return groups == {"bag 0 · 1 GPU", "bag 1 · 1 GPU", "bag 2 · 2 GPUs", "bag 3 · 4 GPUs"}

    _wait_for(switched)
    assert page.inner_text("#stat-steps") == "1"
    assert not page.locator("#notice").is_visible()


def test_idle_ticks_complete_no_callback(page):
    """With nothing new on disk a tick is answered without running any view's callback."""
    import json
    import urllib.request

    def callbacks() -> int:
        with urllib.request.urlopen(page.url + "api/status", timeout=10) as resp:
            return json.loads(resp.read())["callbacks"]

    def settled():
        """no callback completes for a second"""
        before = callbacks()
        page.wait_for_timeout(1000)  # lets the page tick (and Playwright dispatch events)
        return callbacks() == before

    _wait_for(settled, timeout=15)
    before = callbacks()
    page.wait_for_timeout(2 * 1000)  # four ticks
    assert callbacks() == before
    assert page.inner_text("#stat-steps") == "1"  # still the page of the previous test
