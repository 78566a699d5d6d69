"""`BackgroundWriter`: a thread that handles queued items, so that the caller only queues.

The shape both writers of a run share: the plan recorder's JSONL writer
(`knapformer.runtime.recorder`) and the run store's writer
(`knapformer.runtime.store_writer`). What it guarantees, for either:

- `put` never blocks: the queue is bounded, and an item that finds it full is dropped
  and counted (``dropped``), never waited for.
- One daemon thread, started by the first `put`, hands the items to ``handle`` one at a
  time, in the order they were queued.
- A `put` racing `close` either queues before the thread's last item or returns False
  (both take one lock): an item `put` accepted is handled, or counted in ``unhandled``.
- Only the process that started the thread queues: in a forked child (a data-loader
  worker) `put` returns False and `close` waits for nothing.
- `drain` waits until what was queued before it has been handled; `close` until all of
  it has, then ``finish`` runs on the thread. Both give up after ``timeout`` seconds: a
  thread stuck on a hung file system never hangs the job's exit.
- ``at_exit`` (optional) is called at interpreter exit while the thread runs and
  `close` has not been called: the owner's own close, which may close more than this.
- ``idle_s`` / ``on_idle`` (optional): the thread waits at most ``idle_s()`` seconds for
  the next item (None: as long as it takes), and calls ``on_idle()`` when none came.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()  # the thread's last item: it finishes after handling what precedes it


class _Mark:
    """Queued by `drain`: the thread sets the event when it reaches it."""

    def __init__(self) -> None:
        self.reached = threading.Event()


class BackgroundWriter:
    """Hand queued items to ``handle`` on a daemon thread named ``name`` (the module doc).

    Args:
        name: the thread's name.
        handle: called on the thread with each item, in order.
        queue_size: items waiting for the thread before new ones are dropped.
        finish: called on the thread after the last item, at `close`.
        at_exit: called at interpreter exit while the thread runs, unless closed first.
        idle_s / on_idle: how long the thread waits for an item, and what it does when
            none came in that time.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[Any], object],
        *,
        queue_size: int,
        finish: Callable[[], object] | None = None,
        at_exit: Callable[[], object] | None = None,
        idle_s: Callable[[], float | None] | None = None,
        on_idle: Callable[[], object] | None = None,
    ):
        if (idle_s is None) != (on_idle is None):
            raise ValueError("idle_s and on_idle go together")
        self.name = name
        self._handle = handle
        self._finish = finish
        self._at_exit = at_exit
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._queue: queue.Queue = queue.Queue(maxsize=int(queue_size))
        self._lock = threading.Lock()  # orders `put` against `close`
        self._thread: threading.Thread | None = None
        self._pid: int | None = None  # the process the thread runs in
        #: items that found the queue full
        self.dropped = 0
        #: queued items the thread had not reached when `close` gave up waiting
        self.unhandled = 0
        #: whether `close` saw the thread finish (False: it gave up waiting)
        self.flushed = True
        self.closed = False

    @property
    def queue_size(self) -> int:
        return self._queue.maxsize

    @property
    def started(self) -> bool:
        """Whether the thread was started (by a `put`)."""
        return self._thread is not None

    def put(self, item: object) -> bool:
        """Queue ``item`` for the thread; whether it was queued (never blocks)."""
        with self._lock:
            if self.closed:
                return False
            if self._thread is None:
                self._start()
            elif self._pid != os.getpid():
                return False  # a forked child: the thread is in the parent
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            return True

    def drain(self, timeout: float | None = 30.0) -> None:
        """Wait (at most ``timeout`` s) until the items queued so far have been handled."""
        with self._lock:
            if self.closed or self._thread is None or self._pid != os.getpid():
                return
        mark = _Mark()
        try:
            self._queue.put(mark, timeout=timeout)
        except queue.Full:
            return
        mark.reached.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Handle what is queued, run ``finish`` and stop the thread, waiting at most
        ``timeout`` s in all (then ``flushed`` is False and ``unhandled`` counts what the
        thread had not reached). Whether this call closed it (False: closed already)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        if self._thread is None or self._pid != os.getpid():
            return True
        began = time.monotonic()
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            self.flushed, self.unhandled = False, self._queue.qsize()
            return True
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        self._thread.join(left)
        if self._thread.is_alive():
            self.flushed, self.unhandled = False, max(0, self._queue.qsize() - 1)  # not _STOP
        return True

    def _start(self) -> None:
        """Start the thread (the caller holds ``_lock``)."""
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if self._at_exit is not None:
            atexit.register(self._at_exit)

    def _run(self) -> None:
        while True:
            wait = None if self._idle_s is None else self._idle_s()
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                self._on_idle()
                continue
            if item is _STOP:
                break
            if isinstance(item, _Mark):
                item.reached.set()
                continue
            self._handle(item)
        if self._finish is not None:
            self._finish()
