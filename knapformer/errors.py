"""The library's own error types for mistakes a user can fix.

Raised for bad input (a topology string, a plan file, a tensor shape, a world size that
does not fit, an option out of range, a file that cannot be read). They subclass
``ValueError`` so existing ``except ValueError`` code keeps working. The command line
prints these as one line and exits 1; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# An option named in an `OptionError` message: `name`.
_OPTION = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


class KnapformerError(ValueError):
    """A user error; ``str()`` is a one-line message naming the offending value."""


class OptionError(KnapformerError):
    """A bad value of an option: a function argument that a command exposes as a flag.

    The message names each option between backquotes, e.g. "`dim` 12 must be a multiple
    of `heads` 8". ``str()`` shows the plain names ("dim 12 must be ..."); the command
    line shows its own flags through `with_flags` ("--dim 12 must be ..."), so library
    messages never assume how they are called.
    """

    def __init__(self, message: str):
        self.template = message
        super().__init__(self.with_flags({}))

    @property
    def options(self) -> list[str]:
        """The option names the message mentions, in order."""
        return _OPTION.findall(self.template)

    def with_flags(self, flags: Mapping[str, str]) -> str:
        """The message with each option shown as ``flags[name]`` (its name when absent)."""
        return _OPTION.sub(lambda m: flags.get(m.group(1), m.group(1)), self.template)


class CollectiveFailure(KnapformerError):
    """A collective of the balancer failed or timed out; the message names the step, the
    phase, the bag and the ranks to blame (``culprits``: their global ranks, possibly
    none found), e.g. ``step 3, pre_attn of bag 1 (ranks 2, 3): rank 3 never entered it
    (last seen: route, step 3, 20.1 s ago)``. Raised by every surviving rank
    (`knapformer.runtime.roll_call`); the backend's own error is its ``__cause__``."""

    def __init__(self, message: str, culprits: list[int] | None = None) -> None:
        super().__init__(message)
        self.culprits = list(culprits or [])

    def __reduce__(self):  # picklable with its culprits (the launcher passes it on)
        return (type(self), (str(self), self.culprits))


class MissingExtraError(KnapformerError):
    """A reader needs an optional extra that is not installed."""

    def __init__(self, extra: str, what: str, missing: str):
        super().__init__(
            f"{what} needs the '{extra}' extra ({missing} is not installed): "
            f"pip install 'knapformer[{extra}]'"
        )
        self.extra = extra


def file_error(path: object, err: OSError, doing: str = "cannot read") -> KnapformerError:
    """A one-line user error for an OSError on a file the user named: ``PATH: cannot
    read: No such file or directory``. Raise it ``from err``."""
    reason = err.strerror or type(err).__name__
    return KnapformerError(f"{path}: {doing}: {reason}")
