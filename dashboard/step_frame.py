"""The dashboard's per-step views, drawn together for one step: the step's label, the load
chart, traffic, tokens per GPU, where each rank's step went, and the straggler views up
to it.

One callback (`register`) draws them all from the ``selection`` store, so the page moves
every one of them to a step at once: with a callback each, a slow view lagged behind
while the page followed a live run (the load chart at one step, the phase chart at
another, the label at a third). Its answer ends in the ``frame`` store, the step it drew,
which the timeline, the topology timeline and the sequence table follow. Picking a
sequence redraws the two views that highlight it (`_highlighted`), for the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dash import Dash, Input, Output, State, no_update
from dash.exceptions import PreventUpdate
from knapformer.dashboard.store import PlanStore, Runs, Snapshot
from knapformer.dashboard.store_steps import step_count
from knapformer.dashboard.styles import HIDDEN, NOTICE, SHOWN
from knapformer.visualization.axes import gpu_axis
from knapformer.visualization.figures import (
    bag_load_figure,
    empty_figure,
    tokens_figure,
    traffic_figure,
)
from knapformer.visualization.phase_figures import (
    mean_parts,
    phase_figure,
    reorder,
    step_parts,
    store_parts,
    window_parts,
)
from knapformer.visualization.straggler_figures import (
    compute_wait_figure,
    flagged_ranks,
    ratio_heatmap,
    step_loss_figure,
    wait_heatmap,
    window_views,
)

from knapformer.diagnosis.step_loss import step_losses
from knapformer.diagnosis.store_source import window_rows
from knapformer.diagnosis.store_window import WindowRows, window_figures
from knapformer.diagnosis.stragglers import WINDOW, analyse, judge, rank_steps
from knapformer.errors import KnapformerError

#: Measured steps the window's phase breakdown averages (each is re-read from the file;
#: the store caches 8 plans, the shown step's included).
PHASE_WINDOW = 6
#: Each output of the frame, by the name the callback returns it under.
OUTPUTS = {
    "label": ("step-label", "children"),
    "notice": ("detail-notice", "children"),
    "notice_style": ("detail-notice", "style"),
    "bag_load": ("bag-load", "figure"),
    "traffic": ("traffic", "figure"),
    "tokens": ("tokens", "figure"),
    "phase_step": ("phase-step", "figure"),
    "phase_window": ("phase-window", "figure"),
    "ratio": ("ratio-heatmap", "figure"),
    "wait": ("wait-heatmap", "figure"),
    "scatter": ("compute-wait", "figure"),
    "loss": ("step-loss", "figure"),
    "straggler_style": ("straggler-box", "style"),
    "frame": ("frame", "data"),
}

#: The output (`OUTPUTS`) of each straggler view `window_views` names.
_STRAGGLER_OUTPUTS = {
    "ratio-heatmap": "ratio",
    "wait-heatmap": "wait",
    "compute-wait": "scatter",
    "step-loss": "loss",
}


def register(app: Dash, runs: Runs, timed: Callable) -> None:
    """The frame's callback and the highlight's."""

    @app.callback(
        output={name: Output(*target) for name, target in OUTPUTS.items()},
        inputs={"selection": Input("selection", "data")},
        state={"highlight": State("highlight", "data")},
    )
    @timed
    def step_frame(selection, highlight):
        return frame(runs, selection, highlight)

    @app.callback(
        output={
            "bag_load": Output("bag-load", "figure", allow_duplicate=True),
            "traffic": Output("traffic", "figure", allow_duplicate=True),
        },
        inputs={"highlight": Input("highlight", "data")},
        state={"shown": State("frame", "data")},
        prevent_initial_call=True,
    )
    @timed
    def highlighted(highlight, shown):
        return _highlighted(runs, shown, highlight)


def frame(runs: Runs, selection: dict | None, highlight: dict | None) -> dict[str, Any]:
    """Every per-step view of the selected step (`OUTPUTS`)."""
    if key(selection) is None:
        empty = empty_figure("no steps yet", validate=False)
        out = {name: empty for name, (_, prop) in OUTPUTS.items() if prop == "figure"}
        return out | {
            "label": "no steps yet",
            "notice": "",
            "notice_style": HIDDEN,
            "straggler_style": HIDDEN,
            "frame": selection,
        }
    plan, problem = plan_of(runs, selection)
    if plan is None:  # the views keep the step they show, and say why
        out = {name: no_update for name in OUTPUTS}
        return out | {"notice": problem, "notice_style": NOTICE}
    rows = _store_rows(runs, selection, plan)
    flagged, stragglers = _stragglers(runs, selection, plan, rows)
    seq = _highlighted_sequence(plan, selection, highlight)
    return {
        "label": _label(runs, selection, plan),
        "notice": "",
        "notice_style": HIDDEN,
        "bag_load": bag_load_figure(plan, seq, False, flagged),
        "traffic": traffic_figure(plan, seq, validate=False),
        "tokens": tokens_figure(plan, False, flagged),
        **_phase_views(runs, selection, plan, flagged, rows),
        **stragglers,
        "frame": selection,
    }


def _highlighted(runs: Runs, shown: dict | None, highlight: dict | None) -> dict[str, Any]:
    """The load chart and the traffic of the step on the page, with ``highlight``'s
    sequence marked (only when it belongs to that step)."""
    if key(shown) is None or not highlight or highlight.get("key") != key(shown):
        raise PreventUpdate
    plan, _problem = plan_of(runs, shown)
    if plan is None:
        raise PreventUpdate
    seq = _highlighted_sequence(plan, shown, highlight)
    flagged, _views = _stragglers(runs, shown, plan, _store_rows(runs, shown, plan))
    return {
        "bag_load": bag_load_figure(plan, seq, False, flagged),
        "traffic": traffic_figure(plan, seq, validate=False),
    }


def _highlighted_sequence(plan: Any, selection: dict, highlight: dict | None) -> int | None:
    """The highlighted sequence when it belongs to the selected step (None otherwise)."""
    if not highlight or highlight.get("key") != key(selection):
        return None
    seq = highlight.get("seq")
    return seq if isinstance(seq, int) and 0 <= seq < len(plan.sequences) else None


def _phase_views(
    runs: Runs, selection: dict, plan: Any, flagged: dict, rows: WindowRows | None
) -> dict[str, Any]:
    """Where each rank's step went: the selected step (in bag order) and the mean of up to
    `PHASE_WINDOW` measured steps ending at it: the store's last steps when it holds the
    step (``rows``, `_store_rows`), else the measured plans'."""
    shown = step_parts(plan)
    step = (
        empty_figure("no per-rank times recorded for this step", validate=False)
        if shown is None
        else phase_figure(
            reorder(shown, gpu_axis(plan).ranks),
            flagged,
            "Where each rank's step went (bag order)",
            validate=False,
        )
    )
    if rows is not None:
        mean = mean_parts(store_parts(rows, PHASE_WINDOW))
    else:
        mean = window_parts(_measured_plans(runs, selection, PHASE_WINDOW))
    window = (
        empty_figure("no measured steps up to this one", validate=False)
        if mean is None
        else phase_figure(mean, flagged, "Where each rank's steps went", validate=False)
    )
    return {"phase_step": step, "phase_window": window}


