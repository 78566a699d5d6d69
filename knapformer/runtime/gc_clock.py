"""How long Python's garbage collector has held this process: one ``gc.callbacks`` hook,
read as running totals (`GcClock`).

A collection holds the GIL, so it stops every Python thread of the process, whichever
thread's allocation set it off. A full collection of a large heap takes from tens to
hundreds of ms: on a GPU the kernel queue drains meanwhile, on the CPU the training
thread computes nothing. Either way it is host work, not the device's compute, and a
rank whose collections are long is ``slow_host``, not ``slow_gpu``
(`knapformer.runtime.timing` records it as the ``gc`` phase,
`knapformer.diagnosis.measured.GC_PHASE`).
"""

from __future__ import annotations

import gc
import threading
import time


class GcClock:
    """Running totals of the collections since it was installed: their wall time, and
    for each thread that ran one, the CPU time they took on it."""

    def __init__(self) -> None:
        self.wall_ms = 0.0
        self._cpu_ms: dict[int, float] = {}
        self._began: tuple[float, float] | None = None  # collections never nest

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = (time.perf_counter(), time.thread_time())
        elif self._began is not None:
            wall, cpu = self._began
            self._began = None
            self.wall_ms += (time.perf_counter() - wall) * 1e3
            thread = threading.get_ident()
            spent = (time.thread_time() - cpu) * 1e3
            self._cpu_ms[thread] = self._cpu_ms.get(thread, 0.0) + spent

    def reading(self) -> tuple[float, float]:
        """(wall ms of every collection, CPU ms of those the calling thread ran), so far."""
        return self.wall_ms, self._cpu_ms.get(threading.get_ident(), 0.0)


_CLOCK: GcClock | None = None
_INSTALLING = threading.Lock()


def gc_clock() -> GcClock:
    """The process's clock, installed in ``gc.callbacks`` on the first call."""
    global _CLOCK
    with _INSTALLING:
        if _CLOCK is None:
            _CLOCK = GcClock()
            gc.callbacks.append(_CLOCK)
        return _CLOCK
