"""Recorded plans as a Chrome Trace Event Format file, for the trace viewers users already
have: Perfetto (ui.perfetto.dev, trace_processor), chrome://tracing and the Performance
panel of Chromium's DevTools.

The format is the JSON object form of the Trace Event Format (``{"traceEvents": [...]}``;
times in microseconds): complete events (``"ph": "X"``) for slices, counter events
(``"C"``) for numbers over time and metadata events (``"M"``) naming processes and
threads. What goes where:

- one process per run (a run folder may hold several), named after the run;
- in it, one track (thread) per GPU rank, named ``GPU 5 · bag 1 · 4 GPUs``, in rank
  order, and above them a ``steps`` track;
- steps at their recorded wall-clock times (`step_start_us`): ``ts`` is microseconds
  since the Unix epoch, the clock torch.profiler's traces use, so the two merge
  (`knapformer.tools.profiler_merge`). A step's slot on the steps track runs from its
  ``plan.time`` (the wall clock when the balancer began planning it on the recording
  rank: the step's start) to the next plan's (where that step ended); the last one, and
  plans without a time (then steps follow one another from `ORIGIN_MS`), are as long as
  their slowest rank. The recorder keeps no per-rank start times: every rank's step
  starts at the slot's start (the ranks leave the length all-gather together), or where
  that rank's previous step ended when that is later (a rank's phases can add up to more
  than the recording rank's step), so no drift accumulates. A rank's step
  is one slice ``step N`` (its measured ``step`` time, or the sum of its phases when that
  is longer or ``step`` was not measured), holding the rank's measured phases as slices
  in the order a step runs them (`knapformer.contract.plan` names the phases). The recorder keeps
  one sum per phase and step, not timestamps, so where a phase sits inside its step is a
  layout, not a measurement: ``plan`` (holding ``gather``), ``record``,
  ``forward_backward`` (holding ``route``, ``pre_attn``, ``post_attn`` and
  ``reverse_route`` when they fit inside it, as in a training loop that times the model
  call; otherwise they go before and after it), ``allreduce``, ``optimizer``, then any
  other phase a training loop added. ``step`` and ``compute`` (derived) are arguments of
  the step slice;
- the ``steps`` track holds one slice per step with the plan's figures as arguments, and
  counters carry them over time (`COUNTERS`: imbalance before/after, moved fraction,
  planning time, modelled speedup, measured max/mean compute).

A plan without per-rank times gets a slot of `UNMEASURED_SLOT_MS` (its figures, no rank
slices).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from knapformer.contract.output_file import output_file
from knapformer.contract.phases import NESTED_PHASES, SPAN_PHASES, STEP_ORDER
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.scalars import step_figures
from knapformer.contract.stats import gpu_bags
from knapformer.errors import KnapformerError

UNMEASURED_SLOT_MS = 1.0
#: Where every run's first step starts. Not 0: DevTools' Performance panel leaves events
#: at timestamp 0 out of the trace's bounds.
ORIGIN_MS = 1.0
STEPS_TRACK = 1_000_000  # tid of the steps track (ranks use their own rank as tid)
US_PER_MS = 1000.0


@dataclass(frozen=True)
class Slice:
    """A phase laid out inside a rank's step: offset from the step's start and length, ms."""

    name: str
    start_ms: float
    ms: float
    depth: int  # 0: the step itself, 1: a phase, 2: a phase inside another


def layout_rank_step(times: dict[str, float]) -> tuple[float, list[Slice]]:
    """(span ms, slices) of one rank's step from its measured ``times`` (phase -> ms).

    The span is the measured ``step`` time, or the sum of the outermost phases when that
    is longer or ``step`` is missing. Slices start with the step itself (depth 0)."""
    times = {p: float(ms) for p, ms in times.items() if np.isfinite(ms) and ms >= 0}
    inner: dict[str, list[str]] = {}
    outer: list[str] = []
    for parent, children in NESTED_PHASES.items():
        measured = [c for c in children if c in times]
        if parent in times and sum(times[c] for c in measured) <= times[parent]:
            inner[parent] = measured
    nested = {c for children in inner.values() for c in children}
    for phase in STEP_ORDER:
        if phase == "forward_backward" and "forward_backward" not in inner:
            # Not nested: route and the attention exchanges before the model call, the
            # way back after it.
            outer += [p for p in ("route", "pre_attn", "post_attn") if p in times]
            outer += ["forward_backward"] if "forward_backward" in times else []
            outer += ["reverse_route"] if "reverse_route" in times else []
        elif phase == "plan" and "plan" not in inner:
            outer += [p for p in ("gather", "plan") if p in times]
        elif phase in times:
            outer.append(phase)
    placed = set(outer) | nested | set(SPAN_PHASES)
    outer += [p for p in times if p not in placed]  # phases a training loop added
    total = sum(times[p] for p in outer)
    span = max(times.get("step", 0.0), total)
    slices = [Slice("step", 0.0, span, 0)]
    at = 0.0
    for phase in outer:
        slices.append(Slice(phase, at, times[phase], 1))
        children = inner.get(phase, [])
        if phase == "forward_backward" and "reverse_route" in children:
            # route first, reverse_route last, the attention exchanges in between.
            first = [c for c in children if c != "reverse_route"]
            inner_at = at
            for child in first:
                slices.append(Slice(child, inner_at, times[child], 2))
                inner_at += times[child]
            back = times["reverse_route"]
            slices.append(Slice("reverse_route", at + times[phase] - back, back, 2))
        else:
            inner_at = at
            for child in children:
                slices.append(Slice(child, inner_at, times[child], 2))
                inner_at += times[child]
        at += times[phase]
    return span, slices


#: Counter track -> series -> figure of `knapformer.contract.scalars.step_figures` (one home for
#: what a step is summed up by; TensorBoard gets the same figures).
COUNTERS = {
    "imbalance (max/mean load)": {"before": "imbalance_before", "after": "imbalance_after"},
    "moved tokens (fraction)": {"moved": "moved_fraction"},
    "modelled speedup": {"speedup": "modelled_speedup"},
    "planning time (ms)": {"plan": "plan_ms"},
    "measured compute (max/mean)": {"max/mean": "compute_max_over_mean"},
}


def plan_counters(plan: RoutingPlan) -> dict[str, dict[str, float]]:
    """Counter name -> series -> value: the figures of one plan shown over time (a counter
    whose figures the plan lacks, e.g. measured compute, is left out)."""
    return counters_of(step_figures(plan))


def counters_of(figures: dict[str, float]) -> dict[str, dict[str, float]]:
    """`COUNTERS` filled from a step's `step_figures` (those it has)."""
    counters = {
        name: {label: figures[key] for label, key in series.items() if key in figures}
        for name, series in COUNTERS.items()
    }
    return {name: series for name, series in counters.items() if series}


