"""Waiting for a condition that another process or a browser page makes true: shared by
the browser tests and the dashboard benches (which put tests/ on their path)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    check: Callable[[], object], timeout: float, what: str | None = None, interval: float = 0.02
) -> float:
    """Poll ``check()`` every ``interval`` s until it is truthy; returns the seconds taken.

    An exception inside ``check`` counts as "not yet" (a page mid-update, a server still
    starting). Past ``timeout`` s raises `TimeoutError` naming ``what`` (default: the
    check's docstring).
    """
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except Exception:
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what or check.__doc__} did not happen within {timeout} s")
        time.sleep(interval)
