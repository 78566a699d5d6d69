"""The dashboard's browser tests share one way to look at it: a server in the test's
process on a free port, opened in headless Chromium (Debian's, through Playwright), the
page handed over once ``ready`` (a CSS selector) is drawn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from knapformer.visualization.browser import launch_chromium

#: The window the dashboard's layout is checked in: wide and tall enough for every view.
VIEWPORT = {"width": 1400, "height": 1600}


@contextmanager
def dashboard_page(path: Path, ready: str) -> Iterator:
    """A Playwright page on the dashboard of ``path`` (a run folder, a plans file or a
    folder of runs) once ``ready`` is on it; the browser and the server are stopped after."""
    from knapformer.dashboard.server import start_server
    from playwright import sync_api

    handle = start_server(path, port=0)
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(handle.url)
            page.wait_for_selector(ready, timeout=120_000)
            yield page
        finally:
            browser.close()
            handle.stop()
