"""Fuzz: mutated sample plans thrown at the parser and at the command line.

The contract (docs/reliability.md): whatever the bytes, `parse_plan_line` returns a valid,
usable plan or raises `PlanFormatError` with a short one-line message, and ``validate`` /
``show`` exit 0 or 1 printing no traceback. Mutations start from the committed samples
(ours, legacy, with measurements) and an auto plan (``policy: "auto"``), and mix
structural edits (hostile values at any path, dropped or unknown keys, cut or stretched
columns) with textual ones (cuts, deep nesting, 5,000-digit numbers, stray bytes).

``KNAPFORMER_FUZZ_EXAMPLES`` sets the parser's example count (default 2,000; the CLI runs
a tenth of it); ``KNAPFORMER_FUZZ_RANDOM=1`` draws new examples instead of the fixed,
reproducible set the suite runs.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import auto_plan_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapformer.cli import main
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import PlanFormatError, parse_plan_line

SAMPLES = Path(__file__).resolve().parent.parent / "sample_plans"
EXAMPLES = int(os.environ.get("KNAPFORMER_FUZZ_EXAMPLES", "2000"))
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=os.environ.get("KNAPFORMER_FUZZ_RANDOM") != "1",
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
MAX_MESSAGE = 600  # characters: one short line, whatever the input echoes


def _bases() -> list[dict]:
    docs = [
        json.loads((SAMPLES / name).read_text())
        for name in ("mixed8_g1n2+g2n1+g4n1.json", "legacy_mixed8.json", "joint32_g8n4.json")
    ]
    for name in ("demo.jsonl", "joint32_50steps.jsonl"):  # with measurements; 4 bag sizes
        docs.append(json.loads((SAMPLES / name).read_text().splitlines()[3]))
    return [*docs, auto_plan_record()]


BASES = _bases()
HOSTILE: list[Any] = [
    2**63, 2**64, -(2**63) - 1, 2**63 - 1, 2**53 + 1, 2**31, 4 * 10**9, 10**9, 10**30, -1, 0,
    1, 3, 6, 7, 16384, 1.5, 1e308, -1e308, float("inf"), float("nan"), True, None, "", "7",
    "g1n99999999999", "auto", "fixed", [3], [1, 2, 4, 16384], [[0, 2], [1, 3]],
    "g2n4", "x" * 300, [], {}, [[]], [0, 0], [2**63], [10**9, 0], {"0": [0]}, {"a": {"b": [1]}},
]  # fmt: skip


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in a decoded JSON document (dict keys, list indices)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for step in path[:-1]:
        doc = doc[step]
    return doc


def _hostile(draw) -> Any:
    return copy.deepcopy(draw(st.sampled_from(HOSTILE)))


def _structural(draw, doc: Any, paths: list[tuple]) -> None:
    """One edit of ``doc`` in place at a drawn path."""
    path = paths[draw(st.integers(0, len(paths) - 1))]
    parent, key = _parent(doc, path), path[-1]
    kind = draw(st.sampled_from(["value", "value", "delete", "extra", "cut", "grow", "swap"]))
    target = parent[key]
    if kind == "value":
        parent[key] = _hostile(draw)
    elif kind == "delete":
        del parent[key]
        if isinstance(parent, list):
            return
    elif kind == "extra" and isinstance(target, dict):
        target[draw(st.sampled_from(["extra", "0", str(2**64), "topology"]))] = _hostile(draw)
    elif kind == "cut" and isinstance(target, list):
        del target[draw(st.integers(0, len(target))) :]
    elif kind == "grow" and isinstance(target, list):
        target.extend([_hostile(draw)] * draw(st.integers(1, 3)))
    elif kind == "swap" and isinstance(target, list) and len(target) > 1:
        i, j = draw(st.integers(0, len(target) - 1)), draw(st.integers(0, len(target) - 1))
        target[i], target[j] = target[j], target[i]
    else:
        parent[key] = _hostile(draw)


def _textual(draw, text: str) -> str:
    """One edit of the serialised record."""
    kind = draw(st.sampled_from(["cut", "insert", "digits", "nest", "bytes"]))
    at = draw(st.integers(0, len(text)))
    if kind == "cut":
        return text[:at]
    if kind == "insert":
        junk = draw(st.sampled_from(["[", "{", "]", "}", ",", ":", '"', "-", "e9", "\\u"]))
        return text[:at] + junk * draw(st.integers(1, 3)) + text[at:]
    if kind == "digits":  # a number of thousands of digits where a number was
        digits = "9" * draw(st.sampled_from([19, 20, 400, 4301, 6000]))
        return text.replace(": 0", ": " + digits, 1) if ": 0" in text else digits + text
    if kind == "nest":
        depth = draw(st.sampled_from([10, 900, 1200, 50_000]))
        return text[:at] + "[" * depth + "]" * depth + text[at:]
    junk = draw(st.binary(min_size=1, max_size=4)).decode("latin-1")
    return text[:at] + junk + text[at:]


@st.composite
def mutated_records(draw) -> str:
    which = draw(st.integers(0, len(BASES) - 1))
    doc = json.loads(json.dumps(BASES[which]))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:  # the document became a scalar or an empty container
            break
        if draw(st.booleans()):  # fields and whole columns as often as single entries
            paths = [p for p in paths if len(p) <= 2] or paths
        _structural(draw, doc, paths)
    text = json.dumps(doc)
    if draw(st.integers(0, 3)) == 0:
        text = _textual(draw, text)
    return text


def check_record(text: str) -> RoutingPlan | None:
    """The parser's contract for one record."""
    try:
        plan = parse_plan_line(text)
    except PlanFormatError as err:
        message = str(err)
        assert "\n" not in message and 0 < len(message) <= MAX_MESSAGE, message[:2000]
        return None
    # What parsed is usable by every reader: its stats, its JSON, and it round-trips.
    stats = plan.stats
    assert np.isfinite(stats.total_load) and stats.tokens_after.sum() == stats.total_tokens
    assert parse_plan_line(plan.model_dump_json()) == plan
    return plan


