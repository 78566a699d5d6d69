"""The Dash app: layout and callbacks of the live dashboard, one callback per concern.

- run picker (`_watch_runs`): every tick (and when the user picks a run) it decides which
  run is shown and stores a small *view* of what that run holds now (steps, resets,
  problems, notices). It sends nothing when nothing changed, so an idle tick costs one
  request; the callbacks below follow the view, not the tick.
- header cards (`_header_cards`) and notices (`_notices`): drawn from the view; a run
  whose step failed shows its incident in a red banner above them (`_incident_banner`).
- step selection (`_step_selection`): slider, "go to step" (typed, Enter), "follow live"
  and timeline clicks decide which step is shown (the ``selection`` store).
- the per-step views (`knapformer.dashboard.step_frame`): the step's label, the load
  chart, traffic, tokens per GPU, where each rank's step went (the shown step and the
  mean of the last measured steps) and the straggler views up to it (rank × step
  heatmaps, compute vs waiting, what each step lost), drawn by ONE callback from the
  ``selection`` store, so that all of them show the same step. The step they drew goes to
  the ``frame`` store.
- timeline (`_timeline`) and partition per step (`_topology_view`): they mark the step in
  ``frame``; the timeline appends new steps with a `Patch` instead of resending the whole
  figure.
- whole-run views (`knapformer.dashboard.whole_run`), when the run has a store: drawn
  with the layout, redrawn when a segment closes, and a drill-down into one cell. On
  such a run the first layout holds nothing else of weight: the run picker, the tick and
  every per-step view are laid out (`_deferred`) once the browser has drawn the whole
  run, so that their graphs, table and callbacks do not delay that first draw.
- sequence table (`_sequence_table`, `_pick_sequence`): the sequences of the step in
  ``frame``, one page at a time, sorted and filtered on the server (`dashboard.table`);
  picking a row sets the ``highlight`` store.

Every callback names its outputs (dicts of `Output`), and figures are built by
`visualization.figures` and `visualization.straggler_figures`.
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
from knapformer.dashboard import step_frame, whole_run
from knapformer.dashboard.guard import (
    guard_callbacks,
    is_int,
    is_list,
    is_number,
    is_str,
    list_of,
    optional,
    record,
)
from knapformer.dashboard.page_index import index_string
from knapformer.dashboard.step_frame import key, plan_of, step_of
from knapformer.dashboard.store import PlanStore, RequestGate, Runs, Snapshot
from knapformer.dashboard.store_steps import (
    mean_speedup,
    nearest_kept,
    partition_spans,
    step_columns,
    step_count,
)
from knapformer.dashboard.styles import CARD, HALF, HIDDEN, INCIDENT, NOTICE, PICKER, WAITING
from knapformer.dashboard.table import query
from knapformer.visualization.figures import (
    SEQUENCE_COLUMNS,
    empty_figure,
    partition_figure,
    selection_shapes,
    step_marker,
    timeline_columns,
    timeline_figure,
    timeline_measured,
    timeline_mode,
    topology_figure,
)
from knapformer.visualization.run_figures import run_timeline_figure

from knapformer.contract.incident import run_incident
from knapformer.contract.runfiles import RUNS_LAYOUT
from knapformer.contract.stats import before_after
from knapformer.contract.units import LoadUnit
from knapformer.diagnosis.stragglers import WINDOW, analyse, headline
from knapformer.errors import KnapformerError

TICK_MS = 500
PAGE_LOAD_LINGER_S = 1.5
PAGE_SIZE = 15
_SHOWN_PROBLEMS = 8
_COLUMN_NAMES = {"src_gpu": "source GPU"}  # else the column id


def _clicked_point(point: Any) -> bool:
    """A timeline point as a click sends it: its customdata (the plans' timeline: the
    step's index) and, when sent, its x (the store's timeline: the step)."""
    return record(customdata=is_number)(point) and record(False, x=is_number)(point)


#: What each callback input and state may hold, by (component id, property): a request
#: with anything else is answered 400 before a callback runs (see dashboard.guard).
CALLBACK_SHAPES = {
    ("tick", "n_intervals"): optional(is_int),
    ("step-slider", "value"): optional(is_number),
    ("timeline", "clickData"): optional(record(points=list_of(_clicked_point, nonempty=True))),
    ("follow", "value"): optional(list_of(is_str)),
    ("run-picker", "value"): optional(is_str),
    ("run-picker", "options"): optional(is_list),
    ("client", "data"): record(required=False, run=optional(is_str), count=is_int),
    ("selection", "data"): optional(
        record(run=optional(is_str), reset=optional(is_int), index=optional(is_int))
    ),
    ("frame", "data"): optional(
        record(run=optional(is_str), reset=optional(is_int), index=optional(is_int))
    ),
    ("view", "data"): optional(record(run=optional(is_str), notices=list_of(is_str))),
    ("run-picker-box", "style"): optional(record()),
    ("step-slider", "max"): optional(is_number),
    ("step-input", "n_submit"): optional(is_int),
    ("step-input", "value"): optional(is_number),
    ("highlight", "data"): optional(record(key=optional(is_list), seq=is_int)),
    ("seq-table", "page_current"): optional(is_int),
    ("seq-table", "sort_by"): optional(list_of(record(column_id=is_str, direction=is_str))),
    ("seq-table", "filter_query"): optional(is_str),
    ("seq-table", "selected_rows"): optional(list_of(is_int)),
    ("seq-table", "data"): optional(list_of(record(id=is_int))),
    ("deferred", "data"): optional(lambda value: isinstance(value, bool)),
}


def _card(label: str, value_id: str, value: str | None = None) -> html.Div:
    return html.Div(
        [
            html.Div(label, style={"fontSize": "12px", "color": "#868e96"}),
            html.B(value, id=value_id),
        ],
        style=CARD,
    )


def _layout(runs: Runs, whole: whole_run.WholeRun) -> html.Div:
    # A run with a store shows its whole-run views first: the run picker and the per-step
    # views (a dozen graphs, a table and their callbacks) come once the browser has drawn
    # them (`_deferred`), so that they do not delay that first draw.
    later = whole_run.has_store_view(runs)
    # Its header is filled here too: the view that fills it comes after the first draw,
    # and a header growing then would move the whole-run figures under the user's hand.
    shown = _header_values(runs, whole, {"run": runs.default()}) if later else {}
    return html.Div(
        [
            # What the shown run holds now (set by the run picker; the rest follow it).
            dcc.Store(id="view"),
            # Whether the two slots below are filled after the whole-run views are drawn.
            dcc.Store(id="deferred", data=later),
            html.H2("KnapFormer routing plans", style={"margin": "4px 0"}),
            html.Div(id="incident", role="alert", style=HIDDEN),
            html.Div([] if later else _picker(), id="picker-slot"),
            html.Div(
                [
                    _card("run", "stat-run", shown.get("run")),
                    _card("steps seen", "stat-steps", shown.get("steps")),
                    _card(
                        "latest imbalance before → after",
                        "stat-imbalance",
                        shown.get("imbalance"),
                    ),
                    _card("mean modelled speedup", "stat-speedup", shown.get("speedup")),
                    _card(
                        f"straggler (last {WINDOW} measured steps)",
                        "stat-straggler",
                        shown.get("straggler"),
                    ),
                    _card("malformed records skipped", "stat-skipped", shown.get("skipped")),
                ],
                style={"display": "flex", "gap": "10px", "flexWrap": "wrap"},
            ),
            html.Div(id="notice", role="alert", style=HIDDEN),
            whole_run.section(whole, runs),
            # Kept a screen tall until filled: the page has its scroll bar from the start,
            # so the whole-run figures are not resized (and redrawn) when it comes.
            html.Div(
                [] if later else _per_step(runs),
                id="per-step",
                style={"minHeight": "100vh"} if later else {},
            ),
        ],
        style={"fontFamily": "system-ui, sans-serif", "margin": "8px 16px"},
    )


def _picker() -> list:
    """The run picker (shown when the folder holds more than one run)."""
    return [
        html.Div(
            [
                html.Span("run ", style={"marginRight": "6px"}),
                dcc.Dropdown(id="run-picker", clearable=False, style={"width": "360px"}),
            ],
            id="run-picker-box",
            style=HIDDEN,
        ),
    ]


def _per_step(runs: Runs) -> list:
    """The per-step views, the tick that follows the run, and the stores they share."""
    # The newest step is chosen here, so the per-step views are computed in parallel with
    # the first tick instead of after it (one round trip less before the bars show).
    run = runs.default()
    store = runs.store(run)
    snap = store.snapshot() if store else None
    initial = None
    if snap is not None and snap.summaries:
        initial = {"run": run, "reset": snap.reset, "index": snap.newest}
    return [
        dcc.Interval(id="tick", interval=TICK_MS),
        # What the browser's timeline currently holds, so an update can append to it.
        dcc.Store(id="client", data={"run": None, "reset": None, "count": 0}),
        # The step the per-step views are to show: run, reset counter, index.
        dcc.Store(id="selection", data=initial),
        # The step they show (`step_frame`), which the timelines and the table follow.
        dcc.Store(id="frame"),
        # The sequence whose chunks are highlighted: the step it belongs to, and its id.
        dcc.Store(id="highlight"),
        *_step_controls(),
        *_step_graphs(),
        *_sequence_table_layout(),
    ]


def _step_controls() -> list:
    """Slider, "go to step", "follow live", and the line naming the step shown."""
    return [
        html.Div(
            [
                html.Div(
                    dcc.Slider(
                        id="step-slider",
                        min=0,
                        max=0,
                        step=1,
                        value=0,
                        marks={},
                        # its box would take an index, not a step: "go to step" does
                        allow_direct_input=False,
                    ),
                    style={"flex": "1"},
                ),
                dcc.Input(
                    id="step-input",
                    type="number",
                    placeholder="go to step",
                    debounce=True,  # the value is sent with Enter (n_submit)
                    style={"width": "170px"},
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
        html.Div(
            [
                html.Span(id="step-label", style={"fontWeight": "bold"}),
                html.Span(id="follow-note", style={"color": "#868e96", "marginLeft": "8px"}),
            ],
            style={"margin": "0 8px"},
        ),
        html.Div(id="detail-notice", role="alert", style=HIDDEN),
    ]


def _step_graphs() -> list:
    """The per-step graphs (`step_frame`), the timeline and the partitions over the run."""
    return [
        # Full width: the GPU label rule plans for a plot `axes.PLOT_PX` wide.
        _graph("bag-load", height="440px"),
        _row(
            html.Div(_graph("phase-step", height="440px"), style=HALF),
            html.Div(_graph("phase-window", height="440px"), style=HALF),
        ),
        _graph("tokens", height="360px"),
        _row(
            html.Div(_graph("timeline"), style=HALF),
            html.Div(_graph("traffic", height="430px"), style=HALF),
        ),
        _graph("topology-timeline"),
        html.Div(
            [
                html.H4("Stragglers: measured compute apart from waiting"),
                _row(
                    html.Div(_graph("ratio-heatmap"), style=HALF),
                    html.Div(_graph("wait-heatmap"), style=HALF),
                ),
                _graph("compute-wait"),
                _graph("step-loss"),
            ],
            id="straggler-box",
            style=HIDDEN,
        ),
    ]


def _sequence_table_layout() -> list:
    """The sequences of the step, one page at a time (`_sequence_table`)."""
    return [
        html.H4("Sequences of the step (select one to highlight its chunks)"),
        dash_table.DataTable(
            id="seq-table",
            columns=_table_columns(None),
            data=[],
            page_action="custom",
            page_current=0,
            page_size=PAGE_SIZE,
            page_count=1,
            sort_action="custom",
            sort_mode="single",
            sort_by=[],
            filter_action="custom",
            filter_query="",
            row_selectable="single",
            selected_rows=[],
            style_cell={"fontFamily": "monospace", "padding": "2px 8px"},
        ),
    ]


def _graph(name: str, **style: str) -> dcc.Graph:
    """A per-step graph, axis-less until its callback draws it (`WAITING`)."""
    return dcc.Graph(id=name, figure=WAITING, style=style)


def _row(*cells: html.Div) -> html.Div:
    """Figures side by side, wrapping onto the next line on a narrow window."""
    return html.Div(list(cells), style={"display": "flex", "gap": "10px", "flexWrap": "wrap"})


def _table_columns(unit: LoadUnit | None) -> list[dict]:
    """The sequence table's columns; the workload's names its unit (`LoadUnit`)."""
    names = {**_COLUMN_NAMES, "workload": f"workload ({unit.name})" if unit else "workload"}
    return [
        {
            "name": names.get(name, name),
            "id": name,
            "type": "text" if name == "destinations" else "numeric",
        }
        for name in SEQUENCE_COLUMNS
    ]


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
    return {i: str(step_of(snap, snap.by_step[i])) for i in picks}


def _view(run: str | None, snap: Snapshot | None, path: Path) -> dict:
    """What the shown run holds now: when this changes, the page has something to redraw."""
    return {
        "run": run,
        "reset": snap.reset if snap else None,
        "count": len(snap.summaries) if snap else 0,
        "problems": snap.problem_count if snap else 0,
        "indexing": snap.indexing if snap else False,
        "notices": _notice(snap, path),
        "store": _store_key(snap),
    }


def _store_key(snap: Snapshot | None) -> str | None:
    """Which closed segments of the run's store the snapshot holds (None: no store)."""
    if snap is None or snap.store is None:
        return None
    store = snap.store
    return f"{len(store.segments)}:{store.segments[-1] if store.segments else ''}:{store.count}"


