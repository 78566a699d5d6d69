"""Output files written whole or not at all: the one way every command writes a file.

A command that fails half-way (a hostile input found late, a full disk, Ctrl-C) must not
leave a truncated file behind, nor destroy the good file an earlier run wrote there. So
the content goes to a temporary file beside the target (same folder, so the same file
system) and is renamed over the target only once it is complete and flushed; on any
failure the temporary file is removed and the target is as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from knapformer.errors import file_error


@contextlib.contextmanager
def output_file(path: str | os.PathLike, binary: bool = False) -> Iterator[IO[Any]]:
    """A new file to write ``path``'s content into (text in UTF-8, or ``binary``); it
    becomes ``path`` when the block ends without an exception, and disappears otherwise.

    A target that cannot be written (no such folder, no permission) is a
    `KnapformerError` naming it, before anything is written."""
    target = Path(path)
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name[:64]}.", dir=target.parent)
    except OSError as err:
        raise file_error(target, err, "cannot write") from err
    try:
        _permissions_of_a_new_file(fd)
        handle = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.replace(temporary, target)
        except OSError as err:  # a folder of that name, a read-only folder entry
            raise file_error(target, err, "cannot write") from err
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _permissions_of_a_new_file(fd: int) -> None:
    """What ``open(path, "w")`` would give the file (mkstemp makes it private): read and
    write for everyone the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)
