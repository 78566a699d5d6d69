"""The dashboard's whole-run views, drawn from the run's store (``store/`` beside its
plans) when it has one; without a store the section stays hidden.

- rank x step heatmap of compute rate, from the per-segment summaries (`rank_windows`,
  one row per rank per segment: never the per-step rows), binned to the screen
  (`visualization.run_figures`);
- ranks named slow over the run, per segment (rate at least the straggler analysis's
  ``slow_ratio`` in ``persistence`` of the segment's steps, and in its median);
- imbalance before/after and the time each step lost, over the run (`steps`);
- drill-down: a click on a heatmap cell reads that cell's steps (those rows only) and
  shows them rank by step with the straggler verdict over them.

Whole-run figures are kept per store until its list of segments changes, so a tick that
finds nothing new costs a directory listing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate
from knapformer.dashboard.guard import is_number, is_str, list_of, optional, record
from knapformer.dashboard.store import Runs
from knapformer.dashboard.styles import HALF, HIDDEN, WAITING
from knapformer.visualization.figures import empty_figure
from knapformer.visualization.run_figures import (
    cell_steps,
    run_grid,
    run_rate_heatmap,
    run_steps_figure,
    run_verdicts_figure,
)

from knapformer.contract.run_store import has_store, list_segments, read_table, store_folder
from knapformer.diagnosis.store_source import step_window, window_rows
from knapformer.diagnosis.store_window import window_figures
from knapformer.diagnosis.stragglers import THRESHOLDS, WINDOW, headline, judge
from knapformer.errors import KnapformerError

# pyarrow and plotly each import pandas on first use, and two callbacks that do so at
# once in the server's threads see a half-imported module (a 500 on the first page):
# import it once here, before any thread.
with contextlib.suppress(ImportError):
    import pandas  # noqa: F401

#: What the whole-run callbacks' inputs may hold (`knapformer.dashboard.guard`).
SHAPES = {
    ("run-heatmap", "clickData"): optional(
        record(points=list_of(record(x=is_number), nonempty=True))
    ),
    ("run-key", "data"): optional(is_str),
    ("run-drawn", "data"): optional(lambda value: value is True),
}
#: The most steps a drill-down reads (a click on a wider cell opens its last ones): a
#: column each on the screen, and ~90 MB of the server's memory at 1,024 GPUs.
DRILL_STEPS = 256
_SHOWN = {"display": "block"}
#: Each whole-run figure's margins, fixed (px): room for what Plotly would push them out
#: for (the heatmap's colour bar, the legend under the imbalance figure, tick labels on
#: the edges), as Chromium measured them at 1,024 GPUs x 100,000 steps, and some. With
#: margins that may grow, Plotly draws a figure, measures those and draws it again: that
#: second pass was half the time the browser took to draw the whole-run figures.
MARGINS = {
    "heatmap": {"l": 70, "r": 110, "t": 60, "b": 55},
    "verdicts": {"l": 70, "r": 30, "t": 60, "b": 55},
    "steps": {"l": 60, "r": 80, "t": 60, "b": 90},
}
#: Resolves once the browser has drawn the whole-run figures the layout brought (at once
#: without any): the per-step views, a dozen graphs, a table and their callbacks, are
#: started only then, so that they do not delay the first draw of the whole run.
DRAWN_JS = """async function(key, drawn) {
  if (drawn) { return window.dash_clientside.no_update; }
  const ids = ['run-heatmap', 'run-verdicts', 'run-steps'];
  // drawn by Plotly: the layout's figures (one may hold no trace: no rank named slow)
  const ready = () => ids.every(id => {
    const gd = document.querySelector('#' + id + ' .js-plotly-plot');
    return gd && gd._fullLayout && gd.data;
  });
  const until = performance.now() + 10000;  // never hold the page back for long
  while (key && !ready() && performance.now() < until) {
    await new Promise(done => requestAnimationFrame(done));
  }
  return true;
}"""


def section(kept: WholeRun, runs: Runs) -> html.Div:
    """The whole-run section of the layout, drawn with the page: its figures travel with
    the layout, so the first draw waits for no callback (hidden without a store)."""
    drawn = _drawn(kept, _plans(runs, None))
    figures = {} if drawn is None or "summary" not in drawn else drawn

    def graph(name: str, **style) -> dcc.Graph:
        return dcc.Graph(id=f"run-{name}", figure=figures.get(name, WAITING), style=style)

    return html.Div(
        [
            html.H4("The whole run (from its run store)"),
            html.Div(
                figures.get("summary", (drawn or {}).get("error", "")),
                id="run-summary",
                style={"margin": "0 8px"},
            ),
            graph("heatmap", height="420px"),
            html.Div(
                [html.Div(graph("verdicts"), style=HALF), html.Div(graph("steps"), style=HALF)],
                style={"display": "flex", "gap": "8px"},
            ),
            html.Div(id="drill-label", style={"margin": "0 8px", "fontWeight": "bold"}),
            dcc.Graph(id="drill-heatmap", figure=WAITING, style={"height": "420px"}),
            # which store and segments the browser's figures show (redrawn when they change)
            dcc.Store(id="run-key", data=figures.get("key")),
            # set once the browser has drawn the figures above (`DRAWN_JS`): the run
            # picker and the per-step views are laid out then (`app._deferred`)
            dcc.Store(id="run-drawn"),
        ],
        id="run-box",
        style=HIDDEN if drawn is None else _SHOWN,
    )


def has_store_view(runs: Runs) -> bool:
    """Whether the page's first run shows whole-run views (it has a store)."""
    plans = _plans(runs, None)
    return plans is not None and has_store(plans)