def _all_steps(snap: Snapshot | None) -> dict | None:
    """Every step of a run with a store (`step_columns`: the store's and the newest
    plans'); None without a store (the plans' summaries are then every step shown)."""
    if snap is None or snap.store is None:
        return None
    return step_columns(snap.store, snap.summaries)


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
    # The picker and the per-step views are laid out later on a run with a store (their
    # callbacks name components the first layout does not hold).
    app = Dash(
        __name__,
        title="KnapFormer dashboard",
        update_title=None,
        serve_locally=True,
        suppress_callback_exceptions=True,
    )
    app.index_string = index_string(app.config.requests_pathname_prefix)
    whole = whole_run.WholeRun()
    app.layout = lambda: _layout(runs, whole)
    runs.store(runs.default())  # start indexing now, not at the first page view
    whole.warm(runs.files().get(runs.default()))  # and drawing its whole-run views
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

    guard_callbacks(
        app, CALLBACK_SHAPES | whole_run.SHAPES
    )  # after the gate's hooks: a refusal still leaves it

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
    _deferred(app, runs, timed)
    _watch_runs(app, runs, path, timed)
    _header_cards(app, runs, whole, timed)
    _notices(app, timed)
    _incident_banner(app, timed)
    _step_selection(app, runs, timed)
    _timeline(app, runs, timed)
    step_frame.register(app, runs, timed)
    whole_run.register(app, runs, timed, whole)
    _topology_view(app, runs, timed)
    _sequence_table(app, runs, timed)
    _pick_sequence(app, timed)
    return app


