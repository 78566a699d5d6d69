"""The Dash app: layout and callbacks of the live dashboard, one callback per concern.

- run picker (`_watch_runs`): every tick (and when the user picks a run) it decides which
  run is shown and stores a small *view* of what that run holds now (steps, resets,
  problems, notices). It sends nothing when nothing changed, so an idle tick costs one
  request; the callbacks below follow the view, not the tick.
- header cards (`_header_cards`) and notices (`_notices`): drawn from the view.
- step selection (`_step_selection`): slider, "follow live" and timeline clicks decide
  which step is shown (the ``selection`` store).
- timeline (`_timeline`): appends new steps with a `Patch` instead of resending the
  whole figure, and marks the selected step.
- per-step views (`_step_views`): run only when the shown step or the selected sequence
  changes; they re-read that one plan and draw it.

Every callback names its outputs (dicts of `Output`), and figures are built by
`visualization.figures`.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from knapformer.runfiles import RUNS_LAYOUT
from knapformer.stats import before_after
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
_PICKER = {"display": "flex", "alignItems": "center", "margin": "6px 0"}
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
    ("selection", "data"): optional(
        record(run=optional(is_str), reset=optional(is_int), index=optional(is_int))
    ),
    ("view", "data"): optional(record(run=optional(is_str), notices=list_of(is_str))),
    ("run-picker-box", "style"): optional(record()),
    ("step-slider", "max"): optional(is_number),
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
            # What the shown run holds now (set by the run picker; the rest follow it).
            dcc.Store(id="view"),
            # What the browser's timeline currently holds, so an update can append to it.
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


def _notice(snap: Snapshot | None, path: Path) -> list[str]:
    if snap is None:
        return [f"no runs found in {path} (expected {RUNS_LAYOUT} or plan files)"]
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


def _view(run: str | None, snap: Snapshot | None, path: Path) -> dict:
    """What the shown run holds now: when this changes, the page has something to redraw."""
    return {
        "run": run,
        "reset": snap.reset if snap else None,
        "count": len(snap.summaries) if snap else 0,
        "problems": snap.problem_count if snap else 0,
        "indexing": snap.indexing if snap else False,
        "notices": _notice(snap, path),
    }


def _changed(new: dict[str, Any], shown: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the values the page already shows replaced by `no_update`; nothing at
    all to send raises `PreventUpdate`."""
    out = {key: no_update if value == shown.get(key) else value for key, value in new.items()}
    if all(value is no_update for value in out.values()):
        raise PreventUpdate
    return out


class _CallbackLog:
    """How many callbacks completed and how long the recent ones took (``/api/status``);
    a callback that sends nothing (`PreventUpdate`) does not count."""

    def __init__(self, keep: int = 200):
        self.recent_ms: deque[float] = deque(maxlen=keep)
        self.completed = 0

    def timed(self, callback: Callable) -> Callable:
        @functools.wraps(callback)
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = callback(*args, **kwargs)
            self.recent_ms.append((time.perf_counter() - started) * 1e3)
            self.completed += 1
            return out

        return run


def create_app(path: str | Path) -> Dash:
    """The dashboard of PATH (a .jsonl, a .json, or a folder of runs)."""
    path = Path(path)
    gate = RequestGate()
    runs = Runs(path, gate)
    app = Dash(__name__, title="KnapFormer dashboard", update_title=None, serve_locally=True)
    app.layout = lambda: _layout(runs)
    runs.store(runs.default())  # start indexing now, not at the first page view
    log = _CallbackLog()
    app.server.config["KNAPFORMER_RUNS"] = runs

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
            "callbacks": log.completed,
            "callback_ms": list(log.recent_ms),
        }

    timed = log.timed
    _watch_runs(app, runs, path, timed)
    _header_cards(app, runs, timed)
    _notices(app, timed)
    _step_selection(app, runs, timed)
    _timeline(app, runs, timed)
    _step_views(app, runs, timed)
    return app


