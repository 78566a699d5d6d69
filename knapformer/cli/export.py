"""``knapformer trace`` and ``knapformer tensorboard``: recorded plans in the tools users
already watch (Perfetto / chrome://tracing / DevTools' Performance panel, and TensorBoard)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import typer

from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.cli.source import SOURCE_HELP
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import parse_step_range, plans_in_range, read_plans
from knapformer.contract.runfiles import (
    RUNS_LAYOUT,
    every_run,
    safe_name,
    writable_folder,
)

PLANS_HELP = f"plan file (JSON, JSONL or legacy JSON) or a folder of runs ({RUNS_LAYOUT})"
STEPS_HELP = "steps A:B (inclusive; A: or :B open) to export (default: every plan)"


#: Steps a trace of the run store holds without --steps: its last ones (every step of a
#: long run is more than a trace viewer opens).
STORE_TRACE_STEPS = 100


def register(app: typer.Typer) -> None:
    app.command()(trace)
    app.command()(tensorboard)


def read_runs(path: Path, steps: str | None) -> dict[str, list[RoutingPlan]]:
    """Run name -> its plans (in ``steps`` when given) for every run behind ``path``: a
    plan file is one run (named by its plans' ``run``, else its file name), a folder
    holds the runs `every_run` lists. Bad records, and runs of a folder without a single
    plan, are skipped with a line on stderr; a `UserError` when no run has a plan."""
    runs = every_run(path)
    out: dict[str, list[RoutingPlan]] = {}
    first_problem = None
    for name, file in runs.items():
        result = read_plans(file, on_error="skip")
        for problem in result.problems:
            print(f"skipped {problem}", file=sys.stderr)
        first_problem = first_problem or (result.problems[0] if result.problems else None)
        if not result.records:
            continue
        plans = plans_in_range(result, steps) if steps else result.plans
        out[name if path.is_dir() else (plans[-1].run or name)] = plans
    if not out:
        raise UserError(str(first_problem) if first_problem else f"{path}: no plan")
    return out


def run_folders(logdir: Path, names: list[str]) -> dict[str, Path]:
    """Run name -> its own folder in ``logdir``: a `safe_name` (a run read from a plan never
    names a path outside ``logdir``), made unique; ``logdir`` is created (`UserError` when
    it cannot be)."""
    writable_folder(logdir, "`logdir`")
    folders: dict[str, Path] = {}
    used: set[str] = set()
    for name in names:
        base = candidate = safe_name(name)
        k = 1
        while candidate in used:
            k += 1
            candidate = f"{base}-{k}"
        used.add(candidate)
        folders[name] = logdir / candidate
    return folders


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def trace(
    plans: Path = typer.Argument(..., metavar="PLANS", help=PLANS_HELP),
    out: Path = typer.Option(Path("trace.json"), "-o", "--out", help="output trace (.json)"),
    steps: str | None = typer.Option(None, help=STEPS_HELP),
    merge: Path | None = typer.Option(
        None,
        "--merge",
        help="folder of torch.profiler Chrome traces, one per rank, to merge in (one "
        "process per rank, on the wall clock)",
    ),
    source: str = typer.Option(
        "auto", help=SOURCE_HELP + f" (on the store: {STORE_TRACE_STEPS} steps unless --steps)"
    ),
) -> None:
    """Write recorded per-rank phases as a Chrome Trace Event Format file: one track per
    rank, steps at their recorded wall-clock times, phases as slices, plan figures as
    counters. Open it in Perfetto (ui.perfetto.dev), chrome://tracing or DevTools'
    Performance panel. With --merge, each rank's torch.profiler trace joins it."""
    from knapformer.contract.run_store import has_store  # pyarrow: not at start-up
    from knapformer.tools.trace import build_trace, write_trace

    if out.suffix.lower() != ".json":
        raise UserError(f"output must be a .json file, not {str(out)!r}")
    if merge is None and source != "plans" and (has_store(plans) or source == "store"):
        _store_trace(plans, out, steps, source)
        return
    runs = read_runs(plans, steps)
    built = build_trace(runs, source=str(plans))
    profiled: Iterable[str] = ()
    if merge is not None:
        from knapformer.tools.profiler_merge import merge_profiler

        if len(runs) != 1:
            raise UserError(f"--merge takes one run; {plans} holds {len(runs)}: name its file")
        built, profiled = merge_profiler(built, merge, next(iter(runs.values())))
    written = write_trace(out, built, profiled)
    every = [p for run in runs.values() for p in run]
    measured = sum(1 for p in every if p.measurements is not None and p.measurements.per_rank_ms)
    print(
        f"wrote {written}: {_count(len(every), 'step')} of {_count(len(runs), 'run')}, "
        f"{measured:,} with per-rank times"
        + (f", merged with the torch.profiler traces of {merge}" if merge is not None else "")
        + "; open it in ui.perfetto.dev or chrome://tracing"
    )
    if not measured:
        print(
            "note: no plan carries per-rank times (measurements.per_rank_ms), so the trace "
            "holds the plans' figures only; a PlanRecorder attached to the balancer records "
            "them"
        )


def _store_trace(plans: Path, out: Path, steps: str | None, source: str) -> None:
    """``knapformer trace`` of the run store: the window's steps, phases and figures."""
    from knapformer.diagnosis.store_source import reader_run, run_folder, step_window
    from knapformer.tools.store_trace import store_steps
    from knapformer.tools.trace import trace_document, write_trace

    run, _ = reader_run(plans, source)
    first, last = step_window(run, steps, STORE_TRACE_STEPS)
    traced = list(store_steps(run, first, last))
    if not traced:
        raise UserError(f"{plans}: the run store holds no step in {steps or 'its last steps'}")
    written = write_trace(out, trace_document({run_folder(run).name: traced}, str(plans)), ())
    measured = sum(1 for s in traced if s.times)
    print(
        f"wrote {written}: {_count(len(traced), 'step')} of 1 run (run store, steps "
        f"{traced[0].step}..{traced[-1].step}), {measured:,} with per-rank times; open it in "
        "ui.perfetto.dev or chrome://tracing"
    )


def tensorboard(
    plans: Path = typer.Argument(..., metavar="PLANS", help=PLANS_HELP),
    logdir: Path = typer.Option(..., "--logdir", help="TensorBoard log folder (one run each)"),
    steps: str | None = typer.Option(None, help=STEPS_HELP),
    source: str = typer.Option("auto", help=SOURCE_HELP),
) -> None:
    """Write per-step scalars (imbalance before/after, moved fraction, plan ms, modelled
    speedup, measured max/mean compute) for TensorBoard, one TensorBoard run per run.
    From the run store when the run has one: every step, however few full plans it kept."""
    require("tensorboard", "knapformer tensorboard")
    from knapformer.contract.run_store import has_store  # pyarrow: not at start-up
    from knapformer.contract.scalars import open_writer, store_step_figures, write_step
    from knapformer.diagnosis.store_source import reader_run, run_folder

    if source != "plans" and (has_store(plans) or source == "store"):
        name = run_folder(reader_run(plans, source)[0]).name
        first, last = parse_step_range(steps) if steps else (None, None)
        scalars, total = _scalars_to(logdir, name, store_step_figures(plans, first, last))
        count = 1
    else:
        runs = read_runs(plans, steps)
        folders = run_folders(logdir, list(runs))
        scalars = 0
        for name, run in runs.items():
            writer = _writer(open_writer, folders[name])
            try:
                for index, plan in enumerate(run):
                    scalars += write_step(writer, plan, index)
            finally:
                writer.close()
        total, count = sum(len(run) for run in runs.values()), len(runs)
    print(
        f"wrote {scalars:,} scalars of {_count(total, 'step')} in {_count(count, 'run')} "
        f"to {logdir}; view them with: tensorboard --logdir {logdir}"
    )


def _writer(open_writer, folder: Path):
    try:
        return open_writer(folder, "knapformer tensorboard")
    except OSError as err:
        raise UserError(f"{folder}: cannot write: {err.strerror or err}") from None


def _scalars_to(logdir: Path, name: str, rows) -> tuple[int, int]:
    """Write ``rows`` (step, time, figures) of the run store to ``name``'s folder; the
    scalars and the steps written."""
    from knapformer.contract.scalars import TAG_PREFIX, open_writer

    writer = _writer(open_writer, run_folders(logdir, [name])[name])
    scalars = steps = 0
    try:
        for step, walltime, figures in rows:
            steps += 1
            for tag, value in figures.items():
                writer.add_scalar(TAG_PREFIX + tag, value, global_step=step, walltime=walltime)
            scalars += len(figures)
    finally:
        writer.close()
    if not steps:
        raise UserError(f"{logdir}: the run store holds no step to write")
    return scalars, steps
