"""Merge torch.profiler traces of each rank into a ``knapformer trace`` file, one process
per rank, the balancer's phases and the profiler's events on one clock.

The profiler traces are read one at a time, as foreign input
(`knapformer.tools.profiler_trace`: bounded, typed, of a rank the plans hold), and their
events are written out before the next is read, so memory holds one trace at a time.

- **Which rank** a file is: ``distributedInfo.rank`` in the trace (torch.profiler writes
  it when a process group was initialised), else a ``rank<N>`` in the file name
  (``rank3.json``, ``trainer_rank_3.pt.trace.json``); a file with neither is refused by
  name, and so is a rank that is not a GPU of the plans.
- **The clock**: knapformer places steps at their recorded wall clock, in microseconds
  since the Unix epoch (`knapformer.tools.trace`). torch.profiler (torch >= 2.4) writes
  ``ts`` relative to ``baseTimeNanoseconds``, so an event's wall clock is
  ``ts + baseTimeNanoseconds / 1000``. A trace without ``baseTimeNanoseconds`` is aligned
  on the wall clock of a profiled step: its first ``knapformer.plan`` range (the
  balancer's ``record_function`` around planning) is taken to start when the first
  recorded step whose plan it could be did, i.e. the earliest ``plan.time`` of the run
  (profile from the run's first recorded step, or record the trace with torch >= 2.4).
- **Where events go**: rank r is process `RANK_PID` + r, named ``rank r``; its
  knapformer track (the rank's phases of `knapformer.tools.trace`) is thread
  `KNAPFORMER_TID`, first; each (process, thread) of the rank's profiler trace becomes
  one thread of it, named after the profiler's process and thread names (``python
  4242 · thread 4242``, ``GPU 0 · stream 7``). Flow events keep their links within a
  rank (their ids are prefixed with the rank).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError
from knapformer.tools.profiler_trace import (
    clock_offset_us,
    non_finite_field,
    plan_ranks,
    profiler_files,
    rank_of,
    read_profiler_trace,
)
from knapformer.tools.trace import STEPS_TRACK

#: pid of rank 0 in a merged trace (rank r: RANK_PID + r).
RANK_PID = 1000
#: tid of a rank's knapformer track in its process.
KNAPFORMER_TID = 0


def merge_profiler(
    trace: dict[str, Any], folder: Path, plans: Sequence[RoutingPlan]
) -> tuple[dict[str, Any], Iterator[str]]:
    """``trace`` (of `knapformer.tools.trace.build_trace`, one run whose ``plans`` are
    given) with each rank's track in its own process, and the events of the profiler
    traces of ``folder`` as JSON text, one piece per trace, each read only when the
    iterator reaches it: give both to `knapformer.tools.trace.write_trace`. A bad trace
    raises a `KnapformerError` from the iterator."""
    files = profiler_files(folder)
    ranks = plan_ranks(plans)
    events = _knapformer_by_rank(trace["traceEvents"])
    for rank in sorted(ranks):
        pid = RANK_PID + rank
        events += [
            _meta("process_name", pid, None, {"name": f"rank {rank}"}),
            _meta("process_sort_index", pid, None, {"sort_index": rank}),
        ]
    merged = dict(trace)
    merged["traceEvents"] = events
    merged["otherData"] = {
        **trace.get("otherData", {}),
        "merged": f"torch.profiler traces of {len(files)} rank(s) from {folder}, on the "
        "wall clock (ts in µs since the Unix epoch)",
    }
    return merged, _profiler_pieces(files, folder, ranks, plans)


def _profiler_pieces(
    files: list[Path], folder: Path, ranks: set[int], plans: Sequence[RoutingPlan]
) -> Iterator[str]:
    """The events of each profiler trace in its rank's process, as JSON text (events
    separated by commas), one trace at a time."""
    seen: dict[int, Path] = {}
    for path in files:
        loaded = read_profiler_trace(path)
        rank = rank_of(loaded, path, ranks)
        if rank in seen:
            raise KnapformerError(
                f"two profiler traces of rank {rank} in {str(folder)!r}: {seen[rank].name}"
                f" and {path.name} (keep one per rank)"
            )
        seen[rank] = path
        events = _profiler_events(loaded, rank, clock_offset_us(loaded, path, plans))
        try:
            yield json.dumps(events, allow_nan=False, separators=(",", ":"))[1:-1]
        except ValueError:  # a literal beyond ±1.8e308 somewhere in an event
            raise KnapformerError(f"{path}: {non_finite_field(loaded)}") from None
        del loaded, events


def _meta(kind: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _knapformer_by_rank(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The knapformer trace's events with each rank's track moved into that rank's
    process; the steps track and the counters stay in the run's process."""
    out = []
    for e in events:
        tid = e.get("tid")
        if tid is None or tid == STEPS_TRACK:
            out.append(e)
            continue
        moved = {**e, "pid": RANK_PID + tid, "tid": KNAPFORMER_TID}
        if e["ph"] == "M" and e["name"] == "thread_name":
            moved["args"] = {"name": f"knapformer · {e['args']['name']}"}
        elif e["ph"] == "M" and e["name"] == "thread_sort_index":
            moved["args"] = {"sort_index": -1}
        out.append(moved)
    return out


def _profiler_events(trace: dict[str, Any], rank: int, offset_us: float) -> list[dict]:
    """The events of one rank's profiler trace (checked: `read_profiler_trace`) in its
    process, on the wall clock: one thread per (profiler process, thread), named after
    both. The trace's own event objects are moved, not copied."""
    pid = RANK_PID + rank
    process_names: dict[Any, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e.get("pid")] = _label(e, e.get("pid"))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e.get("pid"), e.get("tid"))] = _label(e, e.get("tid"))
    tids: dict[tuple[Any, Any], int] = {}
    out: list[dict] = []

    def tid_of(key: tuple[Any, Any]) -> int:
        if key not in tids:
            tids[key] = len(tids) + 1  # after the knapformer track
            process = process_names.get(key[0], f"process {key[0]}")
            thread = thread_names.get(key, f"thread {key[1]}")
            out.append(_meta("thread_name", pid, tids[key], {"name": f"{process} · {thread}"}))
            out.append(_meta("thread_sort_index", pid, tids[key], {"sort_index": tids[key]}))
        return tids[key]

    for e in trace["traceEvents"]:
        if e.get("ph") in (None, "M"):
            continue  # names are carried over as thread names above
        e["tid"] = tid_of((e.get("pid"), e.get("tid")))
        e["pid"] = pid
        if "ts" in e:
            e["ts"] = float(e["ts"]) + offset_us
        if "id" in e:
            e["id"] = f"rank{rank}:{e['id']}"
        out.append(e)
    return out


def _label(meta: dict[str, Any], fallback: Any) -> str:
    """The name a metadata event gives (text or a number), else ``fallback``'s."""
    name = (meta.get("args") or {}).get("name")  # "args": null is no name
    if isinstance(name, str | int | float) and not isinstance(name, bool):
        return str(name)
    return str(fallback)
