"""The Dash app: layout and callbacks of the live dashboard.

Two callbacks do the work. ``_tick`` runs every second (and on navigation): it reads the
run's snapshot, updates the header, notices, slider and timeline (appending new steps
with a `Patch` instead of resending the whole figure) and decides which step is shown.
``_details`` runs only when the shown step or the selected sequence changes: it re-reads
that one plan and draws the per-step views.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import flask
from dash import Dash, Input, Output, Patch, State, ctx, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from dashboard.guard import (
    guard_callbacks,
    is_int,
    is_list,
    is_number,
    is_str,
    list_of,
    optional,
    record,
)
from dashboard.store import RequestGate, Runs, Snapshot
from visualization.figures import (
    bag_load_figure,
    predicted_vs_measured_figure,
    selection_shapes,
    sequence_rows,
    timeline_columns,
    timeline_figure,
    timeline_mode,
    traffic_figure,
)

TICK_MS = 500
PAGE_LOAD_LINGER_S = 1.5
_SHOWN_PROBLEMS = 8
_HIDDEN = {"display": "none"}
_CARD = {
    "padding": "8px 14px",
    "border": "1px solid #dee2e6",
    "borderRadius": "6px",
    "minWidth": "150px",
}
_NOTICE = {
    "padding": "8px 12px",
    "margin": "8px 0",
    "background": "#fff4e6",
    "border": "1px solid #ffa94d",
    "borderRadius": "6px",
    "whiteSpace": "pre-wrap",
}


#: What each callback input and state may hold, by (component id, property): a request
#: with anything else is answered 400 before a callback runs (see dashboard.guard).
CALLBACK_SHAPES = {
    ("tick", "n_intervals"): optional(is_int),
    ("step-slider", "value"): optional(is_number),
    ("timeline", "clickData"): optional(
        record(points=list_of(record(customdata=is_number), nonempty=True))
    ),
    ("follow", "value"): optional(list_of(is_str)),
    ("run-picker", "value"): optional(is_str),
    ("run-picker", "options"): optional(is_list),
    ("client", "data"): record(required=False, run=optional(is_str), count=is_int),
    ("selection", "data"): optional(record(run=is_str, reset=is_int, index=is_int)),
    ("seq-table", "selected_row_ids"): optional(list_of(is_int)),
}


def _card(label: str, value_id: str) -> html.Div:
    return html.Div(
        [html.Div(label, style={"fontSize": "12px", "color": "#868e96"}), html.B(id=value_id)],
        style=_CARD,
    )


def _layout(runs: Runs) -> html.Div:
    # The newest step is chosen here, so the per-step views are computed in parallel with
    # the first tick instead of after it (one round trip less before the bars show).
    run = runs.default()
    store = runs.store(run)
    snap = store.snapshot() if store else None
    initial = None
    if snap is not None and snap.summaries:
        initial = {"run": run, "reset": snap.reset, "index": len(snap.summaries) - 1}
    return html.Div(
        [
            dcc.Interval(id="tick", interval=TICK_MS),
            # What the browser's timeline currently holds, so a tick can append to it.
            dcc.Store(id="client", data={"run": None, "reset": None, "count": 0}),
            # The step the per-step views show: run, reset counter, index.
            dcc.Store(id="selection", data=initial),
            html.H2("KnapFormer routing plans", style={"margin": "4px 0"}),
            html.Div(
                [
                    html.Span("run ", style={"marginRight": "6px"}),
                    dcc.Dropdown(id="run-picker", clearable=False, style={"width": "360px"}),
                ],
                id="run-picker-box",
                style=_HIDDEN,
            ),
            html.Div(
                [
                    _card("run", "stat-run"),
                    _card("steps seen", "stat-steps"),
                    _card("latest imbalance before → after", "stat-imbalance"),
                    _card("mean modelled speedup", "stat-speedup"),
                    _card("malformed records skipped", "stat-skipped"),
                ],
                style={"display": "flex", "gap": "10px", "flexWrap": "wrap"},
            ),
            html.Div(id="notice", role="alert", style=_HIDDEN),
            html.Div(
                [
                    html.Div(
                        dcc.Slider(id="step-slider", min=0, max=0, step=1, value=0, marks={}),
                        style={"flex": "1"},
                    ),
                    dcc.Checklist(
                        id="follow",
                        options=[{"label": " follow live", "value": "on"}],
                        value=["on"],
                        style={"whiteSpace": "nowrap"},
                    ),
                ],
                style={"display": "flex", "gap": "16px", "alignItems": "center", "margin": "8px"},
            ),
            html.Div(id="step-label", style={"margin": "0 8px", "fontWeight": "bold"}),
            html.Div(id="detail-notice", role="alert", style=_HIDDEN),
            dcc.Graph(id="bag-load", style={"height": "420px"}),
            html.Div(
                [
                    html.Div(dcc.Graph(id="timeline"), style={"flex": "1", "minWidth": "420px"}),
                    html.Div(
                        dcc.Graph(id="traffic", style={"height": "430px"}),
                        style={"flex": "1", "minWidth": "420px"},
                    ),
                ],
                style={"display": "flex", "gap": "10px", "flexWrap": "wrap"},
            ),
            html.Div(dcc.Graph(id="pvm"), id="pvm-box", style=_HIDDEN),
            html.H4("Sequences of the step (select one to highlight its chunks)"),
            dash_table.DataTable(
                id="seq-table",
                columns=[
                    {"name": "id", "id": "id", "type": "numeric"},
                    {"name": "source GPU", "id": "src_gpu", "type": "numeric"},
                    {"name": "length", "id": "length", "type": "numeric"},
                    {"name": "workload", "id": "workload", "type": "numeric"},
                    {"name": "bag", "id": "bag", "type": "numeric"},
                    {"name": "chunks", "id": "chunks", "type": "numeric"},
                    {"name": "destinations", "id": "destinations", "type": "text"},
                ],
                data=[],
                sort_action="native",
                filter_action="native",
                row_selectable="single",
                selected_rows=[],
                page_size=15,
                style_cell={"fontFamily": "monospace", "padding": "2px 8px"},
            ),
        ],
        style={"fontFamily": "system-ui, sans-serif", "margin": "8px 16px"},
    )


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _notice(snap: Snapshot | None, path: Path, run: str | None) -> list:
    if snap is None:
        return [f"no runs found in {path} (expected <run>/plans.jsonl or plan files)"]
    lines = list(snap.notices)
    if snap.problem_count:
        lines.append(f"{snap.problem_count} malformed record(s) skipped:")
        shown = snap.problems[-_SHOWN_PROBLEMS:]
        lines += [f"  {p}" for p in shown]
        if snap.problem_count > len(shown):
            lines.append(f"  … and {snap.problem_count - len(shown)} earlier")
    return lines


def _marks(snap: Snapshot) -> dict:
    n = len(snap.summaries)
    if n == 0:
        return {}
    picks = sorted({round(i * (n - 1) / 5) for i in range(6)})
    return {i: str(_step_of(snap, i)) for i in picks}


def _step_of(snap: Snapshot, index: int) -> int:
    step = snap.summaries[index].step
    return index if step is None else step


def create_app(path: str | Path) -> Dash:
    """The dashboard of PATH (a .jsonl, a .json, or a folder of runs)."""
    path = Path(path)
    gate = RequestGate()
    runs = Runs(path, gate)
    app = Dash(__name__, title="KnapFormer dashboard", update_title=None, serve_locally=True)
    app.layout = lambda: _layout(runs)
    runs.store(runs.default())  # start indexing now, not at the first page view
    timings: deque[float] = deque(maxlen=200)
    app.server.config["KNAPFORMER_RUNS"] = runs
    app.server.config["KNAPFORMER_TIMINGS"] = timings

    @app.server.before_request
    def _enter():
        gate.enter()

    @app.server.teardown_request
    def _leave(_exc):
        # Page and asset loads (GET) are followed by heavy parsing in the browser; live
        # updates (POST callbacks) are not.
        page_load = flask.request.method == "GET" and not flask.request.path.startswith("/api")
        gate.leave(PAGE_LOAD_LINGER_S if page_load else 0.0)

    guard_callbacks(app, CALLBACK_SHAPES)  # after the gate's hooks: a refusal still leaves it

    @app.server.route("/api/status")
    def status():
        """Steps and problems per followed run, and recent callback times (for benches)."""
        name = runs.default()
        store = runs.store(name)
        snap = store.snapshot() if store else None
        return {
            "run": name,
            "runs": list(runs.files()),
            "steps": len(snap.summaries) if snap else 0,
            "problems": snap.problem_count if snap else 0,
            "indexing": snap.indexing if snap else False,
            "callback_ms": list(timings),
        }

    @app.callback(
        Output("stat-run", "children"),
        Output("stat-steps", "children"),
        Output("stat-imbalance", "children"),
        Output("stat-speedup", "children"),
        Output("stat-skipped", "children"),
        Output("notice", "children"),
        Output("notice", "style"),
        Output("step-slider", "max"),
        Output("step-slider", "marks"),
        Output("step-slider", "value"),
        Output("follow", "value"),
        Output("timeline", "figure"),
        Output("client", "data"),
        Output("selection", "data"),
        Output("step-label", "children"),
        Output("run-picker", "options"),
        Output("run-picker", "value"),
        Output("run-picker-box", "style"),
        Input("tick", "n_intervals"),
        Input("step-slider", "value"),
        Input("timeline", "clickData"),
        Input("follow", "value"),
        Input("run-picker", "value"),
        State("client", "data"),
        State("selection", "data"),
        State("run-picker", "options"),
    )
    def _tick(_n, value, click, follow, run, client, selection, options):
        started = time.perf_counter()
        trigger = ctx.triggered_id
        files = runs.files()
        names = list(files)
        new_options = [{"label": n, "value": n} for n in names]
        picked = run
        if run not in files:
            run = runs.default()
        picker_style = {"display": "flex", "alignItems": "center", "margin": "6px 0"}
        if len(names) <= 1:
            picker_style = _HIDDEN
        store = runs.store(run)
        snap = store.snapshot() if store else None
        notice_lines = _notice(snap, path, run)
        notice_style = _NOTICE if notice_lines else _HIDDEN
        notice = [html.Div(line) for line in notice_lines]
        n = len(snap.summaries) if snap else 0
        last = max(n - 1, 0)
        following = "on" in (follow or [])
        run_changed = client.get("run") != run
        reset_changed = snap is not None and client.get("reset") != snap.reset

        signature = [
            run,
            snap.reset if snap else None,
            n,
            snap.problem_count if snap else 0,
            notice_lines,
            snap.indexing if snap else False,
        ]
        if trigger == "tick" and client.get("signature") == signature:
            raise PreventUpdate  # nothing new: send nothing, redraw nothing

        index = value if isinstance(value, int) else last
        if run_changed:
            following, index = True, last
        elif trigger == "timeline" and click:
            index = int(click["points"][0]["customdata"])
            following = index >= last
        elif trigger == "step-slider":
            following = following and index >= last  # scrubbing back stops following
        elif following:  # includes switching "follow live" back on
            index = last
        index = min(max(index, 0), last)

        if snap is None or n == 0:
            figure = timeline_figure([], validate=False)
            new_client = {"run": run, "reset": snap.reset if snap else None, "count": 0}
        elif run_changed or reset_changed or client.get("count", 0) > n or trigger is None:
            figure = timeline_figure(snap.summaries, index, validate=False)
            new_client = {"run": run, "reset": snap.reset, "count": n}
        else:
            # Same data on the client: append new steps and move the marker only.
            figure = Patch()
            count = client.get("count", 0)
            if count < n:
                switch = timeline_mode(n) != timeline_mode(count)
                for i, (x, y, c) in enumerate(timeline_columns(snap.summaries, count)):
                    figure["data"][i]["x"].extend(x)
                    figure["data"][i]["y"].extend(y)
                    figure["data"][i]["customdata"].extend(c)
                    if switch:
                        figure["data"][i]["mode"] = timeline_mode(n)
            figure["layout"]["shapes"] = selection_shapes(snap.summaries, index)
            new_client = {"run": run, "reset": snap.reset, "count": n}

        new_selection = {"run": run, "reset": snap.reset, "index": index} if snap and n else None
        if n:
            s = snap.summaries[index]
            latest = snap.summaries[-1]
            label = (
                f"step {_step_of(snap, index)} · {index + 1} of {n}"
                + (f" · line {s.line}" if s.line is not None else "")
                + ("" if following else " · not following live")
            )
            imbalance = f"{latest.imbalance_before:.3f} → {latest.imbalance_after:.3f}"
            run_label = latest.run or run
        else:
            label, imbalance, run_label = "no steps yet", "–", run or "–"
        steps = f"{n:,}" + (" (indexing…)" if snap and snap.indexing else "")
        out = (
            run_label,
            steps,
            imbalance,
            _fmt(snap.mean_speedup if snap else None, ".2f") + ("×" if snap and n else ""),
            str(snap.problem_count if snap else 0),
            notice,
            notice_style,
            last,
            _marks(snap) if snap else {},
            index if index != value else no_update,
            (["on"] if following else []) if following != ("on" in (follow or [])) else no_update,
            figure,
            new_client if new_client != client else no_update,
            new_selection if new_selection != selection else no_update,
            label,
            new_options if new_options != options else no_update,
            run if run != picked else no_update,
            picker_style,
        )
        timings.append((time.perf_counter() - started) * 1e3)
        return out

    @app.callback(
        Output("bag-load", "figure"),
        Output("traffic", "figure"),
        Output("pvm", "figure"),
        Output("pvm-box", "style"),
        Output("seq-table", "data"),
        Output("seq-table", "selected_rows"),
        Output("detail-notice", "children"),
        Output("detail-notice", "style"),
        Input("selection", "data"),
        Input("seq-table", "selected_row_ids"),
    )
    def _details(selection, selected_ids):
        started = time.perf_counter()
        if not selection:
            empty = {"data": [], "layout": {"template": "plotly_white"}}
            return empty, empty, empty, _HIDDEN, [], [], "", _HIDDEN
        store = runs.store(selection["run"])
        try:
            if store is None:
                raise LookupError(f"run {selection['run']!r} is gone")
            plan = store.plan(selection["index"], selection["reset"])
        except LookupError as err:
            message = f"cannot show this step: {err}"
            return (no_update,) * 6 + (message, _NOTICE)
        new_step = ctx.triggered_id != "seq-table"
        seq = None
        if not new_step and selected_ids:  # ids from before a step change are stale
            seq = int(selected_ids[0])
            if not 0 <= seq < len(plan.sequences):
                seq = None
        pvm = predicted_vs_measured_figure(plan, validate=False)
        out = (
            bag_load_figure(plan, seq, validate=False),
            traffic_figure(plan, seq, validate=False),
            pvm if pvm is not None else no_update,
            {"display": "block"} if pvm is not None else _HIDDEN,
            sequence_rows(plan) if new_step else no_update,
            [] if new_step else no_update,
            "",
            _HIDDEN,
        )
        timings.append((time.perf_counter() - started) * 1e3)
        return out

    return app
