"""What the dashboard knows about one run, and the folder of runs it may choose from.

A `PlanStore` keeps one `StepSummary` plus a file location per step (a few hundred bytes)
and, for a step with measurements, its per-rank `RankFigures` (a few float32 per rank),
never the plans themselves: a full plan is re-read and validated only when the user
selects its step, and the last few are cached. Steps are walked in step order
(`Snapshot.by_step`), not file order: the plans a verdict names are appended by the
store's writer when it gets to them, after newer steps. That still grows with the run: about 1 KB
a step, 2.5 KB more and 60 bytes per GPU for a measured one (docs/reliability.md). A
background thread per store follows the file (`dashboard.tail.JsonlTail`) so Dash
callbacks only read a snapshot; the same thread follows the run's store, when it has one
(`dashboard.store_steps`: every step's figures, whichever full plans were kept). A line
that cannot be read as a plan, for whatever reason, costs that line only: it becomes a
`Problem` and the lines after it are read. A file that the follower reports as new
(replaced, truncated), or whose first plan after a rotation does not continue the steps
held (a re-run moved aside), is a new run: the steps held are dropped. `Runs` follows at
most `KEEP_STORES` runs at a time (the ones viewed most recently), so browsing a folder
of thousands of runs does not leave a thread and open files behind for each.
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from knapformer.dashboard.store_steps import StoreFollower, StoreSteps
from knapformer.dashboard.tail import MAX_LINE_BYTES, NEW_FILE, JsonlTail, TailEvent, TailLine

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import PlanFormatError, Problem, parse_plan_line, read_plans
from knapformer.contract.runfiles import find_runs
from knapformer.contract.stats import StepSummary, summarize
from knapformer.diagnosis.measured import RankFigures, measure

_POLL_BYTES = 512 << 10  # per poll while catching up: small, so serving requests waits little
_IDLE_S = 0.25
_YIELD_S = 0.5
_KEEP_PROBLEMS = 200
_KEEP_EVENTS = 5
_CACHE_PLANS = 8
#: Runs followed at once (each: one thread, its file and up to 16 rotated ones open).
KEEP_STORES = 16


@dataclass(frozen=True, slots=True)
class Location:
    generation: int  # file generation of the tailer (JSONL) — or -1 for a JSON file
    offset: int  # byte offset (JSONL) or record index (JSON)
    length: int


#: What indexing keeps of one plan: its summary, where it is, its measured figures.
_Indexed = tuple[StepSummary, "Location", RankFigures | None]


def _index(plan: RoutingPlan, line: int, where: Location) -> _Indexed:
    measured = measure(plan)
    return summarize(plan, line), where, None if measured is None else measured.figures()


@dataclass(frozen=True)
class Snapshot:
    """A consistent view for one callback. ``reset`` changes when earlier steps vanished
    (truncation, a rewritten JSON file), so a client must redraw rather than append."""

    reset: int
    summaries: list[StepSummary]
    problems: list[Problem]
    problem_count: int
    notices: list[str]
    indexing: bool
    mean_speedup: float | None
    measured_steps: int  # steps whose measurements name a compute phase
    store: StoreSteps | None = None  # every closed step of the run's store (None: no store)
    #: the index of the newest step's plan: the last one, unless plans of earlier steps
    #: came after it (the store's writer appends those a verdict named as it gets to them)
    newest: int = -1
    #: the indices of ``summaries`` in step order (file order for unnumbered plans): what
    #: the step picker walks, so that a plan written late stands among its neighbours
    by_step: list[int] = field(default_factory=list)


class RequestGate:
    """Counts web requests in flight, so that catching up on a long file (which holds the
    GIL most of the time) pauses while a page or callback is being served — and for a
    moment after a page load, while the browser parses plotly.js on the same CPUs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy = 0
        self._quiet_at = 0.0  # monotonic time until which to stay out of the way
        self._idle = threading.Event()
        self._idle.set()

    def enter(self) -> None:
        with self._lock:
            self._busy += 1
            self._idle.clear()

    def leave(self, linger: float = 0.0) -> None:
        with self._lock:
            self._busy = max(self._busy - 1, 0)
            self._quiet_at = max(self._quiet_at, time.monotonic() + linger)
            if self._busy == 0:
                self._idle.set()

    def wait_idle(self, timeout: float) -> None:
        """Wait until no request is in flight and any linger is over, at most ``timeout``."""
        deadline = time.monotonic() + timeout
        self._idle.wait(timeout)
        rest = min(self._quiet_at, deadline) - time.monotonic()
        if rest > 0:
            time.sleep(rest)


