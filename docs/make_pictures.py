"""Regenerate the pictures of the docs from the sample plans and the example data.

Run: ``make pictures`` (``.venv/bin/python docs/make_pictures.py [--only NAME ...]``).
Writes ``docs/animation.png`` (the last frame of the 8-GPU animation), ``docs/animation.gif``
(the whole animation, 10 fps, 640 px wide), ``docs/calibration.png`` (the plot of
``knapformer calibrate examples/latency.csv``, as docs/debugging.md runs it),
``docs/trace.png`` (``knapformer trace sample_plans/demo.jsonl --steps 3:5`` in the trace
viewer Chromium ships, DevTools' Performance panel), ``docs/tensorboard.png``
(``knapformer tensorboard sample_plans/demo.jsonl``, served by TensorBoard on 127.0.0.1),
``docs/stragglers.png`` (the dashboard's straggler views of the run docs/debugging.md
records: the demo with rank 5 made twice as slow), ``docs/whole_run.png`` (the
dashboard's whole-run views of a 64-rank run recorded with its store, rank 17 turning
slow mid-run, one cell opened) and ``docs/dashboard.png`` (via
``dashboard.screenshot``). Needs the ``all`` extra, Playwright and a system Chromium.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import av
from PIL import Image

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PLAN = ROOT / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json"
LATENCIES = "examples/latency.csv"  # relative to ROOT
DEMO = "sample_plans/demo.jsonl"  # relative to ROOT: a recorded run with per-rank times
KNAPFORMER = Path(sys.executable).parent / "knapformer"
# The walkthrough's run (docs/debugging.md runs the same options).
SLOW_DEMO = ["--slow-rank", "5", "--slow-factor", "2", "--steps", "16"]


def decode_frames(video: Path) -> list[Image.Image]:
    with av.open(str(video)) as container:
        return [frame.to_image() for frame in container.decode(video=0)]


def animation_pictures(tmp: Path) -> None:
    """The last frame as PNG and the whole 8-GPU animation as a 10-fps GIF."""
    video = tmp / "routing.mp4"
    subprocess.run(
        [str(KNAPFORMER), "animate", str(PLAN), "-o", str(video), "--quality", "medium"],
        check=True,
    )
    frames = decode_frames(video)
    frames[-1].save(DOCS / "animation.png")
    step = max(1, round(30 / 10))  # 30 fps medium quality -> 10 fps GIF
    small = [
        f.resize((640, round(640 * f.height / f.width))).quantize(colors=128)
        for f in frames[::step]
    ]
    small[0].save(
        DOCS / "animation.gif",
        save_all=True,
        append_images=small[1:] + [small[-1]] * 20,  # hold the last frame ~2 s
        duration=100,
        loop=0,
        optimize=True,
    )


def calibration_picture(tmp: Path) -> None:
    """Screenshot of the plot `knapformer calibrate --plot` writes for the example CSV."""
    from knapformer.visualization.browser import launch_chromium
    from playwright.sync_api import sync_playwright

    html = tmp / "calibration.html"
    subprocess.run(  # the path as the page shows it: the plot's title names it
        [str(KNAPFORMER), "calibrate", LATENCIES, "--token-dim", "256", "--plot", str(html)],
        check=True,
        cwd=ROOT,
    )
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 560})
            page.goto(html.as_uri())
            page.wait_for_selector(".plotly-graph-div .main-svg", timeout=60_000)
            page.locator(".plotly-graph-div").first.screenshot(path=str(DOCS / "calibration.png"))
        finally:
            browser.close()


def trace_picture(tmp: Path) -> None:
    """Three steps of the recorded demo in DevTools' Performance panel, every GPU's track
    expanded (the panel draws on a canvas: tracks are opened by clicking their headers)."""
    from knapformer.visualization.browser import launch_chromium
    from knapformer.visualization.trace_viewer import load_trace
    from playwright.sync_api import sync_playwright

    trace = tmp / "trace.json"
    subprocess.run(
        [str(KNAPFORMER), "trace", DEMO, "--steps", "3:5", "-o", str(trace)], check=True, cwd=ROOT
    )
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            load_trace(page, trace)
            page.get_by_role("button", name="Close").first.click()  # the shortcuts pop-up
            page.get_by_role("button", name="Hide sidebar").click()
            page.wait_for_timeout(500)
            page.mouse.click(60, 129)  # the run's process track
            page.wait_for_timeout(500)
            for k in reversed(range(8)):  # GPU 7 .. GPU 0, bottom up: headers do not move
                page.mouse.click(60, 146 + 20.8 * k)
                page.wait_for_timeout(300)
            page.mouse.move(1500, 990)
            page.wait_for_timeout(500)
            page.screenshot(
                path=str(DOCS / "trace.png"), clip={"x": 0, "y": 0, "width": 1600, "height": 780}
            )
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard_picture(tmp: Path) -> None:
    """TensorBoard's time series of the recorded demo's scalars, served on 127.0.0.1."""
    from knapformer.visualization.browser import launch_chromium
    from playwright.sync_api import sync_playwright

    logdir = tmp / "tb"
    subprocess.run(
        [str(KNAPFORMER), "tensorboard", DEMO, "--logdir", str(logdir)], check=True, cwd=ROOT
    )
    port = _free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 980})
                page.goto(url + "#timeseries", timeout=60_000)
                tags = page.locator("input[placeholder='Filter tags (regex)']")
                tags.wait_for(timeout=60_000)
                tags.fill("imbalance|moved|speedup|compute_max_over")
                tags.press("Escape")  # close the tag suggestions
                page.locator("button:has-text('Settings')").first.click()  # hide the pane
                page.wait_for_selector("canvas", timeout=60_000)
                page.wait_for_timeout(4000)  # let the charts draw
                page.screenshot(path=str(DOCS / "tensorboard.png"))
            finally:
                browser.close()
    finally:
        server.terminate()
        server.wait(30)


def stragglers_picture(tmp: Path) -> None:
    """The straggler views of the dashboard on a fresh recording of the walkthrough's run
    (docs/debugging.md, section 1): the same demo command, then only the views' box."""
    run = tmp / "slow"
    subprocess.run(
        [str(KNAPFORMER), "demo", *SLOW_DEMO, "--no-dashboard", "--out", str(run)],
        check=True,
        cwd=ROOT,
    )
    out = ["--out", str(DOCS / "stragglers.png"), "--element", "#straggler-box"]
    subprocess.run(
        [sys.executable, "-m", "knapformer.dashboard.screenshot", str(run / "plans.jsonl"), *out],
        check=True,
        cwd=ROOT,
    )


