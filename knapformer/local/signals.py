"""Ctrl-C and SIGTERM handling shared by the command line, the demo and replay.

Only the main thread may install signal handlers; in any other thread these blocks
change nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

Handler = Callable[[int, Any], None] | int


@contextlib.contextmanager
def handling(signum: int, handler: Handler) -> Iterator[None]:
    """``handler`` for ``signum`` inside the block, the previous one restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def ignoring_sigint() -> contextlib.AbstractContextManager[None]:
    """Ctrl-C does nothing inside the block (a clean-up that must not be cut short)."""
    return handling(signal.SIGINT, signal.SIG_IGN)


def interrupt(signum: int, frame: Any) -> None:
    """A handler that stops the program the way Ctrl-C does."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def deferring_sigint() -> Iterator[None]:
    """Ctrl-C inside the block takes effect when the block ends.

    For starting worker processes: cut off half-way, a child still being started would
    find the resources its parent handed it already gone (and print a traceback).
    """
    got: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    with handling(signal.SIGINT, lambda signum, frame: got.append(signum)):
        yield
    if got and previous is not signal.SIG_IGN:
        if callable(previous):
            previous(signal.SIGINT, None)
        raise KeyboardInterrupt
