"""The live dashboard driven in Debian's Chromium (headless) through Playwright.

One server (on a folder holding a growing run and a finished one) and one browser page
for the whole module; the tests run in file order and each appends to the growing file.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from dashboard_page import dashboard_page
from knapformer.visualization.browser import find_chromium

from knapformer.cli import main
from knapformer.contract.plan_io import parse_plan_line, write_jsonl
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.step_loss import PARTS, step_losses
from knapformer.diagnosis.stragglers import WINDOW
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.measured_plans import measured_run, with_measurements
from knapformer.testing.polling import wait_until

pytestmark = pytest.mark.browser

CHROMIUM = find_chromium()
# How long a view may take to follow a change before a test gives up: generous, because the
# machine's load varies tenfold; a wait returns as soon as its check holds.
LIVE_WITHIN_S = 60.0
WIDE64 = "g1n16+g2n8+g4n4+g8n2"  # 64 GPUs in 30 bags
WIDE128 = "g1n32+g2n16+g4n8+g8n4"  # 128 GPUs in 60 bags: the most shown GPU by GPU
WIDE256 = "g1n64+g2n32+g4n16+g8n8"  # 256 GPUs in 120 bags: shown bag by bag
CAP64 = 6_000  # max_tokens_per_gpu of the measured 64-GPU run (its GPUs hold ~5,300)
ALTERNATING = ("g1n4+g2n2", "g2n2+g4n1")
# A real `knapformer demo --topology auto` run: this mix's one video rank sits near the
# point where a group of 4 pays, so its partition changes between steps 0 and 1 (g1n8,
# then g1n4+g4n1).
AUTO_DEMO = ["demo", "--topology", "auto", "--world-size", "8", "--steps", "4",
             "--data-codes", "g7b2i512f1s0,g1b1i256f57s1", "--no-dashboard"]  # fmt: skip

if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (make browser-deps)", allow_module_level=True)
pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def lines50():
    return (
        (Path(__file__).parent.parent / "sample_plans" / "joint32_50steps.jsonl")
        .read_text()
        .splitlines()
    )


#: A measured run the page follows live (its first steps are on disk when the server starts).
FOLLOWED = measured_run(9, slow_rank=3, slow_factor=2.0, seed=5)
#: The per-step views, drawn together for the step the label names (`step_frame`).
PER_STEP_VIEWS = ("bag-load", "traffic", "tokens", "phase-step", "phase-window",
                  "ratio-heatmap", "wait-heatmap", "compute-wait", "step-loss")  # fmt: skip


def _measured64() -> list:
    """12 measured steps of 64 GPUs in 30 bags, rank 17 twice as slow, a token cap, and a
    first step whose ranks waited 6 s in the all-reduce (gloo's set-up)."""
    rng = np.random.default_rng(3)
    mix = parse_mix("g32b8i256f1s0,g16b4i512f1s0,g16b2i1024f1s0")
    model = WorkloadModel(3072, 0.4)
    plans = []
    for s in range(12):
        plan = plan_routing(
            sample_lengths(mix, rng), WIDE64, model, step=s, run="m64", max_tokens_per_gpu=CAP64
        )
        plans.append(with_measurements(plan, rng, slow_rank=17, slow_factor=2.0))
    # every rank but rank 0 (the last to arrive) waits 6 s more in the first all-reduce
    times = plans[0].measurements.per_rank_ms
    times["allreduce"] = [t + (6000.0 if i else 0.0) for i, t in enumerate(times["allreduce"])]
    times["step"] = [t + (6000.0 if i else 0.0) for i, t in enumerate(times["step"])]
    return plans


def _alternating(steps: int) -> list:
    """8 GPUs whose partition alternates between two topologies, step by step."""
    rng = np.random.default_rng(4)
    mix = parse_mix("g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0")
    model = WorkloadModel(3072, 0.4)
    return [
        plan_routing(sample_lengths(mix, rng), ALTERNATING[s % 2], model, step=s, run="alt")
        for s in range(steps)
    ]


def _wide_plans(topology: str, codes: str, steps: int) -> list:
    """Plans of a wide group (64 or 256 GPUs) of the given data mix."""
    rng = np.random.default_rng(0)
    mix = parse_mix(codes)
    model = WorkloadModel(3072, 0.4)
    return [
        plan_routing(sample_lengths(mix, rng), topology, model, step=s, run="wide")
        for s in range(steps)
    ]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, lines50):
    root = tmp_path_factory.mktemp("runs")
    shutil.copy(
        Path(__file__).parent.parent / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json",
        root / "mixed8.json",
    )
    os.utime(root / "mixed8.json", (1e9, 1e9))  # older: the live run is the default
    for name, plans in (
        ("measured", measured_run(30, slow_rank=5, slow_factor=2.0, seed=1)),
        ("live-measured", FOLLOWED[:3]),
        ("measured64", _measured64()),
        ("alternating", _alternating(6)),
        ("wide64", _wide_plans(WIDE64, "g32b8i256f1s0,g16b4i512f1s0,g16b2i1024f1s0", 2)),
        ("wide128", _wide_plans(WIDE128, "g64b8i256f1s0,g32b4i512f1s0,g32b2i1024f1s0", 1)),
        ("wide256", _wide_plans(WIDE256, "g128b8i256f1s0,g64b4i512f1s0,g64b2i1024f1s0", 1)),
        ("empty", []),
    ):
        (root / name).mkdir()
        write_jsonl(root / name / "plans.jsonl", plans)
        os.utime(root / name / "plans.jsonl", (1e9, 1e9))
    (root / "live").mkdir()
    (root / "live" / "plans.jsonl").write_text("\n".join(lines50[:5]) + "\n")
    # In this process (its workers are processes all the same): a command started anew
    # would import torch twice more.
    assert main([*AUTO_DEMO, "--out", str(root / "auto")]) == 0
    os.utime(root / "auto" / "plans.jsonl", (1e9, 1e9))
    return root


