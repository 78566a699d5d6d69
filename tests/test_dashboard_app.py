"""The Dash server over HTTP without a browser: the page, the callbacks, the status API."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from knapformer.dashboard.server import start_server


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.read().decode()


@pytest.fixture
def server(tmp_path, steps50_path):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(steps50_path.read_text().splitlines()[:3]) + "\n{broken\n")
    handle = start_server(path, port=0)
    yield handle, path
    handle.stop()


def test_port_zero_picks_a_free_port_and_debug_is_off(server):
    handle, _ = server
    assert handle.port > 0 and handle.url == f"http://127.0.0.1:{handle.port}/"
    status, page = _get(handle.url)
    assert status == 200 and "<title>KnapFormer dashboard</title>" in page
    # Dash debug off: no dev-tools UI, no props checking (and no reloader thread).
    assert '"ui":false' in page and '"props_check":false' in page


def test_status_reports_steps_and_problems(server):
    import time

    handle, _ = server
    deadline = time.monotonic() + 10
    while True:
        status = json.loads(_get(handle.url + "api/status")[1])
        if status["steps"] == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["steps"] == 3
    assert status["problems"] == 1
    assert status["run"] == "plans"


def test_stop_closes_the_socket(tmp_path, steps50_path):
    handle = start_server(steps50_path, port=0)
    url = handle.url
    handle.stop()
    with pytest.raises(OSError):
        _get(url)


def test_every_graph_of_the_first_page_has_a_figure_so_none_lays_out_made_up_axes(server):
    # A graph without a figure gets plotly's default axes, laid out and measured only to
    # be replaced: the page's dozen such graphs delayed the whole-run views' first draw.
    handle, _ = server
    layout = json.loads(_get(handle.url + "_dash-layout")[1])
    graphs = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Graph":
                graphs.append(node["props"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(layout)
    assert {"bag-load", "timeline", "run-heatmap", "drill-heatmap"} <= {g["id"] for g in graphs}
    for graph in graphs:
        figure = graph.get("figure")
        assert figure is not None, graph["id"]
        if not figure.get("data"):
            layout_of = figure.get("layout", {})
            assert layout_of["xaxis"]["visible"] is False, graph["id"]
            assert layout_of["yaxis"]["visible"] is False, graph["id"]


def test_the_header_straggler_line_is_kept_until_the_store_closes_a_segment(tmp_path, monkeypatch):
    # The page is laid out anew for each visitor: the store's straggler line (a read and
    # an analysis of its last steps) is made once per set of closed segments, not per page.
    from knapformer.dashboard import whole_run

    from knapformer.runtime.recorder import PlanRecorder
    from knapformer.testing.measured_plans import measured_run

    plans = measured_run(16, slow_rank=5, slow_factor=2.0, seed=3)
    made = []
    real = whole_run.store_headline
    monkeypatch.setattr(whole_run, "store_headline", lambda p: made.append(p) or real(p))
    kept, path = whole_run.WholeRun(), tmp_path / "run" / "plans.jsonl"
    with PlanRecorder(path, every=8, store_segment_steps=4) as rec:
        for plan in plans[:8]:
            rec.record(plan)
    kept.warm(path).join()  # what the server does as it starts
    assert made == [path]
    first = kept.headline(path)
    assert first.startswith("slow_gpu: rank 5") and "in 8 of 8 steps" in first
    assert kept.headline(path) == first and len(made) == 1  # kept: not made again
    with PlanRecorder(path, every=8, store_segment_steps=4) as rec:  # resumes the run
        for plan in plans[8:]:
            rec.record(plan)
    assert "in 16 of 16 steps" in kept.headline(path) and len(made) == 2
    assert kept.headline(tmp_path / "none.jsonl") is None and len(made) == 2


# ------------------------------------------- per-step figures of a run with a store
@pytest.fixture(scope="module")
def every10(tmp_path_factory):
    """40 measured steps, rank 5 slow, recorded with ``every=10``: 40 store rows, and 8
    full plans: steps 0, 10, 20, 30 (``every``) and 1, 11, 21, 31, kept by the store's
    writer because the verdict named rank 5 (one a window of 10 steps)."""
    from knapformer.runtime.recorder import PlanRecorder
    from knapformer.testing.measured_plans import measured_run

    plans = measured_run(40, slow_rank=5, slow_factor=2.0, seed=3)
    folder = tmp_path_factory.mktemp("every10") / "run"
    path = folder / "plans.jsonl"
    with PlanRecorder(path, every=10, store_segment_steps=16) as rec:
        for plan in plans:
            rec.record(plan)
    # the store's thread queues the plans it keeps when it gets to them: in step order
    # here, whatever the threads did
    lines = path.read_text().splitlines()
    path.write_text("\n".join(sorted(lines, key=lambda line: json.loads(line)["step"])) + "\n")
    return folder, plans


KEPT = [0, 1, 10, 11, 20, 21, 30, 31]


def _followed(path):
    from knapformer.dashboard.store import Runs

    runs = Runs(path)
    store = runs.store(runs.default())
    store.stop()  # read here, not by the follower thread
    while store.poll():
        pass
    return runs, store.snapshot()


def _view(runs):
    return {"run": runs.default()}


def test_the_timeline_holds_every_step_of_the_store_and_agrees_with_the_kept_plans(every10):
    from knapformer.dashboard import app

    folder, plans = every10
    _runs, snap = _followed(folder.parent)
    assert [s.step for s in snap.summaries] == KEPT
    shown = {"run": "run", "reset": snap.reset, "index": KEPT.index(20)}
    out = app._store_timeline(snap, shown, {}, first=True)
    figure, client = out["figure"], out["client"]
    after = next(t for t in figure.data if t.name == "after")
    assert list(after.x) == list(range(40))  # every step, not the 4 kept
    assert "40 steps" in figure.layout.title.text
    for plan in (plans[step] for step in KEPT):  # the kept plans' figures, where they are
        assert after.y[plan.step] == pytest.approx(plan.stats.imbalance_after, rel=1e-6)
    assert [s.x0 for s in figure.layout.shapes] == [20]  # the step shown
    # another step shown: only the marker moves
    moved = app._store_timeline(snap, shown | {"index": KEPT.index(30)}, client, first=False)
    assert moved["figure"].to_plotly_json()["operations"] == [
        {"operation": "Assign", "location": ["layout", "shapes"],
         "params": {"value": [app.step_marker(30)]}}
    ]  # fmt: skip
    with pytest.raises(app.PreventUpdate):  # the browser draws exactly this
        app._store_timeline(snap, shown, client, first=False)


def test_the_header_counts_every_step_and_its_figures_come_from_the_store(every10):
    from knapformer.dashboard import app, whole_run

    folder, plans = every10
    runs, _snap = _followed(folder.parent)
    values = app._header_values(runs, whole_run.WholeRun(), _view(runs))
    assert values["steps"] == "40 (8 full plans)"
    last = plans[-1].stats  # step 39: no full plan kept, its figures from the store
    assert values["imbalance"] == f"{last.imbalance_before:.3f} → {last.imbalance_after:.3f}"
    mean = np.mean([p.stats.speedup for p in plans])
    assert values["speedup"] == f"{mean:.2f}×"
    assert values["straggler"].startswith("slow_gpu: rank 5")


def test_a_step_without_a_full_plan_snaps_to_the_nearest_kept_one_and_says_so(every10):
    from knapformer.dashboard import app

    folder, _plans = every10
    _runs, snap = _followed(folder.parent)
    assert app._typed_step(snap, 21) == (KEPT.index(21), "")
    index, note = app._typed_step(snap, 14)
    assert index == KEPT.index(11) and note == (
        "· step 14 has no full plan (the recorder kept 8 full plans of 40 steps): its "
        "figures are on the timeline; showing the nearest full plan, step 11"
    )
    assert app._typed_step(snap, 500)[1].startswith("· step 500 is not in this run;")
    # a click on the store's timeline names a step (x), not a plan's index
    assert app._clicked_step(snap, {"x": 28, "customdata": 28})[0] == KEPT.index(30)
    assert app._clicked_step(snap, {"x": 31, "customdata": 31}) == (KEPT.index(31), "")
    assert app._kept_of(snap) == "8 full plans of 40 steps"


def test_a_run_without_a_store_keeps_the_plans_timeline_and_header(tmp_path, steps50_path):
    from knapformer.dashboard import app, whole_run

    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(steps50_path.read_text().splitlines()[:5]) + "\n")
    runs, snap = _followed(path)
    assert snap.store is None and app._all_steps(snap) is None
    values = app._header_values(runs, whole_run.WholeRun(), _view(runs))
    assert values["steps"] == "5"
    latest = snap.summaries[-1]
    assert values["imbalance"] == f"{latest.imbalance_before:.3f} → {latest.imbalance_after:.3f}"
    # a click carries the plan's index; steps are the plans'
    assert app._clicked_step(snap, {"customdata": 3}) == (3, "")
    assert app._kept_of(snap) == "5 steps"
    assert (
        app._typed_step(snap, 99)[1] == "· step 99 is not in this run; showing the nearest, step 4"
    )


def test_the_step_shown_reads_its_full_plan_and_the_stores_window_up_to_it(every10):
    from knapformer.dashboard import step_frame

    folder, plans = every10
    runs, snap = _followed(folder.parent)
    selection = {"run": "run", "reset": snap.reset, "index": KEPT.index(20)}
    out = step_frame.frame(runs, selection, None)
    assert out["label"] == "step 20 · 5 of 8 full plans (40 steps in all) · line 5"
    assert "step 20" in out["bag_load"].layout.title.text
    # the straggler views hold every step of the window from the store, not the 3 plans
    # (steps 0, 10, 20) kept up to it
    assert list(out["ratio"].data[0].x) == list(range(1, 21))
    assert "steps 1–20" in out["scatter"].layout.title.text
    rows = step_frame._store_rows(runs, selection, plans[20])
    flagged, _views = step_frame._stragglers(runs, selection, plans[20], rows)
    assert list(flagged) == [5]


def _bars(figure) -> dict[str, np.ndarray]:
    """Each stacked part of a phase figure: its ms per rank slot."""
    return {t.name: np.asarray(t.y, float) for t in figure.data if t.type == "bar"}


def _assert_same_parts(figure, expected) -> None:
    """The figure's bars are ``expected``'s parts (a `RankPhases`), to the store's
    rounding of times (1/128 ms; a wait is a difference of two)."""
    bars = _bars(figure)
    assert list(bars) == list(expected.parts)
    for name, ms in expected.parts.items():
        np.testing.assert_allclose(bars[name], ms, atol=2 / 128, err_msg=name)


def test_the_phase_window_averages_the_stores_last_steps_not_the_kept_plans(every10):
    from knapformer.dashboard import step_frame
    from knapformer.visualization.phase_figures import window_parts

    folder, plans = every10
    runs, snap = _followed(folder.parent)
    selection = {"run": "run", "reset": snap.reset, "index": KEPT.index(20)}
    out = step_frame.frame(runs, selection, None)
    title = out["phase_window"].layout.title.text
    assert "mean of 6 steps (15–20)" in title, title
    # the mean of steps 15..20 as their plans (all recorded, 5 of them not kept) give it
    _assert_same_parts(out["phase_window"], window_parts(plans[15:21]))
    # the kept plans up to step 20 (steps 0, 1, 10, 11, 20) would give another mean
    kept = window_parts([p for p in plans[:21] if p.step in KEPT])
    assert not np.allclose(
        _bars(out["phase_window"])[next(iter(kept.parts))],
        next(iter(kept.parts.values())),
        atol=2 / 128,
    )


def test_the_stores_phases_of_a_step_equal_its_full_plans(every10):
    from knapformer.dashboard import step_frame
    from knapformer.visualization.phase_figures import step_parts, store_parts

    folder, plans = every10
    runs, snap = _followed(folder.parent)
    for step in KEPT:  # every step both hold
        selection = {"run": "run", "reset": snap.reset, "index": KEPT.index(step)}
        rows = step_frame._store_rows(runs, selection, plans[step])
        from_store = store_parts(rows)[-1]
        from_plan = step_parts(plans[step])
        assert from_store.steps == from_plan.steps == [step]
        order = np.argsort(from_plan.ranks)
        assert from_store.ranks.tolist() == from_plan.ranks[order].tolist()
        assert list(from_store.parts) == list(from_plan.parts)
        assert from_store.styles == from_plan.styles
        for name, ms in from_plan.parts.items():
            np.testing.assert_allclose(from_store.parts[name], ms[order], atol=2 / 128)
        np.testing.assert_allclose(from_store.step_ms, from_plan.step_ms[order], atol=1 / 128)


def _callback(handle, output: str, values: dict, changed: tuple[str, ...] = ()) -> dict:
    """Run the server's callback whose output names ``output`` as the page would, its
    inputs and states set from ``values`` (by ``id.property``; the rest None), after a
    change of the inputs ``changed``."""
    deps = json.loads(_get(handle.url + "_dash-dependencies")[1])
    dep = next(d for d in deps if output in d["output"])

    def items(specs):
        return [{**d, "value": values.get(f"{d['id']}.{d['property']}")} for d in specs]

    outputs = [
        dict(zip(("id", "property"), name.split("@")[0].split("."), strict=True))
        for name in dep["output"].strip(".").split("...")
    ]
    body = {
        "output": dep["output"],
        "outputs": outputs,
        "inputs": items(dep["inputs"]),
        "state": items(dep["state"]),
        "changedPropIds": list(changed),
    }
    request = urllib.request.Request(
        handle.url + "_dash-update-component",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["response"]


def test_the_served_timeline_of_a_run_with_a_store_has_every_step(every10):
    from knapformer.testing.polling import wait_until

    folder, plans = every10
    handle = start_server(folder.parent, port=0)
    try:
        values = {
            "view.data": {"run": "run", "notices": []},
            "client.data": {"run": None, "reset": None, "count": 0},
        }
        drawn = {}

        def every_step():
            """the served timeline holds the store's 40 steps"""
            drawn.update(_callback(handle, "timeline.figure", values)["timeline"]["figure"])
            return len(drawn["data"][1]["x"]) == 40

        wait_until(every_step, 60)
        after = drawn["data"][1]
        assert after["name"] == "after" and after["x"] == list(range(40))
        for step in KEPT:
            assert after["y"][step] == pytest.approx(plans[step].stats.imbalance_after, 1e-6)
    finally:
        handle.stop()


