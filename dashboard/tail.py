"""Incremental reader of a JSONL file that is still being written.

Each `poll` reads only bytes not seen before and returns the complete lines among them
with their byte offsets (so a record can be re-read later without keeping it in memory).
It copes with what a recorder and the tools around it do to such a file:

- a partial last line (the writer is mid-record): left for the next poll;
- truncation (the file shrinks below what was read), or a rewrite in place that grew
  past it between two polls (its first bytes changed): reading restarts at byte 0;
- rotation (``plans.jsonl`` renamed to ``plans.1.jsonl`` and a new ``plans.jsonl``
  started): the rest of the old file is drained through the still-open handle, then the
  new file is read from its start; the old file stays open so earlier records remain
  readable by ``read_record``. Whether the new file continues the run (a rotation by
  size) or starts another (a re-run moves the old recording aside the same way) is for
  the reader of the records to tell: the new file is a new ``generation``;
- the file missing, removed or replaced by another while open: reported once; the file
  that takes its place is a new file (``replaced``: none of the old lines belong to it),
  read from its start;
- only regular files are read, checked at every open: a symbolic link (to ``/dev/zero``,
  to ``/etc/passwd``) or a device, FIFO or folder put in the file's place is reported
  once (``refused``) and not opened; reading resumes when a regular file is back. (A
  link the user names on the command line is resolved before following starts:
  `dashboard.store.Runs`.)
- a last line that never ends (or a huge one): bytes after the last newline are scanned
  once, not on every poll, and not kept in memory; a line longer than `MAX_LINE_BYTES`
  is reported (``TailLine.too_long``) instead of read.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from knapformer.contract.plan_io import file_kind

_CHUNK = 1 << 20
#: Longest line read into memory. A plan of a 4096-GPU step is a few MB; anything much
#: longer is not a plan the dashboard could draw.
MAX_LINE_BYTES = 64 << 20
_KEEP_GENERATIONS = 16  # rotated files kept open for re-reading records
_HEAD_BYTES = 64  # compared on every poll to notice a file rewritten in place


@dataclass(frozen=True, slots=True)
class TailLine:
    number: int  # 1-based line number within its file generation
    offset: int  # byte offset of the line's start
    length: int  # bytes, without the newline
    generation: int  # which file (0 = the first one opened; +1 per rotation/truncation)
    text: str  # "" when too_long
    too_long: bool = False  # longer than MAX_LINE_BYTES: skipped, not read


@dataclass(frozen=True, slots=True)
class TailEvent:
    """What happened to the file: ``kind`` is one of missing, refused, appeared,
    truncated, rotated, removed, replaced."""

    kind: str
    message: str
    generation: int = 0  # the generation the file is in after the event


#: Events after which the lines read belong to a new file whose start is unrelated to
#: what was read before (the old lines are another run, or the same lines again).
NEW_FILE = ("truncated", "replaced")


@dataclass
class TailBatch:
    lines: list[TailLine] = field(default_factory=list)
    events: list[TailEvent] = field(default_factory=list)
    more: bool = False  # stopped at max_bytes: poll again right away


class JsonlTail:
    """Follows one path. One thread polls; others may call `read_record` at the same time
    (a lock keeps a rotation from closing a handle under a concurrent read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.generation = 0
        self.offset = 0  # bytes consumed: end of the last complete line
        self.line = 0  # complete lines consumed in this generation
        self._scanned = 0  # the bytes from offset to here hold no newline (a partial line)
        self._file = None  # binary handle of the current generation
        self._inode: int | None = None
        self._head = b""  # the file's first bytes as read (see `_unchanged`)
        self._absent: str | None = None  # why no file is open, as last reported
        self._had_file = False  # a file was opened before (a new one is a replacement)
        self._rotated = False  # the last file left by rotation (the next one may continue it)
        self._old: dict[int, object] = {}  # generation -> open handle of a rotated file
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ polling
    def poll(self, max_bytes: int | None = None) -> TailBatch:
        """New complete lines since the last poll (at most about ``max_bytes`` of them)."""
        with self._lock:
            return self._poll(max_bytes)

    def _poll(self, max_bytes: int | None) -> TailBatch:
        batch = TailBatch()
        try:
            st = os.lstat(self.path)  # a link put in the file's place is another file
        except FileNotFoundError:
            st = None
        except OSError as err:
            self._report_absent(batch, "missing", f"cannot read {self.path}: {err.strerror}")
            return batch

        if self._file is None:
            if st is None:
                self._report_absent(batch, "missing", f"{self.path} does not exist yet")
                return batch
            if not self._open(batch):
                return batch
        elif st is None or st.st_ino != self._inode:
            # Renamed away, deleted or replaced: finish what the old handle still holds.
            self._read(batch, None)
            self._leave(batch, st is not None)
            if st is None:
                self._absent = f"{self.path} does not exist yet"  # said: "removed"
                return batch
            if not self._open(batch):
                return batch
        elif st.st_size < self.offset:
            self._restart(
                batch,
                f"{self.path.name} was truncated to {st.st_size} bytes (had read "
                f"{self.offset}, {self.line} lines); reading it again from the start",
            )
        elif not self._unchanged():
            self._restart(
                batch,
                f"{self.path.name} was rewritten since line {self.line} was read (its start "
                "changed); reading it again from the start",
            )
        if st is not None and st.st_size < self._scanned:
            self._scanned = self.offset  # the partial line was cut short: scan it again
        self._read(batch, max_bytes)
        return batch

    def _leave(self, batch: TailBatch, replaced: bool) -> None:
        """The followed file is no longer at the path: say where it went, keep its handle
        for `read_record`, and start a new generation."""
        where = _rotated_name(self.path, self._inode)
        if where is not None:
            kind, message = "rotated", f"{self.path.name} was rotated to {where.name}"
        elif replaced:
            kind, message = "removed", f"{self.path.name} was replaced by another file"
        else:
            kind, message = "removed", f"{self.path} was removed"
        self._retire()
        event = TailEvent(kind, f"{message} after line {self.line}", self.generation)
        batch.events.append(event)
        self._rotated = where is not None

    def _report_absent(self, batch: TailBatch, kind: str, message: str) -> None:
        """Say why no file is read, once per reason."""
        if self._absent != message:
            batch.events.append(TailEvent(kind, message, self.generation))
            self._absent = message

    def _unchanged(self) -> bool:
        """Whether what was read is still there: a file truncated and written past the read
        offset between two polls is not smaller, but its first bytes (a plan's step and
        time) and the newline before the offset are unlikely to have survived."""
        if self.offset == 0:
            return True
        fd = self._file.fileno()
        head = os.pread(fd, len(self._head), 0)
        return head == self._head and os.pread(fd, 1, self.offset - 1) == b"\n"

    def _restart(self, batch: TailBatch, message: str) -> None:
        """The same file, new content: a new generation read from byte 0."""
        self.generation += 1
        batch.events.append(TailEvent("truncated", message, self.generation))
        self.offset = 0
        self.line = 0
        self._scanned = 0
        self._head = b""

    def read_record(self, generation: int, offset: int, length: int) -> str:
        """Re-read one line returned earlier (from the live or a rotated file)."""
        with self._lock:
            return self._read_record(generation, offset, length)

    def _read_record(self, generation: int, offset: int, length: int) -> str:
        handle = self._file if generation == self.generation else self._old.get(generation)
        if handle is None:
            raise OSError(
                f"the file holding that record ({self.path}, generation {generation}) "
                "is no longer available"
            )
        data = os.pread(handle.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"{self.path}: record at byte {offset} is no longer in the file")
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        with self._lock:
            for handle in [self._file, *self._old.values()]:
                if handle is not None:
                    handle.close()
            self._file = None
            self._old.clear()

    # ---------------------------------------------------------------- internals
    def _open(self, batch: TailBatch) -> bool:
        """Open the file at the path if it is a regular file (not a link, a device, a FIFO
        or a folder: each is reported once and left unopened)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as err:
            if err.errno == errno.ELOOP:
                self._report_absent(
                    batch, "refused", _refusal(self.path, f"a symbolic link{_target(self.path)}")
                )
            else:
                self._report_absent(batch, "missing", f"cannot open {self.path}: {err.strerror}")
            return False
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            self._report_absent(batch, "refused", _refusal(self.path, file_kind(mode)))
            return False
        self._file = os.fdopen(fd, "rb")
        self._inode = os.fstat(fd).st_ino
        self.offset = 0
        self.line = 0
        self._scanned = 0
        self._head = b""
        if self._had_file and not self._rotated:
            message = f"{self.path.name} is a new file; reading it from its start"
            batch.events.append(TailEvent("replaced", message, self.generation))
        elif self._absent is not None:
            batch.events.append(TailEvent("appeared", f"{self.path} appeared", self.generation))
        self._absent, self._had_file, self._rotated = None, True, False
        return True

    def _retire(self) -> None:
        """Keep the old handle for `read_record`; start a new generation."""
        self._old[self.generation] = self._file
        while len(self._old) > _KEEP_GENERATIONS:
            self._old.pop(min(self._old)).close()
        self._file = None
        self._inode = None
        self.generation += 1

    def _read(self, batch: TailBatch, max_bytes: int | None) -> None:
        """Complete lines after ``offset``, reading at most about ``max_bytes``; bytes of a
        partial last line are scanned once (``_scanned``), then re-read whole only when
        its newline arrives."""
        fd = self._file.fileno()
        budget = max_bytes if max_bytes is not None else float("inf")
        pos = max(self._scanned, self.offset)
        while budget > 0:
            data = os.pread(fd, int(min(_CHUNK, budget)), pos)
            if not data:
                self._scanned = pos
                return
            budget -= len(data)
            cut = data.rfind(b"\n")
            before, pos = pos - self.offset, pos + len(data)
            if cut < 0:  # a line longer than one read, or a partial last line
                continue
            # The bytes after the last newline stay scanned; the line they begin is read
            # whole (`before`) when its newline comes.
            self._take_lines(batch, fd, data[:cut], before)
            if len(self._head) < _HEAD_BYTES:
                self._head = os.pread(fd, min(_HEAD_BYTES, self.offset), 0)
        self._scanned = pos
        batch.more = True

    def _take_lines(self, batch: TailBatch, fd: int, data: bytes, before: int) -> None:
        """The complete lines of ``data`` (read at ``offset + before``, ending just before
        a newline); the first one began ``before`` bytes earlier, in an earlier read."""
        first, _, rest = data.partition(b"\n")
        length = before + len(first)
        if before and length > MAX_LINE_BYTES:
            self._line(batch, None, length)
        else:
            self._line(batch, os.pread(fd, before, self.offset) + first if before else first)
        if len(first) < len(data):
            for raw in rest.split(b"\n"):
                self._line(batch, raw)

    def _line(self, batch: TailBatch, raw: bytes | None, length: int | None = None) -> None:
        """Record the line at ``offset`` (``raw`` None: too long to read) and move past it."""
        self.line += 1
        if raw is None:
            batch.lines.append(
                TailLine(self.line, self.offset, length, self.generation, "", too_long=True)
            )
        else:
            length = len(raw)
            text = raw.decode("utf-8", errors="replace").rstrip("\r")
            if text.strip():
                batch.lines.append(TailLine(self.line, self.offset, length, self.generation, text))
        self.offset += length + 1


def _refusal(path: Path, what: str) -> str:
    return (
        f"{path} is {what}: the dashboard reads regular files only; waiting for a regular "
        "file there"
    )


def _target(path: Path) -> str:
    """`` (to TARGET)`` for a symbolic link, shortened; empty when unreadable."""
    try:
        target = os.readlink(path)
    except OSError:
        return ""
    return f" (to {target[:200]})"


def _rotated_name(path: Path, inode: int | None) -> Path | None:
    """The sibling (e.g. ``plans.1.jsonl``) that now holds the file with ``inode``."""
    if inode is None or not path.parent.is_dir():
        return None
    for sibling in path.parent.iterdir():
        try:
            if sibling != path and sibling.lstat().st_ino == inode:
                return sibling
        except OSError:
            continue
    return None
