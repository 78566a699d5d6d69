"""`PlanAhead`: the side channel's background thread. It runs requests one at a time, in
the order they were submitted, and hands each result (or the exception it raised) to
whoever waits for that request's `Ticket`.

`knapformer.runtime.balancer.SequenceBalancer` (``plan_ahead=True``) submits one request per
``prefetch``: the thread gathers the lengths over a gloo group of its own and plans
while the training thread computes the previous step; ``plan_routing`` then waits for
the oldest ticket. Order matters twice: every rank's thread runs the same collectives in
the same order on the side group, and tickets are taken in the order of the steps.

Waiting is interruptible (Ctrl-C raises ``KeyboardInterrupt`` in the waiting thread and
leaves the ticket in place, so the same call can be made again) and bounded (the
balancer waits at most twice its process group's timeout, by which any collective of the
thread has failed). `close` lets the thread run what was submitted before it, then stops
it: every rank submitted the same requests, so every rank's thread runs the same
collectives and none is left inside one whose peers stopped first (``stop`` is set
meanwhile, so that a request waiting for a step that will never end gives up, on every
rank alike). After a request fails while closing (peers gone), the rest are not run. A
thread stuck in a collective anyway is left behind (a daemon) after the timeout rather
than hanging the caller.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_STOP = object()


@dataclass
class Ticket:
    """One submitted request and, once ``done`` is set, its ``result`` or ``error``."""

    request: Any
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        """The result (``done`` must be set); raises the request's exception instead."""
        if self.error is not None:
            raise self.error
        return self.result


class PlanAhead:
    """A background thread running ``work(request)`` for each submitted request, in order.

    ``work`` may block (in a collective, or waiting for the training thread); ``stop`` is
    set when the worker is closing, for ``work`` to give up such a wait.
    """

    def __init__(self, work: Callable[[Any], Any], name: str = "knapformer-plan-ahead") -> None:
        self.stop = threading.Event()
        self._work = work
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: deque[Ticket] = deque()  # submitted, not yet taken (oldest first)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: Any, keep: bool = True) -> Ticket:
        """Queue ``request``; ``keep``: the ticket counts among the `outstanding` ones
        until taken (else only its submitter holds it)."""
        if self.stop.is_set():
            raise RuntimeError("the plan-ahead thread is closed")
        ticket = Ticket(request)
        if keep:
            self._tickets.append(ticket)
        self._queue.put(ticket)
        return ticket

    def oldest(self) -> Ticket | None:
        """The oldest ticket not yet taken (None: none is outstanding)."""
        return self._tickets[0] if self._tickets else None

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Wait until ``ticket`` is done, at most ``timeout`` s (then `TimeoutError`);
        Ctrl-C interrupts the wait, not the request."""
        # Event.wait blocks in a lock acquire, which a signal interrupts (POSIX).
        if not ticket.done.wait(timeout):
            raise TimeoutError(
                f"the plan-ahead thread did not answer within {timeout:g} s (a peer's "
                "plan-ahead thread is gone or stuck)"
            )

    def take(self) -> Ticket:
        """Remove and return the oldest ticket (after `wait`)."""
        return self._tickets.popleft()

    def outstanding(self) -> list[Ticket]:
        """Every ticket not yet taken, oldest first."""
        return list(self._tickets)

    def close(self, timeout: float) -> bool:
        """Run what was submitted, then stop; returns whether the thread ended in time."""
        self.stop.set()
        self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failed_closing = False
        while True:
            ticket = self._queue.get()
            if ticket is _STOP:
                return
            if failed_closing:
                ticket.error = RuntimeError("the plan-ahead thread was closed first")
            else:
                try:
                    ticket.result = self._work(ticket.request)
                except BaseException as err:  # handed to the waiting thread, raised there
                    ticket.error = err
                    failed_closing = self.stop.is_set()
            ticket.done.set()