def _snapshot(runs: Runs, view: dict | None) -> Snapshot | None:
    """The current snapshot of the view's run (None: no run)."""
    store = runs.store(view["run"]) if view else None
    return store.snapshot() if store else None


def _deferred(app: Dash, runs: Runs, timed: Callable) -> None:
    """Lays out the run picker and the per-step views once the browser has drawn the
    whole-run views (``run-drawn``), where the first layout left them out."""

    @app.callback(
        output={
            "picker": Output("picker-slot", "children"),
            "per_step": Output("per-step", "children"),
        },
        inputs={"drawn": Input("run-drawn", "data")},
        state={"later": State("deferred", "data")},
        prevent_initial_call=True,
    )
    @timed
    def deferred(drawn, later):
        if not (drawn and later):
            raise PreventUpdate  # laid out with the page
        return {"picker": _picker(), "per_step": _per_step(runs)}


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
            "style": PICKER if len(files) > 1 else HIDDEN,
            "view": _view(run, store.snapshot() if store else None, path)
            | {"incident": _incident(files.get(run))},
        }
        return _changed(new, {"options": options, "value": picked, "style": style, "view": view})


def _header_cards(app: Dash, runs: Runs, whole: whole_run.WholeRun, timed: Callable) -> None:
    @app.callback(
        output={
            "run": Output("stat-run", "children"),
            "steps": Output("stat-steps", "children"),
            "imbalance": Output("stat-imbalance", "children"),
            "speedup": Output("stat-speedup", "children"),
            "skipped": Output("stat-skipped", "children"),
            "straggler": Output("stat-straggler", "children"),
        },
        inputs={"view": Input("view", "data")},
    )
    @timed
    def header_cards(view):
        return _header_values(runs, whole, view)


