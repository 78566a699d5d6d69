"""Reading and writing plan files: JSON (one plan, ours or legacy, or a list) and JSONL.

Readers report problems as ``path:line: message`` and either skip the bad record or
raise, as the caller chooses. Nothing here knows about files growing live; the
dashboard's tailer builds on ``parse_plan_line``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
from pydantic import ValidationError
from pydantic_core import to_json

from knapformer.errors import KnapformerError, OptionError, file_error
from knapformer.legacy import is_legacy, plan_from_legacy
from knapformer.plan import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, RoutingPlan


class PlanFormatError(KnapformerError):
    """A record that is not a valid plan; ``str()`` is a one-line reason."""


@dataclass(frozen=True)
class Problem:
    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class PlanRecord:
    plan: RoutingPlan
    line: int  # 1-based line of the record in its file (1 for a whole-file JSON)


@dataclass
class ReadResult:
    records: list[PlanRecord] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def plans(self) -> list[RoutingPlan]:
        return [r.plan for r in self.records]


def describe_validation_error(err: ValidationError) -> str:
    """One line: each error as ``field.path: message``."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_plan_record(record: Any) -> RoutingPlan:
    """Validate one decoded JSON record (ours or legacy) into a `RoutingPlan`."""
    if not isinstance(record, dict):
        raise PlanFormatError(f"expected a JSON object, got {type(record).__name__}")
    try:
        if is_legacy(record):
            return plan_from_legacy(record)
        version = record.get("schema_version", SCHEMA_VERSION)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise PlanFormatError(
                f"schema_version {version!r} is not supported (this reader understands "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
            )
        return RoutingPlan.model_validate(record)
    except ValidationError as err:
        raise PlanFormatError(describe_validation_error(err)) from err
    except PlanFormatError:
        raise
    except ValueError as err:
        raise PlanFormatError(str(err)) from err
    except (KeyError, TypeError, IndexError, AttributeError) as err:  # malformed structure
        raise PlanFormatError(f"malformed record ({type(err).__name__}: {err})") from err