@settings(FUZZ, max_examples=EXAMPLES)
@given(mutated_records())
def test_parser_never_raises_anything_but_a_one_line_format_error(text):
    check_record(text)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


@settings(FUZZ, max_examples=max(EXAMPLES // 10, 1))
@given(
    records=st.lists(mutated_records(), min_size=1, max_size=3),
    jsonl=st.booleans(),
    bad_byte=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_validate_and_show_exit_0_or_1_without_traceback(fuzz_dir, records, jsonl, bad_byte):
    path = fuzz_dir / ("plans.jsonl" if jsonl else "plans.json")
    data = ("\n".join(records) + "\n").encode("utf-8", errors="surrogatepass")
    if bad_byte is not None:  # a byte that is not UTF-8
        at = bad_byte % len(data)
        data = data[:at] + b"\xff" + data[at:]
    path.write_bytes(data)
    good = path.with_name("good.json")
    good.write_text((SAMPLES / "mixed8_g1n2+g2n1+g4n1.json").read_text())

    code, out = run_cli("validate", str(path), str(good))
    assert code in (0, 1) and "Traceback" not in out, out[-3000:]
    lines = out.splitlines()
    # One line per problem, each naming the file; the good file after it is still checked.
    assert lines[-1] == f"{good}: 1 plan(s) OK", out[-3000:]
    assert all(line.startswith(f"{path}") for line in lines[:-1]), out[-3000:]
    assert (code == 0) == (lines[0].startswith(f"{path}: ") and lines[0].endswith("OK"))

    code, out = run_cli("show", str(path))
    assert code in (0, 1) and "Traceback" not in out, out[-3000:]
    if code == 1:
        assert out.startswith("error: ") and out.count("\n") == 1, out[-3000:]
