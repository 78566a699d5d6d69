"""Reading and writing plan files: JSON (one plan, ours or legacy, or a list) and JSONL.

Readers report problems as ``path:line: message`` and either skip the bad record or
raise, as the caller chooses. No input makes them raise anything else: too deep, too long
or too large records, FIFOs and undecodable bytes are problems like any other. A record's
shape is counted before it is parsed and JSON that Python reads but JSON does not allow
(``NaN``, ``Infinity``, an object with a key twice) is refused
(`knapformer.contract.strict_json`); records are validated strictly (no boolean or
string read as a number).
Nothing here knows about files growing live; the dashboard's tailer builds on
``parse_plan_line``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal

import numpy as np
from pydantic import ValidationError
from pydantic_core import to_json

from knapformer.contract.legacy import is_legacy, plan_from_legacy
from knapformer.contract.limits import MAX_RECORD_BYTES, abbreviate, printable
from knapformer.contract.output_file import output_file
from knapformer.contract.plan import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, RoutingPlan
from knapformer.contract.strict_json import (
    TOO_DEEP,
    TOO_LARGE,
    JsonRecordError,
    check_shape,
    decode_json,
)
from knapformer.errors import KnapformerError, OptionError, file_error

#: A file whose first lines are this many non-JSON-object lines is not read further.
NOT_A_PLAN_FILE_AFTER = 3
NOT_A_PLAN_FILE = (
    f"this does not look like a plan file: its first {NOT_A_PLAN_FILE_AFTER} lines are not "
    "JSON objects; stopped reading"
)


class PlanFormatError(KnapformerError):
    """A record that is not a valid plan; ``str()`` is a one-line reason. ``line`` is the
    line of the file the reason points at, when known."""

    line: int | None = None


@dataclass(frozen=True)
class Problem:
    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        # A path from the file system may hold undecodable bytes (as lone surrogates).
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return printable(f"{where}: {self.message}")


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


_ERRORS_IN_MESSAGE = 3


def describe_validation_error(err: ValidationError) -> str:
    """One short line: the first errors as ``field.path: message``, then how many more."""
    errors = err.errors(include_url=False)
    parts = []
    for e in errors[:_ERRORS_IN_MESSAGE]:
        loc = abbreviate(".".join(str(x) for x in e["loc"]), 60)
        msg = abbreviate(str(e["msg"]).removeprefix("Value error, "), 300)
        if not isinstance(e.get("input"), dict | list) and "Value error" not in e["msg"]:
            msg += f", got {abbreviate(repr(e.get('input')))}"  # a value of the wrong type
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = len(errors) - _ERRORS_IN_MESSAGE
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_plan_record(record: Any) -> RoutingPlan:
    """Validate one decoded JSON record (ours or legacy) into a `RoutingPlan`."""
    if not isinstance(record, dict):
        raise PlanFormatError(f"expected a JSON object, got {type(record).__name__}")
    try:
        if is_legacy(record):
            return plan_from_legacy(record)
        version = record.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
            raise PlanFormatError(
                f"schema_version {abbreviate(repr(version))} is not supported (this reader "
                f"understands {', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
            )
        return RoutingPlan.model_validate(record, strict=True)
    except ValidationError as err:
        raise PlanFormatError(describe_validation_error(err)) from err
    except PlanFormatError:
        raise
    except ValueError as err:
        raise PlanFormatError(str(err)) from err
    except (KeyError, TypeError, IndexError, AttributeError) as err:  # malformed structure
        raise PlanFormatError(f"malformed record ({type(err).__name__}: {err})") from err
    except RecursionError:
        raise PlanFormatError(TOO_DEEP) from None
    except MemoryError:
        raise PlanFormatError(TOO_LARGE) from None


def _checked(data: bytes) -> None:
    """`PlanFormatError` when the record ``data`` holds more than a plan can, before
    anything is parsed (`knapformer.contract.strict_json.check_shape`)."""
    try:
        check_shape(data)
    except JsonRecordError as err:
        raise PlanFormatError(str(err)) from None


def _decode(text: str) -> Any:
    """``text`` read strictly as JSON (`knapformer.contract.strict_json.decode_json`); its
    failures as `PlanFormatError` (``line`` set when known). Its shape was checked."""
    try:
        return decode_json(text)
    except JsonRecordError as err:
        problem = PlanFormatError(str(err))
        problem.line = err.line
        raise problem from None


def parse_plan_line(text: str) -> RoutingPlan:
    """Parse one JSONL line."""
    _checked(text.encode("utf-8", "surrogatepass"))
    return parse_plan_record(_decode(text))


def read_plans(path: str | os.PathLike, on_error: Literal["skip", "raise"] = "skip") -> ReadResult:
    """Read every plan of a file. ``on_error="raise"`` raises `PlanFormatError` on the first
    bad record (message ``path:line: reason``); ``"skip"`` collects it in ``problems``."""
    result = ReadResult()
    for item in iter_plan_file(path):
        if isinstance(item, PlanRecord):
            result.records.append(item)
        elif on_error == "raise":
            raise PlanFormatError(str(item))
        else:
            result.problems.append(item)
    return result


def iter_plan_file(path: str | os.PathLike) -> Iterator[PlanRecord | Problem]:
    """Every plan of a file as a `PlanRecord` and every bad record as a `Problem`, in file
    order; the caller decides what to keep.

    A ``.jsonl`` file is streamed (only the current line is held). Another file is read
    whole, up to `MAX_RECORD_BYTES`, as one JSON document (a plan, a legacy summary or a
    list of plans), and as JSONL when it is not one. Only regular files are read (a FIFO
    would block); a record over `MAX_RECORD_BYTES` is a problem, skipped unread.
    """
    path = Path(path)
    try:
        handle = _open_regular_file(path)
    except PlanFormatError as err:
        yield Problem(str(path), None, str(err))
        return
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if path.suffix != ".jsonl" and size <= MAX_RECORD_BYTES:
            yield from _document_or_lines(path, handle.read())
        else:
            yield from _lines(path, handle)


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` that is not a regular file is, for a message
    (``a FIFO``, ``a character device``, ...)."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a file")


def _open_regular_file(path: Path) -> BinaryIO:
    """``path`` opened for binary reading; `PlanFormatError` when it cannot be read or is
    not a regular file. Opened non-blocking, so a FIFO is recognised, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise PlanFormatError(f"cannot read: {err.strerror or err}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise PlanFormatError(f"not a regular file ({file_kind(mode)})")
    return os.fdopen(fd, "rb")


def _document_or_lines(path: Path, data: bytes) -> Iterator[PlanRecord | Problem]:
    """The records of a whole-file JSON document; if it is not one, of its lines."""
    where = str(path)
    try:
        _checked(data)
        whole = _decode(data.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        yield Problem(where, None, f"cannot read: not UTF-8 text (byte {err.start:,})")
        return
    except PlanFormatError as err:
        if b"\n" not in data.strip():  # one line: its error is the document's
            yield Problem(where, getattr(err, "line", None) or 1, str(err))
            return
        # Maybe JSONL under another name. If no line holds a plan either, the document's
        # own error is the one to report (once, not once per line of an indented file).
        items = list(_lines(path, io.BytesIO(data)))
        document = data.lstrip()[:1] in (b"{", b"[")  # else: README.md, a CSV, a log
        if any(isinstance(i, PlanRecord) for i in items) or len(items) <= 1 or not document:
            yield from items
        else:
            yield Problem(where, getattr(err, "line", None) or 1, str(err))
        return
    records = whole if isinstance(whole, list) else [whole]
    for i, record in enumerate(records):
        try:
            yield PlanRecord(parse_plan_record(record), 1)
        except PlanFormatError as err:
            yield Problem(where, 1, f"record {i}: {err}" if isinstance(whole, list) else str(err))


def _lines(path: Path, handle: BinaryIO) -> Iterator[PlanRecord | Problem]:
    """The records of a JSONL stream, one per non-blank line (lines end at ``\\n`` only)."""
    where = str(path)
    # A file whose first NOT_A_PLAN_FILE_AFTER lines cannot be JSON objects (README.md, a
    # CSV, a log) is not read further: one problem says so instead of one per line.
    number, blank, plans, not_objects = 0, True, 0, 0
    while line := handle.readline(MAX_RECORD_BYTES + 1):
        number += 1
        if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
            length = len(line) + _skip_line(handle)
            blank = False
            yield Problem(
                where,
                number,
                f"line of {length:,} bytes skipped: a record holds at most "
                f"{MAX_RECORD_BYTES:,} (knapformer.contract.limits)",
            )
            continue
        if not line.strip():
            continue
        blank = False
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            yield Problem(where, number, f"not UTF-8 text (byte {err.start + 1:,} of the line)")
            continue
        try:
            _checked(line)
            yield PlanRecord(parse_plan_record(_decode(text)), number)
            plans += 1
        except PlanFormatError as err:
            yield Problem(where, number, str(err))
            if not plans and not text.lstrip().startswith("{"):
                not_objects += 1
                if not_objects == NOT_A_PLAN_FILE_AFTER:
                    yield Problem(where, None, NOT_A_PLAN_FILE)
                    return
    if blank:
        yield Problem(where, None, "file is empty")


def _skip_line(handle: BinaryIO, chunk: int = 2**20) -> int:
    """Read past the rest of the current line in chunks; returns the bytes skipped."""
    skipped = 0
    while part := handle.readline(chunk):
        skipped += len(part)
        if part.endswith(b"\n"):
            break
    return skipped


def write_jsonl(path: str | os.PathLike, plans: Iterable[RoutingPlan], append: bool = False) -> int:
    """Write one plan per line; returns how many were written. A new file is written
    whole or not at all (`knapformer.contract.output_file`); ``append`` adds to the end
    of an existing one."""
    count = 0
    with _writing(path, append) as f:
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
    """Write one plan (or a legacy dict) as a JSON document, whole or not at all."""
    with output_file(path) as f:
        if isinstance(plan, RoutingPlan):
            f.write(plan.model_dump_json(indent=indent))
        else:
            json.dump(plan, f, indent=indent)
        f.write("\n")


def _writing(path: str | os.PathLike, append: bool) -> contextlib.AbstractContextManager[IO[str]]:
    """A file to append to, or a new one written whole (`output_file`); a path the user
    cannot write to is a `KnapformerError`."""
    if not append:
        return output_file(path)
    try:
        return open(path, "a", encoding="utf-8")
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