def _snapshot(runs: Runs, view: dict | None) -> Snapshot | None:
    """The current snapshot of the view's run (None: no run)."""
    store = runs.store(view["run"]) if view else None
    return store.snapshot() if store else None


def _watch_runs(app: Dash, runs: Runs, path: Path, timed: Callable) -> None:
    @app.callback(
        output={
            "options": Output("run-picker", "options"),
            "value": Output("run-picker", "value"),
            "style": Output("run-picker-box", "style"),
            "view": Output("view", "data"),
        },
        inputs={"_tick": Input("tick", "n_intervals"), "picked": Input("run-picker", "value")},
        state={
            "options": State("run-picker", "options"),
            "style": State("run-picker-box", "style"),
            "view": State("view", "data"),
        },
    )
    @timed
    def watch_runs(_tick, picked, options, style, view):
        files = runs.files()
        run = picked if picked in files else runs.default()
        store = runs.store(run)
        new = {
            "options": [{"label": name, "value": name} for name in files],
            "value": run,
            "style": _PICKER if len(files) > 1 else _HIDDEN,
            "view": _view(run, store.snapshot() if store else None, path),
        }
        return _changed(new, {"options": options, "value": picked, "style": style, "view": view})


def _header_cards(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={
            "run": Output("stat-run", "children"),
            "steps": Output("stat-steps", "children"),
            "imbalance": Output("stat-imbalance", "children"),
            "speedup": Output("stat-speedup", "children"),
            "skipped": Output("stat-skipped", "children"),
        },
        inputs={"view": Input("view", "data")},
    )
    @timed
    def header_cards(view):
        snap = _snapshot(runs, view)
        run = view["run"] if view else None
        n = len(snap.summaries) if snap else 0
        latest = snap.summaries[-1] if n else None
        return {
            "run": (latest.run if latest else None) or run or "–",
            "steps": f"{n:,}" + (" (indexing…)" if snap and snap.indexing else ""),
            "imbalance": (
                before_after(latest.imbalance_before, latest.imbalance_after) if latest else "–"
            ),
            "speedup": _fmt(snap.mean_speedup if snap else None, ".2f") + ("×" if n else ""),
            "skipped": str(snap.problem_count if snap else 0),
        }


def _notices(app: Dash, timed: Callable) -> None:
    @app.callback(
        output={"lines": Output("notice", "children"), "style": Output("notice", "style")},
        inputs={"view": Input("view", "data")},
    )
    @timed
    def notices(view):
        lines = view["notices"] if view else []
        return {
            "lines": [html.Div(line) for line in lines],
            "style": _NOTICE if lines else _HIDDEN,
        }


def _step_selection(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={
            "last": Output("step-slider", "max"),
            "marks": Output("step-slider", "marks"),
            "value": Output("step-slider", "value"),
            "follow": Output("follow", "value"),
            "selection": Output("selection", "data"),
            "label": Output("step-label", "children"),
        },
        inputs={
            "view": Input("view", "data"),
            "value": Input("step-slider", "value"),
            "click": Input("timeline", "clickData"),
            "follow": Input("follow", "value"),
        },
        state={"selection": State("selection", "data"), "shown_last": State("step-slider", "max")},
    )
    @timed
    def step_selection(view, value, click, follow, selection, shown_last):
        trigger = ctx.triggered_id
        snap = _snapshot(runs, view)
        run = view["run"] if view else None
        n = len(snap.summaries) if snap else 0
        last = max(n - 1, 0)
        shown = selection or {}
        run_changed = shown.get("run") != run
        reset_changed = snap is not None and shown.get("reset") != snap.reset
        shown_count = 0 if shown.get("index") is None else (shown_last or 0) + 1
        unchanged = selection is not None and not (run_changed or reset_changed)
        if trigger == "view" and unchanged and shown_count == n:
            raise PreventUpdate  # nothing new for the slider

        following = "on" in (follow or [])
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

        new_selection = {
            "run": run,
            "reset": snap.reset if snap else None,
            "index": index if n else None,
        }
        if n:
            s = snap.summaries[index]
            label = (
                f"step {_step_of(snap, index)} · {index + 1} of {n}"
                + (f" · line {s.line}" if s.line is not None else "")
                + ("" if following else " · not following live")
            )
        else:
            label = "no steps yet"
        return {
            "last": last,
            "marks": _marks(snap) if snap else {},
            "value": index if index != value else no_update,
            "follow": (
                (["on"] if following else [])
                if following != ("on" in (follow or []))
                else no_update
            ),
            "selection": new_selection if new_selection != selection else no_update,
            "label": label,
        }


