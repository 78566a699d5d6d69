"""`knapformer trace RUN --merge DIR`: a real gloo run recorded by PlanRecorder and
profiled by torch.profiler on every rank, merged into one trace on the wall clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.dist_helpers import run_world
from knapformer.tools.profiler_merge import KNAPFORMER_TID, RANK_PID
from knapformer.tools.trace import ORIGIN_MS, STEPS_TRACK, build_trace

STEPS = 3


def _recorded_worker(rank: int, world: int, folder: str) -> None:
    """Three balanced steps of a toy model on each rank, plans recorded on rank 0, under
    torch.profiler writing one trace per rank (tensorboard_trace_handler names the file
    after the host and process, so the rank comes from the trace's distributedInfo)."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    torch.manual_seed(rank)
    model = ToyDiT(16, 4, 1)
    mine = [7 + 5 * rank, 3]
    recorder = PlanRecorder(Path(folder) / "plans.jsonl") if rank == 0 else None
    handler = tensorboard_trace_handler(str(Path(folder) / "profiler"))
    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=handler):
        bal = SequenceBalancer("g2n1", recorder=recorder)
        for _ in range(STEPS):
            bal.plan_routing(mine, token_dim=16)
            model(torch.randn(sum(mine), 16), mine, balancer=bal).sum().backward()
        bal.finish()
        bal.close()
    if recorder is not None:
        recorder.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("profiled")
    (folder / "profiler").mkdir()
    run_world(_recorded_worker, 2, folder, str(folder))
    return folder


@pytest.mark.timeout(300)
def test_merged_trace_puts_both_kinds_of_events_of_a_rank_in_its_process(
    recorded, tmp_path, capsys
):
    out = tmp_path / "merged.json"
    assert main(["trace", str(recorded / "plans.jsonl"), "-o", str(out), "--merge",
                 str(recorded / "profiler")]) == 0  # fmt: skip
    assert "merged with the torch.profiler traces" in capsys.readouterr().out
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes[RANK_PID] == "rank 0" and processes[RANK_PID + 1] == "rank 1"
    plans = read_plans(recorded / "plans.jsonl", on_error="raise").plans
    assert len(plans) == STEPS
    sources = {}
    for path in (recorded / "profiler").iterdir():
        raw = json.loads(path.read_text())
        sources[raw["distributedInfo"]["rank"]] = raw
    assert set(sources) == {0, 1}
    for rank in (0, 1):
        pid = RANK_PID + rank
        mine = [e for e in events if e.get("pid") == pid and e["ph"] == "X"]
        ours = [e for e in mine if e["tid"] == KNAPFORMER_TID]
        theirs = [e for e in mine if e["tid"] != KNAPFORMER_TID]
        # the rank's knapformer track: its steps, at the recorded wall clock
        steps = [e for e in ours if e["cat"] == "step"]
        assert [e["name"] for e in steps] == [f"step {p.step}" for p in plans]
        assert steps[0]["ts"] == round(plans[0].time * 1e6)
        # the profiler's events, moved onto the wall clock by baseTimeNanoseconds
        raw = sources[rank]
        base_us = raw["baseTimeNanoseconds"] / 1e3
        ranges = [e for e in raw["traceEvents"] if e.get("name") == "knapformer.plan"]
        merged = [e for e in theirs if e["name"] == "knapformer.plan"]
        assert len(merged) == len(ranges) == STEPS
        assert [e["ts"] for e in merged] == [e["ts"] + base_us for e in ranges]
        # ... which is the clock the plans were stamped with: each step's planning range
        # starts right when its plan was made (a second is far beyond any scheduling
        # delay, and far below the years a relative clock would be off by)
        for plan, planning in zip(plans, merged, strict=True):
            assert abs(planning["ts"] - plan.time * 1e6) < 1e6
        names = {e["args"]["name"] for e in events if e.get("pid") == pid and e["ph"] == "M"
                 and e["name"] == "thread_name"}  # fmt: skip
        assert any(n.startswith("knapformer · GPU") for n in names) and len(names) >= 2
    # the steps track and the counters stay in the run's process
    assert any(e.get("tid") == STEPS_TRACK for e in events)


