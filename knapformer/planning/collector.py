"""Python's cyclic garbage collector paused while a step is planned (`collector_paused`).

A plan at thousands of GPUs makes tens of thousands of short-lived containers (heap
entries, per-bag lists), none in a cycle. With the collector on, each 700 of them set off
a young collection, every tenth of those an older one, and the survivors push the process
towards a full pass over every object it holds: in a training process (torch, a model,
its optimizer) a full pass costs tens of milliseconds. Paused, the plan's survivors are
looked at once, in the first young collection after it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # planning calls inside the pause (plan-ahead plans on its own thread)
_resume = False  # whether the collector was on when the first of them began


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off while any caller is inside, then as it was before the first: on
    again only if it was on (a process that turned it off keeps it off). Usable as a
    decorator."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
