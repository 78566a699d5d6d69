"""`PlanRecorder`: write routing plans to JSONL while training, safely enough to leave on.

Guarantees (each one tested in ``tests/test_recorder*.py``):

- Only the writing rank writes: by default the first rank of each balance group. Other
  ranks keep a step number and send their measured times with the balancer's all-gather
  of lengths (a few floats more, no collective of its own); they never serialise a
  plan, open a file or start a thread.
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
  (counted in ``dropped_times``).
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

With a balancer (``SequenceBalancer(..., recorder=PlanRecorder(path))``) the balancer
calls `on_step` on every rank of the balance group after each plan. The plan of step s
is held back one step: at step s+1 every rank's measured times of step s
(``balancer.previous_timings``: plan, route, attention re-sharding, the recorder's own
hook, whole step, and phases added with ``balancer.add_timing``) have reached the
writing rank with that step's lengths (`timing_row`; a stand-in balancer without that is
gathered by the recorder itself), and are stored
in the plan's ``measurements.per_rank_ms[phase]`` (one value per GPU of ``plan.gpus``)
before it is queued. Without a balancer, ``record(plan)`` queues a plan as it is.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from knapformer.errors import KnapformerError
from knapformer.plan import RECORDED_PHASES, Measurements, RoutingPlan
from knapformer.plan_io import json_line_pieces
from knapformer.runfiles import GROUP_TEMPLATE, group_file, rotated_copies, rotated_file

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
        phases: extra timing phases to gather besides `knapformer.plan.RECORDED_PHASES`
            (all ranks must send the same row, so the list is fixed up front).
        enabled: ``False`` makes every call a no-op.
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
        phases: Iterable[str] = (),
        enabled: bool = True,
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
        self.path = Path(path)
        self.every = int(every)
        self.writer = int(writer)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.backups = int(backups)
        self.phases: tuple[str, ...] = tuple(dict.fromkeys([*RECORDED_PHASES, *phases]))
        self.enabled = bool(enabled)
        #: plans queued and then dropped because the queue was full
        self.dropped = 0
        #: plans written to disk (updated by the writer thread)
        self.written = 0
        #: plans the writer could not serialise (skipped; the recorder stays on)
        self.failed = 0
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
        # on_step state, identical on every rank of the group
        self._pending_step: int | None = None
        self._pending: RoutingPlan | None = None  # writer rank only
        self._warned_phases: set[str] = set()
        self._pid = os.getpid()  # the writer thread exists only in this process

    # ----------------------------------------------------------------- public API
    @property
    def active(self) -> bool:
        """Whether plans are still being recorded (not closed, disabled or turned off)."""
        return self.enabled and not self._closed and self._disabled_reason is None

    @property
    def disabled_reason(self) -> str | None:
        """Why the recorder switched itself off after an I/O error (``None`` if it did not)."""
        return self._disabled_reason

    def record(self, plan: RoutingPlan) -> bool:
        """Queue ``plan`` for writing; returns whether it was queued.

        Never blocks: a full queue drops the plan (counted in ``dropped``). In a process
        group, only the writing rank of the plan's group (``plan.gpus[writer]``) records.
        """
        if not self.active or self._pid != os.getpid():
            return False
        if plan.step is None:
            due = self._calls % self.every == 0
            self._calls += 1
        else:
            due = plan.step % self.every == 0
        if not due:
            return False
        rank = _dist_rank()
        if rank is not None:
            gpus = plan.gpus
            if self.writer >= len(gpus) or gpus[self.writer] != rank:
                return False
            if self.file_path is None:
                self.file_path = self._group_path(gpus)
        return self._enqueue(plan)

    def on_step(self, balancer: Any, plan: RoutingPlan) -> None:
        """Hook the balancer calls on EVERY rank of the balance group after planning.

        Gathers the previous recorded step's per-rank timings to the writing rank (one
        fixed-size gather, only after a recorded step), attaches them to that step's
        plan and queues it; keeps ``plan`` pending if its step is due.
        """
        if not self.enabled or self._closed:
            return
        step = plan.step if plan.step is not None else getattr(balancer, "step", None)
        is_writer = self._is_writer(balancer)
        if step is None:  # no step number to agree on: record as it comes, no times
            if is_writer:
                self.record(plan)
            return
        if self._pending_step is not None:
            if step == self._pending_step + 1:
                # Gathered with the balancer's lengths (see `timing_row`); a balancer
                # that does not carry them (a stand-in) is gathered from here.
                rows = getattr(balancer, "previous_timing_rows", None)
                if rows is None:
                    rows = self._gather(balancer, dict(getattr(balancer, "previous_timings", {})))
                if rows is not None and self._pending is not None:
                    _attach(self._pending, _group_ranks(balancer), rows, self.phases)
            # A gap in step numbers (e.g. a restarted counter): the timings we hold are
            # not the pending step's, so it is written without them.
            self._flush_pending(is_writer)
        if step % self.every == 0:
            self._pending_step = step
            if is_writer and self._disabled_reason is None:
                self._pending = plan

    def finish(self, balancer: Any) -> None:
        """Collective end of training (call on every rank of the group, before ``close``).

        Gathers the current step's timings (``balancer.timings``) into the last pending
        plan and queues it, so the last step also has measured times. ``close()`` alone
        writes that plan without them (it may not run a collective: other ranks may be gone).
        """
        if not self.enabled or self._closed or self._pending_step is None:
            return
        is_writer = self._is_writer(balancer)
        rows = self._gather(balancer, dict(getattr(balancer, "timings", {})))
        if rows is not None and self._pending is not None:
            _attach(self._pending, _group_ranks(balancer), rows, self.phases)
        self._flush_pending(is_writer)

    def close(self, timeout: float | None = 30.0) -> None:
        """Queue the pending plan, write everything queued, close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._at_exit)
        pending, self._pending = self._pending, None
        self._pending_step = None
        if pending is not None and self._disabled_reason is None:
            self._start_thread()
            self._put(pending)
        if self._thread is not None and self._pid == os.getpid():
            # Bounded: a writer stuck on a hung file system must not hang the job's exit.
            began = time.monotonic()
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                log.warning("PlanRecorder could not flush %s in %s s", self.file_path, timeout)
            else:
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
                self._thread.join(left)
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
    def _enqueue(self, plan: RoutingPlan) -> bool:
        if self._thread is None:
            self._start_thread()
        elif self._pid != os.getpid():
            return False  # a forked child (e.g. a data-loader worker) has no writer thread
        return self._put(plan)

    def _put(self, plan: RoutingPlan) -> bool:
        try:
            self._queue.put_nowait(plan)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            if self.file_path is None:
                self.file_path = self.path
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, name="knapformer-plan-recorder", daemon=True
            )
            self._thread.start()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        self.close(timeout=10.0)

    def _is_writer(self, balancer: Any) -> bool:
        ranks = _group_ranks(balancer)
        rank = getattr(balancer, "rank", None)
        if rank is None:
            return True  # no process group: this process is the whole group
        if self.writer >= len(ranks):
            raise KnapformerError(
                f"PlanRecorder writer position {self.writer} is outside the balance group "
                f"of {len(ranks)} ranks"
            )
        writer = ranks[self.writer] == rank
        if writer and self.file_path is None:
            self.file_path = self._group_path(ranks)
        return writer

    def _group_path(self, group_ranks: list[int]) -> Path:
        """This group's file: groups are consecutive blocks of ranks, index = first // size."""
        return group_file(self.path, min(group_ranks) // len(group_ranks))

    def _flush_pending(self, is_writer: bool) -> None:
        self._pending_step = None
        if is_writer and self._pending is not None:
            plan, self._pending = self._pending, None
            if self.active:
                self._enqueue(plan)

    def timing_row(self, timings: dict[str, float]) -> list[float]:
        """This rank's ``timings`` as one row in `phases` order (NaN: not measured).

        `SequenceBalancer` sends the previous step's row with its length all-gather, so
        recording costs no collective of its own; every rank's row then has the same size.
        """
        unknown = set(timings) - set(self.phases) - self._warned_phases
        if unknown:
            self._warned_phases |= unknown
            log.warning(
                "PlanRecorder ignores timing phase(s) %s; pass PlanRecorder(phases=[...]) "
                "to record them",
                ", ".join(sorted(unknown)),
            )
        return [float(timings.get(p, math.nan)) for p in self.phases]

    def _gather(self, balancer: Any, timings: dict[str, float]) -> list[list[float]] | None:
        """Gather one row of timings per rank to the writing rank (others get ``None``):
        for `finish` and for balancers that do not gather them (see `timing_row`).

        Rows follow the group's rank order; a phase a rank did not measure is NaN.
        """
        row = self.timing_row(timings)
        ranks = _group_ranks(balancer)
        if len(ranks) == 1:
            return [row]
        dist = _dist()
        if dist is None:
            return None  # a group without a process group (a stand-in): nothing to gather
        import torch

        group = getattr(balancer, "group", None)
        # The balancer's device suits its group's backend (CUDA for NCCL, else CPU).
        device = getattr(balancer, "device", None) or torch.device("cpu")
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        dst = ranks[self.writer]
        if balancer.rank == dst:
            rows = [torch.empty_like(mine) for _ in ranks]
            dist.gather(mine, rows, dst=dst, group=group)
            return [r.cpu().tolist() for r in rows]
        dist.gather(mine, None, dst=dst, group=group)
        return None

    # -------------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if self._disabled_reason is not None:
                continue  # drain without writing
            try:
                data = self._serialize(self._without_non_finite_times(item))
            except Exception as err:  # a broken plan is skipped, the recorder stays on
                self.failed += 1
                log.warning("PlanRecorder skipped a plan it could not serialise: %s", err)
                continue
            try:
                self._write(data)
            except OSError as err:
                self._disable(err)
        self._close_file()

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

    def _write(self, pieces: list[bytes]) -> None:
        if self._fd is not None and not self._follow_path():
            return
        size = sum(map(len, pieces))
        if self._fd is None:
            self._open()
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

    def _open(self) -> None:
        path = self.file_path or self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._open_plain(path)

    def _open_plain(self, path: Path) -> None:
        """Open ``path`` for appending without creating its directory: if that was removed,
        it is an I/O error, not something to recreate behind the user's back."""
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        st = os.fstat(self._fd)
        self._file_id = (st.st_dev, st.st_ino)
        self._size = st.st_size

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


def _attach(
    plan: RoutingPlan, ranks: list[int], rows: list[list[float]], phases: tuple[str, ...]
) -> None:
    """Store gathered rows in ``plan.measurements.per_rank_ms[phase]`` (ms per GPU of
    ``plan.gpus``). A phase no rank measured is left out; where only some ranks measured
    it, the others spent no time in it (e.g. attention re-sharding in a 1-GPU bag): 0."""
    row_of = {rank: i for i, rank in enumerate(ranks)}
    if any(gpu not in row_of for gpu in plan.gpus):
        return  # the plan is not this group's (e.g. planned offline): nothing to attach
    if plan.measurements is None:
        plan.measurements = Measurements()
    for j, phase in enumerate(phases):
        values = [rows[row_of[gpu]][j] for gpu in plan.gpus]
        if all(math.isnan(v) for v in values):
            continue
        plan.measurements.per_rank_ms[phase] = [0.0 if math.isnan(v) else v for v in values]


def _group_ranks(balancer: Any) -> list[int]:
    ranks = getattr(balancer, "group_ranks", None)
    if ranks:
        return [int(r) for r in ranks]
    rank = getattr(balancer, "rank", None)
    return [int(rank)] if rank is not None else [0]


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
