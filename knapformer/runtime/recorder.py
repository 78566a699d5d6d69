"""`PlanRecorder`: write routing plans to JSONL while training, safely enough to leave on.

Guarantees (each one tested in ``tests/test_recorder*.py``):

- Only the writing rank writes: by default the first rank of each balance group. Other
  ranks never serialise a plan, open a file or start a thread.
- The training thread only enqueues the plan object. Serialisation and file I/O run on a
  background thread, which builds the JSON line piecewise (`json_line_pieces`) and lets
  go of the GIL every ~16 KiB, so a multi-MB plan never holds the training thread up for
  more than a fraction of a millisecond at a time. The queue is bounded; when it is full
  the plan is dropped and counted (``dropped``), never waited for.
- Append-only JSONL: each plan is one line handed to the kernel in one ``writev`` call
  (its pieces gathered by the kernel; no user-space buffer), so a reader tailing the
  file sees whole lines, except possibly
  the last one while it is being written or after the process was killed.
- Every written line is a plan every reader accepts: a non-finite measured time (inf,
  nan: JSON has neither) is left out of the written plan, with one warning per recorder
  (counted in ``dropped_times``). The writer thread then validates the plan as a reader
  will (the contract's own validation: `RoutingPlan` with its invariants; the training
  thread still validates nothing); a plan it refuses is not written, is counted in
  ``refused`` and the first one is named in one warning.
- Exact counts: ``record()`` returns True only for a plan that is then written, or
  counted in ``failed`` (could not be serialised), ``refused`` (invalid) or ``lost`` (the
  recorder was disabled by an I/O error, or ``close()`` timed out, before its turn). A
  ``record()`` racing ``close()`` either queues before the writer's last item or returns
  False.
- A file that ends in a partial line (a writer killed mid-line, a full disk) is
  terminated with a newline before the first append, with one warning: the partial line
  stays one bad line that readers report, and the next plan starts a line of its own.
- One run per file: when the file already holds plans and the first plan this recorder
  writes has a step at or below the file's last step (a re-run whose steps restart), the
  earlier recording is moved aside as a rotated copy (``plans.1.jsonl``; deleted with
  ``backups=0``) with one warning, and the run starts a new file. A run resumed from a
  checkpoint, whose steps go on, appends.
- Size-based rotation: when ``plans.jsonl`` would grow past ``max_bytes`` it is renamed
  to ``plans.1.jsonl`` (older files shift to ``.2``, ``.3``, ...; at most ``backups``
  are kept, and numbered files beyond that, e.g. left by a run that kept more, are
  deleted) and a new ``plans.jsonl`` is started.
- Before each write the open file is checked against the path (two ``stat`` calls). If
  the file was removed, moved or replaced, one warning and a new file at the path; if
  its directory was removed, one warning and the recorder turns itself off. Any other
  I/O error (disk full, permissions) logs one warning and disables the recorder; training
  goes on. Nothing is written into a deleted file.
- The path may hold ``{group}`` (the balance group's index) and no other placeholder:
  ``{date}`` or ``{}`` is refused when the recorder is made, not at the first write.
- ``close()`` flushes the queue; a recorder is a context manager and is closed at
  interpreter exit.
- With ``tensorboard_dir``, the writer thread also writes each written plan's per-step
  scalars (`knapformer.contract.scalars`) to TensorBoard, live; never on the training thread. A
  failure there logs one warning and stops the TensorBoard logging only.

- The run store (``store=True``, the default): every step's plan, whatever ``every``
  says, also goes to a `StoreWriter` (``<run>/store/``, Parquet: one row per rank per
  step, one per step) on a thread of its own; ``record()`` only queues it there too
  (its return value still says whether the JSONL will have it), after the JSONL queue,
  with whether the line was queued: the store's ``full_plan`` says what reached the file
  (the writer thread also tells the store of a queued line it could not write). The
  store's thread hands back for the JSONL a step whose line was not queued (outside
  ``every``, or dropped from a full queue) that a reader must be able to open in full
  (`knapformer.runtime.store_rows.worth_keeping`; the first of each window of ``every``
  steps): such a line may follow the line of a later step when the store's thread lags.
  ``close()`` drains the store first (the plans it keeps in full reach the JSONL's
  queue) and closes it last (after the JSONL writer's word on every line).

A plain sink: it never reads the balancer, runs no collective and times nothing. With a
balancer (``SequenceBalancer(..., recorder=PlanRecorder(path))``) the balancer hands it
each plan it `wants` once every rank's measured times of that step are attached
(`knapformer.runtime.balancer`: they travel with the lengths of a later step, and
``balancer.finish()`` gathers the last ones); without one, ``record(plan)`` queues any
plan as it is.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from knapformer.contract.plan import Measurements, RoutingPlan
from knapformer.contract.plan_io import describe_validation_error, json_line_pieces
from knapformer.contract.run_store import store_folder
from knapformer.contract.runfiles import GROUP_TEMPLATE, group_file, rotated_copies, rotated_file
from knapformer.errors import KnapformerError, MissingExtraError
from knapformer.runtime.store_writer import StoreWriter

log = logging.getLogger(__name__)

_STOP = object()  # queue sentinel: the writer thread exits after draining what precedes it
# JSON written between two releases of the GIL by the writer thread: ~0.2 ms of work.
# (A release costs a system call, up to 0.1 ms on a busy machine: not after every piece.)
_YIELD_BYTES = 16 << 10
try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, ValueError, OSError):  # pragma: no cover — not POSIX
    _IOV_MAX = 16

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


class PlanRecorder:
    """Record routing plans to an append-only JSONL file from a background thread.

    Args:
        path: the JSONL file (its directory is created). With several balance groups in
            the world, each group's writer needs its own file: put ``{group}`` in the
            path (replaced by the group index), otherwise group k > 0 writes to
            ``<stem>.group<k><suffix>`` next to it. Any other ``{...}`` placeholder is
            refused (`KnapformerError`); a lone brace is taken literally.
        every: record the plans of steps divisible by ``every`` (by ``plan.step``; a
            plan without a step number counts the calls to `record`).
        writer: position, within the balance group, of the rank that writes (0 = first).
        queue_size: plans waiting for the writer thread before new ones are dropped.
        max_bytes: rotate when the file would grow past this size (``None``: never).
        backups: rotated files kept (``plans.1.jsonl`` ... ``plans.<backups>.jsonl``).
        enabled: ``False`` makes every call a no-op.
        tensorboard_dir: also log every written plan's scalars to TensorBoard there (a
            folder; ``{group}`` and the ``.group<k>`` rule as for ``path``); needs the
            ``tensorboard`` extra (`MissingExtraError` here when it is missing).
        store: also write every step to the run store beside the file (`store_folder`:
            ``store/``, group k ``store.group<k>/``); ``every`` then thins the full plans
            only. ``store_segment_steps`` / ``store_segment_seconds``: when a segment
            closes (`StoreWriter`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        every: int = 1,
        *,
        writer: int = 0,
        queue_size: int = 64,
        max_bytes: int | None = 256 * 1024 * 1024,
        backups: int = 5,
        enabled: bool = True,
        tensorboard_dir: str | os.PathLike | None = None,
        store: bool = True,
        store_segment_steps: int = 256,
        store_segment_seconds: float = 60.0,
    ):
        if int(every) < 1:
            raise KnapformerError(f"every must be a positive number of steps, got {every}")
        if int(writer) < 0:
            raise KnapformerError(f"writer must be a rank position >= 0, got {writer}")
        if int(queue_size) < 1:
            raise KnapformerError(f"queue_size must be >= 1, got {queue_size}")
        if max_bytes is not None and int(max_bytes) <= 0:
            raise KnapformerError(f"max_bytes must be positive or None, got {max_bytes}")
        if int(backups) < 0:
            raise KnapformerError(f"backups must be >= 0, got {backups}")
        _check_placeholders(str(path))
        if tensorboard_dir is not None:
            _check_placeholders(str(tensorboard_dir))
            if importlib.util.find_spec("tensorboard") is None:
                what = "PlanRecorder(tensorboard_dir=...)"
                raise MissingExtraError("tensorboard", what, "tensorboard")
        self.path = Path(path)
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir)
        #: plans whose scalars went to TensorBoard (updated by the writer thread)
        self.tensorboard_written = 0
        self._tensorboard_path: Path | None = None  # this process's TensorBoard folder
        self._tensorboard: Any = None  # its writer, opened by the writer thread
        self.every = int(every)
        self.writer = int(writer)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.backups = int(backups)
        self.enabled = bool(enabled)
        #: plans queued and then dropped because the queue was full
        self.dropped = 0
        #: plans written to disk (updated by the writer thread)
        self.written = 0
        #: plans the writer could not serialise (skipped; the recorder stays on)
        self.failed = 0
        #: plans the writer refused because a reader would refuse them (not written)
        self.refused = 0
        #: plans queued but not written because the recorder was disabled or close() timed out
        self.lost = 0
        self._partial_warned = False
        self.file_path: Path | None = None  # the file this process writes, once known
        self._queue: queue.Queue = queue.Queue(maxsize=int(queue_size))
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards starting the thread / closing
        self._closed = False
        self._disabled_reason: str | None = None
        self._fd: int | None = None
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the open file
        self._size = 0
        #: non-finite measured times left out of written plans (see `_finite_measurements`)
        self.dropped_times = 0
        self._calls = 0  # record() calls on plans without a step number
        self._pid = os.getpid()  # the writer thread exists only in this process
        self.store_wanted = bool(store)
        self._store_options = {
            "segment_steps": int(store_segment_steps),
            "segment_seconds": float(store_segment_seconds),
        }
        #: the run store's writer, made at the first plan (None: no store)
        self.store: StoreWriter | None = None

    # ----------------------------------------------------------------- public API
    @property
    def active(self) -> bool:
        """Whether plans are still being recorded (not closed, disabled or turned off)."""
        return self.enabled and not self._closed and self._disabled_reason is None

    @property
    def disabled_reason(self) -> str | None:
        """Why the recorder switched itself off after an I/O error (``None`` if it did not)."""
        return self._disabled_reason

    def wants(self, plan: RoutingPlan) -> bool:
        """Whether `record` would queue ``plan`` (with a step number): recording, its step
        due (``plan.step % every == 0``) and this process the writing rank of the plan's
        group. A balancer holds back for their measurements only the plans it wants."""
        if not self.active or self._pid != os.getpid():
            return False
        if plan.step is not None and plan.step % self.every and not self.store_wanted:
            return False
        return self._writes(plan)

    def record(self, plan: RoutingPlan) -> bool:
        """Queue ``plan`` for writing; returns whether it was queued for the JSONL.

        Never blocks: a full queue drops the plan (counted in ``dropped``). In a process
        group, only the writing rank of the plan's group (``plan.gpus[writer]``) records.
        Plans without a step number count the calls for ``every``. With the store, every
        plan with a step number is queued for it too (the module doc).
        """
        if plan.step is not None:
            if not self.wants(plan):
                return False
            # the line first: the store's row says whether it was queued (`full_plan`)
            queued = plan.step % self.every == 0 and self._enqueue_line(plan)
            if self.store_wanted:
                self._to_store(plan, queued)
            return queued
        if not self.active or self._pid != os.getpid():
            return False
        due = self._calls % self.every == 0
        self._calls += 1
        return due and self._writes(plan) and self._enqueue_line(plan)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write everything queued, close the file and the store. Idempotent."""
        store = self.store if self._pid == os.getpid() else None
        if store is not None:
            store.drain(timeout)  # first: it may hand plans kept in full to the JSONL
        try:
            self._close_lines(timeout)
        finally:
            if store is not None:  # last: the JSONL writer's word on each line is in
                store.close(timeout)

    def _close_lines(self, timeout: float | None) -> None:
        """Write what the JSONL queue holds and close the file (`close`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._at_exit)
        if self._thread is not None and self._pid == os.getpid():
            # Bounded: a writer stuck on a hung file system must not hang the job's exit.
            began = time.monotonic()
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                self.lost += self._queue.qsize()
                log.warning("PlanRecorder could not flush %s in %s s", self.file_path, timeout)
            else:
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
                self._thread.join(left)
                if self._thread.is_alive():
                    self.lost += max(0, self._queue.qsize() - 1)  # without the stop item
                    log.warning("PlanRecorder could not flush %s in %s s", self.file_path, timeout)
        if self.dropped:
            log.warning(
                "PlanRecorder dropped %d plan(s) because the writer fell behind "
                "(queue of %d); record less often with every=k or raise queue_size",
                self.dropped,
                self._queue.maxsize,
            )

    def __enter__(self) -> PlanRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "active" if self.active else (self._disabled_reason or "closed")
        return (
            f"PlanRecorder({str(self.path)!r}, every={self.every}, written={self.written}, "
            f"dropped={self.dropped}, {state})"
        )

    # ------------------------------------------------------------ training thread
    def _enqueue_line(self, plan: RoutingPlan) -> bool:
        """Queue ``plan`` for the JSONL (this group's file, known from its first plan)."""
        if self.file_path is None and _dist_rank() is not None:
            self.file_path = self._group_path(plan.gpus)
            if self.tensorboard_dir is not None:
                self._tensorboard_path = self._group_path(plan.gpus, self.tensorboard_dir)
        return self._enqueue(plan)

    def _to_store(self, plan: RoutingPlan, queued: bool) -> bool:
        """Queue ``plan`` for the run store (made at the first plan: no I/O here), with
        whether its line was ``queued`` for the JSONL; the store's thread hands back to
        `_enqueue` a plan whose line was not queued, to keep in full."""
        if self.store is None:
            path = self.file_path or self.path
            if self.file_path is None and _dist_rank() is not None:
                path = self._group_path(plan.gpus)  # `record` sets file_path after this
            self.store = StoreWriter(
                store_folder(path),
                every=self.every,
                keep_full=self._enqueue,
                **self._store_options,
            )
            # a run whose plans all fall outside `every` never starts the JSONL thread,
            # which registers this otherwise: the store's open segment is flushed at exit
            atexit.register(self._at_exit)
        return self.store.put(plan, full=queued)

    def _enqueue(self, plan: RoutingPlan) -> bool:
        # Under the lock `close()` takes to set _closed: a plan is either queued before the
        # writer's stop item or refused here, never queued behind it (True, never written).
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._start_thread()
            elif self._pid != os.getpid():
                return False  # a forked child (e.g. a data-loader worker) has no writer thread
            try:
                self._queue.put_nowait(plan)
            except queue.Full:
                self.dropped += 1
                return False
            return True

    def _start_thread(self) -> None:
        """Start the writer thread (the caller holds ``_lock``)."""
        if self.file_path is None:
            self.file_path = self.path
        if self._tensorboard_path is None:
            self._tensorboard_path = self.tensorboard_dir
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=self._run, name="knapformer-plan-recorder", daemon=True
        )
        self._thread.start()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        self.close(timeout=10.0)

    def _writes(self, plan: RoutingPlan) -> bool:
        """Whether this process writes ``plan``'s group: any process outside a process
        group, else the rank at position ``writer`` of ``plan.gpus``."""
        rank = _dist_rank()
        return rank is None or (self.writer < len(plan.gpus) and plan.gpus[self.writer] == rank)

    def _group_path(self, group_ranks: list[int], path: Path | None = None) -> Path:
        """This group's file (or TensorBoard folder) for ``path`` (default: the plans
        file): groups are consecutive blocks of ranks, index = first // size."""
        return group_file(path or self.path, min(group_ranks) // len(group_ranks))

    # -------------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if not self._write_plan(item) and self.store is not None and item.step is not None:
                self.store.not_written(item.step)  # its row must not say it is in the file
        self._close_file()
        if self._tensorboard is not None:
            with contextlib.suppress(Exception):  # what it could not flush is lost, no more
                self._tensorboard.close()

    def _write_plan(self, item: RoutingPlan) -> bool:
        """Write one queued plan (writer thread); whether its line reached the file."""
        if self._disabled_reason is not None:
            self.lost += 1  # drain without writing
            return False
        plan = self._without_non_finite_times(item)
        problem = _reader_problem(plan)
        if problem is not None:
            self._refuse(plan, problem)
            return False
        try:
            data = self._serialize(plan)
        except Exception as err:  # a broken plan is skipped, the recorder stays on
            self.failed += 1
            log.warning("PlanRecorder skipped a plan it could not serialise: %s", err)
            return False
        try:
            written = self._write(data, plan.step)
        except OSError as err:
            self.lost += 1
            self._disable(err)
            return False
        if self._tensorboard_path is not None:
            self._log_scalars(item)
        return written

    def _refuse(self, plan: RoutingPlan, problem: str) -> None:
        """Count a plan no reader would accept; the first one is named in a warning."""
        if not self.refused:
            log.warning(
                "PlanRecorder did not write the plan of step %s, which readers would refuse: "
                "%s (later ones are not written either, without a warning; count in refused)",
                plan.step,
                problem,
            )
        self.refused += 1

    def _log_scalars(self, plan: RoutingPlan) -> None:
        """The plan's per-step scalars to TensorBoard (writer thread); on any failure one
        warning and no more TensorBoard logging (the JSONL goes on)."""
        from knapformer.contract.scalars import open_writer, write_step

        try:
            if self._tensorboard is None:
                self._tensorboard = open_writer(self._tensorboard_path)
            write_step(self._tensorboard, plan)
        except Exception as err:
            log.warning(
                "PlanRecorder stopped logging to TensorBoard at %s: %s",
                self._tensorboard_path,
                err,
            )
            self._tensorboard_path = None
            return
        self.tensorboard_written += 1

    def _serialize(self, plan: RoutingPlan) -> list[bytes]:
        """The plan's JSON line with its newline, in pieces: serialising a multi-MB plan in
        one call (or joining it into one buffer) would hold the GIL, and so stall the
        training thread, for many milliseconds."""
        pieces, since_yield = [], 0
        for piece in json_line_pieces(plan):
            pieces.append(piece)
            since_yield += len(piece)
            if since_yield >= _YIELD_BYTES:
                time.sleep(0)  # releases the GIL: a waiting training thread runs now
                since_yield = 0
        pieces.append(b"\n")
        return pieces

    def _without_non_finite_times(self, plan: RoutingPlan) -> RoutingPlan:
        """``plan``, or a copy without its non-finite measured times (JSON has no inf or
        nan: they would be written null, which no reader accepts as a time). The first
        plan that has some logs one warning; the caller's plan is left as it was."""
        measured = plan.measurements
        if measured is None:
            return plan
        kept, dropped = _finite_measurements(measured, plan.gpus)
        if not dropped:
            return plan
        if not self.dropped_times:
            log.warning(
                "PlanRecorder left non-finite measured time(s) out of the plan of step %s: "
                "%s (later ones are left out without a warning; count in dropped_times)",
                plan.step,
                "; ".join(dropped),
            )
        self.dropped_times += len(dropped)
        return plan.model_copy(update={"measurements": kept})

    def _write(self, pieces: list[bytes], step: int | None = None) -> bool:
        """Append one line; False when the file's folder is gone (the recorder is off)."""
        if self._fd is not None and not self._follow_path():
            self.lost += 1
            return False
        size = sum(map(len, pieces))
        if self._fd is None:
            self._open(step)
        elif self.max_bytes is not None and self._size and self._size + size > self.max_bytes:
            self._rotate()
        if len(pieces) > _IOV_MAX:  # writev takes at most this many buffers
            step = -(-len(pieces) // _IOV_MAX)
            pieces = [b"".join(pieces[i : i + step]) for i in range(0, len(pieces), step)]
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
        self.written += 1
        return True

    def _open(self, first_step: int | None) -> None:
        """Open the file for the first plan, of step ``first_step``: a file whose last step
        is not below it holds another run, which is moved aside (one warning)."""
        path = self.file_path or self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._open_plain(path)
        last = _last_step(self._fd, self._size) if self._size else None
        if first_step is None or last is None or first_step > last:
            return
        aside = "deleted (backups=0)" if self.backups == 0 else f"moved to {rotated_file(path, 1)}"
        log.warning(
            "PlanRecorder: %s holds an earlier recording up to step %d and this run starts at "
            "step %d; the earlier recording was %s so that two runs never mix in one file "
            "(a run resumed from a checkpoint, whose steps go on, appends)",
            path,
            last,
            first_step,
            aside,
        )
        self._rotate()

    def _open_plain(self, path: Path) -> None:
        """Open ``path`` for appending without creating its directory: if that was removed,
        it is an I/O error, not something to recreate behind the user's back. A file that
        ends in a partial line gets a newline first (one warning per recorder)."""
        # Read access too: the end of an existing file is looked at (`_last_step`).
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
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
                    path,
                )

    def _follow_path(self) -> bool:
        """Before each write (two stats: microseconds next to serialising a plan), check that
        the open file is still the one at the path; returns whether to write. If its
        directory was removed, the recorder turns itself off; if the file was removed,
        moved or replaced, it warns once and starts a new file at the path, where the user
        and the dashboard look."""
        path = self.file_path or self.path
        try:
            st = os.stat(path)
            here = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            here = None
        if here == self._file_id:
            return True
        linked = os.fstat(self._fd).st_nlink > 0
        self._close_file()
        if not path.parent.is_dir():
            self._disable_because(f"{path} was removed while recording (its directory is gone)")
            return False
        what = "moved or replaced" if linked else "removed"
        log.warning(
            "PlanRecorder: %s was %s while recording; later plans go to a new file there",
            path,
            what,
        )
        self._open_plain(path)
        return True

    def _rotate(self) -> None:
        self._close_file()
        path = self.file_path or self.path
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
        self._open_plain(path)

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._file_id = None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _disable(self, err: OSError) -> None:
        self._disable_because(f"I/O error on {self.file_path or self.path}: {err}")

    def _disable_because(self, reason: str) -> None:
        self._disabled_reason = reason
        log.warning("PlanRecorder disabled (training goes on): %s", reason)
        self._close_file()


def _reader_problem(plan: RoutingPlan) -> str | None:
    """Why a reader would refuse ``plan`` (None: it would read it), by the contract's own
    validation: `RoutingPlan` validated from the plan's fields as they are, columns
    included (no copy, no JSON; ~11 ms for 32,768 sequences on the writer thread)."""
    fields = {name: getattr(plan, name) for name in RoutingPlan.model_fields}
    for name in ("sequences", "chunks"):
        fields[name] = dict(vars(getattr(plan, name)))
    if plan.measurements is not None:
        fields["measurements"] = plan.measurements.model_dump()
    try:
        RoutingPlan.model_validate(fields)
    except ValidationError as err:
        return describe_validation_error(err)
    except Exception as err:  # a structure validation could not even look at
        return f"malformed plan ({type(err).__name__}: {err})"
    return None


_STEP_KEY = re.compile(rb'"step":\s*(-?\d{1,20})[,}]')
_STEP_SCAN_BYTES = 64 << 20  # give up finding the last line's start beyond this


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


def _remove_backups_beyond(path: Path, keep: int) -> None:
    """Delete ``plans.<k>.jsonl`` for every k > ``keep`` (rotation shifts only 1..keep)."""
    for k, copy in rotated_copies(path).items():
        if k > keep:
            with contextlib.suppress(FileNotFoundError):
                copy.unlink()


def _check_placeholders(path: str) -> None:
    """Refuse a path template with a placeholder other than ``{group}`` (it would be
    written literally, or fail later on the training thread); lone braces are literal."""
    unknown = [p for p in _PLACEHOLDER.findall(path) if p != GROUP_TEMPLATE]
    if unknown:
        raise KnapformerError(
            f"PlanRecorder path {path!r} has placeholder(s) {', '.join(unknown)}: only "
            f"{GROUP_TEMPLATE} is filled in (with the balance group's index); fill in the rest "
            "before passing the path, e.g. with an f-string"
        )


def _finite_measurements(measured: Measurements, gpus: list[int]) -> tuple[Measurements, list[str]]:
    """A copy of ``measured`` without non-finite times, and a description of each one
    left out: a phase of ``per_rank_ms`` with any such value goes as a whole (it must hold
    one value per GPU), ``plan_ms`` becomes ``None``."""
    dropped: list[str] = []
    plan_ms = measured.plan_ms
    if plan_ms is not None and not math.isfinite(plan_ms):
        dropped.append(f"plan_ms ({plan_ms})")
        plan_ms = None
    per_rank: dict[str, list[float]] = {}
    for phase, values in measured.per_rank_ms.items():
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            where = ", ".join(
                f"GPU {gpus[i] if i < len(gpus) else i}: {values[i]}" for i in bad[:3]
            )
            dropped.append(f"per_rank_ms[{phase!r}] ({where}{', ...' if len(bad) > 3 else ''})")
        else:
            per_rank[phase] = values
    if not dropped:
        return measured, dropped
    kept = measured.model_copy(update={"plan_ms": plan_ms, "per_rank_ms": per_rank})
    return kept, dropped


def _dist():
    """``torch.distributed`` when a process group is initialised, else ``None``.

    Looked up in ``sys.modules`` so that recording without torch never imports it.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _dist_rank() -> int | None:
    dist = _dist()
    return None if dist is None else dist.get_rank()