def whole_run_picture(tmp: Path) -> None:
    """The dashboard's whole-run views: 240 measured steps of 64 ranks recorded with the
    run store (segments of 10 steps), rank 17 twice as slow from step 120, and the cell
    of steps 200-209 opened."""
    from knapformer.dashboard.server import start_server
    from knapformer.visualization.browser import launch_chromium
    from playwright.sync_api import sync_playwright

    from knapformer.runtime.recorder import PlanRecorder
    from knapformer.testing.measured_plans import measured_run

    shape = {"topology": "g1n16+g2n8+g4n4+g8n2", "codes": "g32b4i256f1s0,g32b2i512f1s0"}
    healthy = measured_run(120, seed=4, **shape)
    slow = measured_run(240, seed=4, slow_rank=17, slow_factor=2.0, **shape)[120:]
    run = tmp / "whole" / "run"
    with PlanRecorder(run / "plans.jsonl", every=40, store_segment_steps=10) as recorder:
        for plan in healthy + slow:
            recorder.record(plan)
    with start_server(run, port=0) as handle, sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(handle.url)
            page.wait_for_selector("#run-heatmap .heatmaplayer", timeout=120_000)
            box = page.locator("#run-heatmap .nsewdrag").first.bounding_box()
            page.mouse.click(box["x"] + box["width"] * 205 / 240, box["y"] + box["height"] / 2)
            page.wait_for_function(
                "() => document.querySelector('#drill-label').innerText.includes('steps 200')",
                timeout=60_000,
            )
            page.mouse.move(0, 0)  # no hover label in the picture
            page.wait_for_timeout(800)
            page.locator("#run-box").screenshot(path=str(DOCS / "whole_run.png"))
        finally:
            browser.close()


PICTURES = {
    "animation": animation_pictures,
    "calibration": calibration_picture,
    "trace": trace_picture,
    "tensorboard": tensorboard_picture,
    "stragglers": stragglers_picture,
    "whole_run": whole_run_picture,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=[*PICTURES, "dashboard"], help="pictures to make"
    )
    chosen = parser.parse_args().only or [*PICTURES, "dashboard"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            if name in PICTURES:
                PICTURES[name](Path(tmp))
    if "dashboard" in chosen:
        subprocess.run(
            [sys.executable, "-m", "knapformer.dashboard.screenshot"], check=True, cwd=ROOT
        )
    print(f"wrote {', '.join(chosen)} pictures to {DOCS}")


if __name__ == "__main__":
    main()