def _drawn(kept: WholeRun, plans: Path | None) -> dict[str, Any] | None:
    """The whole-run figures of ``plans``' store; None without one, ``{"error": line}``
    when it cannot be read."""
    try:
        return None if plans is None else kept.figures(plans)
    except KnapformerError as err:
        return {"error": f"the run store cannot be read: {err}"}


class WholeRun:
    """What the page draws from each store, each kept until the segments it reads change:
    the whole-run figures (`draw`) and the header's straggler line (`store_headline`). The
    page is laid out anew for each visitor, so neither is recomputed per page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._making = threading.Lock()  # one at a time: a page waits for the warm-up's
        self._kept: dict[tuple[Path, str], tuple[tuple[str, ...], Any]] = {}

    def warm(self, plans: Path | None) -> threading.Thread:
        """Makes ``plans``' figures and header line in a thread now, so that the first
        page waits for them less (or not at all): a few tenths of a second of reading
        and judging at 1,024 GPUs x 100,000 steps."""

        def make() -> None:
            if plans is not None:
                _drawn(self, plans)
                self.headline(plans)

        thread = threading.Thread(target=make, name="whole-run-warm-up", daemon=True)
        thread.start()
        return thread

    def figures(self, plans: Path) -> dict[str, Any] | None:
        """The figures of the store beside ``plans`` (None: it has none)."""
        if not has_store(plans):
            return None

        def drawn(store: Path, names: tuple[str, ...]) -> dict[str, Any]:
            return draw(store) | {"key": f"{store}:{len(names)}:{names[-1] if names else ''}"}

        return self._kept_or(plans, ("rank_windows", "steps"), drawn)

    def headline(self, plans: Path | None) -> str | None:
        """`store_headline` of ``plans``, kept while the store's closed rows stay the same."""
        if plans is None or not has_store(plans):
            return None
        return self._kept_or(plans, ("ranks", "steps"), lambda _s, _n: store_headline(plans))

    def _kept_or(self, plans: Path, tables: tuple[str, ...], make: Callable) -> Any:
        """What ``make(store, names)`` gave for ``tables``' segments ``names`` when they
        are still these (a reader reads closed segments only: same names, same rows)."""
        store = store_folder(plans)
        names = tuple(s.path.name for t in tables for s in list_segments(store, t))
        key = (store, tables[0])
        with self._making:
            with self._lock:
                kept = self._kept.get(key)
            if kept is not None and kept[0] == names:
                return kept[1]
            value = make(store, names)
            with self._lock:
                self._kept[key] = (names, value)
            return value


