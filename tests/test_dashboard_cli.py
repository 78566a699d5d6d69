"""``knapformer dashboard`` as a user runs it: a real process serving real HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request

import pytest

from knapformer.cli import main
from knapformer.testing.processes import CLI


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [*CLI, "dashboard", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_serves_the_page_and_warns_when_not_bound_to_localhost(steps50_path):
    # 127.0.0.2 is loopback too, but not the default: the warning must appear.
    proc = _start(str(steps50_path), "--host", "127.0.0.2", "--port", "0")
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://\S+/", line)
        assert url, f"no URL in {line!r}"
        with urllib.request.urlopen(url.group(0), timeout=20) as resp:
            assert resp.status == 200
            assert "KnapFormer dashboard" in resp.read().decode()
        with urllib.request.urlopen(url.group(0) + "api/status", timeout=20) as resp:
            assert '"run":"joint32_50steps"' in resp.read().decode().replace(" ", "")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert "warning: the dashboard binds to 127.0.0.2" in err
    assert "Traceback" not in err
    # Ctrl-C ends it as it ends every command: "interrupted", exit code 130.
    assert err.strip().endswith("interrupted")
    assert proc.returncode == 130


def test_bad_port_is_a_one_line_error(steps50_path, capsys):
    assert main(["dashboard", str(steps50_path), "--port", "70000"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: --port is 70,000; it must lie in 0..65,535 (knapformer.contract.limits)"
    )


def test_port_in_use_is_a_one_line_error(steps50_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["dashboard", str(steps50_path), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("missing", ["nowhere.jsonl"])
def test_missing_file_starts_anyway_with_a_note(tmp_path, missing):
    proc = _start(str(tmp_path / missing), "--port", "0")
    try:
        first = proc.stdout.readline()
        assert "does not exist yet" in first
        assert "http://127.0.0.1:" in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
