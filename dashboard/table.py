"""The sequence table, paged, sorted and filtered on the server.

A 1,024-GPU plan holds ~30,000 sequences: sending them all to the browser at every step
switch costs seconds, so the table holds one page and the server sorts and filters the
plan's columns (numpy) for it. Filters use the table's own syntax as Dash writes it:
clauses like ``{length} > 1000`` or ``{destinations} contains 4`` joined by ``&&``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable

import numpy as np
from knapformer.visualization.figures import chunk_destinations, sequence_columns, sequence_rows

from knapformer.contract.plan import RoutingPlan

_CLAUSE = re.compile(r"\{(?P<column>[^}]+)\}\s*(?P<op>\S+)\s*(?P<value>.*)")
_COMPARE: dict[str, Callable] = {
    "=": operator.eq,
    "eq": operator.eq,
    "!=": operator.ne,
    "ne": operator.ne,
    "<": operator.lt,
    "lt": operator.lt,
    "<=": operator.le,
    "le": operator.le,
    ">": operator.gt,
    "gt": operator.gt,
    ">=": operator.ge,
    "ge": operator.ge,
}


def _value(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'`":
        return text[1:-1]
    return text


def _destinations(plan: RoutingPlan, cache: dict) -> np.ndarray:
    if "destinations" not in cache:
        cache["destinations"] = np.array(chunk_destinations(plan), dtype=object)
    return cache["destinations"]


def _column(plan: RoutingPlan, name: str, cache: dict) -> np.ndarray | None:
    if name == "destinations":
        return _destinations(plan, cache)
    return cache["numeric"].get(name)


def _keep(plan: RoutingPlan, clause: str, cache: dict) -> np.ndarray | None:
    """Mask of the rows a clause keeps; None for a clause this table cannot apply."""
    match = _CLAUSE.fullmatch(clause.strip())
    if match is None:
        return None
    column = _column(plan, match["column"], cache)
    op = match["op"].lower()
    if op[:1] in "si" and op[1:] in (*_COMPARE, "contains"):
        op = op[1:]  # case-(in)sensitive variants: the same on numbers and rank lists
    value = _value(match["value"])
    if column is None:
        return None
    if column.dtype == object:  # destinations: a list of ranks
        if op == "contains":
            wanted = value.split()
            return np.array([all(w in row.split() for w in wanted) for row in column])
        if op in _COMPARE:
            return np.array([_COMPARE[op](row, value) for row in column])
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if op == "contains":
        return np.char.find(column.astype(str), value) >= 0
    if op in _COMPARE:
        return _COMPARE[op](column, number)
    return None


def query(
    plan: RoutingPlan,
    page: int,
    page_size: int,
    sort_by: list[dict] | None = None,
    filter_query: str | None = None,
) -> tuple[list[dict], int, np.ndarray]:
    """One page of the sequence table: its rows, the number of pages, and the ids of every
    sequence the filter keeps in sorted order. Clauses the table cannot apply are
    ignored, so a half-typed filter does not empty the table."""
    cache = {"numeric": sequence_columns(plan)}
    n = len(plan.sequences)
    keep = np.ones(n, dtype=bool)
    for clause in (filter_query or "").split("&&"):
        if clause.strip():
            mask = _keep(plan, clause, cache)
            if mask is not None:
                keep &= mask
    ids = np.flatnonzero(keep)
    # Stable sorts from the last key to the first give a multi-column sort.
    for rule in reversed(sort_by or []):
        column = _column(plan, str(rule.get("column_id")), cache)
        if column is None:
            continue
        order = np.argsort(column[ids], kind="stable")
        if rule.get("direction") == "desc":
            order = order[::-1]
        ids = ids[order]
    size = max(int(page_size), 1)
    pages = max(-(-len(ids) // size), 1)
    page = min(max(int(page), 0), pages - 1)
    shown = ids[page * size : (page + 1) * size]
    return sequence_rows(plan, shown, cache["numeric"]), pages, ids
