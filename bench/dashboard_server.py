"""What the dashboard benches share: a dashboard server in its own process, its status,
its peak memory, and waiting for the page.

`served_page` starts the server with a headless Chromium page to measure it in."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent

from knapformer.visualization.browser import launch_chromium  # noqa: E402

from knapformer.testing.polling import wait_until  # noqa: E402

__all__ = ["PeakRss", "ServedPage", "served_page", "status", "wait_until"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "api/status", timeout=30) as resp:
        return json.loads(resp.read())


class PeakRss:
    """Samples a process's RSS every 20 ms in a thread; ``peak`` in bytes."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


#: Run before `serve` in the server's process for a baseline of the full plotly.js: the
#: dashboard looks for its cartesian bundle in a folder that does not exist.
FULL_PLOTLY_JS = (
    "import knapformer.dashboard.plotly_bundle as bundle; "
    "bundle.FOLDER = bundle.FOLDER / 'not-fetched'; "
)


def _start_server(
    path: Path, port: int, log_path: Path, full_plotly_js: bool = False
) -> tuple[subprocess.Popen, object]:
    """``knapformer dashboard PATH`` (its `serve`) in its own process; the process and the
    open log file it writes to (a file, not a pipe that fills)."""
    code = (FULL_PLOTLY_JS if full_plotly_js else "") + (
        f"from dashboard.server import serve; serve({str(path)!r}, '127.0.0.1', {port})"
    )
    log = open(log_path, "w+")  # noqa: SIM115 — closed by _stop_server
    server = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    return server, log


def _stop_server(server: subprocess.Popen, log) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log.close()


def _print_log_tail(log, lines: int = 30) -> None:
    log.seek(0)
    print("server log (last lines):\n" + "".join(log.readlines()[-lines:]), file=sys.stderr)


@dataclass
class ServedPage:
    """A dashboard server in its own process and a Chromium page to open it in."""

    page: Any  # playwright's Page, not yet on ``url``
    url: str
    started: float  # perf_counter when the server process was started
    ready_s: float  # from then until the server answered /api/status
    rss_mib: float = 0.0  # the server's peak RSS, known once the session has ended


@contextmanager
def served_page(path: Path, full_plotly_js: bool = False) -> Iterator[ServedPage]:
    """``knapformer dashboard PATH`` on a free port (log in PATH's folder) and a headless
    Chromium page of 1400 x 1600 px, yielded once the server answers. On the way out the
    server's peak RSS goes to ``rss_mib``, the server is stopped and Chromium closed; on
    an error the server log's last lines are printed first. ``full_plotly_js``: the
    server serves plotly.js's full bundle even where the cartesian one is fetched."""
    from playwright.sync_api import sync_playwright

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        started = time.perf_counter()
        server, log = _start_server(path, port, path.parent / "server.log", full_plotly_js)
        rss = PeakRss(server.pid)
        served = None
        try:
            wait_until(lambda: status(url) is not None, 60, "server start")
            served = ServedPage(page, url, started, time.perf_counter() - started)
            yield served
        except Exception:
            _print_log_tail(log)
            raise
        finally:
            peak = rss.stop() / 2**20
            if served is not None:
                served.rss_mib = peak
            _stop_server(server, log)
            browser.close()
