"""``knapformer validate``, ``show`` and ``schema``: check and print plan files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError
from knapformer.contract.incident import incident_file, looks_like_incident, read_incident
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import (
    PlanFormatError,
    PlanRecord,
    ReadResult,
    iter_plan_file,
    read_plans,
    select_step,
)
from knapformer.contract.runfiles import every_run, single_run
from knapformer.contract.stats import before_after, share
from knapformer.contract.units import LoadUnit
from knapformer.errors import KnapformerError
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES, layout_floor


def register(app: typer.Typer) -> None:
    app.command()(validate)
    app.command()(show)
    app.command()(schema)


PLAN_ARGUMENT = "plan file (JSON, JSONL or legacy JSON) or a run folder"


def validate(
    files: list[Path] = typer.Argument(
        ...,
        metavar="FILE",
        help="plan files (JSON, JSONL or legacy JSON), incident files or run folders (every "
        "run checked, with its incident.json)",
    ),
) -> None:
    """Check plan files; print one line per problem as file:line: message (exit 1 if any).
    A file in which steps repeat mixes runs (a re-run appended to a recording): one line
    names the repeated steps. A failed run's incident (incident.json) is checked too."""
    console = Console(highlight=False)
    bad = 0
    incidents = [given for given in files if is_incident_file(given)]
    runs = [run for given in files if given not in incidents for run in every_run(given).values()]
    incidents += [incident_file(run.parent) for run in runs if incident_file(run.parent).is_file()]
    for path in dict.fromkeys(incidents):
        bad += not _valid_incident(path, console)
    for path in runs:
        plans = problems = 0
        seen: set[int] = set()  # one int per plan: a long recording is still not held
        repeated: set[int] = set()
        for item in iter_plan_file(path):  # streamed: a long recording is not held
            if isinstance(item, PlanRecord):
                plans += 1
                step = item.plan.step
                if step is not None:
                    (repeated if step in seen else seen).add(step)
            else:
                print(item, flush=True)
                problems += 1
        if repeated:
            print(f"{path}: {repeated_steps(repeated)}", flush=True)
            problems += 1
        bad += problems
        if not problems:
            console.print(f"{path}: {plans} plan(s) OK", soft_wrap=True)
    if bad:
        raise typer.Exit(1)


