"""`StoreWriter`: write the run store (every step of every rank, Parquet) from a thread.

The recorder hands it every plan (`put`: one ``put_nowait``, the training thread does
nothing else); its thread builds the rows (`knapformer.runtime.store_rows`) and appends
them to the open segment. Guarantees:

- A segment is closed every ``segment_steps`` steps or ``segment_seconds`` seconds,
  whichever comes first: written under a temporary name (``.<name>.<pid>.tmp``), then
  renamed to ``<table>-<first>-<last>.parquet``. A writer killed at any moment loses at
  most its open segment; every reader accepts what is left (temporary files are never
  listed, and a new writer removes them).
- Per closed segment: its ``ranks`` rows, its ``steps`` rows (with each step's loss,
  `knapformer.diagnosis.step_loss` over the segment's steps as the window, at any size:
  under a second of CPU for 1,024 GPUs x 256 steps or 4,096 x 60, the window's compute
  fit by `knapformer.planning.line_fit`'s grid; bench/run_store.py) and one
  ``rank_windows`` row per rank (`window_rows`).
- Bounded memory: ``ranks`` rows go to the segment's file as row groups of
  `ROW_GROUP_ROWS`; what is held is one row group, the segment's per-step figures for its
  loss, and three numbers per rank-step for its windows (about 25 MB at 4,096 GPUs and
  a 60-step segment). The queue is bounded; a full queue drops the plan (``dropped``).
- Compaction: every ``compact`` closed segments, the oldest ``compact`` small segments of
  each table are merged into one (row group by row group, then the small ones removed):
  a week-long run keeps hundreds of files, not tens of thousands. The store is never
  rotated away.
- One run per store: a store whose last step is below the first step written here is
  the same run resumed (from a checkpoint): it is appended to, under its run id. So is
  one whose first step is below it and last step not (resumed from a checkpoint, it
  replays steps): first its steps from the first written here on are removed
  (`knapformer.runtime.store_files.trim`: a segment that straddles it rewritten), with
  one warning. Any other store (steps that restart from the store's first or before,
  an unreadable ``run.json``, a trim that failed) is moved aside to ``store.1`` (or the
  next free ``store.<n>``: none is deleted), with one warning.
- ``full_plan`` is true to the JSONL: a step's row says its full plan is in the file
  when the recorder queued its line (`put`'s ``full``; a line dropped from a full queue
  is not), unless the JSONL writer then says it could not write it (`not_written`:
  refused, not serialisable, its file's folder gone) before the step's segment closes.
- ``add_columns`` is the batch path of the same writer: whole steps of ready-made rows
  (a bench or an importer), segments closed by the same rule.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.run_store import (
    StoreError,
    segment_name,
)
from knapformer.contract.store_schema import (
    LOSS_PARTS,
    TABLES,
    loss_column,
)
from knapformer.diagnosis.step_loss import step_losses
from knapformer.runtime.background import BackgroundWriter
from knapformer.runtime.store_files import (
    ROW_GROUP_ROWS,
    compact,
    open_store,
    parquet_writer,
    tmp_path,
    write_segment,
)
from knapformer.runtime.store_rows import (
    concat_columns,
    plan_rows,
    ranks_table,
    steps_table,
    window_figures,
    window_rows,
)

log = logging.getLogger(__name__)


class StoreWriter:
    """Write a run store in ``folder`` (``<run>/store``) from a background thread.

    Args:
        folder: the store's folder (created).
        segment_steps / segment_seconds: close the open segment after this many steps or
            this many seconds, whichever comes first.
        queue_size: plans waiting for the thread before new ones are dropped.
        compact: merge this many small segments into one, every this many segments
            (0: never).
        every: the recorder's ``every``: the full plans of steps divisible by it are
            written (``full_plan``; `put` may say otherwise) ...
        keep_full: ... and this is called (on the writer thread) with a plan of any other
            step (or one whose line was dropped) that a reader must be able to open in
            full (`store_rows.worth_keeping`),
            the first such step of each window of ``every`` steps (a straggler that lasts
            keeps one full plan a window, not one a step); it returns whether that full
            plan will be written.
        at_exit: called at interpreter exit while the thread runs, unless closed first
            (the recorder's close, which closes the store in its turn).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        segment_steps: int = 256,
        segment_seconds: float = 60.0,
        queue_size: int = 256,
        compact: int = 16,
        every: int = 1,
        keep_full: Callable[[RoutingPlan], bool] | None = None,
        at_exit: Callable[[], object] | None = None,
    ):
        if int(segment_steps) < 1 or not segment_seconds > 0:
            raise StoreError("segment_steps must be >= 1 and segment_seconds > 0")
        self.folder = Path(folder)
        self.segment_steps = int(segment_steps)
        self.segment_seconds = float(segment_seconds)
        self.compact = int(compact)
        self.every = max(int(every), 1)
        self.keep_full = keep_full
        #: plans written; segments closed (``dropped``: plans that found the queue full)
        self.written = 0
        self.segments = 0
        #: plans kept in full beyond ``every`` (handed to ``keep_full``, which took them)
        self.kept = 0
        self._kept_window: int | None = None  # the window of `every` steps last kept in
        #: plans left out (rows that could not be built, a step not after the last one)
        self.failed = 0
        self.disabled_reason: str | None = None
        self.run_id: str | None = None
        self._background = BackgroundWriter(
            "knapformer-store-writer",
            self._handle,
            queue_size=queue_size,
            finish=self._end_segment,
            at_exit=at_exit,
            idle_s=self._segment_seconds_left,
            on_idle=self._end_segment,  # the open segment's time is up
        )
        self._lock = threading.Lock()  # guards _unwritten
        self._segment: _OpenSegment | None = None
        self._last_step: int | None = None
        self._unwritten: set[int] = set()  # steps whose full plan did not reach the JSONL

    # ------------------------------------------------------------ training thread
    @property
    def dropped(self) -> int:
        """Plans dropped because the queue was full."""
        return self._background.dropped

    def put(self, plan: RoutingPlan, full: bool | None = None) -> bool:
        """Queue ``plan`` (with a step number) for the store; never blocks. ``full``:
        whether its full plan was queued for the JSONL (`add_plan`)."""
        if self.disabled_reason is not None:
            return False
        return self._background.put((plan, full))

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued and close the open segment. Idempotent."""
        background = self._background
        if not background.close(timeout):
            return
        if not background.started:
            self._end_segment()  # the batch path's segment (`add_columns`), on this thread
        elif not background.flushed:
            log.warning("StoreWriter could not flush %s in %s s", self.folder, timeout)
        if background.dropped:
            log.warning(
                "StoreWriter dropped %d step(s) because it fell behind (queue of %d)",
                background.dropped,
                background.queue_size,
            )

    def drain(self, timeout: float | None = 30.0) -> None:
        """Wait until the plans queued so far are in the open segment (and those to keep
        in full handed back), without closing it: the recorder's `close` lets the JSONL
        writer have its word (`not_written`) before the last segment closes."""
        self._background.drain(timeout)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- writer thread
    def _handle(self, item: tuple[RoutingPlan, bool | None]) -> None:
        if self.disabled_reason is None:
            self._guarded(self.add_plan, *item)

    def _end_segment(self) -> None:
        """Close the open segment (if any); an error turns the store off (`_guarded`)."""
        self._guarded(self._close_segment)

    def _segment_seconds_left(self) -> float | None:
        segment = self._segment
        return None if segment is None else segment.seconds_left(self)

    def _guarded(self, action: Callable, *args: object) -> None:
        """Run ``action``; an error (I/O, a store changed underneath, pyarrow) turns the store
        off with one warning and training goes on: the thread must outlive it, or `put`
        would fill the queue and `close` wait out its timeout."""
        try:
            action(*args)
        except Exception as err:  # any failure: the store stops, not the run
            self.disabled_reason = f"{type(err).__name__} in {self.folder}: {err}"
            log.warning("StoreWriter disabled (training goes on): %s", self.disabled_reason)
            self._segment = None

    def not_written(self, step: int) -> None:
        """The JSONL writer's word (from its thread) that the full plan of ``step`` it was
        handed did not reach the file (refused, not serialisable, lost): the step's row
        says so unless its segment was closed before the word came."""
        with self._lock:
            self._unwritten.add(int(step))

    def add_plan(self, plan: RoutingPlan, full: bool | None = None) -> None:
        """Append ``plan``'s rows (the writer thread; or the caller's, without `put`).
        ``full``: whether its full plan was queued for the JSONL (None: the steps
        divisible by ``every`` are taken for queued); if not, ``keep_full`` may keep it."""
        if plan.step is None:
            return
        if self._last_step is not None and plan.step <= self._last_step:
            self._skip(plan, f"its step is not after step {self._last_step}")
            return
        due = plan.step % self.every == 0 if full is None else bool(full)
        try:
            rows = plan_rows(plan)
        except Exception as err:  # a plan the rows cannot be built from: skipped
            self._skip(plan, str(err))
            return
        full = due
        window = plan.step // self.every
        if (
            not due
            and rows.notable
            and window != self._kept_window
            and self.keep_full is not None
            and self.keep_full(plan)
        ):
            self.kept += 1
            self._kept_window = window
            full = True
        rows.step["full_plan"] = full
        segment = self._segment_for(plan.step)
        segment.add_ranks(ranks_table(rows.ranks))
        segment.add_step(rows.step, rows.figures)
        self.written += 1
        self._after_step(plan.step)

    def _skip(self, plan: RoutingPlan, why: str) -> None:
        """Count a plan left out of the store; the first one is named in a warning."""
        self.failed += 1
        if self.failed == 1:
            log.warning(
                "StoreWriter left step %s out of %s: %s (later ones without a warning; "
                "count in failed)",
                plan.step,
                self.folder,
                why,
            )

    def add_columns(self, ranks: pa.Table, steps: pa.Table) -> None:
        """The batch path: whole steps of rows (``ranks`` and ``steps`` with the tables'
        columns, steps ascending, each step's rank rows together). Segments close by the
        same rule as `add_plan`'s (by steps; the seconds are the caller's)."""
        step_col = steps["step"].to_numpy()
        rank_steps = ranks["step"].to_numpy()
        begin = 0
        while begin < len(step_col):
            first = int(step_col[begin])
            segment = self._segment_for(first)
            room = self.segment_steps - segment.steps
            end = min(begin + room, len(step_col))
            lo, hi = np.searchsorted(rank_steps, [first, int(step_col[end - 1]) + 1])
            segment.add_ranks(ranks.slice(lo, hi - lo))
            segment.add_steps(steps.slice(begin, end - begin))
            self.written += end - begin
            self._after_step(int(step_col[end - 1]))
            begin = end

    def _segment_for(self, step: int) -> _OpenSegment:
        if self.run_id is None:
            self.run_id = open_store(self.folder, step)
        if self._last_step is not None and step <= self._last_step:
            raise StoreError(f"step {step} after step {self._last_step}: steps must increase")
        if self._segment is None:
            self._segment = _OpenSegment(self.folder, self.run_id, step)
        return self._segment

    def _after_step(self, step: int) -> None:
        self._last_step = step
        segment = self._segment
        segment.last = step
        if segment.steps >= self.segment_steps or segment.seconds_left(self) <= 0:
            self._close_segment()

    def _close_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None or not segment.steps:
            return
        with self._lock:  # words on later steps wait for their segment
            unwritten = {step for step in self._unwritten if step <= segment.last}
            self._unwritten -= unwritten
        segment.close(unwritten)
        self.segments += 1
        if self.compact > 1 and self.segments % self.compact == 0:
            for table in TABLES:
                compact(self.folder, table, self.compact, self.segment_steps)


class _OpenSegment:
    """The segment being written: ``ranks`` rows streamed to a temporary file, ``steps``
    rows and the windows' figures held until it closes."""

    def __init__(self, folder: Path, run: str, first: int):
        self.folder, self.run, self.first, self.last = folder, run, first, first
        self.opened = time.monotonic()
        self.steps = 0
        self._tmp = tmp_path(folder, f"ranks-{first}")
        self._ranks = parquet_writer(self._tmp, "ranks", run)
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._step_rows: list[dict] = []
        self._step_tables: list[pa.Table] = []
        self._figures: list = []  # (row index, RankFigures) of measured steps
        self._window: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def seconds_left(self, writer: StoreWriter) -> float:
        return max(0.0, writer.segment_seconds - (time.monotonic() - self.opened))

    def add_ranks(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._window.append(window_figures(table))
        if self._pending_rows >= ROW_GROUP_ROWS:
            self._flush_ranks()

    def add_step(self, row: dict, figures: object) -> None:
        if figures is not None:
            self._figures.append((len(self._step_rows), figures))
        self._step_rows.append(row)
        self.steps += 1

    def add_steps(self, table: pa.Table) -> None:
        self._step_tables.append(table)
        self.steps += table.num_rows

    def _flush_ranks(self) -> None:
        if self._pending:
            self._ranks.write_table(pa.concat_tables(self._pending), ROW_GROUP_ROWS)
            self._pending, self._pending_rows = [], 0

    def close(self, unwritten: set[int]) -> None:
        """Write the segment's three files (temporary names, then renamed); the steps of
        ``unwritten`` have no full plan (`StoreWriter.not_written`)."""
        first, last = self.first, self.last
        for row in self._step_rows:
            row["full_plan"] = row["full_plan"] and row["step"] not in unwritten
        write_segment(self.folder, "steps", first, last, self._steps_table(), self.run)
        windows = window_rows(first, last, *concat_columns(self._window))
        write_segment(self.folder, "rank_windows", first, last, windows, self.run)
        self._flush_ranks()
        self._ranks.close()
        os.replace(self._tmp, self.folder / segment_name("ranks", first, last))

    def _steps_table(self) -> pa.Table:
        rows = self._step_rows
        if rows:
            losses = step_losses([f for _, f in self._figures])
            for (index, _), loss in zip(self._figures, losses, strict=True):
                rows[index] |= {
                    "measured_ms": loss.measured_ms,
                    "ideal_ms": loss.ideal_ms,
                    "lost_ms": loss.lost_ms,
                    **{loss_column(p): loss.part_ms[p] for p in LOSS_PARTS},
                }
        if rows:
            self._step_tables.append(steps_table(rows))
        return pa.concat_tables(self._step_tables)
