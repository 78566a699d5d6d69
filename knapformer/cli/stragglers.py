"""``knapformer stragglers PLANS``: which rank is slow, and whether the GPU or the data is."""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError
from knapformer.cli.source import SOURCE_HELP
from knapformer.contract.incident import run_incident
from knapformer.contract.plan_io import Problem, iter_plan_file, parse_step_range
from knapformer.contract.runfiles import PLANS_FILE, RUNS_LAYOUT
from knapformer.contract.units import significant
from knapformer.diagnosis.measured import RankFigures, measure
from knapformer.diagnosis.probed import relative_bandwidth
from knapformer.diagnosis.rank_steps import RankSteps, rank_steps
from knapformer.diagnosis.step_loss import (
    PART_INFO,
    PARTS,
    StepLoss,
    describe_loss,
    summarise,
    window_losses,
)
from knapformer.diagnosis.store_window import window_figures, without_huge_pages
from knapformer.diagnosis.stragglers import (
    WINDOW,
    StragglerReport,
    describe,
    describe_link,
    headline,
    judge,
    scope_times,
)
from knapformer.errors import KnapformerError

#: Up to this many ranks the table lists every rank; beyond, the named ones only.
_ALL_RANKS_UP_TO = 64


def register(app: typer.Typer) -> None:
    app.command()(stragglers)


def stragglers(
    plans: Path = typer.Argument(
        ...,
        metavar="PLANS",
        help=f"recorded plans with measurements: a .jsonl, or a run folder ({RUNS_LAYOUT})",
    ),
    window: int | None = typer.Option(
        None,
        callback=bounded,
        show_default=False,
        help=f"analyse the last N measured steps (0: every step; default: {WINDOW}, or every "
        "step of --steps)",
    ),
    steps: str | None = typer.Option(
        None, help="analyse steps A:B (inclusive; A: or :B open), e.g. 40000:40999"
    ),
    source: str = typer.Option("auto", help=SOURCE_HELP),
    as_json: bool = typer.Option(
        False, "--json", help="print a JSON list of per-rank objects (rank, verdict, ...)"
    ),
    loss: bool = typer.Option(
        False,
        "--loss",
        help="per step: the measured step against an ideal one and what the difference went "
        "to (layout floor, solver gap, slow ranks, input, communication, other); with "
        "--json a list of per-step objects",
    ),
) -> None:
    """Name slow ranks: per rank, predicted share vs measured compute, waiting, and a verdict
    (slow_gpu, slow_host, slow_input, slow_link, layout_floor, data_imbalance or ok)."""
    from knapformer.diagnosis.store_source import reader_run, run_folder  # pyarrow: not at start-up

    path, from_store = reader_run(plans, source)
    last = (None if steps else WINDOW) if window is None else (window or None)
    _show_incident(run_folder(path) / PLANS_FILE, as_json)  # its incident sits beside it
    if from_store:
        m, report = _store_window(path, steps, last)
    else:
        m, report = _plans_window(path, steps, last)
    losses = window_losses(m)
    if loss:
        if as_json:
            print(json.dumps([item.as_dict() for item in losses], indent=1))
        else:
            console = Console(highlight=False, width=max(Console().width, 110))
            shown = [name for name in PARTS if any(abs(x.part_ms[name]) >= 0.5 for x in losses)]
            console.print(_loss_table(losses, shown), describe_loss(summarise(losses)))
            console.print(_loss_legend(shown))
        return
    if as_json:
        print(json.dumps([r.as_dict() for r in report.ranks], indent=1))
        return
    console = Console(highlight=False, width=max(Console().width, 110))
    console.print(_table(report), _summary(report, len(m.steps)))
    console.print(f"what a step lost (--loss per step): {describe_loss(summarise(losses))}")


