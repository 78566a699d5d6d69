"""Load a Chrome trace (``knapformer trace``) into the trace viewer every Chromium ships:
the Performance panel of DevTools, headless, through Playwright.

The panel is opened as `TRACE_APP`; nothing is fetched from the network.

Tests use it to check that a trace really loads (the panel shows its full time range);
``docs/make_pictures.py`` takes the screenshot for the docs with it.
"""

from __future__ import annotations

import re
from pathlib import Path

TRACE_APP = "devtools://devtools/bundled/trace_app.html"
_RANGE = re.compile(r"Full range \(([\d,.]+)\s*(µs|ms|s|min)\)")
_MS_PER = {"µs": 1e-3, "ms": 1.0, "s": 1e3, "min": 6e4}


def load_trace(page, trace: str | Path, timeout_s: float = 60) -> float:
    """Open DevTools' Performance panel on ``page`` (a Playwright page of headless
    Chromium), load the trace file ``trace`` through its "Load trace" button and wait
    until it is shown; returns the trace's full range in ms as the panel reports it.
    Raises RuntimeError when the panel shows no loaded trace in ``timeout_s``."""
    page.goto(TRACE_APP, timeout=timeout_s * 1000)
    # Opened outside DevTools, the app says its debugging connection closed: dismiss it.
    close = page.get_by_role("button", name="Close")
    close.first.wait_for(timeout=timeout_s * 1000)
    close.first.click()
    page.get_by_text("Performance", exact=True).click()
    with page.expect_file_chooser(timeout=timeout_s * 1000) as chooser:
        page.get_by_role("button", name="Load trace…").click()
    chooser.value.set_files(str(trace))
    shown = page.get_by_text(_RANGE)
    try:
        shown.first.wait_for(state="attached", timeout=timeout_s * 1000)
    except Exception as err:  # Playwright's TimeoutError: the trace did not load
        raise RuntimeError(f"DevTools showed no loaded trace for {trace}") from err
    match = _RANGE.search(shown.first.inner_text())
    if match is None:
        raise RuntimeError(f"DevTools showed an unreadable range for {trace}")
    number, unit = match.groups()
    return float(number.replace(",", "")) * _MS_PER[unit]
