"""CPU work of a known CPU time, for tests of what the timer counts as compute."""

from __future__ import annotations

import time

from knapformer.runtime.timing import cpu_clock_ms


def burn_cpu(ms: float) -> float:
    """Run the thread for ``ms`` of its CPU time (longer by the wall clock on a busy
    machine); returns the wall-clock ms it took."""
    began, end = time.perf_counter(), cpu_clock_ms() + ms
    x = 0
    while cpu_clock_ms() < end:
        x += 1
    return (time.perf_counter() - began) * 1e3
