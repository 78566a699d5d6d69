"""Commands run as real processes by the tests: the ``knapformer`` command line with this
interpreter, started so that a failing test leaves nothing running."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]  # the repository
#: ``knapformer`` run by this Python (no console script needed): append its arguments.
CLI = [sys.executable, "-c", "import sys; from knapformer.cli import main; sys.exit(main())"]


@contextmanager
def running(args: Sequence[Any], **popen: Any) -> Iterator[subprocess.Popen]:
    """``args`` started in the repository root with text pipes for stdout and stderr
    (``popen`` adds to or overrides that); killed on the way out if it still runs."""
    options = {"cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(list(args), **{**options, **popen})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def survivors(procs: list[psutil.Process], timeout: float = 15) -> list[psutil.Process]:
    """Those of ``procs`` still alive after waiting up to ``timeout`` s for them to end."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive
