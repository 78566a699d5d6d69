"""`StepTimer`: one rank's milliseconds per phase of each training step, compute apart
from waiting.

A step runs from one ``plan_routing`` call to the next. Within it the balancer times
every collective it owns (`knapformer.contract.phases.COLLECTIVE_PHASES`: the length gather, the
routing all-to-alls forward and backward, the Ulysses exchanges, the gradient
all-reduce run through it) and a few host phases (``plan``, ``record``); a training loop
adds its own with ``add`` (``data``: waiting for the next batch; ``host``: other host
work). When the step ends, ``step`` is its wall time and ``compute`` is ``step`` minus the
time inside the collectives, the ``data`` wait and the host work
(`knapformer.contract.phases.host_ms`: planning without its gather, recording,
``host``): what this rank's device computed, without the time it waited for its peers or
its input or spent on host work of its own (docs/concepts.md).

On CUDA the host work is also asynchronous to the device, so this still counts host
time that overlaps kernels as not compute. On the CPU the device is the training thread
itself: ``compute`` is its CPU time (``time.thread_time``) over the step less its CPU
time in those phases, and ``descheduled`` is what the wall clock counted on top of that,
the time the thread was ready to compute but waited for a core (more ranks than cores,
another process on them). Four ranks on two cores share them, so a rank that ends its
work early leaves its core to the others and the wall clock makes the heavily loaded
rank look fast per unit of work; its CPU time does not. A phase added by hand without
its CPU time (`StepTimer.add`) is taken out of the CPU time at its wall time. A device
the thread waits for without running (the demo's slowed GPU, `knapformer.local.slowdown`)
declares that time with `StepTimer.add_device`: it is the device's compute too.

Clocks: on the CPU ``time.perf_counter``. On CUDA the work is asynchronous, so
collectives and step boundaries are CUDA events, read only once a later point of the
stream is known to be done (`FinishedStep.values` then finds them complete); the host
never waits for them on the hot path. Host phases (``plan``, ``record``, user phases)
are host times on every device.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from knapformer.contract.phases import (
    COMPUTE,
    DESCHEDULED,
    FORWARD_BACKWARD,
    GC,
    NOT_COMPUTE,
    RECORDED_PHASES,
    STEP,
    UNTIMED,
    outside_compute_ms,
)
from knapformer.contract.plan import Measurements, RoutingPlan
from knapformer.runtime import gc_clock

log = logging.getLogger(__name__)


def cpu_clock_ms() -> float:
    """The calling thread's CPU time in ms: what it ran, not the time it waited."""
    return time.thread_time() * 1e3


def wall_clock_ms() -> float:
    """The host's monotonic clock in ms."""
    return time.perf_counter() * 1e3


def _outside_cpu(cpu: Mapping[str, float], wall: Mapping[str, float]) -> float:
    """CPU ms of a step's phases that are not compute (``cpu``), each phase whose CPU
    time is not known at its wall ms (``wall``)."""
    return sum(cpu.get(p, wall.get(p, 0.0)) for p in NOT_COMPUTE)


@dataclass
class Coverage:
    """What the training thread's outermost timed phases of one step covered (on the
    CPU): their wall and CPU ms, the garbage collections during them and, once the step
    ended, those between them, and whether one of them was the ``forward_backward`` that
    holds the compute. The rest of the step's wall time is ``untimed``: Python between
    the loop's phases."""

    wall: float = 0.0
    cpu: float = 0.0
    gc_in: list[float] = field(default_factory=lambda: [0.0, 0.0])  # (wall, CPU) ms
    gc_between: tuple[float, float] = (0.0, 0.0)  # (wall, CPU) ms, set when the step ends
    holds_compute: bool = False

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu
        self.holds_compute |= phase == FORWARD_BACKWARD

    def untimed(self, step_wall: float, step_cpu: float) -> tuple[float, float] | None:
        """(wall ms, CPU ms) of the step outside every outermost phase and every
        collection between them; None when no phase held the compute (the time between
        phases is then the compute's own: nothing tells them apart)."""
        if not self.holds_compute:
            return None
        wall = max(step_wall - self.wall - self.gc_between[0], 0.0)
        cpu = step_cpu - self.cpu - self.gc_between[1]
        return wall, min(max(cpu, 0.0), wall)