class PlanStore:
    """Summaries of every plan in one file (JSONL followed live, or a JSON document)."""

    def __init__(
        self, path: str | os.PathLike, name: str | None = None, gate: RequestGate | None = None
    ):
        self.path = Path(path)
        self._gate = gate
        self.name = name or self.path.stem
        self.is_jsonl = self.path.suffix != ".json"
        self._lock = threading.Lock()
        self._summaries: list[StepSummary] = []
        self._where: list[Location] = []
        self._figures: list[RankFigures | None] = []
        self._measured = 0
        self._newest = -1
        self._order: list[int] = []  # indices by `_order_key`
        self._order_keys: list[tuple[int, int]] = []
        self._problems: deque[Problem] = deque(maxlen=_KEEP_PROBLEMS)
        self._problem_count = 0
        self._events: deque[str] = deque(maxlen=_KEEP_EVENTS)
        self._missing: str | None = None
        self._reset = 0
        self._speedup_sum = 0.0
        self._speedup_count = 0
        self._indexing = True
        self._cache: OrderedDict[tuple[int, int], RoutingPlan] = OrderedDict()
        self._tail = JsonlTail(self.path) if self.is_jsonl else None
        self._json_plans: list[RoutingPlan] = []
        self._json_stamp: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._store = StoreFollower(self.path)  # touched by `poll` only
        self._store_steps: StoreSteps | None = None
        self._store_problem: str | None = None

    # --------------------------------------------------------------- following
    def start(self) -> None:
        """Follow the file in a daemon thread until `stop`."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._follow, name=f"follow {self.name}", daemon=True
            )
            self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop following and close the file(s). ``wait=False`` returns at once and leaves
        the closing to the follower thread as it finishes its poll (a request evicting a
        store must not wait for that)."""
        self._stop.set()
        if self._thread is not None and not wait:
            return
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._tail is not None:
            self._tail.close()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                more = self.poll()
            except Exception as err:  # never let the follower die: show why instead
                with self._lock:
                    self._events.append(f"error while reading {self.path}: {err}")
                more = False
            if not more:
                self._stop.wait(_IDLE_S)
            elif self._gate is not None:
                # Yield to requests, but at most this long, so indexing never starves.
                self._gate.wait_idle(_YIELD_S)
        if self._tail is not None:
            self._tail.close()

    def poll(self) -> bool:
        """Read what is new; True when more is waiting (call again right away)."""
        if self._tail is None:
            self._poll_json()
            self._follow_store()
            return False
        batch = self._tail.poll(_POLL_BYTES)
        items: list[tuple[int, _Indexed | Problem]] = []  # (file generation, what it holds)
        for line in batch.lines:
            try:
                items.append((line.generation, _index_line(line)))
            except Exception as err:  # whatever a line holds, it costs that line only
                items.append((line.generation, Problem(self.path.name, line.number, _reason(err))))
        with self._lock:
            fresh = None
            for event in batch.events:
                self._note(event)
                if event.kind in NEW_FILE:
                    fresh = event.generation
            if fresh is not None:  # a new file: what was read before is not part of it
                self._clear()
                items = [(generation, item) for generation, item in items if generation >= fresh]
            self._add_items(items)
            self._indexing = batch.more
        if not batch.more:  # caught up with the plans: what the store closed meanwhile
            self._follow_store()
        return batch.more

    def _follow_store(self) -> None:
        """Read the segments the run's store closed since the last poll (a directory
        listing when none did)."""
        if self._store.refresh():
            with self._lock:
                self._store_steps = self._store.steps
                self._store_problem = self._store.problem

    def _note(self, event: TailEvent) -> None:
        """What the follower reports about the file, kept for the page."""
        if event.kind in ("missing", "refused"):
            self._missing = event.message
        elif event.kind == "removed":
            self._missing = f"{event.message}; waiting for it to reappear"
        else:  # a file is read again
            self._missing = None
            if event.kind != "appeared":
                self._events.append(event.message)

    def _add_items(self, items: list[tuple[int, _Indexed | Problem]]) -> None:
        """Add lines in file order. The first plan of a new file generation (after a
        rotation) must continue the steps shown; if it starts another run (a re-run moves
        the old recording aside just as a rotation does), the earlier steps are dropped."""
        for generation, item in items:
            if isinstance(item, Problem):
                self._add([], [item])
                continue
            if self._where and generation != self._where[-1].generation:
                reason = _new_run(self._summaries[-1], item[0])
                if reason is not None:
                    self._events.append(
                        f"{self.path.name} holds a new run ({reason}): the earlier steps are "
                        "no longer shown"
                    )
                    self._clear()
            self._add([item], [])

    def _poll_json(self) -> None:
        try:
            st = os.lstat(self.path)  # a link put in the file's place is not read
        except OSError as err:
            st, reason = None, f"cannot read {self.path}: {err.strerror}"
        if st is not None and stat.S_ISLNK(st.st_mode):
            reason = (
                f"{self.path} is a symbolic link: the dashboard reads regular files only; "
                "waiting for a regular file there"
            )
            st = None
        if st is None:
            with self._lock:
                self._missing = reason
                self._indexing = False
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._json_stamp:
            return
        self._json_stamp = stamp
        result = read_plans(self.path, on_error="skip")
        with self._lock:
            self._missing = None
            if self._summaries or self._problem_count:
                self._events.append(f"{self.path.name} changed on disk; reloaded")
            self._clear()
            self._problems.clear()
            self._problem_count = 0
            self._json_plans = result.plans
            parsed = [
                _index(r.plan, r.line, Location(-1, i, 0)) for i, r in enumerate(result.records)
            ]
            self._add(parsed, result.problems)
            self._indexing = False

    def _clear(self) -> None:
        self._summaries = []
        self._where = []
        self._figures = []
        self._measured = 0
        self._newest = -1
        self._order = []
        self._order_keys = []
        self._speedup_sum = 0.0
        self._speedup_count = 0
        self._problems.clear()
        self._problem_count = 0
        self._cache.clear()
        self._reset += 1

    def _add(self, parsed: list[_Indexed], problems: list[Problem]) -> None:
        for summary, where, figures in parsed:
            if _is_newer(summary, self._summaries[self._newest] if self._summaries else None):
                self._newest = len(self._summaries)
            key = _order_key(summary, len(self._summaries))
            at = bisect.bisect(self._order_keys, key)  # a late plan: near the end
            self._order_keys.insert(at, key)
            self._order.insert(at, len(self._summaries))
            self._summaries.append(summary)
            self._where.append(where)
            self._figures.append(figures)
            self._measured += figures is not None
            if summary.speedup != float("inf"):  # a step with nothing to do after
                self._speedup_sum += summary.speedup
                self._speedup_count += 1
        self._problems.extend(problems)
        self._problem_count += len(problems)

    # ----------------------------------------------------------------- reading
    def snapshot(self) -> Snapshot:
        with self._lock:
            n = len(self._summaries)
            notices = list(self._events)
            if self._store_problem:
                notices.append(f"{self._store_problem}; the figures come from the plans")
            if self._missing:
                notices.insert(0, self._missing)
            elif n == 0 and self._problem_count == 0 and not self._indexing:
                notices.insert(0, f"{self.path.name} holds no plans yet — waiting for some")
            return Snapshot(
                reset=self._reset,
                summaries=list(self._summaries),
                problems=list(self._problems),
                problem_count=self._problem_count,
                notices=notices,
                indexing=self._indexing,
                mean_speedup=(
                    self._speedup_sum / self._speedup_count if self._speedup_count else None
                ),
                measured_steps=self._measured,
                store=self._store_steps,
                newest=self._newest,
                by_step=list(self._order),
            )

    def measured(self, index: int, count: int, reset: int | None = None) -> list[RankFigures]:
        """The figures of up to ``count`` measured steps ending at the step of plan
        ``index``, in step order (oldest first; a plan written late among its neighbours;
        empty when the file was reset since ``reset``)."""
        with self._lock:
            if reset is not None and reset != self._reset:
                return []
            return [self._figures[i] for i in self._measured_before(index, count)]

    def measured_plans(self, index: int, count: int, reset: int | None = None) -> list[int]:
        """The indices of the plans `measured` takes its figures from (empty when the file
        was reset since ``reset``)."""
        with self._lock:
            if reset is not None and reset != self._reset:
                return []
            return self._measured_before(index, count)

    def _measured_before(self, index: int, count: int) -> list[int]:
        """Up to ``count`` indices of plans with measurements ending at plan ``index`` in
        step order, oldest first. Call with the lock held."""
        if not self._summaries:
            return []
        index = min(max(index, 0), len(self._summaries) - 1)
        at = bisect.bisect(self._order_keys, _order_key(self._summaries[index], index))
        out: list[int] = []
        for i in _back(self._order, at):
            if len(out) == count:
                break
            if self._figures[i] is not None:
                out.append(i)
        return out[::-1]

    def plan(self, index: int, reset: int | None = None) -> RoutingPlan:
        """The full plan of step ``index`` (re-read and validated; a few are cached).

        Raises ``LookupError`` when the step is gone (file truncated or removed)."""
        with self._lock:
            if reset is not None and reset != self._reset:
                raise LookupError("the file was reset; that step is gone")
            if not 0 <= index < len(self._where):
                raise LookupError(f"step index {index} is out of range")
            key = (self._reset, index)
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            where = self._where[index]
            if where.generation < 0:
                plan = self._json_plans[where.offset]
            else:
                try:
                    text = self._tail.read_record(where.generation, where.offset, where.length)
                except (OSError, ValueError) as err:  # ValueError: handle closed meanwhile
                    raise LookupError(str(err)) from err
                try:
                    plan = parse_plan_line(text)
                except PlanFormatError as err:
                    raise LookupError(f"record changed on disk: {err}") from err
            self._cache[key] = plan
            while len(self._cache) > _CACHE_PLANS:
                self._cache.popitem(last=False)
            return plan


