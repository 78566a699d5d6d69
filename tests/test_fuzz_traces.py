"""Fuzz: hostile torch.profiler traces through ``knapformer trace PLANS --merge DIR``.

Traces are mutated from one shaped like torch.profiler's (process and thread names,
operator slices with nested ``args``, flow events, the balancer's ``knapformer.plan``
ranges, ``baseTimeNanoseconds``, ``distributedInfo``) by the edits hostile or damaged
files make: any field of any event, or of the trace, given a value of another type, a
number beyond every bound or a JSON literal JSON does not allow; events that are not
objects; nesting up to 100,000 deep; keys given twice; ranks the plans do not hold; cut
files; gzip archives whole, cut or not gzip at all. Each merge must exit 0 with a whole,
strict-JSON trace, or 1 with one ``error:`` line naming a trace file, and leave no output
file behind (docs/reliability.md).

``KNAPFORMER_FUZZ_TRACES`` sets the count of merges (default 300) and
``KNAPFORMER_FUZZ_SEED`` the seed (default 0).
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from knapformer.cli import main

SAMPLES = Path(__file__).resolve().parent.parent / "sample_plans"
MERGES = int(os.environ.get("KNAPFORMER_FUZZ_TRACES", "300"))
SEED = int(os.environ.get("KNAPFORMER_FUZZ_SEED", "0"))
BASE_NS = 1_700_000_000_000_000_000
HOSTILE: list[Any] = [
    "abc", "", None, True, [7], {"a": 1}, [[[]]], -1, 0, 2**63, 10**330, 1e308, -1e308,
    5e-324, 1.5, "rank0", "\ud800", "../../x",
]  # fmt: skip
LITERALS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "-0"]
FIELDS = ["ph", "name", "pid", "tid", "ts", "dur", "id", "args", "cat", "bp"]
META_ARGS: list[Any] = [None, [], "x", {}, {"name": None}, {"name": [1]}, {"name": 1e308}]


def base_trace(rank: int) -> dict:
    """A trace as torch.profiler writes one, small."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 40, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 40, "tid": 41, "args": {"name": "main"}},
        {"ph": "M", "name": "process_sort_index", "pid": 40, "args": {"sort_index": 3}},
    ]
    for i in range(6):
        events.append({
            "ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 40, "tid": 41,
            "ts": 100.0 + 10 * i, "dur": 4.5,
            "args": {"External id": i, "Input Dims": [[4, 16], [16, 16]], "Ev Idx": i},
        })  # fmt: skip
    events += [
        {"ph": "X", "cat": "user_annotation", "name": "knapformer.plan", "pid": 40, "tid": 41,
         "ts": 90.0, "dur": 3.0},
        {"ph": "s", "id": 7, "pid": 40, "tid": 41, "ts": 101.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "f", "id": 7, "pid": "GPU 0", "tid": "stream 7", "ts": 102.0, "bp": "e",
         "cat": "ac2g", "name": "ac2g"},
        {"ph": "i", "s": "t", "name": "marker", "pid": 40, "tid": 41, "ts": 150.0},
    ]  # fmt: skip
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 8},
        "baseTimeNanoseconds": BASE_NS,
        "traceEvents": events,
    }


