"""``knapformer demo --profile DIR``: every worker writes a torch.profiler trace of its
training loop, which holds the balancer's ``knapformer.*`` ranges, and ``knapformer trace
RUN --merge DIR`` merges them with the recorded phases into one file, a process per rank."""

from __future__ import annotations

import json

import pytest

from knapformer.cli import main
from knapformer.local.demo import DemoConfig, run_demo
from knapformer.runtime import marks

pytestmark = pytest.mark.timeout(300)
WORLD = 2


def test_a_profiled_demo_merges_into_one_trace_with_the_balancers_ranges(tmp_path, capsys):
    out, traces = tmp_path / "run", tmp_path / "profile"
    run_demo(DemoConfig(steps=2, world_size=WORLD, topology="g2n1", out=out, profile=traces))
    files = sorted(p.name for p in traces.iterdir())
    assert len(files) == WORLD, files
    merged = tmp_path / "trace.json"
    assert main(["trace", str(out / "plans.jsonl"), "--merge", str(traces), "-o", str(merged)]) == 0
    capsys.readouterr()
    events = json.loads(merged.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    for mark in (marks.PLAN, marks.ROUTE, marks.PRE_ATTN, marks.REVERSE_ROUTE):
        assert mark in names, mark
    ranks = {e["pid"] for e in events if e.get("name") == marks.ROUTE}
    assert len(ranks) == WORLD  # one process per rank
