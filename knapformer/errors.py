"""The library's own error type for mistakes a user can fix.

Raised for bad input (a topology string, a plan file, a tensor shape, a world size that
does not fit, an option out of range). It subclasses ``ValueError`` so existing
``except ValueError`` code keeps working. The command line prints these as one line and
exits 1; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class KnapformerError(ValueError):
    """A user error; ``str()`` is a one-line message naming the offending value."""


class MissingExtraError(KnapformerError):
    """A reader needs an optional extra that is not installed."""

    def __init__(self, extra: str, what: str, missing: str):
        super().__init__(
            f"{what} needs the '{extra}' extra ({missing} is not installed): "
            f"pip install 'knapformer[{extra}]'"
        )
        self.extra = extra