def draw(store: Path) -> dict[str, Any]:
    """The whole-run figures of ``store`` and its one-line summary."""
    windows = read_table(
        store,
        "rank_windows",
        columns=["first_step", "last_step", "rank", "steps", "rate_median", "slow_steps"],
    )
    steps = read_table(
        store, "steps", columns=["step", "imbalance_before", "imbalance_after", "lost_ms"]
    )
    ranks, lo, hi, cells = _cells(windows)
    rate = cells["rate_median"]
    grid = run_grid(ranks, lo, hi, rate)
    th = THRESHOLDS
    with np.errstate(invalid="ignore"):
        named = (cells["slow_steps"] >= th.persistence * np.maximum(cells["steps"], 1)) & (
            rate >= th.slow_ratio
        )
    column = {name: steps[name].to_numpy(zero_copy_only=False) for name in steps.column_names}
    figures = {
        "heatmap": run_rate_heatmap(grid, validate=False),
        "verdicts": run_verdicts_figure(ranks, lo, hi, named, rate, validate=False),
        "steps": run_steps_figure(
            column["step"],
            column["imbalance_before"].astype(np.float64),
            column["imbalance_after"].astype(np.float64),
            column["lost_ms"].astype(np.float64),
            validate=False,
        ),
    }
    return {name: fixed_margins(f, MARGINS[name]) for name, f in figures.items()} | {
        "grid": grid,
        "summary": _summary(ranks, lo, hi, named, len(column["step"])),
    }


def fixed_margins(figure: Any, margin: dict[str, int]) -> Any:
    """``figure`` with ``margin`` (`MARGINS`) that Plotly keeps as they are; a figure with
    nothing to show keeps its own."""
    if figure.data:
        figure.layout.margin = {**margin, "autoexpand": False}
    return figure