def _store_window(
    path: Path, steps: str | None, last: int | None
) -> tuple[RankSteps, StragglerReport]:
    """The window's matrices and verdicts from the run store: only its rows are read."""
    from knapformer.diagnosis.store_source import step_window, window_rows

    without_huge_pages()  # one window, then the process exits
    first, end = step_window(path, steps, last)
    w = window_figures(window_rows(path, first, end))
    if not w.m.steps:
        raise UserError(f"{path}: no step of the run store measured a compute phase")
    return w.m, judge(w.m, w.scopes, w.bandwidth)


def _plans_window(
    path: Path, steps: str | None, last: int | None
) -> tuple[RankSteps, StragglerReport]:
    """The window's matrices and verdicts from the plans (streamed)."""
    span = parse_step_range(steps) if steps else None
    figures, count, skipped = _measured_figures(path, last, span)
    if skipped:
        # On stderr, so that --json stays one document.
        count_bad, first = skipped
        print(f"skipped {count_bad:,} unreadable record(s) (first: {first})", file=sys.stderr)
    if not figures:
        where = f" in steps {steps}" if steps else ""
        raise UserError(
            f"{path}: none of its {count} plan(s){where} measured a compute phase "
            "(record with a balancer and a PlanRecorder)"
        )
    m = rank_steps(figures)
    return m, judge(m, scope_times(figures), relative_bandwidth(figures, m.ranks))


def _show_incident(path: Path, as_json: bool) -> None:
    """The run's failed step, if it has one, first (on stderr under --json, which stays
    one document)."""
    try:
        incident = run_incident(path)
    except KnapformerError as err:
        print(f"the run's incident cannot be read: {err}", file=sys.stderr)
        return
    if incident is None:
        return
    if as_json:
        print(incident.headline(), file=sys.stderr)
    else:
        Console(highlight=False, soft_wrap=True).print(incident.headline(), style="bold red")


def _measured_figures(
    path: Path, window: int | None, span: tuple[int | None, int | None] | None = None
) -> tuple[list[RankFigures], int, tuple[int, Problem] | None]:
    """The per-rank figures of the last ``window`` measured plans of ``path`` (all: None)
    whose step lies in ``span`` (inclusive; None: every plan), how many plans it holds,
    and how many records were skipped with the first of them; the file is streamed, so a
    long run is never held whole. A file with no plan at all is a one-line `UserError`
    naming its first problem."""
    kept: deque[RankFigures] = deque(maxlen=window)
    count, problems, first_problem = 0, 0, None
    low, high = span if span is not None else (None, None)
    for item in iter_plan_file(path):
        if isinstance(item, Problem):
            problems += 1
            first_problem = first_problem or item
            continue
        count += 1
        step = item.plan.step
        if span is not None and (
            step is None or (low is not None and step < low) or (high is not None and step > high)
        ):
            continue
        measured = measure(item.plan)
        if measured is not None:
            kept.append(measured.figures())
    if not count:
        raise UserError(str(first_problem) if first_problem else f"{path}: no plan")
    return list(kept), count, (problems, first_problem) if first_problem else None


def _fmt(value: float, spec: str = "") -> str:
    if value != value:  # NaN: the rank had no work (or no measurement) in the window
        return "–"
    return format(value, spec) if spec else significant(value)


