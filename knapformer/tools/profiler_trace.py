"""One torch.profiler trace read as foreign input: bounded before it is parsed, typed
field by field, on the ranks and the clock of the plans it is merged with
(`knapformer.tools.profiler_merge`).

A profiler folder holds Chrome-trace JSON files (``.json`` or ``.json.gz``), one per
rank, as ``torch.profiler.tensorboard_trace_handler(DIR)`` or
``prof.export_chrome_trace(path)`` write them. They are read under the rules plan files
are read under (`knapformer.contract.strict_json`, docs/reliability.md):

- **bounded before parsing**: at most `MAX_TRACE_BYTES` bytes, a ``.json.gz`` counted as
  it inflates (a small archive of gigabytes is refused after that many); containers,
  values and nesting counted on the bytes (`TRACE_SHAPE`);
- **strict JSON**: no ``NaN``/``Infinity``, no key twice, no number beyond ±1.8e308
  (`non_finite_field` names one; the merge finds it when it writes the events);
- **typed fields**: an event is an object; ``ph``, ``name`` text; ``pid``, ``tid`` and
  ``id`` a whole number or text; ``args`` an object; ``ts`` and ``dur`` finite numbers
  within `MAX_TRACE_US` (``dur`` ≥ 0); ``baseTimeNanoseconds`` a wall clock before year
  10,000; ``distributedInfo.rank`` a whole number;
- **ranks the plans hold**: a trace of a rank that is not a GPU of the plans is refused.

Each refusal is one `KnapformerError` naming the file and the field, e.g.
``prof/rank0.json: traceEvents[12].ts is 'abc'; it must be a number (µs)``.
"""

from __future__ import annotations

import gzip
import math
import re
import zlib
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from knapformer.contract.limits import (
    MAX_RANK,
    MAX_TRACE_BYTES,
    MAX_TRACE_CONTAINERS,
    MAX_TRACE_DEPTH,
    MAX_TRACE_US,
    MAX_TRACE_VALUES,
    MAX_UNIX_TIME,
    abbreviate,
    parse_count,
)
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.record_shape import RecordShape
from knapformer.contract.strict_json import JsonRecordError, read_json_record
from knapformer.errors import KnapformerError, file_error

#: What one profiler trace may hold, counted before it is parsed.
TRACE_SHAPE = RecordShape(
    MAX_TRACE_CONTAINERS, MAX_TRACE_VALUES, MAX_TRACE_DEPTH, "a profiler trace"
)
#: The balancer's ``record_function`` range around planning (aligns a trace without a
#: base time).
PLAN_RANGE = "knapformer.plan"
SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
_TEXT = (str,)
_ID = (int, str)


def profiler_files(folder: Path) -> list[Path]:
    """The Chrome-trace files of a profiler folder, sorted; refuses a folder with none.
    Only regular files are taken (a FIFO or a device named ``x.json`` is not one)."""
    if not folder.is_dir():
        raise KnapformerError(f"--merge {str(folder)!r} is not a folder of torch.profiler traces")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise KnapformerError(
            f"no torch.profiler trace (*.json, *.json.gz) in {str(folder)!r}: write them with "
            "torch.profiler.tensorboard_trace_handler or prof.export_chrome_trace"
        )
    return files