@pytest.fixture
def late_plans(every10, tmp_path):
    """``every10``'s plans as the store's writer may leave them: those of steps 1, 11,
    21, 31 (kept for a verdict) written after steps 0, 10, 20, 30; without its store."""
    folder, _plans = every10
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    lines = (folder / "plans.jsonl").read_text().splitlines()
    lines.sort(key=lambda line: (json.loads(line)["step"] % 10 != 0, json.loads(line)["step"]))
    (run / "plans.jsonl").write_text("\n".join(lines) + "\n")
    return run.parent, [json.loads(line)["step"] for line in lines]


def test_the_slider_walks_the_steps_in_order_though_plans_came_late(late_plans):
    folder, steps = late_plans
    assert steps == [0, 10, 20, 30, 1, 11, 21, 31]
    from knapformer.testing.polling import wait_until

    handle = start_server(folder, port=0)
    try:
        values = {"view.data": {"run": "run", "notices": []}, "follow.value": ["on"]}
        first = {}

        def every_plan_read():
            """the server's follower has read the 8 plans"""
            first.update(_callback(handle, "follow-note.children", values))
            return first["step-slider"]["max"] == 7

        wait_until(every_plan_read, 60)
        shown = first["selection"]["data"]
        assert steps[shown["index"]] == 31 and first["step-slider"]["value"] == 7
        marks = first["step-slider"]["marks"]  # at places 0, 1, 3, 4, 6, 7 in step order
        assert [marks[k] for k in sorted(marks, key=int)] == ["0", "1", "11", "20", "30", "31"]
        for place, step in enumerate([0, 1, 10, 11, 20, 21, 30, 31]):
            moved = {**values, "step-slider.value": place, "selection.data": shown}
            out = _callback(handle, "follow-note.children", moved, ("step-slider.value",))
            picked = out["selection"]["data"] if "selection" in out else shown  # unchanged
            assert steps[picked["index"]] == step
            assert "value" not in out.get("step-slider", {})  # the slider stays where it is
    finally:
        handle.stop()


def test_without_a_store_the_phase_window_takes_the_measured_plans_in_step_order(late_plans):
    from knapformer.dashboard import step_frame

    folder, steps = late_plans
    runs, snap = _followed(folder)
    assert snap.store is None
    selection = {"run": "run", "reset": snap.reset, "index": steps.index(11)}
    out = step_frame.frame(runs, selection, None)
    # the plans up to step 11 in step order: 0, 1, 10, 11 (in file order, 0, 10, 20, 30,
    # 1, 11: steps after the one shown)
    assert "mean of 4 steps (0–11)" in out["phase_window"].layout.title.text
    assert list(out["ratio"].data[0].x) == [0, 1, 10, 11]