def _header_values(runs: Runs, whole: whole_run.WholeRun, view: dict | None) -> dict[str, str]:
    """The header cards' values for the view's run (its store's straggler line as kept)."""
    snap = _snapshot(runs, view)
    run = view["run"] if view else None
    n = len(snap.summaries) if snap else 0
    latest = snap.summaries[-1] if n else None
    values = {
        "straggler": whole.headline(runs.files().get(run) if run else None)
        or _straggler(runs.store(run), snap),
        "run": (latest.run if latest else None) or run or "–",
        "steps": f"{n:,}",
        "imbalance": (
            before_after(latest.imbalance_before, latest.imbalance_after) if latest else "–"
        ),
        "speedup": _fmt(snap.mean_speedup if snap else None, ".2f") + ("×" if n else ""),
        "skipped": str(snap.problem_count if snap else 0),
    }
    columns = _all_steps(snap)
    if columns is not None and len(columns["step"]):
        values |= _store_header(columns, n)
    if snap and snap.indexing:
        values["steps"] += " (indexing…)"
    return values


def _store_header(columns: dict, plans: int) -> dict[str, str]:
    """The header's figures of every step (`_all_steps`), not only of the kept plans."""
    count = len(columns["step"])
    speedup = mean_speedup(columns)
    return {
        "steps": f"{count:,}" + (f" ({plans:,} full plans)" if plans != count else ""),
        "imbalance": before_after(
            float(columns["imbalance_before"][-1]), float(columns["imbalance_after"][-1])
        ),
        "speedup": _fmt(speedup, ".2f") + ("×" if speedup is not None else ""),
    }