def _stragglers(
    runs: Runs, selection: dict, plan: Any, rows: WindowRows | None
) -> tuple[dict, dict[str, Any]]:
    """The ranks flagged up to the selected step, and the straggler views: from the run's
    store when it holds that step (``rows``, `_store_rows`), else from the measured plans."""
    stored = None if rows is None else _store_stragglers(runs, selection, plan, rows)
    if stored is not None:
        return stored
    window = _measured_window(runs, selection)
    flagged = flagged_ranks(analyse(window)) if window else {}
    return flagged, _straggler_views(runs, selection, window, flagged)


def _store_rows(runs: Runs, selection: dict, plan: Any) -> WindowRows | None:
    """The store's rows of the `WINDOW` steps up to the plan's: every step, where the
    plans may hold every k-th (as the report and the header's line read them). None
    without a store, or when its closed segments do not hold the step yet."""
    store = runs.store(selection["run"])
    snap = store.snapshot() if store else None
    steps = snap.store if snap else None
    if steps is None or plan.step is None or steps.last_step is None:
        return None
    if plan.step > steps.last_step:
        return None
    try:
        return window_rows(store.path, max(plan.step - WINDOW + 1, 0), plan.step)
    except KnapformerError:
        return None  # the store's problem is on the page (`Snapshot.notices`)