@dataclass
class FinishedStep:
    """The timings of one ended step. ``values()`` resolves its CUDA events (waiting for
    them if the stream has not reached them yet, which callers arrange not to happen on
    the training thread) and derives ``step`` and ``compute``; cached, thread-safe."""

    step: int
    host: dict[str, float]
    events: list[tuple[str, Any, Any]]  # (phase, start event, end event)
    started: float  # host clock at the step's start
    ended: float  # host clock at the step's end (the next step's start, or finish())
    begin: Any = None  # CUDA event at the step's start
    end: Any = None  # CUDA event at the step's end
    cpu_step: float | None = None  # on the CPU: the thread's CPU ms over the step
    cpu: dict[str, float] = field(default_factory=dict)  # CPU ms of phases that timed it
    device_ms: float = 0.0  # on the CPU: a waited-for device's time (`StepTimer.add_device`)
    coverage: Coverage | None = None  # on the CPU: what its timed blocks covered
    _values: dict[str, float] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def values(self) -> dict[str, float]:
        with self._lock:
            if self._values is None:
                self._values = self._resolve()
            return self._values

    def _resolve(self) -> dict[str, float]:
        values = dict(self.host)
        for phase, start, end in self.events:
            end.synchronize()  # a no-op once the stream passed it
            values[phase] = values.get(phase, 0.0) + start.elapsed_time(end)
        if self.begin is not None:
            self.end.synchronize()
            values[STEP] = self.begin.elapsed_time(self.end)
        else:
            values[STEP] = (self.ended - self.started) * 1e3
        cpu = dict(self.cpu)
        if self.cpu_step is not None and self.coverage is not None:
            untimed = self.coverage.untimed(values[STEP], self.cpu_step)
            if untimed is not None:
                values[UNTIMED], cpu[UNTIMED] = untimed
        values[COMPUTE] = max(values[STEP] - outside_compute_ms(values), 0.0)
        if self.cpu_step is not None:
            busy = self.cpu_step - _outside_cpu(cpu, values) + self.device_ms
            wall = values[COMPUTE]
            values[COMPUTE] = min(max(busy, 0.0), wall)
            values[DESCHEDULED] = wall - values[COMPUTE]
        return values

    def row(self, phases: Iterable[str]) -> list[float]:
        """The values in ``phases`` order; NaN for a phase not measured."""
        values = self.values()
        return [float(values.get(p, math.nan)) for p in phases]


@dataclass(frozen=True)
class GatheredStep:
    """Every rank's timings of one step, as gathered: ``table[i, j]`` is the ms of the
    i-th GPU of the balance group in ``phases[j]`` (NaN: not measured there)."""

    step: int
    phases: tuple[str, ...]
    table: np.ndarray  # (num_gpus, len(phases)) float64

    def column(self, phase: str) -> np.ndarray:
        """(num_gpus,) every GPU's ms in ``phase`` (NaN where not measured)."""
        return self.table[:, self.phases.index(phase)]

    def per_rank_ms(self) -> dict[str, list[float]]:
        """What a plan stores (`Measurements.per_rank_ms`): a phase no GPU measured is left
        out; where only some measured it, the others spent no time in it (e.g. Ulysses
        re-sharding in a 1-GPU bag): 0."""
        out: dict[str, list[float]] = {}
        for j, phase in enumerate(self.phases):
            values = self.table[:, j]
            if not np.isnan(values).all():
                out[phase] = np.where(np.isnan(values), 0.0, values).tolist()
        return out

    def attach(self, plan: RoutingPlan) -> None:
        """Store the timings in ``plan.measurements.per_rank_ms`` (the plan of this step,
        whose ``gpus`` are the balance group in the order of the table's rows)."""
        if plan.measurements is None:
            plan.measurements = Measurements()
        plan.measurements.per_rank_ms.update(self.per_rank_ms())


@dataclass
class _OpenStep:
    step: int
    started: float
    begin: Any
    cpu_started: float | None = None
    device_ms: float = 0.0
    host: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, Any, Any]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    gc_at_open: tuple[float, float] = (0.0, 0.0)  # `GcClock.reading` when it opened
    gc_in_phases: list[float] = field(default_factory=lambda: [0.0, 0.0])  # (wall, CPU) ms
    thread: int = field(default_factory=threading.get_ident)  # the training thread
    coverage: Coverage = field(default_factory=Coverage)