def _order_key(summary: StepSummary, index: int) -> tuple[int, int]:
    """Where a plan stands in step order: by its step, then its place in the file (an
    unnumbered plan by its place alone)."""
    return (index if summary.step is None else summary.step, index)


def _back(items: list[int], end: int):
    """``items[end - 1]``, ``items[end - 2]``, … without copying the list."""
    for i in range(end - 1, -1, -1):
        yield items[i]


def _is_newer(summary: StepSummary, newest: StepSummary | None) -> bool:
    """Whether ``summary`` is the newest step now (an unnumbered one is, as the last)."""
    return (
        newest is None
        or summary.step is None
        or newest.step is None
        or (summary.step >= newest.step)
    )


def _new_run(last: StepSummary, first: StepSummary) -> str | None:
    """Why the plan ``first``, the first of a new file, does not continue the run whose
    last plan shown is ``last`` (None when it continues it)."""
    if last.run != first.run and last.run is not None and first.run is not None:
        return f"run {first.run!r} after run {last.run!r}"
    if last.step is not None and first.step is not None and first.step <= last.step:
        return f"it starts at step {first.step}, not after step {last.step}"
    if last.time is not None and first.time is not None and first.time < last.time:
        return "its first plan is older than the last one shown"
    return None


def _index_line(line: TailLine) -> _Indexed:
    if line.too_long:
        raise PlanFormatError(
            f"a line of {line.length:,} bytes is longer than the {MAX_LINE_BYTES:,} the "
            "dashboard reads; skipped"
        )
    where = Location(line.generation, line.offset, line.length)
    return _index(parse_plan_line(line.text), line.number, where)


