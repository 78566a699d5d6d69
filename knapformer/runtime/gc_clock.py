"""How long Python's garbage collector has held this process: a ``gc.callbacks`` hook,
read as running totals (`GcClock`), installed while a step timer asks for it
(`acquire`, `release`).

A collection holds the GIL, so it stops every Python thread of the process, whichever
thread's allocation set it off. A full collection of a large heap takes from tens to
hundreds of ms: on a GPU the kernel queue drains meanwhile, on the CPU the training
thread computes nothing. Either way it is host work, not the device's compute, and a
rank whose collections are long is ``slow_host``, not ``slow_gpu``
(`knapformer.runtime.timing` records it as the ``gc`` phase,
`knapformer.contract.phases.GC`).

Opt-in (``SequenceBalancer(..., time_gc=True)``), because of one CPython behaviour: a
signal that arrives during a collection is handled by the first Python code that runs
after it, which is the hook, and an exception raised there is swallowed (gc callbacks
cannot raise). A handler that raises, as Ctrl-C's ``KeyboardInterrupt`` does, is then
lost. Measured: 20 of 20 SIGINTs sent during 120 ms collections were lost with the hook
installed, none without. A process stopped by a flag, or by SIGTERM's default action
(no Python handler: torchrun's workers, unless the script installs one), is not
affected. The demo's workers leave by the launcher's flag; their SIGTERM handler raises,
and one lost there is followed by the launcher's SIGKILL after its grace period.
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


_CLOCK = GcClock()
_USERS = 0
_LOCK = threading.Lock()


def acquire() -> GcClock:
    """The process's clock, its hook installed while anyone holds it."""
    global _USERS
    with _LOCK:
        if _USERS == 0:
            gc.callbacks.append(_CLOCK)
        _USERS += 1
        return _CLOCK


def release() -> None:
    """Give back what `acquire` gave; the last release removes the hook."""
    global _USERS
    with _LOCK:
        if _USERS == 0:
            return
        _USERS -= 1
        if _USERS == 0:
            gc.callbacks.remove(_CLOCK)