def _table(report: StragglerReport) -> Table:
    steps = [s for s in report.steps if s is not None]
    span = f"steps {min(steps)}..{max(steps)}" if steps else f"{len(report.steps)} plans"
    table = Table(
        title=f"stragglers over {span} ({len(report.steps)} measured; compute phase "
        f"{', '.join(report.phases)})",
        title_justify="left",
    )
    for name in ("rank", "verdict", "predicted\nshare", "predicted\nload (× ideal)"):
        table.add_column(name, justify="right" if name != "verdict" else "left")
    for name in ("compute\n(ms)", "rate\n(× group)", "wait\n(ms)", "times\nlast", "steps"):
        table.add_column(name, justify="right")
    probed = any(r.probes for r in report.ranks)
    if probed:  # only runs with the link probe have the figure
        table.add_column("link\n(× peers)", justify="right")
    shown = report.ranks if len(report.ranks) <= _ALL_RANKS_UP_TO else report.named
    for r in shown:
        style = "bold red" if r.verdict.startswith("slow_") else None
        style = {"data_imbalance": "yellow", "layout_floor": "yellow"}.get(r.verdict, style)
        table.add_row(
            str(r.rank),
            r.verdict,
            _fmt(r.predicted_share, ".1%"),
            _fmt(r.predicted_load, ".2f"),
            _fmt(r.measured_ms),
            _fmt(r.ratio, ".2f"),
            _fmt(r.wait_ms),
            str(r.last_arrivals),
            str(r.steps),
            *([_fmt(r.link_bandwidth, ".2f")] if probed else []),
            style=style,
        )
    return table


def _loss_table(losses: list[StepLoss], parts: list[str]) -> Table:
    """Per step: measured, ideal, lost and each of ``parts`` (ms)."""
    table = Table(
        title="what each step lost against an ideal one (ms): compute spread evenly at the "
        "group's rate, exchanges at its median bandwidth",
        title_justify="left",
    )
    for name in ("step", "measured", "ideal", "lost"):
        table.add_column(name, justify="right")
    for name in parts:
        table.add_column(PART_INFO[name].label, justify="right")
    for item in losses:
        table.add_row(
            "–" if item.step is None else str(item.step),
            *(_fmt(v, ".0f") for v in (item.measured_ms, item.ideal_ms, item.lost_ms)),
            *(_fmt(item.part_ms[name], ".0f") for name in parts),
        )
    return table


def _loss_legend(parts: list[str]) -> str:
    """What each shown part of the loss holds, one line each; the others were 0."""
    lines = [f"  {PART_INFO[name].label}: {PART_INFO[name].meaning}" for name in parts]
    hidden = [PART_INFO[name].label for name in PARTS if name not in parts]
    if hidden:
        lines.append(f"  (0 in every step, not shown: {', '.join(hidden)})")
    return "the parts:\n" + "\n".join(lines)


def _summary(report: StragglerReport, measured: int) -> str:
    th = report.thresholds
    lines = []
    if len(report.ranks) > _ALL_RANKS_UP_TO:
        ok = len(report.ranks) - len(report.named)
        lines.append(f"{ok:,} of {len(report.ranks):,} ranks ok (not listed; --json lists all)")
    if measured < th.min_steps:
        lines.append(
            f"only {measured} measured step(s): a verdict needs {th.min_steps} (all ranks ok)"
        )
    lines += [describe(r) for r in report.named]
    lines += [describe_link(v) for v in report.slow_links + report.cleared_links]
    if not report.named and not report.slow_links and measured >= th.min_steps:
        lines.append(f"straggler: {headline(report)}")
    if report.fit is not None and report.fit.note:
        lines.append(f"compute model: {report.fit.note}")
    lines.append(
        f"verdicts (each needs its figure in ≥ {th.persistence:.0%} of steps): slow_gpu when "
        f"the rate (affine model) is ≥ {th.slow_ratio:g}× the group's (minor when it costs "
        f"under {th.material:.0%} of the step); slow_host / slow_input when host work / the "
        f"wait for data exceed the group's median by ≥ {th.material:.0%} of the step; "
        "slow_link when in the link probe its fastest link moves ≤ "
        f"{th.link_bandwidth:g}× the group's, in ≥ {th.min_probes} probes (an "
        "exchange scope, the group's routing or one bag's Ulysses exchanges, when its time "
        f"with nobody waiting is ≥ {th.link_cost:g}× the compute it serves); layout_floor / "
        "data_imbalance when the predicted load "
        f"is ≥ {th.heavy_load:g}× the ideal, at the layout floor or above it"
    )
    return "\n".join(lines)