def _reason(err: Exception) -> str:
    """One line on why a record was skipped (the parser's own words when it has them)."""
    if isinstance(err, PlanFormatError):
        return str(err)
    if isinstance(err, RecursionError):
        return "nested too deeply to read"
    return f"unreadable record ({type(err).__name__}: {err})"


class Runs:
    """The runs behind PATH (`knapformer.contract.runfiles.find_runs`): one file, or a folder of
    ``<run>/plans.jsonl`` and plan files. Stores are created, and start following, when
    first asked for."""

    def __init__(self, path: str | os.PathLike, gate: RequestGate | None = None):
        # A link the user names is followed to its file or folder, once: the files read
        # are then regular files only, a link put in a file's place being refused.
        self.path = Path(os.path.realpath(path))
        self.gate = gate
        self._stores: OrderedDict[str, PlanStore] = OrderedDict()  # least recently viewed first
        self._lock = threading.Lock()
        self._names: dict[str, Path] = {}
        self._scanned = 0.0

    def files(self) -> dict[str, Path]:
        """Run name -> plan file (rescanned at most every 2 s; runs can appear live)."""
        now = time.monotonic()
        with self._lock:
            if now - self._scanned > 2.0 or not self._names:
                # Only regular files (or ones not there yet): a device or a FIFO named
                # as a run would be read for ever.
                self._names = {
                    name: file
                    for name, file in find_runs(self.path).items()
                    if file.is_file() or not file.exists()
                }
                self._scanned = now
            return dict(self._names)

    def default(self) -> str | None:
        """The run written to most recently."""
        files = self.files()
        if not files:
            return None

        def mtime(item):
            try:
                return item[1].stat().st_mtime
            except OSError:
                return 0.0

        return max(files.items(), key=mtime)[0]

    def store(self, name: str | None) -> PlanStore | None:
        files = self.files()
        if name not in files:
            return None
        with self._lock:
            store = self._stores.get(name)
            if store is None:
                store = self._stores[name] = PlanStore(files[name], name, self.gate)
                store.start()
            self._stores.move_to_end(name)
            while len(self._stores) > KEEP_STORES:
                _, oldest = self._stores.popitem(last=False)
                oldest.stop(wait=False)
            return store

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.stop()
            self._stores.clear()
