"""`knapformer report`: self-contained HTML with the dashboard's figures, PNG export."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from knapformer.visualization.browser import find_chromium, launch_chromium
from knapformer.visualization.report import build_report
from knapformer.visualization.straggler_figures import straggler_views
from PIL import Image

from knapformer.cli import main
from knapformer.contract.plan import Measurements
from knapformer.contract.plan_io import read_plans, write_json, write_jsonl
from knapformer.diagnosis.measured import measure
from knapformer.testing.measured_plans import measured_run

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine")


def _views(page: str) -> Counter:
    return Counter(re.findall(r"<div class='figure' data-view='([a-z-]+)'", page))


def _report(capsys, *args: str) -> str:
    code = main(["report", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_report_has_one_figure_per_requested_view(tmp_path, steps50_path, capsys):
    out = tmp_path / "report.html"
    said = _report(capsys, str(steps50_path), "--steps", "10:12", "-o", str(out))
    page = out.read_text()
    assert _views(page) == {"timeline": 1, "bag-load": 3, "traffic": 3}
    assert "(7 figures)" in said
    for step in (10, 11, 12):
        assert f"<h2>Step {step}</h2>" in page
        assert f"data-step='{step}'" in page
    assert "data-step='13'" not in page and "<h2>Step 9</h2>" not in page
    # Self-contained: plotly.js is inline exactly once and nothing is fetched.
    assert page.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]+src=", page)
    # One sequence table per step, with one row per sequence of that step.
    plans = {p.step: p for p in read_plans(steps50_path).plans}
    tables = re.findall(r"<table class='sequences'>.*?</table>", page, flags=re.S)
    assert [t.count("<tr>") - 1 for t in tables] == [len(plans[s].sequences) for s in (10, 11, 12)]


def test_default_is_the_last_plan_and_measurements_add_a_view(tmp_path, plan8_path, capsys):
    plan = read_plans(plan8_path, on_error="raise").plans[0]
    times = (plan.stats.load_after * 10 + np.arange(8)).tolist()
    measured = plan.model_copy(
        update={"measurements": Measurements(plan_ms=1.0, per_rank_ms={"step": times})}
    )
    source = tmp_path / "measured.json"
    write_json(source, measured)
    out = tmp_path / "r.html"
    _report(capsys, str(source), "-o", str(out))
    assert _views(out.read_text()) == {
        "timeline": 1,
        "bag-load": 1,
        "traffic": 1,
        "ratio-heatmap": 1,
        "wait-heatmap": 1,
        "compute-wait": 1,
        "step-loss": 1,
    }


@pytest.mark.parametrize(
    ("topology", "codes", "slow"),
    [
        ("g1n2+g2n1+g4n1", "g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0", 5),
        ("g1n16+g2n8+g4n4+g8n2", "g32b8i256f1s0,g16b4i512f1s0,g16b2i1024f1s0", 17),
    ],
    ids=["8-ranks", "64-ranks"],
)
def test_report_holds_the_dashboards_straggler_views(tmp_path, capsys, topology, codes, slow):
    plans = measured_run(8, topology, codes, seed=2, slow_rank=slow, slow_factor=2.0)
    source = tmp_path / "plans.jsonl"
    write_jsonl(source, plans)
    out = tmp_path / "r.html"
    _report(capsys, str(source), "-o", str(out))
    page = out.read_text()
    assert _views(page)["ratio-heatmap"] == _views(page)["wait-heatmap"] == 1
    assert f"straggler: slow_gpu: rank {slow} (major: costs " in html.unescape(page)
    # the slow rank is labelled on both heatmaps' rank axes, and named in the scatter
    result = read_plans(source, on_error="raise")
    _page, figures = build_report(result)
    assert [f.view for f in figures][-4:] == [
        "ratio-heatmap",
        "wait-heatmap",
        "compute-wait",
        "step-loss",
    ]
    verdict, views = straggler_views([measure(p).figures() for p in plans], 0)
    assert verdict.startswith(f"slow_gpu: rank {slow}")
    by_view = dict(views)
    for name in ("ratio-heatmap", "wait-heatmap"):
        assert str(slow) in by_view[name].layout.yaxis.ticktext
    slow_points = next(t for t in by_view["compute-wait"].data if t.name == "slow GPU")
    assert [int(r) for r, _ in slow_points.customdata] == [slow]
    # what each step lost: the slow rank's excess compute is its largest part
    assert _views(page)["step-loss"] == 1
    loss = {t.name: np.asarray(t.y, dtype=float) for t in by_view["step-loss"].data}
    assert len(loss["measured step"]) == len(plans)
    assert np.median(loss["slow ranks"]) > 0.5 * np.median(
        loss["measured step"] - loss["ideal step"]
    )


def test_legacy_plan_report(tmp_path, legacy_path, capsys):
    out = tmp_path / "legacy.html"
    _report(capsys, str(legacy_path), "-o", str(out))
    assert _views(out.read_text()) == {"timeline": 1, "bag-load": 1, "traffic": 1}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0:60"], "selects 50 plans; a report holds at most 20"),
        (["--steps", "900:901"], "no plan with a step in '900:901'"),
        (["--steps", "x:y"], "integer steps"),
    ],
)
def test_report_user_errors(tmp_path, steps50_path, capsys, args, message):
    assert main(["report", str(steps50_path), "-o", str(tmp_path / "r.html"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()


def test_png_without_chromium_is_a_clear_error(tmp_path, plan8_path, capsys, monkeypatch):
    monkeypatch.setenv("KNAPFORMER_CHROMIUM", str(tmp_path / "no-such-chromium"))
    out = tmp_path / "r.html"
    code = main(["report", str(plan8_path), "-o", str(out), "--png", str(tmp_path / "png")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: PNG export needs Chromium") and "no-such-chromium" in err
    assert out.is_file()  # the HTML is still there
    assert not list((tmp_path).glob("png/*.png"))


@pytest.mark.browser
@needs_chromium
def test_report_opens_in_headless_chromium_without_errors(tmp_path, steps50_path, capsys):
    from playwright.sync_api import sync_playwright

    out = tmp_path / "report.html"
    _report(capsys, str(steps50_path), "--steps", "20:21", "-o", str(out))
    expected = sum(_views(out.read_text()).values())
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(out.resolve().as_uri())
            page.wait_for_function(
                f"document.querySelectorAll('div.figure .main-svg').length >= {expected}",
                timeout=60_000,
            )
            drawn = page.evaluate("document.querySelectorAll('div.figure .js-plotly-plot').length")
            bars = page.evaluate("document.querySelectorAll('div.figure g.point').length")
        finally:
            browser.close()
    assert problems == []
    assert drawn == expected == 5
    assert bars > 32  # the bag-load bars were really drawn


@pytest.mark.browser
@needs_chromium
def test_png_export_writes_one_image_per_figure(tmp_path, plan8_path, capsys):
    png = tmp_path / "png"
    said = _report(capsys, str(plan8_path), "-o", str(tmp_path / "r.html"), "--png", str(png))
    files = sorted(p.name for p in png.iterdir())
    assert files == ["step-0-bag-load.png", "step-0-traffic.png", "timeline.png"]
    assert "wrote 3 PNG files" in said
    for name in files:
        with Image.open(png / name) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 200
            pixels = np.asarray(image.convert("RGB"))
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # a drawn plot, not blank


def test_commands_import_plotly_and_manim_lazily():
    # `import knapformer.cli` must not pull in plotly or manim (imported inside commands).
    code = "import sys, knapformer.cli; print('plotly' in sys.modules, 'manim' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