def _straggler(store: PlanStore | None, snap: Snapshot | None) -> str:
    """The run's current straggler: the verdict over its last `WINDOW` measured steps."""
    if store is None or snap is None or not snap.measured_steps:
        return "– (no measured steps)"
    window = store.measured(snap.newest, WINDOW, snap.reset)
    return headline(analyse(window)) if window else "– (no measured steps)"


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
            "style": NOTICE if lines else HIDDEN,
        }


def _incident(plans: Path | None) -> str | None:
    """The headline of the run's failed step (its incident.json beside the plans), if any."""
    if plans is None:
        return None
    try:
        incident = run_incident(plans)
    except KnapformerError as err:
        return f"the run's incident cannot be read: {err}"
    return None if incident is None else incident.headline()


def _incident_banner(app: Dash, timed: Callable) -> None:
    @app.callback(
        output={"text": Output("incident", "children"), "style": Output("incident", "style")},
        inputs={"view": Input("view", "data")},
    )
    @timed
    def incident_banner(view):
        text = view.get("incident") if isinstance(view, dict) else None
        text = text if isinstance(text, str) else ""  # a crafted request shows nothing
        return {"text": text, "style": INCIDENT if text else HIDDEN}


def _step_selection(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={
            "last": Output("step-slider", "max"),
            "marks": Output("step-slider", "marks"),
            "value": Output("step-slider", "value"),
            "follow": Output("follow", "value"),
            "selection": Output("selection", "data"),
            "note": Output("follow-note", "children"),
        },
        inputs={
            "view": Input("view", "data"),
            "value": Input("step-slider", "value"),
            "click": Input("timeline", "clickData"),
            "follow": Input("follow", "value"),
            "entered": Input("step-input", "n_submit"),
        },
        state={
            "typed": State("step-input", "value"),
            "selection": State("selection", "data"),
            "shown_last": State("step-slider", "max"),
        },
    )
    @timed
    def step_selection(view, value, click, follow, entered, typed, selection, shown_last):
        trigger = ctx.triggered_id
        snap = _snapshot(runs, view)
        run = view["run"] if view else None
        n = len(snap.summaries) if snap else 0
        last = max(n - 1, 0)
        newest = max(snap.newest, 0) if snap else 0  # followed: the newest step's plan
        shown = selection or {}
        run_changed = shown.get("run") != run
        reset_changed = snap is not None and shown.get("reset") != snap.reset
        shown_count = 0 if shown.get("index") is None else (shown_last or 0) + 1
        unchanged = selection is not None and not (run_changed or reset_changed)
        if trigger == "view" and unchanged and shown_count == n:
            raise PreventUpdate  # nothing new for the slider

        following = "on" in (follow or [])
        # the slider's value is a place in step order (`Snapshot.by_step`), the selection's
        # an index: a plan written late moves the places after it, never the indices
        index = shown.get("index") if isinstance(shown.get("index"), int) else newest
        if trigger == "step-slider" and snap and isinstance(value, int) and 0 <= value < n:
            index = snap.by_step[value]
        note = ""
        if run_changed:
            following, index = True, newest
        elif trigger == "timeline" and click:
            index, note = _clicked_step(snap, click["points"][0])
            following = index == newest
        elif trigger == "step-input":
            if typed is None or not n:
                raise PreventUpdate
            index, note = _typed_step(snap, typed)
            following = following and index == newest
        elif trigger == "step-slider":
            following = following and index == newest  # scrubbing back stops following
        elif following:  # includes switching "follow live" back on
            index = newest
        index = min(max(index, 0), last)

        new_selection = {
            "run": run,
            "reset": snap.reset if snap else None,
            "index": index if n else None,
        }
        if n and not note:
            note = (
                f"· following live ({_kept_of(snap)})"
                if following
                else f"· not following live (newest: step {step_of(snap, newest)})"
            )
        return {
            "last": last,
            "marks": _marks(snap) if snap else {},
            "value": _place(snap, index) if _place(snap, index) != value else no_update,
            "follow": (
                (["on"] if following else [])
                if following != ("on" in (follow or []))
                else no_update
            ),
            "selection": new_selection if new_selection != selection else no_update,
            "note": note,
        }