def _store_stragglers(
    runs: Runs, selection: dict, plan: Any, rows: WindowRows
) -> tuple[dict, dict[str, Any]] | None:
    """`_stragglers` of the store's ``rows``; None when the step itself was not measured."""
    w = window_figures(rows)
    if not w.m.steps or w.m.steps[-1] != plan.step:
        return None
    report = judge(w.m, w.scopes, w.bandwidth)
    _line, views = window_views(
        w.m, report, _run_start(runs.store(selection["run"])), validate=False
    )
    shown = {_STRAGGLER_OUTPUTS[view]: figure for view, figure in views}
    return flagged_ranks(report), shown | {"straggler_style": SHOWN}


def _straggler_views(runs: Runs, selection: dict, window: list, flagged: dict) -> dict[str, Any]:
    """The rank × step heatmaps, compute vs waiting and the step loss over the measured
    steps of ``window`` (`WINDOW` up to the selected one; hidden without any)."""
    if not window:
        return {
            "ratio": no_update, "wait": no_update, "scatter": no_update, "loss": no_update,
            "straggler_style": HIDDEN,
        }  # fmt: skip
    start = _run_start(runs.store(selection["run"]))
    heat = rank_steps(window)
    return {
        "ratio": ratio_heatmap(heat, False, flagged),
        "wait": wait_heatmap(heat, False, flagged, start),
        "scatter": compute_wait_figure(analyse(window), heat, validate=False),
        "loss": step_loss_figure(step_losses(window), start, validate=False),
        "straggler_style": SHOWN,
    }


# ---------------------------------------------------------------- the selected step
def key(selection: dict | None) -> list | None:
    """Which step a selection (or a highlight) is of: run, reset counter, index."""
    if not selection or selection.get("index") is None:
        return None
    return [selection.get("run"), selection.get("reset"), selection.get("index")]


def plan_of(runs: Runs, selection: dict) -> tuple[Any, str | None]:
    """The plan of the selected step, or None and why it cannot be shown."""
    store = runs.store(selection["run"])
    try:
        if store is None:
            raise LookupError(f"run {selection['run']!r} is gone")
        return store.plan(selection["index"], selection["reset"]), None
    except LookupError as err:
        return None, f"cannot show this step: {err}"


def step_of(snap: Snapshot, index: int) -> int:
    """The step number of the ``index``-th step a snapshot holds (its index if unnumbered)."""
    step = snap.summaries[index].step
    return index if step is None else step


def _label(runs: Runs, selection: dict, plan: Any) -> str:
    """What the per-step views show: ``step 7 · 8 of 50 · line 8``; with a store that
    holds more steps than full plans, ``step 20 · 3 of 8 full plans (40 steps in all) ·
    line 3``."""
    store = runs.store(selection["run"])
    snap = store.snapshot() if store else None
    index = selection["index"]
    step = index if plan.step is None else plan.step
    label = f"step {step}"
    if snap is not None and snap.reset == selection["reset"] and index < len(snap.summaries):
        line = snap.summaries[index].line
        n = len(snap.summaries)
        count = step_count(snap.store, snap.summaries)
        label += f" · {index + 1:,} of {n:,}"
        label += f" full plans ({count:,} steps in all)" if count != n else ""
        label += f" · line {line:,}" if line is not None else ""
    return label


def _run_start(store: PlanStore | None) -> int | None:
    """The first step of the run the store holds (where its warm-up is)."""
    snap = store.snapshot() if store else None
    return step_of(snap, 0) if snap and snap.summaries else None


def _measured_window(runs: Runs, selection: dict) -> list:
    """The figures of up to `WINDOW` measured steps ending at the selected one: the
    straggler views show the steps their verdicts are judged on, as with a store, the
    report and `knapformer stragglers` (docs/dashboard.md, "Straggler views")."""
    store = runs.store(selection["run"])
    return store.measured(selection["index"], WINDOW, selection["reset"]) if store else []


def _measured_plans(runs: Runs, selection: dict, count: int) -> list[Any]:
    """The plans of up to ``count`` measured steps ending at the selected one, in step
    order (`PlanStore.measured_plans`)."""
    store = runs.store(selection["run"])
    if store is None:
        return []
    out = []
    for i in store.measured_plans(selection["index"], count, selection["reset"]):
        try:
            out.append(store.plan(i, selection["reset"]))
        except LookupError:
            continue  # gone meanwhile: the mean of the others
    return out
