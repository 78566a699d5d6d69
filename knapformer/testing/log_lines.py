"""The messages a logger emits in a worker process, kept for the test process to check."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Keeps every message of INFO and above, in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        """The messages kept so far; the next call starts afresh."""
        lines, self.lines = self.lines, []
        return lines


def capture(logger: str) -> LogLines:
    """A `LogLines` on ``logger``, which is set to log INFO."""
    lines = LogLines()
    logging.getLogger(logger).addHandler(lines)
    logging.getLogger(logger).setLevel(logging.INFO)
    return lines
