"""Merge torch.profiler traces of each rank into a ``knapformer trace`` file, one process
per rank, the balancer's phases and the profiler's events on one clock.

What a profiler folder holds: Chrome-trace JSON files (``.json`` or ``.json.gz``), one per
rank, as ``torch.profiler.tensorboard_trace_handler(DIR)`` or
``prof.export_chrome_trace(path)`` write them.

- **Which rank** a file is: ``distributedInfo.rank`` in the trace (torch.profiler writes
  it when a process group was initialised), else a ``rank<N>`` in the file name
  (``rank3.json``, ``trainer_rank_3.pt.trace.json``); a file with neither is refused by
  name.
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

import gzip
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError, file_error
from knapformer.tools.trace import STEPS_TRACK

#: pid of rank 0 in a merged trace (rank r: RANK_PID + r).
RANK_PID = 1000
#: tid of a rank's knapformer track in its process.
KNAPFORMER_TID = 0
#: The balancer's ``record_function`` range around planning (aligns a trace without a
#: base time).
PLAN_RANGE = "knapformer.plan"
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
_SUFFIXES = (".json", ".json.gz")


def profiler_files(folder: Path) -> list[Path]:
    """The Chrome-trace files of a profiler folder, sorted; refuses a folder with none."""
    if not folder.is_dir():
        raise KnapformerError(f"--merge {str(folder)!r} is not a folder of torch.profiler traces")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES))
    if not files:
        raise KnapformerError(
            f"no torch.profiler trace (*.json, *.json.gz) in {str(folder)!r}: write them with "
            "torch.profiler.tensorboard_trace_handler or prof.export_chrome_trace"
        )
    return files


def read_profiler_trace(path: Path) -> dict[str, Any]:
    """One profiler trace file as a dict (gzipped or not); a file that is not a Chrome
    trace is refused by name."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if path.name.endswith(".gz") else raw
        trace = json.loads(text)
    except OSError as err:
        raise file_error(path, err, "cannot read") from err
    except (ValueError, EOFError) as err:  # bad JSON, bad gzip
        raise KnapformerError(f"{path}: not a Chrome trace ({err})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise KnapformerError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def rank_of(trace: dict[str, Any], path: Path) -> int:
    """The rank a profiler trace is of: ``distributedInfo.rank``, else ``rank<N>`` in the
    file name."""
    info = trace.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    match = _RANK_IN_NAME.search(path.name)
    if match:
        return int(match.group(1))
    raise KnapformerError(
        f"{path}: cannot tell its rank: the trace has no distributedInfo.rank and the file "
        "name no rank<N> (profile after init_process_group, or name the file rank<N>.json)"
    )


def clock_offset_us(trace: dict[str, Any], path: Path, plans: Sequence[RoutingPlan]) -> float:
    """What to add to the trace's ``ts`` to get microseconds since the Unix epoch (see the
    module doc: ``baseTimeNanoseconds``, else the first `PLAN_RANGE` at the run's first
    recorded step)."""
    base = trace.get("baseTimeNanoseconds")
    if isinstance(base, int | float) and base > 0:
        return base / 1e3
    starts = [e["ts"] for e in trace["traceEvents"] if e.get("name") == PLAN_RANGE and "ts" in e]
    times = [p.time for p in plans if p.time is not None]
    if starts and times:
        return min(times) * 1e6 - min(starts)
    raise KnapformerError(
        f"{path}: cannot put it on the wall clock: no baseTimeNanoseconds (torch >= 2.4 "
        f"writes it) and no {PLAN_RANGE} range matched with a recorded plan time"
    )


def merge_profiler(
    trace: dict[str, Any], folder: Path, plans: Sequence[RoutingPlan]
) -> dict[str, Any]:
    """``trace`` (of `knapformer.tools.trace.build_trace`, one run whose ``plans`` are
    given) with the profiler traces of ``folder`` merged in, one process per rank."""
    traces = {}
    for path in profiler_files(folder):
        loaded = read_profiler_trace(path)
        rank = rank_of(loaded, path)
        if rank in traces:
            raise KnapformerError(
                f"two profiler traces of rank {rank} in {str(folder)!r}: {traces[rank][1].name}"
                f" and {path.name} (keep one per rank)"
            )
        traces[rank] = (loaded, path)
    events = _knapformer_by_rank(trace["traceEvents"])
    ranks = sorted({*traces, *(p for plan in plans for p in plan.gpus)})
    for rank in ranks:
        pid = RANK_PID + rank
        events += [
            _meta("process_name", pid, None, {"name": f"rank {rank}"}),
            _meta("process_sort_index", pid, None, {"sort_index": rank}),
        ]
    for rank, (loaded, path) in sorted(traces.items()):
        events += _profiler_events(loaded, rank, clock_offset_us(loaded, path, plans))
    merged = dict(trace)
    merged["traceEvents"] = events
    merged["otherData"] = {
        **trace.get("otherData", {}),
        "merged": f"torch.profiler traces of {len(traces)} rank(s) from {folder}, on the "
        "wall clock (ts in µs since the Unix epoch)",
    }
    return merged


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
    """The events of one rank's profiler trace in its process, on the wall clock: one
    thread per (profiler process, thread), named after both."""
    pid = RANK_PID + rank
    process_names: dict[Any, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            key = (e.get("pid"), e.get("tid"))
            thread_names[key] = str(e.get("args", {}).get("name", e.get("tid")))
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
        if not isinstance(e, dict) or e.get("ph") in (None, "M"):
            continue  # names are carried over as thread names above
        moved = {**e, "pid": pid, "tid": tid_of((e.get("pid"), e.get("tid")))}
        if "ts" in e:
            moved["ts"] = float(e["ts"]) + offset_us
        if "id" in e:
            moved["id"] = f"rank{rank}:{e['id']}"
        out.append(moved)
    return out