def _timeline(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={"figure": Output("timeline", "figure"), "client": Output("client", "data")},
        inputs={"view": Input("view", "data"), "selection": Input("selection", "data")},
        state={"client": State("client", "data")},
    )
    @timed
    def timeline(view, selection, client):
        snap = _snapshot(runs, view)
        run = view["run"] if view else None
        n = len(snap.summaries) if snap else 0
        reset = snap.reset if snap else None
        index = None
        if selection and (selection.get("run"), selection.get("reset")) == (run, reset):
            index = selection.get("index")
        new_client = {"run": run, "reset": reset, "count": n, "index": index}
        if new_client == client:
            raise PreventUpdate  # the browser already draws exactly this

        if n == 0:
            figure = timeline_figure([], validate=False)
        elif (
            client.get("run") != run
            or client.get("reset") != reset
            or client.get("count", 0) > n
            or ctx.triggered_id is None
        ):
            figure = timeline_figure(snap.summaries, index, validate=False)
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
        return {"figure": figure, "client": new_client}


def _step_views(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={
            "bag_load": Output("bag-load", "figure"),
            "traffic": Output("traffic", "figure"),
            "pvm": Output("pvm", "figure"),
            "pvm_style": Output("pvm-box", "style"),
            "rows": Output("seq-table", "data"),
            "selected_rows": Output("seq-table", "selected_rows"),
            "notice": Output("detail-notice", "children"),
            "notice_style": Output("detail-notice", "style"),
        },
        inputs={
            "selection": Input("selection", "data"),
            "selected_ids": Input("seq-table", "selected_row_ids"),
        },
    )
    @timed
    def step_views(selection, selected_ids):
        if not selection or selection.get("index") is None:
            empty = {"data": [], "layout": {"template": "plotly_white"}}
            return {
                "bag_load": empty,
                "traffic": empty,
                "pvm": empty,
                "pvm_style": _HIDDEN,
                "rows": [],
                "selected_rows": [],
                "notice": "",
                "notice_style": _HIDDEN,
            }
        store = runs.store(selection["run"])
        try:
            if store is None:
                raise LookupError(f"run {selection['run']!r} is gone")
            plan = store.plan(selection["index"], selection["reset"])
        except LookupError as err:
            return {
                "bag_load": no_update,
                "traffic": no_update,
                "pvm": no_update,
                "pvm_style": no_update,
                "rows": no_update,
                "selected_rows": no_update,
                "notice": f"cannot show this step: {err}",
                "notice_style": _NOTICE,
            }
        new_step = ctx.triggered_id != "seq-table"
        seq = None
        if not new_step and selected_ids:  # ids from before a step change are stale
            seq = int(selected_ids[0])
            if not 0 <= seq < len(plan.sequences):
                seq = None
        pvm = predicted_vs_measured_figure(plan, validate=False)
        return {
            "bag_load": bag_load_figure(plan, seq, validate=False),
            "traffic": traffic_figure(plan, seq, validate=False),
            "pvm": pvm if pvm is not None else no_update,
            "pvm_style": {"display": "block"} if pvm is not None else _HIDDEN,
            "rows": sequence_rows(plan) if new_step else no_update,
            "selected_rows": [] if new_step else no_update,
            "notice": "",
            "notice_style": _HIDDEN,
        }