def _cells(windows) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``rank_windows`` rows as rank x segment matrices (NaN / 0 where a rank was absent):
    (ranks, first steps, last steps, {column: (r, w)})."""
    first = windows["first_step"].to_numpy()
    ranks = np.unique(windows["rank"].to_numpy())
    starts, at = np.unique(first, return_index=True)
    last = windows["last_step"].to_numpy()[at]
    row = np.searchsorted(ranks, windows["rank"].to_numpy())
    col = np.searchsorted(starts, first)
    cells = {}
    for name in ("rate_median", "slow_steps", "steps"):
        grid = np.full((len(ranks), len(starts)), np.nan if name == "rate_median" else 0.0)
        grid[row, col] = windows[name].to_numpy(zero_copy_only=False)
        cells[name] = grid
    return ranks, starts, last, cells


def _summary(ranks, lo, hi, named: np.ndarray, steps: int) -> str:
    """``12,000 steps; rank 517 named slow in steps 40,000–99,999 (60 segments)``."""
    if not len(lo):
        return f"{steps:,} steps in the store; no closed segment to summarise yet"
    slow = np.flatnonzero(named.any(axis=1))
    said = []
    for i in slow[:5].tolist():
        cols = np.flatnonzero(named[i])
        said.append(
            f"rank {int(ranks[i])} named slow in steps {int(lo[cols[0]]):,}–"
            f"{int(hi[cols[-1]]):,} ({len(cols)} segment(s))"
        )
    more = f"; and {len(slow) - 5} more rank(s)" if len(slow) > 5 else ""
    who = "; ".join(said) + more if said else "no rank named slow in any segment"
    return f"{steps:,} steps, {len(ranks):,} ranks, {len(lo):,} segments: {who}"


def drill(plans: Path, first: int, last: int) -> tuple[Any, str]:
    """The figure and line of steps ``first..last`` (its last `DRILL_STEPS` at most): only
    those rows are read."""
    cell = f"{first:,}–{last:,}"
    first = max(first, last - DRILL_STEPS + 1)
    w = window_figures(window_rows(plans, first, last))
    m = w.m
    if not m.steps:
        return empty_figure(f"no measured step in {first}..{last}", False), ""
    steps = np.asarray(m.steps)
    grid = run_grid(m.ranks, steps, steps, m.ratio)
    figure = fixed_margins(run_rate_heatmap(grid, validate=False), MARGINS["heatmap"])
    figure.layout.title.text = (
        f"Steps {first:,}–{last:,}: compute rate under the window's fit (the verdicts' "
        f"figure), {grid.rate.shape[0]} × {grid.rate.shape[1]} cells"
    )
    shown = f"steps {first:,}–{last:,}" + (
        f" (the last of {cell})" if cell != f"{first:,}–{last:,}" else ""
    )
    return figure, f"{shown}: {headline(judge(m, w.scopes, w.bandwidth))}"


def store_headline(plans: Path | None) -> str | None:
    """The header's straggler line from the run's store: the verdict over its last
    `WINDOW` steps, every one of them (the plans may keep only every k-th); None
    without a store, or when it cannot be read (the plans' line stands)."""
    if plans is None or not has_store(plans):
        return None
    try:
        first, last = step_window(plans, None, WINDOW)
        w = window_figures(window_rows(plans, first, last))
    except KnapformerError:
        return None
    return headline(judge(w.m, w.scopes, w.bandwidth)) if w.m.steps else None


def register(app: Dash, runs: Runs, timed: Callable, kept: WholeRun) -> None:
    """The whole-run callback (on a change of the shown run or its steps: the first draw
    comes with the layout), the drill-down's, and the browser's note that the first
    figures are drawn (``run-drawn``)."""
    app.clientside_callback(
        DRAWN_JS,
        Output("run-drawn", "data"),
        Input("run-key", "data"),
        State("run-drawn", "data"),
    )

    @app.callback(
        output={
            "style": Output("run-box", "style"),
            "summary": Output("run-summary", "children"),
            "heatmap": Output("run-heatmap", "figure"),
            "verdicts": Output("run-verdicts", "figure"),
            "steps": Output("run-steps", "figure"),
            "key": Output("run-key", "data"),
        },
        inputs={"view": Input("view", "data")},
        state={"shown": State("run-key", "data")},
        prevent_initial_call=True,
    )
    @timed
    def whole_run(view, shown):
        drawn = _drawn(kept, _plans(runs, view))
        unchanged = dict.fromkeys(("summary", "heatmap", "verdicts", "steps", "key"), no_update)
        if drawn is None:
            return unchanged | {"style": HIDDEN, "key": None}
        if "error" in drawn:
            return unchanged | {"style": _SHOWN, "summary": drawn["error"]}
        if drawn["key"] == shown:
            raise PreventUpdate  # the browser shows these segments already
        return {"style": _SHOWN} | {k: v for k, v in drawn.items() if k != "grid"}

    @app.callback(
        output={
            "figure": Output("drill-heatmap", "figure"),
            "label": Output("drill-label", "children"),
        },
        inputs={"click": Input("run-heatmap", "clickData"), "view": Input("view", "data")},
        prevent_initial_call=True,
    )
    @timed
    def drill_down(click, view):
        plans = _plans(runs, view)
        if click is None or plans is None:
            return {"figure": no_update, "label": "click a cell of the heatmap to open its steps"}
        try:
            drawn = kept.figures(plans)
            if drawn is None:
                return {"figure": no_update, "label": "the run has no store"}
            first, last = cell_steps(drawn["grid"], float(click["points"][0]["x"]))
            figure, label = drill(plans, first, last)
        except KnapformerError as err:
            return {"figure": no_update, "label": f"the run store cannot be read: {err}"}
        return {"figure": figure, "label": label}


def _plans(runs: Runs, view: dict | None) -> Path | None:
    """The plans file of the shown run (the default one before the first tick)."""
    name = view.get("run") if view else runs.default()
    return runs.files().get(name) if name else None
