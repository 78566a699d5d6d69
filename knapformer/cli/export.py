"""``knapformer trace`` and ``knapformer tensorboard``: recorded plans in the tools users
already watch (Perfetto / chrome://tracing / DevTools' Performance panel, and TensorBoard)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import plans_in_range, read_plans
from knapformer.contract.runfiles import RUNS_LAYOUT, every_run

PLANS_HELP = f"plan file (JSON, JSONL or legacy JSON) or a folder of runs ({RUNS_LAYOUT})"
STEPS_HELP = "steps A:B (inclusive; A: or :B open) to export (default: every plan)"


def register(app: typer.Typer) -> None:
    app.command()(trace)
    app.command()(tensorboard)


def read_runs(path: Path, steps: str | None) -> dict[str, list[RoutingPlan]]:
    """Run name -> its plans (in ``steps`` when given) for every run behind ``path``: a
    plan file is one run (named by its plans' ``run``, else its file name), a folder
    holds the runs `every_run` lists. Bad records are skipped with a line on stderr."""
    runs = every_run(path)
    out: dict[str, list[RoutingPlan]] = {}
    for name, file in runs.items():
        result = read_plans(file, on_error="skip")
        for problem in result.problems:
            print(f"skipped {problem}", file=sys.stderr)
        if not result.records:
            raise UserError(str(result.problems[0]) if result.problems else f"{file}: no plan")
        plans = plans_in_range(result, steps) if steps else result.plans
        out[name if path.is_dir() else (plans[-1].run or name)] = plans
    return out


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def trace(
    plans: Path = typer.Argument(..., help=PLANS_HELP),
    out: Path = typer.Option(Path("trace.json"), "-o", "--out", help="output trace (.json)"),
    steps: str | None = typer.Option(None, help=STEPS_HELP),
) -> None:
    """Write recorded per-rank phases as a Chrome Trace Event Format file: one track per
    rank, steps one after another, phases as slices, plan figures as counters. Open it in
    Perfetto (ui.perfetto.dev), chrome://tracing or DevTools' Performance panel."""
    from knapformer.tools.trace import build_trace, write_trace

    if out.suffix.lower() != ".json":
        raise UserError(f"output must be a .json file, not {str(out)!r}")
    runs = read_runs(plans, steps)
    written = write_trace(out, build_trace(runs, source=str(plans)))
    every = [p for run in runs.values() for p in run]
    measured = sum(1 for p in every if p.measurements is not None and p.measurements.per_rank_ms)
    print(
        f"wrote {written}: {_count(len(every), 'step')} of {_count(len(runs), 'run')}, "
        f"{measured:,} with per-rank times; open it in ui.perfetto.dev or chrome://tracing"
    )
    if not measured:
        print(
            "note: no plan carries per-rank times (measurements.per_rank_ms), so the trace "
            "holds the plans' figures only; a PlanRecorder attached to the balancer records "
            "them"
        )


def tensorboard(
    plans: Path = typer.Argument(..., help=PLANS_HELP),
    logdir: Path = typer.Option(..., "--logdir", help="TensorBoard log folder (one run each)"),
    steps: str | None = typer.Option(None, help=STEPS_HELP),
) -> None:
    """Write per-step scalars (imbalance before/after, moved fraction, plan ms, modelled
    speedup, measured max/mean compute) for TensorBoard, one TensorBoard run per run."""
    require("tensorboard", "knapformer tensorboard")
    from knapformer.diagnosis.scalars import open_writer, write_step

    runs = read_runs(plans, steps)
    scalars = 0
    for name, run in runs.items():
        writer = open_writer(logdir / name, "knapformer tensorboard")
        try:
            for index, plan in enumerate(run):
                scalars += write_step(writer, plan, index)
        finally:
            writer.close()
    total = sum(len(run) for run in runs.values())
    print(
        f"wrote {scalars:,} scalars of {_count(total, 'step')} in {_count(len(runs), 'run')} "
        f"to {logdir}; view them with: tensorboard --logdir {logdir}"
    )
