"""`knapformer trace`: recorded plans as a Chrome Trace Event Format file, validated
strictly against the format and loaded for real in DevTools' trace viewer."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.contract.scalars import step_figures
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.trace import (
    COUNTERS,
    STEPS_TRACK,
    Slice,
    build_trace,
    layout_rank_step,
)

PHASES = {"X", "C", "M"}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def check_trace_format(trace: dict) -> None:
    """Strict checks of the JSON object form of the Trace Event Format, for the event
    types a knapformer trace uses (complete, counter and metadata events)."""
    json.dumps(trace, allow_nan=False)  # strict JSON: no NaN or infinity anywhere
    assert set(trace) <= {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    assert isinstance(trace.get("otherData", {}), dict)
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    named_threads, named_processes = set(), set()
    slices = defaultdict(list)
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int), e
        assert isinstance(e.get("args", {}), dict), e
        if e["ph"] == "M":
            assert e["name"] in METADATA, e
            key = "sort_index" if e["name"].endswith("sort_index") else "name"
            assert set(e["args"]) == {key}, e
            if e["name"].startswith("thread"):
                assert isinstance(e["tid"], int), e
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            if e["name"] == "process_name":
                named_processes.add(e["pid"])
            continue
        # Whole microseconds: boundaries that meet compare equal.
        assert isinstance(e["ts"], int) and e["ts"] > 0, e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int), e
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
            slices[(e["pid"], e["tid"])].append(e)
        else:  # a counter: numeric series only
            assert e["args"] and all(
                isinstance(v, int | float) and math.isfinite(v) for v in e["args"].values()
            ), e
    assert set(slices) <= named_threads  # every track has a name
    assert {pid for pid, _ in slices} <= named_processes
    # Slices of one track nest properly (what a flame chart needs), exactly: sorted by
    # start (the longer first at equal starts), each lies inside the open slice it starts
    # in; one that starts where another ends is outside it.
    for track in slices.values():
        stack: list[float] = []
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            assert not stack or end <= stack[-1], e
            stack.append(end)


def _demo_plans(sample_dir: Path):
    return read_plans(sample_dir / "demo.jsonl", on_error="raise").plans


def test_demo_trace_validates_and_holds_every_measured_phase(sample_dir):
    plans = _demo_plans(sample_dir)
    trace = build_trace({"demo": plans})
    check_trace_format(trace)
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    # One track per rank, named after its GPU and bag, and the steps track.
    plan = plans[0]
    for bag_id, members in enumerate(plan.bags):
        for rank in members:
            assert names[rank] == f"GPU {rank} · {plan.bag_label(bag_id)}"
    assert names[STEPS_TRACK] == "steps" and len(names) == len(plan.gpus) + 1
    # Steps at their recorded wall clock (µs since the epoch): each slot runs from its
    # plan's time to the next plan's.
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == STEPS_TRACK]
    assert [e["name"] for e in steps] == [f"step {p.step}" for p in plans]
    assert [e["ts"] for e in steps] == [round(p.time * 1e6) for p in plans]
    for a, b in itertools.pairwise(steps):
        assert b["ts"] == a["ts"] + a["dur"]
    # Every measured phase of every rank is a slice of its measured length in its step.
    for plan, slot in zip(plans, steps, strict=True):
        for position, rank in enumerate(plan.gpus):
            # the rank's step starts in the slot (later only when its previous one ran on)
            (step,) = [e for e in events if e.get("tid") == rank and e["name"] == slot["name"]]
            assert slot["ts"] <= step["ts"] < slot["ts"] + slot["dur"]
            mine = [
                e
                for e in events
                if e["ph"] == "X"
                and e["tid"] == rank
                and step["ts"] <= e["ts"] < step["ts"] + step["dur"]
            ]
            got = {e["name"]: e["dur"] / 1000 for e in mine if e["cat"] == "phase"}
            for phase, values in plan.measurements.per_rank_ms.items():
                if phase not in ("step", "compute"):
                    assert got[phase] == pytest.approx(values[position], abs=1.5e-3)  # µs ends
    # the last step's slot is its slowest rank's step
    assert steps[-1]["dur"] == pytest.approx(
        max(
            layout_rank_step({p: v[i] for p, v in plan.measurements.per_rank_ms.items()})[0]
            for i in range(len(plan.gpus))
        )
        * 1000,
        abs=1,  # whole microseconds
    )


def test_counters_carry_the_step_figures(sample_dir):
    plans = _demo_plans(sample_dir)
    events = build_trace({"demo": plans})["traceEvents"]
    counters = [e for e in events if e["ph"] == "C"]
    by_name = defaultdict(list)
    for e in counters:
        by_name[e["name"]].append(e)
    assert set(by_name) <= set(COUNTERS)
    for plan_index, plan in enumerate(plans):
        figures = step_figures(plan)
        for name, series in COUNTERS.items():
            present = {label: key for label, key in series.items() if key in figures}
            if not present:
                continue
            event = by_name[name][plan_index]
            assert event["args"] == {
                label: pytest.approx(figures[key]) for label, key in present.items()
            }
    # The demo recorded compute and planning time: those counters are there.
    assert "measured compute (max/mean)" in by_name and "planning time (ms)" in by_name


def test_phases_nest_where_a_training_loop_runs_them():
    times = {
        "plan": 40.0,
        "gather": 5.0,
        "record": 0.1,
        "route": 10.0,
        "pre_attn": 4.0,
        "post_attn": 6.0,
        "forward_backward": 200.0,
        "reverse_route": 12.0,
        "optimizer": 30.0,
        "data_loading": 7.0,  # a phase the training loop added
        "step": 300.0,
        "compute": 250.0,
    }
    span, slices = layout_rank_step(times)
    assert span == 300.0  # the measured step is longer than its phases
    by_name = {s.name: s for s in slices}
    assert by_name["step"] == Slice("step", 0.0, 300.0, 0)
    outer = [s.name for s in slices if s.depth == 1]
    assert outer == ["plan", "record", "forward_backward", "optimizer", "data_loading"]
    fb = by_name["forward_backward"]
    assert by_name["route"].start_ms == fb.start_ms  # route at the model's entry
    end = by_name["reverse_route"].start_ms + by_name["reverse_route"].ms
    assert end == pytest.approx(fb.start_ms + fb.ms)  # the way back at its exit
    assert by_name["gather"].depth == 2 and by_name["gather"].start_ms == 0.0
    assert "compute" not in by_name
    # Exchanges that do not fit inside forward_backward are laid out around it, and a
    # step shorter than its phases gets their sum.
    span, slices = layout_rank_step({"route": 50.0, "forward_backward": 20.0, "step": 10.0})
    assert [s.name for s in slices if s.depth == 1] == ["route", "forward_backward"]
    assert span == 70.0


def test_plans_without_measurements_still_give_a_valid_trace_of_their_figures(steps50_path):
    plans = read_plans(steps50_path, on_error="raise").plans
    trace = build_trace({"joint": plans})
    check_trace_format(trace)
    events = trace["traceEvents"]
    assert not [e for e in events if e["ph"] == "X" and e["tid"] != STEPS_TRACK]
    assert sum(e["ph"] == "C" for e in events) >= 3 * len(plans)


def test_cli_writes_a_trace_of_every_run_of_a_folder(tmp_path, capsys):
    model = WorkloadModel(256)
    for run, topology in (("a", "g1n2+g2n1"), ("b", "g2n2")):
        (tmp_path / "runs" / run).mkdir(parents=True)
        plans = [
            plan_routing([[300, 20], [900], [50], [40]], topology, model, step=s) for s in range(3)
        ]
        write_jsonl(tmp_path / "runs" / run / "plans.jsonl", plans)
    out = tmp_path / "trace.json"
    assert main(["trace", str(tmp_path / "runs"), "-o", str(out), "--steps", "1:2"]) == 0
    said = capsys.readouterr().out
    assert "4 steps of 2 runs" in said and "no plan carries per-rank times" in said
    trace = json.loads(out.read_text())
    check_trace_format(trace)
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes == ["knapformer · a", "knapformer · b"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "{tmp}/trace.txt"], "output must be a .json file"),
        (["--steps", "90:99", "-o", "{tmp}/t.json"], "no plan with a step in '90:99'"),
        (["-o", "{tmp}/missing/t.json"], "cannot write"),
    ],
)
def test_cli_user_errors_are_one_line(sample_dir, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["trace", str(sample_dir / "demo.jsonl"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.browser
@pytest.mark.slow
def test_the_trace_loads_in_chromiums_trace_viewer(sample_dir, tmp_path):
    from knapformer.visualization.browser import find_chromium, launch_chromium
    from knapformer.visualization.trace_viewer import load_trace

    if find_chromium() is None:
        pytest.skip("no Chromium on this machine")
    sync_api = pytest.importorskip("playwright.sync_api")
    out = tmp_path / "demo.json"
    assert main(["trace", str(sample_dir / "demo.jsonl"), "-o", str(out), "--steps", "3:8"]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    timed = [e for e in events if e["ph"] == "X"]
    span_ms = (max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)) / 1000
    broken = tmp_path / "broken.json"
    broken.write_text(out.read_text()[:-200])  # cut short: not JSON any more
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            # The viewer parsed every slice: it spans exactly the trace's time range.
            shown = load_trace(browser.new_page(viewport={"width": 1400, "height": 900}), out)
            assert shown == pytest.approx(span_ms, abs=0.01)
            with pytest.raises(RuntimeError, match="no loaded trace"):
                load_trace(browser.new_page(), broken, timeout_s=10)
        finally:
            browser.close()
