"""Progress of long commands on stderr: a transient bar on a terminal; in logs and pipes,
optionally a plain line at each quarter instead of a redrawn bar."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console


@contextlib.contextmanager
def progress(
    label: str, unit: str, console: Console, log_quarters: bool = False
) -> Iterator[Callable[[int, int], None]]:
    """Yields ``on_progress(done, total)`` for the work inside the block."""
    if console.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} " + unit),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task(label, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    started = time.perf_counter()
    quarters = [0]

    def log(done: int, total: int) -> None:
        if log_quarters and total and done * 4 // total > quarters[0]:
            quarters[0] = done * 4 // total
            elapsed = time.perf_counter() - started
            console.print(f"{label}: {done}/{total} {unit}, {elapsed:.1f} s")

    yield log
