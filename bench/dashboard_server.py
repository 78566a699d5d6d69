"""What the dashboard benches share: a dashboard server in its own process, its status,
its peak memory, and waiting for the page."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
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


def wait_until(check, timeout: float, what: str) -> float:
    start = time.perf_counter()
    while True:
        try:
            if check():
                return time.perf_counter() - start
        except Exception:
            pass
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


def start_server(path: Path, port: int, log_path: Path) -> tuple[subprocess.Popen, object]:
    """``knapformer dashboard PATH`` (its `serve`) in its own process; the process and the
    open log file it writes to (a file, not a pipe that fills)."""
    code = f"from dashboard.server import serve; serve({str(path)!r}, '127.0.0.1', {port})"
    log = open(log_path, "w+")  # noqa: SIM115 — closed by stop_server
    server = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    return server, log


def stop_server(server: subprocess.Popen, log) -> None:
    import signal

    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log.close()


def print_log_tail(log, lines: int = 30) -> None:
    log.seek(0)
    print("server log (last lines):\n" + "".join(log.readlines()[-lines:]), file=sys.stderr)
