"""Regenerate the pictures of the docs from the sample plans and the example data.

Run: ``make pictures`` (``.venv/bin/python docs/make_pictures.py``). Writes
``docs/animation.png`` (the last frame of the 8-GPU animation), ``docs/animation.gif``
(the whole animation, 10 fps, 640 px wide), ``docs/calibration.png`` (the plot of
``knapformer calibrate examples/latency.csv``, as docs/debugging.md runs it) and
``docs/dashboard.png`` (via ``dashboard.screenshot``). Needs the ``all`` extra, Playwright
and a system Chromium.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import av
from PIL import Image

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PLAN = ROOT / "sample_plans" / "mixed8_g1n2+g2n1+g4n1.json"
LATENCIES = "examples/latency.csv"  # relative to ROOT
KNAPFORMER = Path(sys.executable).parent / "knapformer"


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
    from playwright.sync_api import sync_playwright

    from visualization.browser import launch_chromium

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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        animation_pictures(Path(tmp))
        calibration_picture(Path(tmp))
    subprocess.run([sys.executable, "-m", "dashboard.screenshot"], check=True, cwd=ROOT)
    names = ("animation.png", "animation.gif", "calibration.png", "dashboard.png")
    print("wrote " + ", ".join(str(DOCS / name) for name in names))


if __name__ == "__main__":
    main()