@dataclass(frozen=True)
class TraceStep:
    """What the trace shows of one step, from its plan (`plan_step`) or from the run
    store's rows (`knapformer.tools.store_trace`)."""

    step: int | None
    time: float | None  # the wall clock when it began (None: unknown)
    ranks: list[int]
    labels: list[str]  # each rank's track name
    times: list[dict[str, float]] | None  # each rank's phase -> ms (None: not measured)
    figures: dict[str, Any]  # the step slice's arguments
    counters: dict[str, dict[str, float]]

    def name(self, index: int) -> str:
        return f"step {self.step if self.step is not None else index}"


def plan_step(plan: RoutingPlan) -> TraceStep:
    """The `TraceStep` of ``plan``."""
    st = plan.stats
    m = plan.measurements
    bags = gpu_bags(plan)
    times = None
    if m is not None and m.per_rank_ms:
        times = [
            {phase: values[position] for phase, values in m.per_rank_ms.items()}
            for position in range(len(plan.gpus))
        ]
    return TraceStep(
        step=plan.step,
        time=plan.time,
        ranks=list(plan.gpus),
        labels=[f"GPU {r} · {plan.bag_label(int(bags[i]))}" for i, r in enumerate(plan.gpus)],
        times=times,
        figures={
            "topology": plan.topology,
            "sequences": len(plan.sequences),
            "chunks": len(plan.chunks),
            "moved_tokens": st.moved_tokens,
            "total_tokens": st.total_tokens,
        },
        counters=plan_counters(plan),
    )


