"""`PlanRecorder`: write routing plans to JSONL while training, safely enough to leave on.

Guarantees (each one tested in ``tests/test_recorder*.py``):

- Only the writing rank writes: by default the first rank of each balance group. Other
  ranks never serialise a plan, open a file or start a thread.
- The training thread only enqueues the plan object. Serialisation and file I/O run on a
  background thread, which builds the JSON line piecewise (`knapformer.runtime.plan_lines`) and lets
  go of the GIL every ~16 KiB, so a multi-MB plan never holds the training thread up for
  more than a fraction of a millisecond at a time. The queue is bounded; when it is full
  the plan is dropped and counted (``dropped``), never waited for.
- Append-only JSONL, whole lines, one run per file, size-based rotation, a file removed
  or moved under the recorder followed to a new one at the path, a partial last line
  terminated: `knapformer.runtime.plan_file`.
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
- An I/O error (disk full, permissions, the file's folder removed) logs one warning and
  disables the recorder; training goes on.
- The path may hold ``{group}`` (the balance group's index) and no other placeholder:
  ``{date}`` or ``{}`` is refused when the recorder is made, not at the first write.
- ``close()`` flushes the queue; a recorder is a context manager and is closed at
  interpreter exit. The writer thread is a `knapformer.runtime.background.BackgroundWriter`.
- With ``tensorboard_dir``, the writer thread also logs each written plan's scalars to
  TensorBoard, live (`knapformer.runtime.scalars_log`); a failure there stops only that.

- The run store (``store=True``, the default): every step's plan, whatever ``every``
  says, is also queued, after the JSONL queue, for a `StoreWriter` (``<run>/store/``) with
  whether its line was queued (``record()`` returns that); the writer thread tells the
  store of a queued line it could not write, so its ``full_plan`` says what reached the
  file. The store's thread hands back a step whose line was not queued that a reader must
  be able to open in full (`StoreWriter`'s ``keep_full``): such a line may follow the
  line of a later step. ``close()`` drains the store first (the plans it keeps in full
  reach the JSONL's queue) and closes it last (after the JSONL writer's word on each line).

A plain sink: it never reads the balancer, runs no collective and times nothing. With a
balancer (``SequenceBalancer(..., recorder=PlanRecorder(path))``) the balancer hands it
each plan it `wants` once every rank's measured times of that step are attached
(`knapformer.runtime.balancer`: they travel with the lengths of a later step, and
``balancer.finish()`` gathers the last ones); without one, ``record(plan)`` queues any
plan as it is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.run_store import store_folder
from knapformer.errors import KnapformerError, MissingExtraError
from knapformer.runtime.background import BackgroundWriter
from knapformer.runtime.plan_file import FolderGone, PlanFile
from knapformer.runtime.plan_lines import finite_times, line_pieces, reader_problem
from knapformer.runtime.scalars_log import ScalarsLog
from knapformer.runtime.store_writer import StoreWriter
from knapformer.runtime.writing_rank import check_template, dist_rank, group_path, writes

log = logging.getLogger(__name__)


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
        _check_arguments(every, writer, queue_size, max_bytes, backups)
        check_template(str(path))
        if tensorboard_dir is not None:
            check_template(str(tensorboard_dir))
            if importlib.util.find_spec("tensorboard") is None:
                what = "PlanRecorder(tensorboard_dir=...)"
                raise MissingExtraError("tensorboard", what, "tensorboard")
        self.path = Path(path)
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir)
        self._scalars: ScalarsLog | None = None  # this process's TensorBoard logging
        self.every = int(every)
        self.writer = int(writer)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.backups = int(backups)
        self.enabled = bool(enabled)
        #: plans written to disk (updated by the writer thread)
        self.written = 0
        #: plans the writer could not serialise (skipped; the recorder stays on)
        self.failed = 0
        #: plans the writer refused because a reader would refuse them (not written)
        self.refused = 0
        #: plans queued but not written because the recorder was disabled or close() timed out
        self.lost = 0
        #: non-finite measured times left out of written plans (`finite_times`)
        self.dropped_times = 0
        self.file_path: Path | None = None  # the file this process writes, once known
        self._file: PlanFile | None = None  # opened by the writer thread
        self._disabled_reason: str | None = None
        self._lines = BackgroundWriter(
            "knapformer-plan-recorder",
            self._handle,
            queue_size=queue_size,
            finish=self._finish,
            at_exit=self._at_exit,
        )
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
        return self.enabled and not self._lines.closed and self._disabled_reason is None

    @property
    def disabled_reason(self) -> str | None:
        """Why the recorder switched itself off after an I/O error (``None`` if it did not)."""
        return self._disabled_reason

    @property
    def tensorboard_written(self) -> int:
        """Plans whose scalars went to TensorBoard (updated by the writer thread)."""
        return 0 if self._scalars is None else self._scalars.written

    @property
    def dropped(self) -> int:
        """Plans dropped because the queue was full."""
        return self._lines.dropped

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
            self._find_paths(plan)
            # the line first: the store's row says whether it was queued (`full_plan`)
            queued = plan.step % self.every == 0 and self._lines.put(plan)
            if self.store_wanted:
                self._to_store(plan, queued)
            return queued
        if not self.active or self._pid != os.getpid():
            return False
        due = self._calls % self.every == 0
        self._calls += 1
        if not (due and self._writes(plan)):
            return False
        self._find_paths(plan)
        return self._lines.put(plan)

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
        """Write what the JSONL queue holds and close the file (`close`); bounded: a
        writer stuck on a hung file system must not hang the job's exit."""
        lines = self._lines
        if not lines.close(timeout):
            return
        if not lines.flushed:
            self.lost += lines.unhandled
            log.warning("PlanRecorder could not flush %s in %s s", self.file_path, timeout)
        if lines.dropped:
            log.warning(
                "PlanRecorder dropped %d plan(s) because the writer fell behind "
                "(queue of %d); record less often with every=k or raise queue_size",
                lines.dropped,
                lines.queue_size,
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
    def _find_paths(self, plan: RoutingPlan) -> None:
        """This process's file and TensorBoard folder, known from its first plan (its
        group's, in a process group): before anything is queued, on the training thread,
        so that the JSONL, the store and TensorBoard agree on the group."""
        if self.file_path is not None:
            return
        grouped = dist_rank() is not None
        if self.tensorboard_dir is not None:
            folder = self.tensorboard_dir
            self._scalars = ScalarsLog(group_path(folder, plan.gpus) if grouped else folder)
        self.file_path = group_path(self.path, plan.gpus) if grouped else self.path

    def _to_store(self, plan: RoutingPlan, queued: bool) -> bool:
        """Queue ``plan`` for the run store (made at the first plan: no I/O here), with
        whether its line was ``queued`` for the JSONL; the store's thread hands back to
        `_keep_full` a plan whose line was not queued, to keep in full."""
        if self.store is None:
            self.store = StoreWriter(
                store_folder(self.file_path),
                every=self.every,
                keep_full=self._keep_full,
                # a run whose plans all fall outside `every` never starts the JSONL
                # thread: the store's open segment is flushed at exit all the same
                at_exit=self._at_exit,
                **self._store_options,
            )
        return self.store.put(plan, full=queued)

    def _keep_full(self, plan: RoutingPlan) -> bool:
        """The store's thread: queue for the JSONL a plan a reader must open in full."""
        return self._lines.put(plan)

    def _at_exit(self) -> None:
        self.close(timeout=10.0)

    def _writes(self, plan: RoutingPlan) -> bool:
        """Whether this process writes ``plan``'s group (`writing_rank.writes`)."""
        return writes(plan.gpus, self.writer)

    # -------------------------------------------------------------- writer thread
    def _handle(self, plan: RoutingPlan) -> None:
        if not self._write_plan(plan) and self.store is not None and plan.step is not None:
            self.store.not_written(plan.step)  # its row must not say it is in the file

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._scalars is not None:
            self._scalars.close()

    def _write_plan(self, item: RoutingPlan) -> bool:
        """Write one queued plan (writer thread); whether its line reached the file."""
        if self._disabled_reason is not None:
            self.lost += 1  # drain without writing
            return False
        plan = self._without_non_finite_times(item)
        problem = reader_problem(plan)
        if problem is not None:
            self._refuse(plan, problem)
            return False
        try:
            data = self._serialize(plan)
        except Exception as err:  # a broken plan is skipped, the recorder stays on
            self.failed += 1
            log.warning("PlanRecorder skipped a plan it could not serialise: %s", err)
            return False
        if self._file is None:  # file_path is known: `_find_paths` ran before the queue
            self._file = PlanFile(self.file_path, max_bytes=self.max_bytes, backups=self.backups)
        try:
            self._file.append(data, plan.step)
        except OSError as err:
            self.lost += 1
            gone = isinstance(err, FolderGone)
            self._disable(str(err) if gone else f"I/O error on {self.file_path}: {err}")
            return False
        self.written += 1
        if self._scalars is not None:
            self._scalars.write(item)
        return True

    def _serialize(self, plan: RoutingPlan) -> list[bytes]:
        """The plan's line, in pieces (`line_pieces`)."""
        return line_pieces(plan)

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

    def _without_non_finite_times(self, plan: RoutingPlan) -> RoutingPlan:
        """``plan``, or a copy without its non-finite measured times (`finite_times`); the
        first plan that has some logs one warning."""
        kept, dropped = finite_times(plan)
        if dropped and not self.dropped_times:
            log.warning(
                "PlanRecorder left non-finite measured time(s) out of the plan of step %s: "
                "%s (later ones are left out without a warning; count in dropped_times)",
                plan.step,
                "; ".join(dropped),
            )
        self.dropped_times += len(dropped)
        return kept

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        log.warning("PlanRecorder disabled (training goes on): %s", reason)
        if self._file is not None:
            self._file.close()


def _check_arguments(every, writer, queue_size, max_bytes, backups) -> None:
    """Refuse an argument out of range, naming it and its value."""
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