@pytest.fixture(scope="module")
def live_file(runs_dir):
    return runs_dir / "live" / "plans.jsonl"


@pytest.fixture(scope="module")
def page(runs_dir):
    with dashboard_page(runs_dir, "#bag-load .main-svg .bars") as pg:
        yield pg


def _append(path: Path, *lines: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def _figure(page, graph_id: str):
    """Name, x, y, hover text and custom data of each drawn trace (``_fullData``: typed
    arrays already decoded), and the title."""
    return page.evaluate(
        f"""() => {{ const gd = document.querySelector('#{graph_id} .js-plotly-plot');
        const list = v => v === undefined ? [] : Array.from(v, e =>
            (e !== null && typeof e === 'object') ? Array.from(e) : e);
        return {{data: gd._fullData.map(t => ({{name: t.name, x: list(t.x), y: list(t.y),
                    hovertext: list(t.hovertext), customdata: list(t.customdata)}})),
                 title: gd._fullLayout.title.text}}; }}"""
    )


def _bag_groups(page) -> list[str]:
    """The bag of each bar, in drawing order, from the bars' hover text."""
    return [h.split(" · ", 1)[1] for h in _figure(page, "bag-load")["data"][0]["hovertext"]]


def _wait_for(check, timeout=LIVE_WITHIN_S):
    """Poll ``check()`` (named by its docstring) until it is truthy; seconds taken."""
    return wait_until(check, timeout, interval=0.1)


def test_page_shows_one_bar_group_per_bag(page, lines50):
    plan = parse_plan_line(lines50[4])
    fig = _figure(page, "bag-load")
    groups = list(dict.fromkeys(_bag_groups(page)))
    assert groups == [
        f"bag {b} · {len(m)} GPU{'s' if len(m) > 1 else ''}" for b, m in enumerate(plan.bags)
    ]
    assert len(groups) == 15
    # The bags are named on the page, not only present in the data: in full where the band
    # has room, by id (under a line naming the run of same-size bags) where it has not.
    drawn = page.locator("#bag-load text").all_text_contents()
    assert "bag 14 · 8 GPUs" in drawn and "8 bags × 1 GPU" in drawn
    assert {str(b) for b in range(8)} <= set(drawn)
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
        except TimeoutError:
            if attempt:
                raise
    assert page.inner_text("#step-label").startswith("step 3 ·")
    assert not page.locator("#follow input").is_checked()
    page.locator("#follow input").check()


def test_typing_a_step_and_enter_selects_it(page):
    box = page.locator("#step-input")
    box.fill("2")
    box.press("Enter")

    def at_step2():
        """step 2 shown"""
        return "step 2" in _figure(page, "bag-load")["title"]

    _wait_for(at_step2)
    assert page.inner_text("#step-label").startswith("step 2 ·")
    assert not page.locator("#follow input").is_checked()
    # a step the run does not hold: the nearest one, and the page says so
    box.fill("999")
    box.press("Enter")
    _wait_for(lambda: "step 8" in _figure(page, "bag-load")["title"])
    assert "step 999 is not in this run; showing the nearest, step 8" in page.inner_text(
        "#follow-note"
    )
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
    assert sorted(str(int(c[0])) for c in marks["customdata"]) == sorted(dests.split())


def test_the_table_filters_sorts_and_pages_on_the_server(page):
    highlighted = [t["name"] for t in _figure(page, "bag-load")["data"] if "sequence" in t["name"]]
    chunks = page.locator("#seq-table th[data-dash-column=chunks] input[type=text]")
    chunks.fill("> 1")
    chunks.press("Enter")

    def filtered():
        """every row shown has more than one chunk"""
        cells = page.locator("#seq-table td[data-dash-column=chunks]").all_inner_texts()
        return cells and all(int(c) > 1 for c in cells)

    _wait_for(filtered)
    sort = page.locator("#seq-table th[data-dash-column=length] .column-header--sort")

    def lengths() -> list[int]:
        return [
            int(t) for t in page.locator("#seq-table td[data-dash-column=length]").all_inner_texts()
        ]

    sort.click()  # ascending
    _wait_for(lambda: lengths() == sorted(lengths()) and len(set(lengths())) > 1)
    sort.click()  # descending
    _wait_for(lambda: lengths() == sorted(lengths(), reverse=True) and len(set(lengths())) > 1)
    first_page = lengths()
    page.locator("#seq-table button.next-page").click()
    _wait_for(lambda: lengths() and max(lengths()) <= min(first_page))
    assert filtered()
    # paging did not drop the highlighted sequence
    shown = [t["name"] for t in _figure(page, "bag-load")["data"] if "sequence" in t["name"]]
    assert shown == highlighted and highlighted
    # a new filter starts again on the first page
    chunks.fill("> 2")
    chunks.press("Enter")
    _wait_for(lambda: lengths() and max(lengths()) > min(first_page))
    assert page.inner_text("#seq-table .current-page-shadow") == "1"
    chunks.fill("")
    chunks.press("Enter")
    _wait_for(
        lambda: "1" in page.locator("#seq-table td[data-dash-column=chunks]").all_inner_texts()
    )


def test_a_short_sequence_highlights_only_its_chunks(page, lines50):
    short = page.locator("#seq-table th[data-dash-column=length] input[type=text]")
    short.fill("< 1000")
    short.press("Enter")

    def lengths_shown() -> list[int]:
        cells = page.locator("#seq-table td[data-dash-column=length]").all_inner_texts()
        return [int(t) for t in cells]

    _wait_for(lambda: lengths_shown() and max(lengths_shown()) < 1000)
    lengths = lengths_shown()
    ids = page.locator("#seq-table td[data-dash-column=id]").all_inner_texts()
    row = int(np.argmin(lengths))
    seq = int(ids[row])
    page.locator("#seq-table input[type=radio]").nth(row).check()
    _wait_for(lambda: f"sequence {seq}" in [t["name"] for t in _figure(page, "bag-load")["data"]])
    step = int(page.inner_text("#step-label").split()[1])
    plan = parse_plan_line(lines50[step])
    state = page.evaluate(
        f"""() => {{ const gd = document.querySelector('#bag-load .js-plotly-plot');
        const t = gd._fullData.find(t => t.name === 'sequence {seq}');
        const after = gd._fullData.find(t => t.name === 'after');
        return {{y: Array.from(t.y), base: Array.from(t.base), x: Array.from(t.x),
                 after: Array.from(after.y), outline: after.marker.line.width}}; }}"""
    )
    # only the chunks: segments the size of each chunk's cost, at the top of the GPUs' bars
    st = plan.stats
    workload = plan.sequences.workload[seq] / st.mean_load
    assert sum(state["y"]) == pytest.approx(workload, rel=1e-6)
    tops = [state["after"][x] for x in state["x"]]
    np.testing.assert_allclose(np.add(state["base"], state["y"]), tops)
    assert max(state["y"]) < 0.1 * min(tops)  # a short sequence is a sliver, not a bar
    assert not state["outline"]  # no GPU's whole bar is outlined
    short.fill("")
    short.press("Enter")
    _wait_for(lambda: max(lengths_shown()) >= 1000)


def test_traffic_legend_counts_tokens_and_bags_are_marked(page, lines50):
    colorbar = page.locator("#traffic .colorbar text").all_text_contents()
    assert "1,000" in colorbar and "10" in colorbar
    assert not any("log10" in t for t in colorbar)
    plan = parse_plan_line(lines50[int(page.inner_text("#step-label").split()[1])])
    lines = page.evaluate(
        """() => document.querySelector('#traffic .js-plotly-plot')._fullLayout.shapes
            .filter(s => s.type === 'line').length"""
    )
    assert lines == 2 * (len(plan.bags) - 1)  # each boundary across both axes
    assert page.locator("#traffic .shapelayer path").count() >= lines


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


def test_the_step_label_names_the_step_the_figures_show(page, live_file, lines50):
    """While following live, each time the label changes the figures it describes are
    already on the page (checked right after the update that changed the label)."""
    page.evaluate(
        """() => { window.__shown = [];
        const label = document.querySelector('#step-label');
        new MutationObserver(() => setTimeout(() => {
            const gd = document.querySelector('#bag-load .js-plotly-plot');
            window.__shown.push([label.textContent, gd.layout.title.text]);
        }, 0)).observe(label, {childList: true, subtree: true, characterData: true}); }"""
    )
    for line in lines50[10:14]:
        _append(live_file, line)
        step = parse_plan_line(line).step

        def shown_now(step=step):
            """the page shows the step just appended"""
            return f"step {step} · " in _figure(page, "bag-load")["title"]

        # one step at a time, each shown before the next is written: however slow the
        # machine, the label changes at least once per step (a sleep between writes let
        # a busy machine fold several steps into one update)
        _wait_for(shown_now)
    shown = page.evaluate("window.__shown")
    assert len(shown) >= 4
    for label, title in shown:
        step = label.split(" · ")[0]
        assert f"{step} · " in title, (label, title)


def test_run_picker_switches_to_another_run(page):
    page.locator("#run-picker").click()
    page.get_by_text("mixed8.json", exact=True).last.click()

    def switched():
        """the 8-GPU plan with 4 bags is shown"""
        groups = set(_bag_groups(page))
        return groups == {"bag 0 · 1 GPU", "bag 1 · 1 GPU", "bag 2 · 2 GPUs", "bag 3 · 4 GPUs"}

    _wait_for(switched)

    def counted():
        """the step count reads 1 (the header is indexed after the first view is drawn)"""
        return page.inner_text("#stat-steps") == "1"

    _wait_for(counted)
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

    _wait_for(settled, timeout=LIVE_WITHIN_S)
    before = callbacks()
    page.wait_for_timeout(2 * 1000)  # four ticks
    assert callbacks() == before
    assert page.inner_text("#stat-steps") == "1"  # still the page of the previous test


def _switch_to(page, run: str, ready) -> None:
    search = page.locator("input.dash-dropdown-search")
    page.keyboard.press("Escape")  # a list left open would close on the click below
    page.locator("#run-picker").click()
    _wait_for(lambda: search.count() and search.last.is_visible())
    # The open list renders only the runs near the chosen one: search, as a user would.
    search.last.fill(run)
    # the option itself: the header card may show the same name, and under load the
    # filtered list may not be drawn yet when a search of the whole page resolves
    option = page.locator(".dash-dropdown-option").get_by_text(run, exact=True)
    _wait_for(lambda: option.count() > 0)
    option.first.click()
    _wait_for(ready)


def _labels(page, graph_id: str) -> list[dict]:
    """Every rank tick and annotation drawn in a graph: text, box and font size."""
    return page.evaluate(
        f"""() => Array.from(document.querySelectorAll(
            '#{graph_id} .xtick text, #{graph_id} .annotation-text')).map(e => {{
            const b = e.getBoundingClientRect();
            return {{text: e.textContent, cls: e.getAttribute('class') || '',
                     box: [b.left, b.top, b.right, b.bottom],
                     size: parseFloat(getComputedStyle(e).fontSize)}}; }})"""
    )


def _overlaps(labels: list[dict]) -> list[tuple[str, str]]:
    out = []
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            (l1, t1, r1, b1), (l2, t2, r2, b2) = a["box"], b["box"]
            if min(r1, r2) - max(l1, l2) > 0.5 and min(b1, b2) - max(t1, t2) > 0.5:
                out.append((a["text"], b["text"]))
    return out


def test_bags_stay_legible_at_64_gpus(page, runs_dir):
    plan = parse_plan_line((runs_dir / "wide64" / "plans.jsonl").read_text().splitlines()[-1])
    _switch_to(page, "wide64", lambda: len(_figure(page, "bag-load")["data"][0]["y"]) == 64)
    labels = _labels(page, "bag-load")
    ticks = [lb["text"] for lb in labels if "annotation" not in lb["cls"]]
    assert ticks == [str(g) for m in plan.bags for g in m]  # every rank, in bag order
    notes = {lb["text"] for lb in labels if "annotation" in lb["cls"]}
    for b in range(len(plan.bags)):  # every bag named, in full where it has room
        assert notes & {plan.bag_label(b), f"bag {b}", str(b)}, b
    assert {"16 bags × 1 GPU", "8 bags × 2 GPUs"} <= notes
    assert "bag 28 · 8 GPUs" in notes
    assert _overlaps(labels) == []
    assert min(lb["size"] for lb in labels) >= 12


def test_beyond_64_gpus_labels_thin_out_by_the_rule(page, runs_dir):
    plan = parse_plan_line((runs_dir / "wide128" / "plans.jsonl").read_text().splitlines()[-1])
    _switch_to(page, "wide128", lambda: len(_figure(page, "bag-load")["data"][0]["y"]) == 128)
    labels = _labels(page, "bag-load")
    ticks = [int(lb["text"]) for lb in labels if "annotation" not in lb["cls"]]
    ranks = [g for m in plan.bags for g in m]
    k = ranks.index(ticks[1])  # every k-th slot, k a power of two
    assert k > 1 and k & (k - 1) == 0
    assert ticks == ranks[::k]
    notes = {lb["text"] for lb in labels if "annotation" in lb["cls"]}
    assert {"32 bags × 1 GPU", "16 bags × 2 GPUs"} <= notes
    assert _overlaps(labels) == []
    # the traffic heatmap of 128 GPUs: one cell per GPU
    heat = page.evaluate(
        """() => { const t = document.querySelector('#traffic .js-plotly-plot')._fullData[0];
            return [t.z.length, t.z[0].length]; }"""
    )
    assert heat == [128, 128]


def test_beyond_128_gpus_the_views_show_bags_and_say_so(page, runs_dir):
    plan = parse_plan_line((runs_dir / "wide256" / "plans.jsonl").read_text().splitlines()[-1])
    _switch_to(page, "wide256", lambda: "aggregated" in _figure(page, "bag-load")["title"])
    assert len(_figure(page, "bag-load")["data"][0]["y"]) == len(plan.bags)
    labels = _labels(page, "bag-load")
    ticks = [lb["text"] for lb in labels if "annotation" not in lb["cls"]]
    assert ticks[0] == "0" and len(ticks) > 8  # bag ids, thinned by the same rule
    assert _overlaps(labels) == []
    assert "aggregated" in _figure(page, "traffic")["title"]


def test_straggler_views_name_the_slow_rank(page):
    _switch_to(page, "measured", lambda: "rank 5" in page.inner_text("#stat-straggler"))
    assert page.inner_text("#stat-straggler").startswith("slow_gpu: rank 5")

    def drawn():
        """the straggler views of the measured run's last 20 steps (the straggler window)"""
        return page.locator("#straggler-box").is_visible() and _figure(page, "ratio-heatmap")[
            "title"
        ].endswith("steps 10–29")

    _wait_for(drawn)
    ratio = page.evaluate(
        """() => { const t = document.querySelector('#ratio-heatmap .js-plotly-plot')._fullData[0];
            return Array.from(t.z, row => Array.from(row)); }"""
    )
    rows = np.nanmedian(np.exp2(np.array(ratio, dtype=float)), axis=1)
    assert int(np.argmax(rows)) == 5 and rows[5] > 1.8
    assert np.all(np.delete(rows, 5) < 1.2)
    wait = _figure(page, "wait-heatmap")
    assert len(wait["data"][0]["y"]) == 8
    # every point of compute vs waiting carries its rank, drawn on the page
    drawn = page.locator("#compute-wait .textpoint text").all_text_contents()
    assert sorted(drawn, key=int) == [str(r) for r in range(8)]
    slow = next(t for t in _figure(page, "compute-wait")["data"] if t["name"] == "slow GPU")
    assert [rank for rank, _ratio in slow["customdata"]] == [5]
    # the timeline gains the measured step time
    _wait_for(lambda: "step ms" in [t["name"] for t in _figure(page, "timeline")["data"]])


def _ticks(page, graph_id: str, axis: str = "x") -> list[str]:
    """The tick labels drawn on the page along one axis of a graph."""
    return page.locator(f"#{graph_id} .{axis}tick text").all_text_contents()


def _stack(page, graph_id: str) -> dict[str, list[float]]:
    """y values of each trace of a graph, by name."""
    return {t["name"]: t["y"] for t in _figure(page, graph_id)["data"]}


def test_per_rank_views_at_8_ranks_show_where_each_step_went(page):
    # still on the measured run of the test above: 8 ranks, rank 5 twice as slow
    _wait_for(lambda: "rank 5" in page.inner_text("#stat-straggler"))
    _wait_for(lambda: "step 29" in _figure(page, "phase-step")["title"])
    step = _stack(page, "phase-step")
    parts = [name for name in step if name not in ("measured step", "flagged")]
    assert parts[0] == "compute (the model's)"
    assert "transfer: gather, all-reduce" in parts and "waiting: allreduce" in parts
    # waiting is drawn hatched, the rest solid
    patterns = dict(
        page.evaluate(
            """() => document.querySelector('#phase-step .js-plotly-plot')._fullData.map(
                t => [t.name, (t.marker && t.marker.pattern && t.marker.pattern.shape) || ''])"""
        )
    )
    assert {p for p in parts if patterns[p]} == {p for p in parts if p.startswith("waiting:")}
    # the stack of every rank adds up to its measured step
    np.testing.assert_allclose(np.sum([step[p] for p in parts], axis=0), step["measured step"])
    flagged = next(t for t in _figure(page, "phase-step")["data"] if t["name"] == "flagged")
    assert flagged["customdata"] == [5]
    # the slow rank computes longest and waits least (its bag's peers wait for it in the
    # attention exchanges, the other ranks in the all-reduce)
    ticks = [int(t) for t in _ticks(page, "phase-step")]
    slot = ticks.index(5)
    assert int(np.argmax(step[parts[0]])) == slot
    waits = np.sum([step[p] for p in parts if p.startswith("waiting")], axis=0)
    assert int(np.argmin(waits)) == slot
    window = _figure(page, "phase-window")
    assert "mean of 6 steps (24–29)" in window["title"]
    # the load chart marks the measured step and the flagged rank
    load = {t["name"]: t for t in _figure(page, "bag-load")["data"]}
    assert "measured compute (ms, right axis)" in load and load["flagged"]["customdata"] == [5]
    assert "slow GPU · 5" in page.locator("#bag-load text").all_text_contents()
    assert "measured" in _figure(page, "bag-load")["title"]
    # tokens per GPU: before and after, no cap in this run
    tokens = {t["name"] for t in _figure(page, "tokens")["data"]}
    assert {"before", "after"} <= tokens and not any("cap" in n for n in tokens)
    # compute vs waiting spreads the ranks along both axes
    scatter = _figure(page, "compute-wait")["data"]
    ok = next(t for t in scatter if t["name"] == "ok")
    slow = next(t for t in scatter if t["name"] == "slow GPU")
    assert slow["x"][0] > 1.8 * max(ok["x"]) and slow["y"][0] < min(ok["y"])
    assert np.ptp(ok["y"]) > 0 and np.ptp(ok["x"]) > 0


@pytest.mark.parametrize(("run", "ranks"), [("measured", 8), ("measured64", 64)])
def test_step_loss_shows_what_each_step_lost(page, runs_dir, run, ranks):
    lines = (runs_dir / run / "plans.jsonl").read_text().splitlines()
    plans = [parse_plan_line(line) for line in lines][-WINDOW:]  # the straggler window
    assert len(plans[0].gpus) == ranks
    losses = step_losses([measure(p).figures() for p in plans])
    span = f"steps {plans[0].step}–{plans[-1].step}"

    def drawn():
        """the step-loss graph shows the run's measured steps"""
        title = _figure(page, "step-loss")["title"] or ""
        return title.startswith("What each step lost") and span in title

    _switch_to(page, run, drawn)
    assert page.locator("#step-loss .bars path").count() > 0
    shown = _stack(page, "step-loss")
    for part, name in zip(PARTS, list(shown)[: len(PARTS)], strict=True):
        want = [loss.part_ms[part] for loss in losses]
        np.testing.assert_allclose(shown[name], want, rtol=1e-6, atol=1e-6)
    measured = [loss.measured_ms for loss in losses]
    np.testing.assert_allclose(shown["measured step"], measured, rtol=1e-6)
    assert np.median(shown["slow ranks"]) > 0  # the slow rank's excess compute
    top = page.evaluate(
        "() => document.querySelector('#step-loss .js-plotly-plot')._fullLayout.yaxis.range[1]"
    )
    assert top >= max(measured[2:])
    if run == "measured64":  # the 6-second set-up step is left off the scale
        assert top < 0.1 * measured[0]


def test_per_rank_views_at_64_ranks_label_the_flagged_rank(page, runs_dir):
    _switch_to(page, "measured64", lambda: "rank 17" in page.inner_text("#stat-straggler"))
    _wait_for(lambda: _figure(page, "ratio-heatmap")["title"].endswith("steps 0–11"))
    _wait_for(lambda: "step 11" in _figure(page, "phase-step")["title"])
    # rank 17 is labelled in every per-rank figure, though 64 ranks thin the labels out
    for graph, axis in (
        ("ratio-heatmap", "y"),
        ("wait-heatmap", "y"),
        ("bag-load", "x"),
        ("tokens", "x"),
        ("phase-step", "x"),
        ("phase-window", "x"),
    ):
        ticks = _ticks(page, graph, axis)
        assert "17" in ticks, (graph, ticks)
        assert len(ticks) < 64 or graph in ("bag-load", "tokens"), graph
    heat_ticks = _ticks(page, "ratio-heatmap", "y")
    assert "16" not in heat_ticks and "18" not in heat_ticks  # its neighbours make room
    assert _overlaps(_labels(page, "bag-load")) == []
    # the wait heatmap's colour scale leaves the 6-second warm-up step out
    wait = page.evaluate(
        """() => { const t = document.querySelector('#wait-heatmap .js-plotly-plot')._fullData[0];
            return {zmax: t.zmax, z: Array.from(t.z, row => Array.from(row))}; }"""
    )
    z = np.array(wait["z"], dtype=float)
    assert z[:, 0].max() > 5000
    assert wait["zmax"] < 0.1 * z[:, 0].max()
    assert wait["zmax"] == pytest.approx(np.nanmax(z[:, 2:]), rel=1e-3)
    assert "warm-up" in " ".join(page.locator("#wait-heatmap .colorbar text").all_text_contents())
    # tokens per GPU: the planner's cap as a line, above every GPU's tokens
    tokens = {t["name"]: t for t in _figure(page, "tokens")["data"]}
    cap = tokens[f"cap: max_tokens_per_gpu = {CAP64:,}"]
    assert cap["y"] == [CAP64, CAP64]
    assert len(tokens["after"]["y"]) == 64 and max(tokens["after"]["y"]) <= CAP64
    # the slow rank stands apart in compute vs waiting
    slow = next(t for t in _figure(page, "compute-wait")["data"] if t["name"] == "slow GPU")
    assert slow["customdata"][0][0] == 17


def _bags_of_bars(page) -> list[list[int]]:
    """The GPUs of each bag as the load chart draws them."""
    fig = _figure(page, "bag-load")
    bags: dict[str, list[int]] = {}
    for hover in fig["data"][0]["hovertext"]:
        gpu, bag = hover.split(" · ", 1)
        bags.setdefault(bag, []).append(int(gpu.removeprefix("GPU ")))
    return list(bags.values())


@pytest.mark.parametrize(("run", "steps"), [("alternating", (4, 5)), ("auto", (0, 1))])
def test_views_follow_each_steps_own_partition(page, runs_dir, run, steps):
    recorded = (runs_dir / run / "plans.jsonl").read_text().splitlines()
    plans = [parse_plan_line(line) for line in recorded]
    assert plans[steps[0]].bags != plans[steps[1]].bags  # consecutive steps, two partitions
    if run == "auto":  # recorded by the demo: the planner chose every step's bags
        assert {p.policy for p in plans} == {"auto"}
    names = [p.topology for p in plans]
    changes = sum(a != b for a, b in pairwise(names))
    _switch_to(page, run, lambda: page.inner_text("#stat-steps") == str(len(plans)))
    title = f"{len(set(names))} topologies, {changes} change{'' if changes == 1 else 's'}"
    _wait_for(lambda: title in _figure(page, "topology-timeline")["title"])
    assert set(_ticks(page, "topology-timeline", "y")) == set(names)
    for step in steps:
        box = page.locator("#step-input")
        box.fill(str(step))
        box.press("Enter")
        plan = plans[step]

        def shown(step=step):
            """the load chart, traffic map and table show the step"""
            return (
                f"step {step}" in _figure(page, "bag-load")["title"]
                and f"step {step}" in _figure(page, "traffic")["title"]
            )

        _wait_for(shown)
        assert plan.topology in _figure(page, "bag-load")["title"]
        assert _bags_of_bars(page) == plan.bags
        lines = page.evaluate(
            """() => document.querySelector('#traffic .js-plotly-plot')._fullLayout.shapes
                .filter(s => s.type === 'line').length"""
        )
        assert lines == 2 * (len(plan.bags) - 1)

        def table_rows(plan=plan):
            """the sequence table lists this step's sequences and bags"""
            ids = page.locator("#seq-table td[data-dash-column=id]").all_inner_texts()
            bags = page.locator("#seq-table td[data-dash-column=bag]").all_inner_texts()
            want = [str(plan.sequences.bag[int(i)]) for i in ids]
            return ids and bags == want and len(plan.sequences) >= len(ids)

        _wait_for(table_rows)

        def marked(step=step):
            """the selected step is marked on the partition timeline (its own callback:
            it may draw after the load chart)"""
            marks = page.evaluate(
                """() => document.querySelector('#topology-timeline .js-plotly-plot')
                    ._fullLayout.shapes.map(s => s.x0)"""
            )
            return marks == [step]

        _wait_for(marked)
    page.locator("#follow input").check()


def test_an_empty_run_shows_no_axes(page):
    _switch_to(page, "empty", lambda: page.inner_text("#stat-steps") == "0")
    _wait_for(lambda: page.inner_text("#step-label") == "no steps yet")
    for graph in ("timeline", "bag-load", "traffic"):
        _wait_for(lambda graph=graph: page.locator(f"#{graph} .xtick").count() == 0)
        assert page.locator(f"#{graph} .ytick").count() == 0
        assert "no steps yet" in page.locator(f"#{graph} text").all_text_contents()
    assert "%" not in " ".join(page.locator("#timeline text").all_text_contents())


def _step_in_title(title: str) -> int | None:
    """The step a figure's title says it shows: ``step 7``, or the last of ``steps 0–7``."""
    found = re.search(r"step (\d+)|(\d+)–(\d+)", title or "")
    return None if found is None else int(found.group(1) or found.group(3))


def test_following_a_live_run_every_view_shows_the_labelled_step(page, runs_dir):
    """While the page follows a live measured run, each time the label changes every
    per-step view already shows the step it names (read right after the update)."""
    live = runs_dir / "live-measured" / "plans.jsonl"
    _switch_to(page, "live-measured", lambda: page.inner_text("#step-label").startswith("step 2"))
    page.evaluate(
        """(ids) => { window.__frames = [];
        const label = document.querySelector('#step-label');
        new MutationObserver(() => setTimeout(() => {
            const titles = ids.map(id => {
                const gd = document.querySelector('#' + id + ' .js-plotly-plot');
                return gd && gd._fullLayout.title ? gd._fullLayout.title.text : null; });
            window.__frames.push([label.textContent, titles]);
        }, 0)).observe(label, {childList: true, subtree: true, characterData: true}); }""",
        list(PER_STEP_VIEWS),
    )
    for plan in FOLLOWED[3:]:
        _append(live, plan.model_dump_json())
        _wait_for(lambda step=plan.step: page.inner_text("#step-label").startswith(f"step {step}"))
    frames = page.evaluate("window.__frames")
    assert len(frames) >= len(FOLLOWED) - 3
    for label, titles in frames:
        step = int(label.split(" · ")[0].removeprefix("step "))
        shown = dict(zip(PER_STEP_VIEWS, map(_step_in_title, titles), strict=True))
        assert set(shown.values()) == {step}, (label, shown)