def step_start_us(step: TraceStep | RoutingPlan, previous_end_us: int) -> int:
    """Where a step's slot starts (whole µs since the Unix epoch): its recorded wall
    clock, or ``previous_end_us`` when that is later or the step has no time."""
    if step.time is None:
        return previous_end_us
    return max(round(step.time * 1e6), previous_end_us)


def _metadata(kind: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def trace_events(runs: dict[str, Sequence[RoutingPlan]]) -> list[dict[str, Any]]:
    """Every event of the trace of ``runs`` (run name -> its plans in step order)."""
    return step_events({run: [plan_step(p) for p in plans] for run, plans in runs.items()})


def step_events(runs: dict[str, Sequence[TraceStep]]) -> list[dict[str, Any]]:
    """Every event of the trace of ``runs`` (run name -> its steps in order)."""
    events: list[dict[str, Any]] = []
    for index, (run, steps) in enumerate(runs.items()):
        pid = index + 1
        events.append(_metadata("process_name", pid, None, {"name": f"knapformer · {run}"}))
        events.append(_metadata("process_sort_index", pid, None, {"sort_index": index}))
        events.append(_metadata("thread_name", pid, STEPS_TRACK, {"name": "steps"}))
        events.append(_metadata("thread_sort_index", pid, STEPS_TRACK, {"sort_index": -1}))
        named: set[int] = set()
        at_us = round(ORIGIN_MS * US_PER_MS)  # whole µs: wall-clock values are ~1.8e15
        rank_end: dict[int, int] = {}  # where each rank's last step ended (µs)
        for i, step in enumerate(steps):
            at_us = step_start_us(step, at_us)
            for rank, label in zip(step.ranks, step.labels, strict=True):
                if rank not in named:
                    named.add(rank)
                    events.append(_metadata("thread_name", pid, rank, {"name": label}))
                    events.append(_metadata("thread_sort_index", pid, rank, {"sort_index": rank}))
            slot_ms, rank_events = _rank_steps(step, pid, at_us, i, rank_end)
            following = steps[i + 1].time if i + 1 < len(steps) else None
            if following is not None and round(following * 1e6) > at_us:
                # the recorded step ends where the next one's planning began
                slot_ms = (round(following * 1e6) - at_us) / US_PER_MS
            events += rank_events
            events += _step_events(step, pid, at_us, slot_ms, i)
            at_us += round(slot_ms * US_PER_MS)
    return events


def _span_us(start_ms: float, ms: float, base_us: int = 0) -> dict[str, int]:
    """``ts`` and ``dur`` in whole microseconds, both ends rounded on their own: a slice
    that ends where the next begins shares its boundary exactly (viewers re-nest a slice
    that starts a hair before its predecessor ends). Offsets are rounded before adding
    ``base_us``: at wall-clock magnitudes a float sum would move ends by a microsecond."""
    start = round(start_ms * US_PER_MS)
    return {"ts": base_us + start, "dur": round((start_ms + ms) * US_PER_MS) - start}


def _rank_steps(
    step: TraceStep, pid: int, at_us: int, index: int, rank_end: dict[int, int]
) -> tuple[float, list[dict]]:
    """The slot length (ms) of the step, as long as its slowest rank, and the slices of
    every rank in it: a rank's step starts at ``at_us``, or where its previous one ended
    (``rank_end``, updated) when that is later."""
    if not step.times:
        return UNMEASURED_SLOT_MS, []
    events, slot = [], 0.0
    name = step.name(index)
    for rank, times in zip(step.ranks, step.times, strict=True):
        span, slices = layout_rank_step(times)
        slot = max(slot, span)
        start_us = max(at_us, rank_end.get(rank, at_us))
        rank_end[rank] = start_us + round(span * US_PER_MS)
        for s in slices:
            args: dict[str, Any] = {"ms": round(s.ms, 6)}
            if s.depth == 0:
                args = {p: round(float(times[p]), 6) for p in SPAN_PHASES if p in times}
                args["phases_ms"] = round(sum(x.ms for x in slices if x.depth == 1), 6)
            events.append(
                {
                    "ph": "X",
                    "name": name if s.depth == 0 else s.name,
                    "cat": "step" if s.depth == 0 else "phase",
                    "pid": pid,
                    "tid": rank,
                    **_span_us(s.start_ms, s.ms, start_us),
                    "args": args,
                }
            )
    return (slot if slot > 0 else UNMEASURED_SLOT_MS), events


def _step_events(step: TraceStep, pid: int, at_us: int, slot_ms: float, index: int):
    """The step's slice on the steps track and its counters."""
    counters = step.counters
    figures: dict[str, Any] = {
        **step.figures,
        **{
            f"{name}: {k}": round(v, 6)
            for name, series in counters.items()
            for k, v in series.items()
        },
    }
    if not step.times:
        figures["note"] = "no per-rank times recorded for this step"
    span = _span_us(0.0, slot_ms, at_us)
    events = [
        {
            "ph": "X",
            "name": step.name(index),
            "cat": "step",
            "pid": pid,
            "tid": STEPS_TRACK,
            **span,
            "args": figures,
        }
    ]
    events += [
        {"ph": "C", "name": name, "pid": pid, "ts": span["ts"], "args": series}
        for name, series in counters.items()
    ]
    return events


def build_trace(runs: dict[str, Sequence[RoutingPlan]], source: str = "") -> dict[str, Any]:
    """The trace of ``runs`` (run name -> plans) as a JSON-ready dict."""
    if not any(runs.values()):
        raise KnapformerError("no plan to trace")
    return trace_document(
        {run: [plan_step(p) for p in plans] for run, plans in runs.items()}, source
    )


def trace_document(runs: dict[str, Sequence[TraceStep]], source: str = "") -> dict[str, Any]:
    """The trace of ``runs`` (run name -> steps) as a JSON-ready dict."""
    from knapformer import __version__

    return {
        "traceEvents": step_events(runs),
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": f"knapformer {__version__} trace",
            "source": source,
            "layout": "steps at their recorded wall-clock start (plan.time; ts in µs since "
            "the Unix epoch); phases laid out inside each step in the order a step runs "
            "them (the recorder keeps per-phase sums, not timestamps)",
        },
    }


def write_trace(
    path: str | os.PathLike, trace: dict[str, Any], more_events: Iterable[str] = ()
) -> Path:
    """Write ``trace`` as JSON to ``path`` (strict JSON: no NaN or infinity), whole or not
    at all (`knapformer.contract.output_file`). ``more_events``: pieces of JSON text, each
    events separated by commas, written after the trace's own events, each made only when
    it is written (a merge holds one profiler trace at a time)."""
    with output_file(path) as f:
        f.write('{"traceEvents":[')
        wrote = _write_events(f, _json(trace["traceEvents"])[1:-1], False)
        for events in more_events:
            wrote = _write_events(f, events, wrote)
        f.write("]")
        for key, value in trace.items():
            if key != "traceEvents":
                f.write(f",{json.dumps(key)}:{_json(value)}")
        f.write("}")
    return Path(path)


def _write_events(f: IO[str], events: str, after: bool) -> bool:
    """Write ``events`` (JSON text) as items of the open events list, a comma first when
    ``after`` others; whether any event has been written."""
    if not events:
        return after
    f.write(("," if after else "") + events)
    return True


def _json(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))
