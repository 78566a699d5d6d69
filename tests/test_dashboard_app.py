"""The Dash server over HTTP without a browser: the page, the callbacks, the status API."""

from __future__ import annotations

import json
import urllib.request

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