def parse_plan_line(text: str) -> RoutingPlan:
    """Parse one JSONL line."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFormatError(f"not valid JSON ({err.msg} at column {err.colno})") from err
    return parse_plan_record(record)


def read_plans(path: str | os.PathLike, on_error: Literal["skip", "raise"] = "skip") -> ReadResult:
    """Read every plan of a file. ``on_error="raise"`` raises `PlanFormatError` on the first
    bad record (message ``path:line: reason``); ``"skip"`` collects it in ``problems``."""
    path = Path(path)
    result = ReadResult()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        problem = Problem(str(path), None, f"cannot read: {getattr(err, 'strerror', None) or err}")
        if on_error == "raise":
            raise PlanFormatError(str(problem)) from err
        result.problems.append(problem)
        return result

    def fail(line: int | None, message: str) -> None:
        problem = Problem(str(path), line, message)
        if on_error == "raise":
            raise PlanFormatError(str(problem))
        result.problems.append(problem)

    if not text.strip():
        fail(None, "file is empty")
        return result
    whole = None
    if path.suffix != ".jsonl":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
    if whole is not None:
        records = whole if isinstance(whole, list) else [whole]
        for i, record in enumerate(records):
            try:
                result.records.append(PlanRecord(parse_plan_record(record), 1))
            except PlanFormatError as err:
                fail(1, f"record {i}: {err}" if isinstance(whole, list) else str(err))
        return result
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            result.records.append(PlanRecord(parse_plan_line(line), number))
        except PlanFormatError as err:
            fail(number, str(err))
    return result


def write_jsonl(path: str | os.PathLike, plans: Iterable[RoutingPlan], append: bool = False) -> int:
    """Write one plan per line; returns how many were written."""
    count = 0
    with _open_for_writing(path, "a" if append else "w") as f:
        for plan in plans:
            f.write(plan.model_dump_json() + "\n")
            count += 1
    return count


#: Numbers per piece of `json_line_pieces`: converting this many to JSON holds the GIL
#: for well under a millisecond.
PIECE_NUMBERS = 4096


def json_line_pieces(plan: RoutingPlan) -> Iterator[bytes]:
    """The plan as one JSON line (UTF-8, no newline), in pieces of bounded work.

    Joined, the pieces parse to what ``plan.model_dump_json()`` writes. That call is one
    C call holding the GIL for the whole plan (~17 ms for a 2 MB plan); here ``gpus``,
    ``bags`` and every column of ``sequences``, ``chunks`` and ``measurements.per_rank_ms``
    are written at most `PIECE_NUMBERS` numbers at a time, so a caller on a background
    thread can let other threads run between pieces. Non-finite floats are written
    ``null``, as pydantic does.
    """
    tables = {"gpus", "bags", "sequences", "chunks", "measurements"}
    head = plan.model_dump_json(exclude=tables)
    yield head[:-1].encode()  # without its closing brace: the tables follow
    yield b',"gpus":['
    yield from _number_pieces(plan.gpus)
    yield b'],"bags":['
    yield from _bag_pieces(plan.bags)
    yield b"]"
    for name in ("sequences", "chunks"):
        table = getattr(plan, name)
        yield f',"{name}":{{'.encode()
        for i, column in enumerate(type(table).model_fields):
            yield f'{"," if i else ""}"{column}":['.encode()
            yield from _number_pieces(getattr(table, column))
            yield b"]"
        yield b"}"
    yield b',"measurements":'
    measured = plan.measurements
    if measured is None:
        yield b"null}"
        return
    rest = measured.model_dump_json(exclude={"per_rank_ms"})
    yield (rest[:-1] + ("," if rest != "{}" else "") + '"per_rank_ms":{').encode()
    for i, (phase, values) in enumerate(measured.per_rank_ms.items()):
        yield f"{',' if i else ''}{json.dumps(phase)}:[".encode()
        yield from _number_pieces(values)
        yield b"]"
    yield b"}}}"


def _bag_pieces(bags: list[list[int]]) -> Iterator[bytes]:
    """The bags (lists of GPU ranks) as comma-separated JSON, about `PIECE_NUMBERS` ranks
    at a time (whole bags)."""
    ends = np.cumsum(np.fromiter(map(len, bags), dtype=np.int64, count=len(bags)))
    start = 0
    while start < len(bags):
        done = int(ends[start - 1]) if start else 0
        end = max(int(np.searchsorted(ends, done + PIECE_NUMBERS, side="right")), start + 1)
        yield (b"," if start else b"") + to_json(bags[start:end])[1:-1]
        start = end


def _number_pieces(values: Any) -> Iterator[bytes]:
    """A column's numbers (a list or an array) as comma-separated JSON, `PIECE_NUMBERS`
    at a time."""
    for start in range(0, len(values), PIECE_NUMBERS):
        part = values[start : start + PIECE_NUMBERS]
        part = part if isinstance(part, list) else np.asarray(part).tolist()
        text = to_json(part, inf_nan_mode="null")
        yield (b"," if start else b"") + text[1:-1]  # without the list's brackets


def write_json(
    path: str | os.PathLike, plan: RoutingPlan | dict, indent: int | None = None
) -> None:
    """Write one plan (or a legacy dict) as a JSON document."""
    with _open_for_writing(path, "w") as f:
        if isinstance(plan, RoutingPlan):
            f.write(plan.model_dump_json(indent=indent))
        else:
            json.dump(plan, f, indent=indent)
        f.write("\n")


def _open_for_writing(path: str | os.PathLike, mode: str) -> TextIO:
    """``open(path, mode)``; a path the user cannot write to is a `KnapformerError`."""
    try:
        return open(path, mode, encoding="utf-8")
    except OSError as err:
        raise file_error(path, err, "cannot write") from err


def select_step(result: ReadResult, step: int | None) -> PlanRecord:
    """The record of ``step`` (the plan's step field, else its index); default: the last."""
    if not result.records:
        raise PlanFormatError("no valid plan in the file")
    if step is None:
        return result.records[-1]
    for record in result.records:
        if record.plan.step == step:
            return record
    if all(r.plan.step is None for r in result.records) and 0 <= step < len(result.records):
        return result.records[step]
    steps = [r.plan.step for r in result.records if r.plan.step is not None]
    span = f"steps {min(steps)}..{max(steps)}" if steps else f"{len(result.records)} plan(s)"
    raise PlanFormatError(f"step {step} is not in the file (it holds {span})")


def parse_step_range(spec: str) -> tuple[int | None, int | None]:
    """``"A:B"`` → (A, B), both inclusive; either side may be empty (open end)."""
    first, sep, last = spec.partition(":")
    if not sep:
        raise OptionError(f"`steps` must look like A:B (e.g. 3:7), not {spec!r}")
    try:
        a = int(first) if first.strip() else None
        b = int(last) if last.strip() else None
    except ValueError:
        raise OptionError(f"`steps` must look like A:B with integer steps, not {spec!r}") from None
    if a is not None and b is not None and b < a:
        raise OptionError(f"`steps` {spec!r}: the last step is before the first")
    return a, b


def plans_in_range(result: ReadResult, spec: str) -> list[RoutingPlan]:
    """The plans whose step (or, when a file has no steps, index) lies in ``A:B``.

    The range counterpart of `select_step`, with the same step numbering.
    """
    a, b = parse_step_range(spec)
    if not result.records:
        raise PlanFormatError("no valid plan in the file")
    unnumbered = all(r.plan.step is None for r in result.records)
    chosen = []
    for index, record in enumerate(result.records):
        step = index if unnumbered else record.plan.step
        if step is not None and (a is None or step >= a) and (b is None or step <= b):
            chosen.append(record.plan)
    if not chosen:
        steps = [
            (i if unnumbered else r.plan.step)
            for i, r in enumerate(result.records)
            if unnumbered or r.plan.step is not None
        ]
        raise KnapformerError(
            f"no plan with a step in {spec!r} (the file holds steps {min(steps)}..{max(steps)})"
        )
    return chosen