class StepTimer:
    """Times the phases of the current step on one rank and keeps the ended steps until
    they have been sent to the other ranks.

    ``device``: where the work runs (CUDA events on a CUDA device, host clocks
    otherwise, and there the training thread's CPU clock too, `cpu_clock_ms`).
    ``phases``: what travels to the other ranks, in row order
    (`knapformer.contract.phases.RECORDED_PHASES` and any extra names); a phase added with `add`
    that is not among them is kept in `current` but not sent (one warning).
    ``time_gc``: record garbage collections outside the timed phases as ``gc``
    (`knapformer.runtime.gc_clock`, which says why it is opt-in); `release` ends it.
    """

    def __init__(
        self, device: torch.device, phases: Iterable[str] = (), time_gc: bool = False
    ) -> None:
        self.cuda = device.type == "cuda"
        self.phases: tuple[str, ...] = tuple(dict.fromkeys([*RECORDED_PHASES, *phases]))
        self._open: _OpenStep | None = None
        self._finished: dict[int, FinishedStep] = {}
        self._last_finished: FinishedStep | None = None
        self._closed_upto = -1  # the latest step that has ended
        self._changed = threading.Condition()
        self._warned: set[str] = set()
        self._gc = gc_clock.acquire() if time_gc else None
        self._nesting = threading.local()  # per thread: timed phases open around it

    # ------------------------------------------------------------ the open step
    def boundary(self) -> Any:
        """A CUDA event recorded now on the current stream (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def open(self, step: int, started: float, begin: Any, cpu: float | None = None) -> None:
        """Start timing ``step``, begun at host time ``started`` (CUDA event ``begin``;
        ``cpu``: the thread's `cpu_clock_ms` then, used on the CPU)."""
        self._open = _OpenStep(step, started, begin, None if self.cuda else cpu)
        if self._gc is not None:
            self._open.gc_at_open = self._gc.reading()

    def close(self, now: float, end: Any = None, cpu: float | None = None) -> FinishedStep | None:
        """End the open step at host time ``now`` (CUDA event ``end``; ``cpu``: the thread's
        `cpu_clock_ms`): the next step's start, or the end of training. Returns it; None
        when none was open."""
        if self._open is None:
            return None
        self._add_gc()  # while the step is still open
        step, self._open = self._open, None
        cpu_step = None
        if step.cpu_started is not None and cpu is not None:
            cpu_step = cpu - step.cpu_started
        done = FinishedStep(
            step.step,
            step.host,
            step.events,
            step.started,
            now,
            step.begin,
            end,
            cpu_step,
            step.cpu,
            step.device_ms,
            step.coverage if cpu_step is not None else None,
        )
        with self._changed:
            self._finished[step.step] = done
            self._last_finished = done
            self._closed_upto = step.step
            self._changed.notify_all()
        return done

    def add(
        self, phase: str, ms: float, cpu_ms: float | None = None, outermost: bool = False
    ) -> None:
        """Add ``ms`` to ``phase`` of the open step (ignored while no step is open), and
        ``cpu_ms``, the thread's CPU time in it, when known. ``outermost``: the phase
        ran on the training thread inside no other timed phase (the step's coverage,
        `Coverage`)."""
        if phase not in self.phases and phase not in self._warned:
            self._warned.add(phase)
            log.warning(
                "timing phase %r is kept in balancer.timings but not gathered: pass "
                "SequenceBalancer(..., phases=[%r]) to record it",
                phase,
                phase,
            )
        if self._open is not None:
            host = self._open.host
            host[phase] = host.get(phase, 0.0) + float(ms)
            if outermost:
                self._open.coverage.add(phase, float(ms), float(cpu_ms or 0.0))
            if cpu_ms is not None:
                cpu = self._open.cpu
                cpu[phase] = cpu.get(phase, 0.0) + float(cpu_ms)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase`` of the open step: events on CUDA (read later),
        ``perf_counter`` and the thread's CPU clock otherwise."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            with self._gc_counted_in_phase(phase):
                yield
            end.record()
            if self._open is not None:
                self._open.events.append((phase, start, end))  # atomic: backward threads
        else:
            with self.host_timed(phase):
                yield

    @contextmanager
    def host_timed(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase`` of the open step by the host's clocks, whatever the
        device: the wall clock and the thread's CPU clock."""
        began, cpu = wall_clock_ms(), cpu_clock_ms()
        outer = self._outermost()
        gc_before = self._gc.reading() if outer is not None and self._gc is not None else None
        depth = getattr(self._nesting, "blocks", 0)
        self._nesting.blocks = depth + 1
        try:
            with self._gc_counted_in_phase(phase):
                yield
        finally:
            self._nesting.blocks = depth
            wall, cpu_ms = wall_clock_ms() - began, cpu_clock_ms() - cpu
            if gc_before is not None and outer is self._open:
                gc_wall, gc_cpu = self._gc.reading()
                outer.coverage.gc_in[0] += gc_wall - gc_before[0]
                outer.coverage.gc_in[1] += gc_cpu - gc_before[1]
            self.add(phase, wall, cpu_ms, outermost=outer is not None and outer is self._open)

    def _outermost(self) -> _OpenStep | None:
        """The open step when a phase starting now is outermost: on the thread that opened
        it, inside no other timed phase (None otherwise)."""
        step = self._open
        if (
            step is None
            or getattr(self._nesting, "blocks", 0)
            or step.thread != threading.get_ident()
        ):
            return None
        return step

    @contextmanager
    def _gc_counted_in_phase(self, phase: str) -> Iterator[None]:
        """Collections during a phase that is not compute (`NOT_COMPUTE`: a collective, host
        work) are in that phase, which the compute already leaves out: keep them out of
        the step's ``gc`` (once, for the outermost of nested phases). Those in a phase of
        the compute (``forward_backward``) stay in ``gc``, and leave the compute."""
        if self._gc is None or phase not in NOT_COMPUTE:
            yield
            return
        depth = getattr(self._nesting, "depth", 0)
        step, (wall, cpu) = self._open, self._gc.reading()
        self._nesting.depth = depth + 1
        try:
            yield
        finally:
            self._nesting.depth = depth
            if step is not None and depth == 0:
                now_wall, now_cpu = self._gc.reading()
                step.gc_in_phases[0] += now_wall - wall
                step.gc_in_phases[1] += now_cpu - cpu

    def _add_gc(self) -> None:
        """Add as ``gc`` the collections since the open step opened outside its timed
        phases (called on the thread that opened it, at its end)."""
        step = self._open
        if self._gc is None or step is None:
            return
        wall, cpu = self._gc.reading()
        since_open = (wall - step.gc_at_open[0], cpu - step.gc_at_open[1])
        coverage = step.coverage
        coverage.gc_between = (since_open[0] - coverage.gc_in[0], since_open[1] - coverage.gc_in[1])
        wall -= step.gc_at_open[0] + step.gc_in_phases[0]
        cpu -= step.gc_at_open[1] + step.gc_in_phases[1]
        if wall > 0:
            self.add(GC, wall, max(cpu, 0.0))

    def release(self) -> None:
        """Stop timing garbage collection (idempotent)."""
        if self._gc is not None:
            self._gc = None
            gc_clock.release()

    def add_device(self, ms: float) -> None:
        """On the CPU: ``ms`` the thread waited, outside every phase, for a device that
        computed meanwhile (an emulated accelerator): compute, though the thread's CPU
        clock does not count it. Ignored on CUDA (events time the device) and while no
        step is open."""
        if self._open is not None and self._open.cpu_started is not None:
            self._open.device_ms += float(ms)

    def outside_cpu_ms(self) -> float:
        """The open step's CPU ms so far in phases that are not compute (their wall ms
        where their CPU time is not known); 0 while none is open or on CUDA."""
        step = self._open
        if step is None or step.cpu_started is None:
            return 0.0
        return _outside_cpu(step.cpu, step.host)

    def current(self) -> dict[str, float]:
        """The open step's ms per phase so far (on CUDA this waits for its events)."""
        step = self._open
        if step is None:
            return {}
        values = dict(step.host)
        for phase, start, end in list(step.events):
            end.synchronize()
            values[phase] = values.get(phase, 0.0) + start.elapsed_time(end)
        return values

    @property
    def open_step(self) -> int | None:
        return None if self._open is None else self._open.step

    # --------------------------------------------------------- the ended steps
    @property
    def last_finished(self) -> FinishedStep | None:
        return self._last_finished

    @property
    def closed_upto(self) -> int:
        """The latest step that has ended (-1: none)."""
        return self._closed_upto

    def get(self, step: int) -> FinishedStep | None:
        """Step ``step`` if it has ended (and was not forgotten), without waiting."""
        with self._changed:
            return self._finished.get(step)

    def finished(self, step: int, stop: threading.Event | None = None) -> FinishedStep | None:
        """Step ``step`` once it has ended, waiting for the training thread to end it
        unless ``stop`` is set (see `notify`); None if it never ran or the wait stopped."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed_upto >= step or (stop is not None and stop.is_set())
            )
            return self._finished.get(step)

    def forget_upto(self, step: int) -> None:
        """Drop the ended steps up to ``step`` (their rows have been sent)."""
        with self._changed:
            for k in [k for k in self._finished if k <= step]:
                del self._finished[k]

    def notify(self) -> None:
        """Make a thread blocked in `finished` look at its ``stop`` event again."""
        with self._changed:
            self._changed.notify_all()