def _place(snap: Snapshot | None, index: int) -> int:
    """The slider's value of plan ``index``: its place in step order."""
    return snap.by_step.index(index) if snap and index < len(snap.by_step) else 0


def _kept_of(snap: Snapshot) -> str:
    """How many steps the step picker chooses from: ``40 steps``, or with a store that
    holds more steps than full plans, ``4 full plans of 40 steps``."""
    n, count = len(snap.summaries), step_count(snap.store, snap.summaries)
    return f"{n:,} steps" if count == n else f"{n:,} full plans of {count:,} steps"


def _typed_step(snap: Snapshot, typed: float) -> tuple[int, str]:
    """The index of the step a user typed, and a note when it has no full plan (then the
    nearest full plan is chosen)."""
    steps = [step_of(snap, i) for i in range(len(snap.summaries))]
    wanted = int(typed)
    if wanted in steps:
        return steps.index(wanted), ""
    index = min(range(len(steps)), key=lambda i: abs(steps[i] - wanted))
    return index, _snapped(snap, wanted, steps[index])


def _clicked_step(snap: Snapshot, point: dict) -> tuple[int, str]:
    """The index of the step a click on the timeline picked, and a note when it has no
    full plan. The plans' timeline carries each point's index; the store's (every step,
    binned) its step, whose nearest full plan is shown."""
    if snap.store is None:
        return int(point["customdata"]), ""
    if "x" not in point:
        raise PreventUpdate  # a click the page does not send
    wanted = int(point["x"])
    index = nearest_kept(snap.summaries, wanted)
    if index is None:  # unnumbered plans: the store cannot name them
        raise PreventUpdate
    shown = step_of(snap, index)
    return index, "" if shown == wanted else _snapped(snap, wanted, shown)


