"""What one JSON record holds, counted on its bytes before it is parsed.

Parsing builds a Python object per value, and the smallest values cost the most: the 3
bytes ``{},`` become a 64-byte dict, so a 100 MB file of empty objects needs 2.6 GB
before a reader can tell that no plan holds them. `shape_problem` counts a record's
containers (``{``, ``[``), values (``,``) and nesting depth against what the largest
plan can hold (`knapformer.contract.limits`: ``MAX_RECORD_*``) with a few C-speed passes
over the bytes and no per-value object, so parsing a record costs at most what the
largest valid plan costs, whatever the file holds. Other foreign records (a profiler's
trace) are counted the same way against their own `RecordShape`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from knapformer.contract.limits import (
    MAX_RECORD_CONTAINERS,
    MAX_RECORD_DEPTH,
    MAX_RECORD_VALUES,
)


@dataclass(frozen=True)
class RecordShape:
    """The most one kind of JSON record may hold; ``what`` names it in messages."""

    containers: int
    values: int
    depth: int
    what: str


#: A plan record: what the largest plan (or legacy summary) the bounds admit holds.
PLAN_SHAPE = RecordShape(MAX_RECORD_CONTAINERS, MAX_RECORD_VALUES, MAX_RECORD_DEPTH, "a plan")

# A JSON string, or an unterminated one running to the end (possessive: linear time on
# any input, and no retry from every later quote of a string that never ends).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENS = np.frombuffer(b"[{", dtype=np.uint8)


def shape_problem(data: bytes, shape: RecordShape = PLAN_SHAPE) -> str | None:
    """Why the JSON record ``data`` holds more than a record of ``shape`` can (None when
    it does not): too many containers or values, or nested too deeply. Counted outside
    strings; a malformed record is left for the JSON parser to describe."""
    counts = _counts(data)
    if _over(counts, shape) and b'"' in data:
        # Brackets and commas inside strings (a run named "a,b") are not structure.
        data = _STRING.sub(b'""', data)
        counts = _counts(data)
    containers, values, closes = counts
    if containers > shape.containers:
        return (
            f"holds {containers:,} objects and arrays; {shape.what} holds at most "
            f"{shape.containers:,} (knapformer.contract.limits); not read"
        )
    if values > shape.values:
        return (
            f"holds {values:,} values; {shape.what} holds at most {shape.values:,} "
            "(knapformer.contract.limits); not read"
        )
    if closes > shape.containers:  # unbalanced: the parser stops at the first one
        return None
    depth = _depth(data)
    if depth > shape.depth and b'"' in data:
        depth = _depth(_STRING.sub(b'""', data))
    if depth > shape.depth:
        return (
            f"nested too deeply to read ({depth:,} levels; {shape.what} is at most "
            f"{shape.depth} deep)"
        )
    return None


def _counts(data: bytes) -> tuple[int, int, int]:
    """(containers, values, closing brackets) of ``data``, strings included."""
    containers = data.count(b"{") + data.count(b"[")
    # Each value but the last of a container is followed by a comma; containers are values.
    values = data.count(b",") + containers
    return containers, values, data.count(b"}") + data.count(b"]")


def _over(counts: tuple[int, int, int], shape: RecordShape) -> bool:
    containers, values, closes = counts
    return containers > shape.containers or values > shape.values or closes > shape.containers


def _depth(data: bytes) -> int:
    """The deepest nesting of ``data``'s brackets (at most a few hundred thousand, as
    counted before)."""
    brackets = np.frombuffer(data.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    step = np.where(np.isin(brackets, _OPENS), 1, -1).astype(np.int32)
    return int(np.cumsum(step).max())
