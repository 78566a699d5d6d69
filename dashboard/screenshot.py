"""Save a screenshot of the dashboard (used in the README).

Run: ``python -m knapformer.dashboard.screenshot [PLANS] [--out docs/dashboard.png]
[--element CSS]``
(default: the 50-step sample). Starts the server on a free port, opens headless Chromium,
selects a sequence split over a multi-GPU bag so the highlight shows, and saves the page
(or only the element ``CSS`` selects, e.g. ``#straggler-box`` for the straggler views of a
measured run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from knapformer.dashboard.server import start_server
from knapformer.visualization.browser import launch_chromium

ROOT = Path(__file__).resolve().parent.parent


def screenshot(
    plans: Path, out: Path, width: int = 1400, height: int = 1250, element: str | None = None
) -> Path:
    """Write a PNG of the dashboard of ``plans`` (or of its ``element``) to ``out``;
    returns ``out``."""
    from playwright.sync_api import sync_playwright

    with start_server(plans, port=0) as handle, sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(handle.url)
            page.wait_for_selector("#bag-load .main-svg .bars", timeout=60_000)
            chunks = page.locator("#seq-table td[data-dash-column=chunks]").all_inner_texts()
            row = next((i for i, c in enumerate(chunks) if int(c) > 1), None)
            if row is None:  # none on the first page: look for a split sequence by filter
                page.locator("#seq-table th[data-dash-column=chunks] input[type=text]").fill("> 1")
                page.keyboard.press("Enter")
                page.wait_for_timeout(500)
                row = 0
            ids = page.locator("#seq-table td[data-dash-column=id]").all_inner_texts()
            seq = ids[row]
            page.locator("#seq-table input[type=radio]").nth(row).check()
            page.wait_for_function(
                f"""() => document.querySelector('#bag-load .js-plotly-plot')._fullData
                    .some(t => t.name === 'sequence {seq}')""",
                timeout=30_000,
            )
            page.wait_for_timeout(800)  # let the transitions settle
            page.evaluate("window.scrollTo(0, 0)")  # checking the row scrolled the table in
            page.wait_for_timeout(200)
            out.parent.mkdir(parents=True, exist_ok=True)
            if element is None:
                page.screenshot(path=str(out), full_page=False)
            else:
                page.locator(element).wait_for(state="visible", timeout=30_000)
                page.wait_for_timeout(800)
                page.locator(element).screenshot(path=str(out))
        finally:
            browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "plans", nargs="?", type=Path, default=ROOT / "sample_plans" / "joint32_50steps.jsonl"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--element", help="CSS selector of the part to save (default: the page)")
    args = parser.parse_args()
    print(screenshot(args.plans, args.out, element=args.element))


if __name__ == "__main__":
    main()
