"""The error type commands raise for problems the user can fix."""

from __future__ import annotations


class UserError(Exception):
    """Printed as one line ``error: ...``; the process exits with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code