def test_a_trace_without_base_time_is_aligned_on_the_first_planning_range(recorded, tmp_path):
    plans = read_plans(recorded / "plans.jsonl", on_error="raise").plans
    profiler = tmp_path / "old"
    profiler.mkdir()
    for path in (recorded / "profiler").iterdir():
        raw = json.loads(path.read_text())
        rank = raw.pop("distributedInfo")["rank"]
        raw.pop("baseTimeNanoseconds")
        (profiler / f"trainer_rank{rank}.json").write_text(json.dumps(raw))  # rank by name
    out = tmp_path / "merged.json"
    assert main(["trace", str(recorded / "plans.jsonl"), "-o", str(out), "--merge",
                 str(profiler)]) == 0  # fmt: skip
    events = json.loads(out.read_text())["traceEvents"]
    for rank in (0, 1):
        first = min(
            e["ts"]
            for e in events
            if e.get("pid") == RANK_PID + rank and e.get("name") == "knapformer.plan"
        )
        assert first == pytest.approx(plans[0].time * 1e6, abs=1)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({}, "no torch.profiler trace"),
        ({"trace.json": "{}"}, "not a Chrome trace (no traceEvents list)"),
        ({"x.json": '{"traceEvents": [], "baseTimeNanoseconds": 1}'}, "cannot tell its rank"),
        (
            {"rank0.json": '{"traceEvents": []}'},
            "cannot put it on the wall clock",
        ),
        (
            {
                "rank1.json": '{"traceEvents": [], "baseTimeNanoseconds": 1}',
                "a_rank_1.json": '{"traceEvents": [], "baseTimeNanoseconds": 1}',
            },
            "two profiler traces of rank 1",
        ),
    ],
    ids=["empty", "not-a-trace", "no-rank", "no-clock", "same-rank"],
)
def test_merge_errors_are_one_line(tmp_path, capsys, layout, message):
    plans = [plan_routing([[30, 2], [9]], "g1n2", WorkloadModel(64), step=0)]
    write_jsonl(tmp_path / "plans.jsonl", plans)
    folder = tmp_path / "prof"
    folder.mkdir()
    for name, text in layout.items():
        (folder / name).write_text(text)
    code = main(["trace", str(tmp_path / "plans.jsonl"), "-o", str(tmp_path / "t.json"),
                 "--merge", str(folder)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_plans_without_a_time_follow_one_another_from_the_origin():
    plans = [
        plan_routing([[30, 2], [9]], "g1n2", WorkloadModel(64), step=s).model_copy(
            update={"time": None}
        )
        for s in range(3)
    ]
    steps = [
        e for e in build_trace({"r": plans})["traceEvents"] if e.get("tid") == STEPS_TRACK
        and e["ph"] == "X"
    ]  # fmt: skip
    assert steps[0]["ts"] == ORIGIN_MS * 1000
    assert [b["ts"] for b in steps[1:]] == [a["ts"] + a["dur"] for a in steps[:-1]]


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_merged_trace_loads_in_chromiums_trace_viewer(recorded, tmp_path):
    from knapformer.visualization.browser import find_chromium, launch_chromium
    from knapformer.visualization.trace_viewer import load_trace

    if find_chromium() is None:
        pytest.skip("no Chromium on this machine")
    sync_api = pytest.importorskip("playwright.sync_api")
    out = tmp_path / "merged.json"
    assert main(["trace", str(recorded / "plans.jsonl"), "-o", str(out), "--merge",
                 str(recorded / "profiler")]) == 0  # fmt: skip
    events = json.loads(out.read_text())["traceEvents"]
    timed = [e for e in events if e["ph"] == "X" and "dur" in e]
    span_ms = (max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)) / 1000
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            shown = load_trace(browser.new_page(viewport={"width": 1400, "height": 900}), out)
        finally:
            browser.close()
    # the viewer parsed both kinds of events: it spans the merged range, not one kind's
    ours = [e for e in timed if e["tid"] == KNAPFORMER_TID and e["pid"] >= RANK_PID]
    ours_ms = (max(e["ts"] + e["dur"] for e in ours) - min(e["ts"] for e in ours)) / 1000
    assert shown == pytest.approx(span_ms, rel=0.01, abs=0.05)
    assert span_ms >= ours_ms
