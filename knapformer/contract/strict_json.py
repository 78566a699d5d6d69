"""JSON read strictly and within bounds: the one decoder of every foreign record (plans,
profiler traces).

A record's shape is counted on its bytes before it is parsed
(`knapformer.contract.record_shape`), so parsing costs at most what the largest valid
record costs. What Python's reader accepts but JSON does not is refused: ``NaN``,
``Infinity``, an object that gives a key twice (Python keeps the last silently). A
literal beyond ±1.8e308 (``1e400``) reads as infinite: the reader of a record's fields
refuses it (a plan's validation; a profiler trace's writer). Every failure,
the parser's own included (recursion, Python's 4,300-digit limit, memory), is a
`JsonRecordError` with a one-line reason.
"""

from __future__ import annotations

import json
from typing import Any

from knapformer.contract.limits import abbreviate
from knapformer.contract.record_shape import PLAN_SHAPE, RecordShape, shape_problem
from knapformer.errors import KnapformerError

TOO_DEEP = "nested too deeply to read (a plan is a few levels deep)"
TOO_LARGE = "too large to hold in memory"


class JsonRecordError(KnapformerError):
    """A record that cannot be read as JSON; ``line`` is the line of the record the reason
    points at, when known."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


class _NotJson(Exception):
    """What Python's JSON reader accepts but JSON does not (raised by its hooks)."""


def _constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number (write a finite number, or null)")


def _object(pairs: list[tuple[str, Any]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):  # Python keeps the last value silently
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _NotJson(f"key {abbreviate(repr(twice))} appears twice in one object")
    return record


def check_shape(data: bytes, shape: RecordShape = PLAN_SHAPE) -> None:
    """`JsonRecordError` when ``data`` holds more than a record of ``shape`` can
    (`shape_problem`), before anything is parsed."""
    problem = shape_problem(data, shape)
    if problem is not None:
        raise JsonRecordError(problem)


def decode_json(text: str) -> Any:
    """``json.loads(text)``, strictly (see the module doc); its failures as
    `JsonRecordError` (``line`` set when known). Check the shape first (`check_shape`)."""
    try:
        return json.loads(
            text,
            parse_constant=_constant,
            object_pairs_hook=_object,
        )
    except _NotJson as err:
        raise JsonRecordError(f"not valid JSON ({err})") from None
    except json.JSONDecodeError as err:
        # Some messages end in "starting at": the column completes them.
        reason = err.msg.removesuffix(" at")
        raise JsonRecordError(
            f"not valid JSON ({reason} at column {err.colno})", err.lineno
        ) from None
    except RecursionError:
        raise JsonRecordError(TOO_DEEP) from None
    except ValueError as err:  # Python refuses to convert ints of more than 4,300 digits
        reason = str(err).split(";")[0]
        raise JsonRecordError(f"holds a number too long to read ({reason})") from None
    except MemoryError:
        raise JsonRecordError(TOO_LARGE) from None


def read_json_record(data: bytes, shape: RecordShape) -> Any:
    """The JSON record ``data`` (UTF-8, a byte order mark allowed), its shape checked
    before it is parsed; a `JsonRecordError` naming what is wrong."""
    check_shape(data, shape)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise JsonRecordError(f"not UTF-8 text (byte {err.start:,})") from None
    return decode_json(text)