def read_profiler_trace(path: Path) -> dict[str, Any]:
    """One profiler trace file as a dict whose every event is typed (see the module doc);
    a `KnapformerError` naming the file and the field otherwise."""
    try:
        trace = read_json_record(_bounded_bytes(path), TRACE_SHAPE)
    except JsonRecordError as err:
        raise KnapformerError(f"{path}: not a Chrome trace: {err}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise KnapformerError(f"{path}: not a Chrome trace (no traceEvents list)")
    for index, event in enumerate(trace["traceEvents"]):
        _check_event(event, path, index)
    return trace


def _bounded_bytes(path: Path) -> bytes:
    """The bytes of ``path`` (inflated when it ends in ``.gz``), refused beyond
    `MAX_TRACE_BYTES` without reading further."""
    compressed = path.name.endswith(".gz")
    try:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if compressed else raw
            data = stream.read(MAX_TRACE_BYTES + 1)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise KnapformerError(f"{path}: not a gzip file ({err or 'it ends early'})") from None
    except OSError as err:
        raise file_error(path, err, "cannot read") from err
    if len(data) > MAX_TRACE_BYTES:
        size = "inflates to more than" if compressed else "holds more than"
        raise KnapformerError(
            f"{path}: {size} {MAX_TRACE_BYTES:,} bytes; a profiler trace is read up to that "
            "(knapformer.contract.limits): profile fewer steps"
        )
    return data


#: The typed fields of an event: (name, types, what the type is in words).
_EVENT_FIELDS = (
    ("ph", _TEXT, "text"),
    ("name", _TEXT, "text"),
    ("pid", _ID, "a whole number or text"),
    ("tid", _ID, "a whole number or text"),
    ("id", _ID, "a whole number or text"),
    ("args", (dict,), "an object"),
)
#: The times of an event: (name, least value).
_EVENT_TIMES = (("ts", -MAX_TRACE_US), ("dur", 0.0))


def _check_event(event: Any, path: Path, index: int) -> None:
    """`KnapformerError` naming ``traceEvents[index].FIELD`` when an event's field has the
    wrong type or an impossible value. A trace holds up to a million events: the place is
    written out only for a message."""
    if not isinstance(event, dict):
        raise KnapformerError(f"{_where(path, index)} is {_kind(event)}; an event is a JSON object")
    get = event.get
    for name, types, what in _EVENT_FIELDS:
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise KnapformerError(
                f"{_where(path, index)}.{name} is {_shown(value)}; it must be {what}"
            )
    for name, low in _EVENT_TIMES:
        if name in event:
            value = event[name]
            if type(value) in (int, float) and low <= value <= MAX_TRACE_US:
                continue  # the common case, decided as _check_time would
            _check_time(value, f"{_where(path, index)}.{name}", low)


def _where(path: Path, index: int) -> str:
    return f"{path}: traceEvents[{index:,}]"


def _check_time(value: Any, where: str, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KnapformerError(f"{where} is {_shown(value)}; it must be a number (µs)")
    if not low <= value <= MAX_TRACE_US:
        raise KnapformerError(
            f"{where} is {_number(value)} µs; it must lie in {low:g}..{MAX_TRACE_US:g} "
            "(knapformer.contract.limits)"
        )


def non_finite_field(trace: dict[str, Any]) -> str:
    """Where the first number of ``trace``'s events that is not finite is (a literal
    beyond ±1.8e308 reads as infinite), as ``traceEvents[3].args.flops is inf``."""
    for index, event in enumerate(trace["traceEvents"]):
        found = _non_finite(event, f"traceEvents[{index:,}]")
        if found is not None:
            return f"{found}; a number must be finite (a literal beyond ±1.8e308 reads as inf)"
    return "a number that is not finite"


def _non_finite(value: Any, where: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is {value}"
    if isinstance(value, dict):
        items = ((f"{where}.{abbreviate(str(k), 40)}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for w, v in items if (found := _non_finite(v, w)) is not None), None)


def _number(value: float) -> str:
    """A number for a message: an int of any size shortened, never converted to float."""
    return abbreviate(f"{value:,}", 32) if isinstance(value, int) else f"{value:.6g}"


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "text", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else "a number")


def _shown(value: Any) -> str:
    if isinstance(value, dict | list):
        return _kind(value)
    return abbreviate(repr(value))


def plan_ranks(plans: Sequence[RoutingPlan]) -> set[int]:
    """Every GPU rank of the plans: the ranks a profiler trace may be of."""
    return {rank for plan in plans for rank in plan.gpus}


def rank_of(trace: dict[str, Any], path: Path, ranks: Collection[int]) -> int:
    """The rank a profiler trace is of: ``distributedInfo.rank``, else ``rank<N>`` in the
    file name; it must be one of ``ranks`` (the plans' GPUs)."""
    info = trace.get("distributedInfo")
    if info is not None and not isinstance(info, dict):
        raise KnapformerError(f"{path}: distributedInfo is {_shown(info)}; it must be an object")
    rank = None if info is None else info.get("rank")
    source = "distributedInfo.rank"
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KnapformerError(f"{path}: {source} is {_shown(rank)}; it must be a whole number")
    if rank is None:
        match = _RANK_IN_NAME.search(path.name)
        if match is None:
            raise KnapformerError(
                f"{path}: cannot tell its rank: the trace has no distributedInfo.rank and the "
                "file name no rank<N> (profile after init_process_group, or name the file "
                "rank<N>.json)"
            )
        rank, source = parse_count(match.group(1), MAX_RANK, f"{path}: the rank"), "file name"
    if rank not in ranks:
        raise KnapformerError(
            f"{path}: rank {rank:,} ({source}) is not a GPU of the plans (ranks "
            f"{_span(ranks)}): a trace of another job, or of another balance group"
        )
    return rank


def _span(ranks: Collection[int]) -> str:
    ordered = sorted(ranks)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    shown = ", ".join(map(str, ordered[:8]))
    return shown + (f", … ({len(ordered):,} in all)" if len(ordered) > 8 else "")


def clock_offset_us(trace: dict[str, Any], path: Path, plans: Sequence[RoutingPlan]) -> float:
    """What to add to the trace's ``ts`` to get microseconds since the Unix epoch:
    ``baseTimeNanoseconds`` (torch >= 2.4), else the first `PLAN_RANGE` taken to start at
    the run's earliest ``plan.time``. The trace's events were checked."""
    base = trace.get("baseTimeNanoseconds")
    if base is not None:
        if isinstance(base, bool) or not isinstance(base, int | float):
            raise KnapformerError(f"{path}: baseTimeNanoseconds is {_shown(base)}; not a number")
        if not 0 < base <= MAX_UNIX_TIME * 1e9:
            raise KnapformerError(
                f"{path}: baseTimeNanoseconds is {_number(base)}; a wall clock in ns since "
                f"the Unix epoch lies in 0..{MAX_UNIX_TIME * 1e9:.6g} "
                "(knapformer.contract.limits)"
            )
        return base / 1e3
    starts = [e["ts"] for e in trace["traceEvents"] if e.get("name") == PLAN_RANGE and "ts" in e]
    times = [p.time for p in plans if p.time is not None]
    if starts and times:
        return min(times) * 1e6 - min(starts)
    raise KnapformerError(
        f"{path}: cannot put it on the wall clock: no baseTimeNanoseconds (torch >= 2.4 "
        f"writes it) and no {PLAN_RANGE} range matched with a recorded plan time"
    )
