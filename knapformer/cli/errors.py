"""The error type commands raise for problems the user can fix, and the check of text
options that raises it."""

from __future__ import annotations


class UserError(Exception):
    """Printed as one line ``error: ...``; the process exits with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def text_option(value: str | None, flag: str) -> str | None:
    """``value`` of a text option (not a path) once it is UTF-8 text; a `UserError` naming
    ``flag`` when the command line gave bytes that are not (Python keeps them as
    surrogates, which no text output can show)."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise UserError(f"{flag} '{shown}' is not valid UTF-8 text") from None
    return value
