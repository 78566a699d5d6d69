"""``knapformer`` commands run in the test's own process, what they print captured (the
command line is no layer knapformer.testing may import: tests/test_layers.py)."""

from __future__ import annotations

import contextlib
import io
import subprocess

from knapformer.cli import main


def run_here(*args: str) -> subprocess.CompletedProcess:
    """``knapformer ARGS`` as if run: exit status, stdout and stderr. For commands that
    start workers (demo, replay): they are processes all the same, forked by a server that
    imports torch once for every run of the test process, where a command started anew
    imports it twice."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["knapformer", *args], code, out.getvalue(), err.getvalue())