def _snapped(snap: Snapshot, wanted: int, shown: int) -> str:
    """The note of a step with no full plan, for which the plan of step ``shown`` is."""
    columns = _all_steps(snap)
    if columns is not None and bool((columns["step"] == wanted).any()):
        return (
            f"· step {wanted} has no full plan (the recorder kept {_kept_of(snap)}): its "
            f"figures are on the timeline; showing the nearest full plan, step {shown}"
        )
    return f"· step {wanted} is not in this run; showing the nearest, step {shown}"


def _timeline(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={"figure": Output("timeline", "figure"), "client": Output("client", "data")},
        inputs={"view": Input("view", "data"), "selection": Input("frame", "data")},
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
        if snap is not None and snap.store is not None:
            shown = {"run": run, "reset": reset, "index": index}
            return _store_timeline(snap, shown, client, ctx.triggered_id is None)
        measured = bool(n) and timeline_measured(snap.summaries)
        new_client = {"run": run, "reset": reset, "count": n, "index": index, "measured": measured}
        if new_client == client:
            raise PreventUpdate  # the browser already draws exactly this

        if n == 0:
            figure = timeline_figure([], validate=False)
        elif (
            client.get("run") != run
            or client.get("reset") != reset
            or client.get("count", 0) > n
            or client.get("count", 0) == 0
            or client.get("measured") != measured  # the step-time panel comes or goes
            or ctx.triggered_id is None
        ):
            figure = timeline_figure(snap.summaries, index, validate=False)
        else:
            # Same data on the client: append new steps and move the marker only.
            figure = Patch()
            count = client.get("count", 0)
            if count < n:
                switch = timeline_mode(n) != timeline_mode(count)
                columns = timeline_columns(snap.summaries, count, measured)
                for i, (x, y, c) in enumerate(columns):
                    figure["data"][i]["x"].extend(x)
                    figure["data"][i]["y"].extend(y)
                    figure["data"][i]["customdata"].extend(c)
                    if switch:
                        figure["data"][i]["mode"] = timeline_mode(n)
            figure["layout"]["shapes"] = selection_shapes(snap.summaries, index)
        return {"figure": figure, "client": new_client}


def _store_timeline(snap: Snapshot, shown: dict, client: dict, first: bool) -> dict:
    """The timeline of every step of a run with a store (`_all_steps`), binned as the
    report's, the step of the full plan ``shown`` marked; ``client``: what the browser
    draws (``first``: nothing yet, a page load). A new selection only moves the marker."""
    columns = _all_steps(snap)
    new_client = shown | {"count": len(columns["step"]), "store": _store_key(snap)}
    if new_client == client:
        raise PreventUpdate  # the browser already draws exactly this
    index = shown["index"]
    step = step_of(snap, index) if index is not None and index < len(snap.summaries) else None
    same_steps = {k: v for k, v in new_client.items() if k != "index"} == {
        k: v for k, v in client.items() if k != "index"
    }
    if same_steps and not first:
        figure = Patch()
        figure["layout"]["shapes"] = [] if step is None else [step_marker(step)]
    else:
        figure = run_timeline_figure(columns, step, validate=False)
    return {"figure": figure, "client": new_client}


def _sequence_table(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={
            "rows": Output("seq-table", "data"),
            "columns": Output("seq-table", "columns"),
            "pages": Output("seq-table", "page_count"),
            "page": Output("seq-table", "page_current"),
            "selected": Output("seq-table", "selected_rows"),
        },
        inputs={
            "selection": Input("frame", "data"),
            "page": Input("seq-table", "page_current"),
            "sort_by": Input("seq-table", "sort_by"),
            "filter_query": Input("seq-table", "filter_query"),
        },
        state={"highlight": State("highlight", "data")},
    )
    @timed
    def sequence_table(selection, page, sort_by, filter_query, highlight):
        if key(selection) is None:
            return {"rows": [], "columns": no_update, "pages": 1, "page": 0, "selected": []}
        plan, _problem = plan_of(runs, selection)
        if plan is None:
            raise PreventUpdate  # the step views say why
        # A new step, order or filter starts on the first page; paging keeps them.
        restart = bool(set(ctx.triggered_prop_ids) - {"seq-table.page_current"})
        rows, pages, _ids = query(
            plan, 0 if restart else page or 0, PAGE_SIZE, sort_by, filter_query
        )
        mine = highlight and highlight.get("key") == key(selection)
        picked = highlight.get("seq") if mine else None
        selected = [i for i, row in enumerate(rows) if row["id"] == picked]
        return {
            "rows": rows,
            "columns": _table_columns(LoadUnit.of(plan)),
            "pages": pages,
            "page": 0 if restart and page else no_update,
            "selected": selected,
        }


def _pick_sequence(app: Dash, timed: Callable) -> None:
    @app.callback(
        output={"highlight": Output("highlight", "data")},
        inputs={"rows": Input("seq-table", "selected_rows")},
        state={
            "data": State("seq-table", "data"),
            "selection": State("frame", "data"),
            "highlight": State("highlight", "data"),
        },
    )
    @timed
    def pick_sequence(rows, data, selection, highlight):
        # A single-choice radio cannot be unchecked: an empty selection only means the
        # table moved to a page (or step) without the row, so the highlight stays.
        if not rows or not data or not 0 <= rows[0] < len(data):
            raise PreventUpdate
        new = {"key": key(selection), "seq": int(data[rows[0]]["id"])}
        if new == highlight:
            raise PreventUpdate
        return {"highlight": new}


def _topology_view(app: Dash, runs: Runs, timed: Callable) -> None:
    @app.callback(
        output={"figure": Output("topology-timeline", "figure")},
        inputs={"view": Input("view", "data"), "selection": Input("frame", "data")},
    )
    @timed
    def topology_view(view, selection):
        snap = _snapshot(runs, view)
        if snap is None or not snap.summaries:
            return {"figure": empty_figure("no steps yet", validate=False)}
        index = None
        if selection and (selection.get("run"), selection.get("reset")) == (
            view["run"],
            snap.reset,
        ):
            index = selection.get("index")
        if snap.store is not None:  # every step's partition, the full plan shown marked
            spans = partition_spans(snap.store, snap.summaries)
            shapes = selection_shapes(snap.summaries, index)
            return {"figure": partition_figure(spans, shapes, validate=False)}
        return {"figure": topology_figure(snap.summaries, index, validate=False)}
