"""`PlanFile`: the recorder's append-only JSONL file, written by its writer thread only.

Guarantees (each one tested in ``tests/test_recorder.py``):

- Each plan is one line handed to the kernel in one ``writev`` call (its pieces gathered
  by the kernel; no user-space buffer), so a reader tailing the file sees whole lines,
  except possibly the last one while it is being written or after the process was killed.
- A file that ends in a partial line (a writer killed mid-line, a full disk) is
  terminated with a newline before the first append, with one warning: the partial line
  stays one bad line that readers report, and the next plan starts a line of its own.
- One run per file: when the file already holds plans and the first plan appended has a
  step at or below the file's last step (a re-run whose steps restart), the earlier
  recording is moved aside as a rotated copy (``plans.1.jsonl``; deleted with
  ``backups=0``) with one warning, and the run starts a new file. A run resumed from a
  checkpoint, whose steps go on, appends.
- Size-based rotation: when ``plans.jsonl`` would grow past ``max_bytes`` it is renamed
  to ``plans.1.jsonl`` (older files shift to ``.2``, ``.3``, ...; at most ``backups``
  are kept, and numbered files beyond that, e.g. left by a run that kept more, are
  deleted) and a new ``plans.jsonl`` is started.
- Before each append the open file is checked against the path (two ``stat`` calls). If
  the file was removed, moved or replaced, one warning and a new file at the path; if
  its directory was removed, `FolderGone` (the recorder turns itself off). Nothing is
  written into a deleted file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from knapformer.contract.runfiles import rotated_copies, rotated_file

# Its warnings are the recorder's: a user silences or collects them under that name.
log = logging.getLogger("knapformer.runtime.recorder")

try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, ValueError, OSError):  # pragma: no cover — not POSIX
    _IOV_MAX = 16

_STEP_KEY = re.compile(rb'"step":\s*(-?\d{1,20})[,}]')
_STEP_SCAN_BYTES = 64 << 20  # give up finding the last line's start beyond this


class FolderGone(OSError):
    """The file's folder was removed while recording (the message says which)."""


class PlanFile:
    """Append whole lines to ``path`` (opened at the first `append`), rotating it past
    ``max_bytes`` (``None``: never) and keeping ``backups`` rotated copies."""

    def __init__(self, path: Path, *, max_bytes: int | None, backups: int):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd: int | None = None
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the open file
        self._size = 0
        self._partial_warned = False

    def append(self, pieces: list[bytes], step: int | None = None) -> None:
        """Append one line (``pieces`` end with its newline), of the plan of ``step``.
        Raises `FolderGone` when the file's folder was removed, `OSError` on any other
        I/O error."""
        if self._fd is not None:
            self._follow_path()
        size = sum(map(len, pieces))
        if self._fd is None:
            self._open(step)
        elif self.max_bytes is not None and self._size and self._size + size > self.max_bytes:
            self._rotate()
        if len(pieces) > _IOV_MAX:  # writev takes at most this many buffers
            per = -(-len(pieces) // _IOV_MAX)
            pieces = [b"".join(pieces[i : i + per]) for i in range(0, len(pieces), per)]
        # One call for the whole line, gathered by the kernel (without the GIL) rather
        # than joined here; loop only if the kernel took part of it.
        n = os.writev(self._fd, pieces)
        self._size += n
        if n < size:
            rest = memoryview(b"".join(pieces))[n:]
            while rest:
                n = os.write(self._fd, rest)
                rest = rest[n:]
                self._size += n

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._file_id = None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open(self, first_step: int | None) -> None:
        """Open the file for the first plan, of step ``first_step``: a file whose last step
        is not below it holds another run, which is moved aside (one warning)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open_plain()
        last = _last_step(self._fd, self._size) if self._size else None
        if first_step is None or last is None or first_step > last:
            return
        aside = (
            "deleted (backups=0)" if self.backups == 0 else f"moved to {rotated_file(self.path, 1)}"
        )
        log.warning(
            "PlanRecorder: %s holds an earlier recording up to step %d and this run starts at "
            "step %d; the earlier recording was %s so that two runs never mix in one file "
            "(a run resumed from a checkpoint, whose steps go on, appends)",
            self.path,
            last,
            first_step,
            aside,
        )
        self._rotate()

    def _open_plain(self) -> None:
        """Open the path for appending without creating its directory: if that was removed,
        it is an I/O error, not something to recreate behind the user's back. A file that
        ends in a partial line gets a newline first (one warning per file)."""
        # Read access too: the end of an existing file is looked at (`_last_step`).
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        st = os.fstat(self._fd)
        self._file_id = (st.st_dev, st.st_ino)
        self._size = st.st_size
        if self._size and os.pread(self._fd, 1, self._size - 1) != b"\n":
            self._size += os.write(self._fd, b"\n")
            if not self._partial_warned:
                self._partial_warned = True
                log.warning(
                    "PlanRecorder: %s ended in a partial line (a writer killed mid-line, or a "
                    "full disk); it was ended with a newline so the next plan starts a line "
                    "of its own (readers report the partial line as one bad record)",
                    self.path,
                )

    def _follow_path(self) -> None:
        """Before each append (two stats: microseconds next to serialising a plan), check
        that the open file is still the one at the path. If its directory was removed,
        `FolderGone`; if the file was removed, moved or replaced, one warning and a new
        file at the path, where the user and the dashboard look."""
        try:
            st = os.stat(self.path)
            here = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            here = None
        if here == self._file_id:
            return
        linked = os.fstat(self._fd).st_nlink > 0
        self.close()
        if not self.path.parent.is_dir():
            raise FolderGone(f"{self.path} was removed while recording (its directory is gone)")
        what = "moved or replaced" if linked else "removed"
        log.warning(
            "PlanRecorder: %s was %s while recording; later plans go to a new file there",
            self.path,
            what,
        )
        self._open_plain()

    def _rotate(self) -> None:
        """Shift the rotated copies up by one, the file to ``.1``, and start a new file."""
        self.close()
        path = self.path
        _remove_backups_beyond(path, self.backups)  # e.g. left by a run that kept more
        if self.backups == 0:
            os.unlink(path)
        else:
            last = rotated_file(path, self.backups)
            if last.exists():
                os.unlink(last)
            for k in range(self.backups - 1, 0, -1):
                older = rotated_file(path, k)
                if older.exists():
                    os.replace(older, rotated_file(path, k + 1))
            os.replace(path, rotated_file(path, 1))
        self._open_plain()


def _remove_backups_beyond(path: Path, keep: int) -> None:
    """Delete ``plans.<k>.jsonl`` for every k > ``keep`` (rotation shifts only 1..keep)."""
    for k, copy in rotated_copies(path).items():
        if k > keep:
            with contextlib.suppress(FileNotFoundError):
                copy.unlink()


def _last_step(fd: int, size: int) -> int | None:
    """The ``step`` of the last line of the open file ``fd`` of ``size`` bytes (None when
    that line has none, or is not found): our writer puts it near the line's start."""
    end = size
    while end > 0 and os.pread(fd, 1, end - 1) in (b"\n", b"\r", b" "):
        end -= 1
    start, pos = 0, end
    while pos > 0 and end - pos < _STEP_SCAN_BYTES:
        begin = max(0, pos - (1 << 20))
        found = os.pread(fd, pos - begin, begin).rfind(b"\n")
        if found >= 0:
            start = begin + found + 1
            break
        pos = begin
    else:
        if pos > 0:
            return None
    match = _STEP_KEY.search(os.pread(fd, min(512, end - start), start))
    return None if match is None else int(match.group(1))