def _edit(rng: random.Random, doc: dict) -> str | None:
    """One structural edit in place; a literal to write in the text, when drawn."""
    events = doc.get("traceEvents")
    kind = rng.choice(["field", "field", "event", "top", "rank", "nest", "literal", "drop", "meta"])
    if kind == "meta" and isinstance(events, list):  # names of processes and threads
        metas = [e for e in events if isinstance(e, dict) and e.get("ph") == "M"]
        if metas:
            rng.choice(metas)["args"] = copy.deepcopy(rng.choice(META_ARGS))
        return None
    if kind in ("field", "nest", "literal") and isinstance(events, list) and events:
        event = rng.choice(events)
        if not isinstance(event, dict):
            return None
        name = rng.choice(FIELDS)
        if kind == "field":
            event[name] = copy.deepcopy(rng.choice(HOSTILE))
        elif kind == "nest":
            depth = rng.choice([3, 15, 40, 2000, 100_000])
            event["args"] = {"deep": "@@NEST@@" + str(depth)}
        else:
            event[rng.choice(["ts", "dur", "args"])] = "@@LITERAL@@"
            return rng.choice(LITERALS)
    elif kind == "event" and isinstance(events, list):
        events.insert(rng.randrange(len(events) + 1), copy.deepcopy(rng.choice(HOSTILE)))
    elif kind == "top":
        key = rng.choice(["traceEvents", "baseTimeNanoseconds", "distributedInfo"])
        doc[key] = copy.deepcopy(rng.choice(HOSTILE))
    elif kind == "rank" and isinstance(doc.get("distributedInfo"), dict):
        doc["distributedInfo"]["rank"] = rng.choice([100, -3, 8, 2**31, "3", None, 3.0, True])
    elif kind == "drop":
        doc.pop(rng.choice(["baseTimeNanoseconds", "distributedInfo", "traceEvents"]), None)
    return None


def hostile_trace(rng: random.Random, rank: int) -> tuple[str, bytes]:
    """(file name, bytes) of one mutated trace of ``rank``."""
    doc = base_trace(rank)
    literal = None
    for _ in range(rng.randint(1, 3)):
        literal = _edit(rng, doc) or literal
    text = json.dumps(doc)
    if literal is not None:
        text = text.replace('"@@LITERAL@@"', literal, 1)
    if "@@NEST@@" in text:
        start = text.index('"@@NEST@@')
        end = text.index('"', start + 1)
        depth = int(text[start + len('"@@NEST@@') : end])
        text = text[:start] + "[" * depth + "]" * depth + text[end + 1 :]
    if rng.random() < 0.05:
        text = text.replace('"traceEvents": ', '"traceEvents": [], "traceEvents": ', 1)
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]  # a file cut short
    data = text.encode("utf-8", "surrogatepass")
    name = rng.choice([f"rank{rank}", f"host_{rank}.pt.trace", f"worker-rank_{rank}"])
    packing = rng.choice(["json", "json", "gz", "gz-cut", "not-gz"])
    if packing == "json":
        return f"{name}.json", data
    packed = gzip.compress(data) if packing != "not-gz" else data
    if packing == "gz-cut":
        packed = packed[: rng.randrange(1, len(packed))]
    return f"{name}.json.gz", packed


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in the output")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.timeout(max(600, MERGES))
def test_every_hostile_trace_merges_whole_or_fails_in_one_line_leaving_nothing(tmp_path):
    rng = random.Random(SEED)
    plans = tmp_path / "plans.jsonl"
    plans.write_text("\n".join((SAMPLES / "demo.jsonl").read_text().splitlines()[:3]) + "\n")
    merged = refused = 0
    for index in range(MERGES):
        folder = tmp_path / f"prof{index}"
        folder.mkdir()
        for rank in rng.sample(range(8), rng.choice([1, 1, 2])):
            name, data = hostile_trace(rng, rank)
            (folder / name).write_bytes(data)
        out_dir = tmp_path / f"out{index}"
        out_dir.mkdir()
        out = out_dir / "trace.json"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = main(["trace", str(plans), "-o", str(out), "--merge", str(folder)])
        text = printed.getvalue()
        assert code in (0, 1) and "Traceback" not in text, text[-3000:]
        text.encode("utf-8")  # everything printed can be printed
        if code == 0:
            merged += 1
            assert [p.name for p in out_dir.iterdir()] == ["trace.json"]
            assert isinstance(_strict(out.read_text())["traceEvents"], list)
        else:
            refused += 1
            assert text.startswith("error: ") and text.count("\n") == 1, text[-3000:]
            assert str(folder) in text and len(text) < 1000, text
            assert list(out_dir.iterdir()) == []  # no partial output file
    assert merged and refused  # both outcomes are exercised