def is_incident_file(path: Path) -> bool:
    """Whether ``path`` is a file whose JSON starts as an incident's."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as handle:
            return looks_like_incident(handle.read(64))
    except OSError:
        return False


def _valid_incident(path: Path, console: Console) -> bool:
    """Check one incident file: one line, OK with what it says, or its problem."""
    try:
        incident = read_incident(path)
    except KnapformerError as err:
        print(err, flush=True)
        return False
    console.print(f"{path}: incident OK ({incident.message})", soft_wrap=True)
    return True


def repeated_steps(steps: set[int]) -> str:
    """The line `validate` prints for a file in which ``steps`` appear more than once."""
    ordered = sorted(steps)
    shown = ", ".join(map(str, ordered[:8])) + (
        f" and {len(ordered) - 8:,} more" if len(ordered) > 8 else ""
    )
    return (
        f"step(s) {shown} appear more than once: the file mixes runs (a re-run appended to "
        "an earlier recording); readers would mix them: give each run its own file"
    )


def show(
    file: Path = typer.Argument(..., metavar="PLAN", help=PLAN_ARGUMENT),
    step: int | None = typer.Option(
        None, callback=bounded, help="step to show (default: the last plan)"
    ),
) -> None:
    """Print a plan as a table per GPU: bag, tokens and load before/after, and its figures."""
    record, result = read_step(file, step)
    console = Console(highlight=False, width=max(Console().width, 110))
    console.print(plan_table(record))
    if shown_positions(record.plan) is not None:
        console.print(
            f"showing {MAX_SHOWN_GPUS} of {len(record.plan.gpus):,} GPUs, the most loaded after "
            "balancing; the figures below cover all of them"
        )
    console.print(plan_summary(record.plan))
    for problem in result.problems:
        print(f"skipped {problem}")


def read_plan_file(path: Path) -> ReadResult:
    """Every valid plan of ``path`` (a plan file, or a run folder: `single_run`); a
    one-line `UserError` naming the first problem when there is none (commands that take
    a plan file start here)."""
    result = read_plans(single_run(path), on_error="skip")
    if not result.records:
        # A problem with the whole file (unreadable, not a plan file) says most.
        whole = [p for p in result.problems if p.line is None]
        first = (whole or result.problems or [f"{path}: no plan"])[0]
        raise UserError(str(first))
    return result


def read_step(path: Path, step: int | None) -> tuple[PlanRecord, ReadResult]:
    """The plan of ``step`` in ``path`` (default: the last) and the whole read."""
    result = read_plan_file(path)
    try:
        return select_step(result, step), result
    except PlanFormatError as err:
        raise UserError(f"{path}: {err}") from err


def schema() -> None:
    """Print the JSON Schema of a routing plan."""
    print(json.dumps(RoutingPlan.model_json_schema(), indent=2))


#: ``show`` prints one row per GPU up to this many GPUs; beyond, the rows of the most
#: loaded ones (after balancing) and a note: 10,000 rows help nobody find rank 17.
MAX_SHOWN_GPUS = 64


def shown_positions(plan: RoutingPlan) -> np.ndarray | None:
    """Positions in ``plan.gpus`` of the rows ``show`` prints; None for all of them."""
    if len(plan.gpus) <= MAX_SHOWN_GPUS:
        return None
    return np.argsort(-plan.stats.load_after, kind="stable")[:MAX_SHOWN_GPUS]


def plan_table(record: PlanRecord) -> Table:
    plan = record.plan
    st = plan.stats
    shown = shown_positions(plan)
    wanted = None if shown is None else {plan.gpus[i] for i in shown.tolist()}
    step = "" if plan.step is None else f" step {plan.step}"
    title = f"{plan.run or 'plan'}{step} · {plan.topology} · solver {plan.solver}"
    unit = LoadUnit.of(plan)
    table = Table(title=title, title_justify="left")
    table.add_column("GPU", justify="right")
    table.add_column("bag", no_wrap=True)
    for name in ("seqs", "tokens before", "tokens after"):
        table.add_column(name, justify="right")
    for when in ("before", "after"):
        table.add_column(f"load {when}\n({unit.name})", justify="right")
    seqs_per_gpu = {g: 0 for g in plan.gpus}
    for g in plan.sequences.src_gpu.tolist():
        seqs_per_gpu[g] += 1
    pos = {g: i for i, g in enumerate(plan.gpus)}
    for bag_id, bag in enumerate(plan.bags):
        members = bag if wanted is None else [g for g in bag if g in wanted]
        for k, g in enumerate(members):
            i = pos[g]
            table.add_row(
                str(g),
                plan.bag_label(bag_id) if k == 0 else "",
                str(seqs_per_gpu[g]),
                f"{st.tokens_before[i]:,}",
                f"{st.tokens_after[i]:,}",
                unit.format(st.load_before[i]).removesuffix(unit.suffix),
                unit.format(st.load_after[i]).removesuffix(unit.suffix),
                end_section=k == len(members) - 1,
            )
    return table


def plan_summary(plan: RoutingPlan) -> str:
    st = plan.stats
    unit = LoadUnit.of(plan)
    plan_ms = plan.measurements.plan_ms if plan.measurements else None
    lines = [
        f"imbalance max/mean: {before_after(st.imbalance_before, st.imbalance_after)}   "
        f"max/min: {before_after(st.max_min_before, st.max_min_after)}",
        f"makespan: {unit.format(st.makespan_before)} → {unit.format(st.makespan_after)}   "
        f"lower bound {unit.format(st.lower_bound)} (makespan/LB {st.makespan_over_lb:.4f})   "
        f"modelled speedup {st.speedup:.2f}×",
        f"moved tokens: {share(st.moved_tokens, st.total_tokens)}"
        f"   sequences {len(plan.sequences):,}   chunks {len(plan.chunks):,}"
        + (f"   planned in {plan_ms:.2f} ms" if plan_ms is not None else ""),
    ]
    lines.append(_floor_line(plan, unit))
    lines.append(_unit_note(plan, unit))
    return "\n".join(lines)


def _floor_line(plan: RoutingPlan, unit: LoadUnit) -> str:
    """What a layout costs this step: the least makespan the best fixed gXnY, and any
    partition of the aligned sizes, could reach (`layout_floor`, compute only)."""
    floor = layout_floor(plan.sequences.workload, plan.sequences.length, len(plan.gpus))
    best = min(floor.fixed, key=floor.fixed.get)
    sizes = ",".join(str(g) for g in DEFAULT_GROUP_SIZES if g <= len(plan.gpus))
    return (
        f"layout floor: best fixed layout {best} {unit.format(floor.fixed[best])}   "
        f"any partition of groups {sizes} {unit.format(floor.partitions)}"
    )


def _unit_note(plan: RoutingPlan, unit: LoadUnit) -> str:
    """Say what the load figures are: the model behind them and their unit."""
    model = "Ulysses-exact modelled cost per GPU"
    if plan.token_dim is not None and plan.gamma is not None:
        model += f" (d={plan.token_dim}, γ={plan.gamma:g})"
    if unit.relative:
        return f"loads: {model}, relative to the mean GPU (1.00 = ideal)"
    return f"loads: {model}, in calibrated ms"
