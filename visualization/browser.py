"""Headless Chromium for screenshots, PNG export, benchmarks and browser tests.

Playwright drives the system Chromium (Debian's ``chromium``); it never downloads a
browser of its own. ``$KNAPFORMER_CHROMIUM`` overrides the path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM_ENV = "KNAPFORMER_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
# Flags for headless Chromium in containers and CI: no sandbox (runs as root), no GPU,
# no background network chatter (the machines have no general internet).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def find_chromium() -> str | None:
    """Path of the Chromium to drive: $KNAPFORMER_CHROMIUM, /usr/bin/chromium, or on PATH."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        return override if Path(override).is_file() else None
    if Path(DEFAULT_CHROMIUM).is_file():
        return DEFAULT_CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_chromium() -> str:
    """Why no Chromium was found, and how to get one (one line). With $KNAPFORMER_CHROMIUM
    set, only that path was tried, and the message says so."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        return (
            f"{CHROMIUM_ENV}={override}: that path was not found (point it at a Chromium "
            f"executable, or unset it to use {DEFAULT_CHROMIUM} or chromium on PATH)"
        )
    return (
        f"none was found at {DEFAULT_CHROMIUM} or on PATH (install chromium, "
        f"or set {CHROMIUM_ENV}=/path/to/chromium)"
    )


def launch_chromium(playwright, **kwargs):
    """Launch headless Chromium through a running Playwright (``sync_playwright()``)."""
    path = find_chromium()
    if path is None:
        raise RuntimeError(f"no Chromium: {missing_chromium()}")
    return playwright.chromium.launch(
        executable_path=path, headless=True, args=CHROMIUM_ARGS, **kwargs
    )
