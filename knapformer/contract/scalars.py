"""The per-step figures of a routing plan as scalars over steps, and writing them to
TensorBoard.

`step_figures` is the one list of what a step is summed up by over time (TensorBoard
tags, the trace's counters): imbalance before/after balancing (max/mean load), the
moved-token fraction, planning time, the modelled speedup and, when the plan carries
measured per-rank times, the measured compute of the slowest GPU over the mean one
(``compute_max_over_mean``; 1.00 = every GPU computed equally long) with its max and
mean in ms.

`write_step(writer, plan)` writes them under ``knapformer/<name>`` with a writer that has
``add_scalar(tag, value, global_step, walltime)`` (``torch.utils.tensorboard.SummaryWriter``,
or tensorboardX's). It does no I/O of its own beyond that call, so a recorder can call it
on its background thread for each plan it writes: open one writer with `open_writer`
(``knapformer[tensorboard]``), call ``write_step(writer, plan)`` after writing the plan's
line, and ``writer.close()`` when the recorder closes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from knapformer.contract.phases import COMPUTE_PHASES, RECORDED_PHASES
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.store_schema import phase_column
from knapformer.errors import MissingExtraError

TAG_PREFIX = "knapformer/"


class ScalarWriter(Protocol):
    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int | None = None, walltime=None
    ) -> Any: ...


def measured_compute(plan: RoutingPlan) -> tuple[float, float] | None:
    """(max ms, mean ms) over the GPUs of the measured phase that stands for compute
    (`Measurements.compute_phase`); None when no such phase was measured."""
    m = plan.measurements
    phase = None if m is None else m.compute_phase()
    if phase is None:
        return None
    times = np.asarray(m.per_rank_ms[phase], dtype=np.float64)
    if times.size == 0 or not np.isfinite(times).all():
        return None
    return float(times.max()), float(times.mean())


def step_figures(plan: RoutingPlan) -> dict[str, float]:
    """Name -> value of the figures of one step (finite values only; measured ones only
    when the plan carries them)."""
    st = plan.stats
    figures = {
        "imbalance_before": st.imbalance_before,
        "imbalance_after": st.imbalance_after,
        "moved_fraction": st.moved_fraction,
        "modelled_speedup": st.speedup,
    }
    if plan.measurements is not None and plan.measurements.plan_ms is not None:
        figures["plan_ms"] = float(plan.measurements.plan_ms)
    compute = measured_compute(plan)
    if compute is not None:
        top, mean = compute
        figures["compute_max_ms"], figures["compute_mean_ms"] = top, mean
        if mean > 0:
            figures["compute_max_over_mean"] = top / mean
    return {name: float(v) for name, v in figures.items() if np.isfinite(v)}


def write_step(writer: ScalarWriter, plan: RoutingPlan, step: int | None = None) -> int:
    """Write ``plan``'s `step_figures` at its step (``step`` when the plan has none) and
    its wall-clock time; returns how many scalars were written."""
    global_step = plan.step if plan.step is not None else step
    figures = step_figures(plan)
    for name, value in figures.items():
        writer.add_scalar(TAG_PREFIX + name, value, global_step=global_step, walltime=plan.time)
    return len(figures)


def open_writer(logdir: str | os.PathLike, what: str = "TensorBoard logging") -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``logdir``; `MissingExtraError` when
    the ``tensorboard`` package (``knapformer[tensorboard]``) is not installed."""
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it; say so plainly)
    except ModuleNotFoundError as err:
        raise MissingExtraError("tensorboard", what, err.name or "tensorboard") from err
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(logdir))


def store_step_figures(
    run: str | os.PathLike, first: int | None = None, last: int | None = None
) -> Iterator[tuple[int, float | None, dict[str, float]]]:
    """(step, wall-clock time, `step_figures`) of every step ``first..last`` of ``run``'s
    run store, read one segment at a time (a long run is never held whole): the plan's
    figures from ``steps``, the measured compute from ``ranks``."""
    from knapformer.contract.run_store import list_segments, read_table, store_folder

    store = store_folder(run)
    step_columns = ["step", "time", "imbalance_before", "imbalance_after", "moved_tokens",
                    "total_tokens", "plan_ms"]  # fmt: skip
    compute_columns = [phase_column(p) for p in COMPUTE_PHASES if p in RECORDED_PHASES]
    for seg in list_segments(store, "steps"):
        if not seg.overlaps(first, last):
            continue
        span = (
            max(seg.first, first or seg.first),
            min(seg.last, seg.last if last is None else last),
        )
        steps = read_table(store, "steps", span, step_columns).sort_by("step")
        ranks = read_table(store, "ranks", span, ["step", *compute_columns]).sort_by("step")
        compute = _compute_by_step(ranks, compute_columns)
        for row in steps.to_pylist():
            yield row["step"], row["time"], _row_figures(row, compute.get(row["step"]))


def _row_figures(row: dict, compute: tuple[float, float] | None) -> dict[str, float]:
    """`step_figures` of a ``steps`` row and the step's measured (max, mean) compute."""
    before, after = row["imbalance_before"], row["imbalance_after"]
    total = row["total_tokens"] or 0
    figures = {
        "imbalance_before": before,
        "imbalance_after": after,
        "moved_fraction": row["moved_tokens"] / total if total else 0.0,
        # makespan before / after: both imbalances are over the same mean load
        "modelled_speedup": before / after if before is not None and after else None,
        "plan_ms": row["plan_ms"],
    }
    if compute is not None:
        top, mean = compute
        figures["compute_max_ms"], figures["compute_mean_ms"] = top, mean
        if mean > 0:
            figures["compute_max_over_mean"] = top / mean
    return {name: float(v) for name, v in figures.items() if v is not None and np.isfinite(v)}


def _compute_by_step(ranks: Any, columns: list[str]) -> dict[int, tuple[float, float]]:
    """Step -> (max, mean) ms of its compute phase over its ranks (`measured_compute`:
    the first of `COMPUTE_PHASES` the step measured; left out unless every rank has it)."""
    if len(ranks) == 0:
        return {}
    step = ranks["step"].to_numpy()
    starts = np.flatnonzero(np.r_[True, np.diff(step) != 0])
    count = np.diff(np.r_[starts, len(step)])
    out: dict[int, tuple[float, float]] = {}
    undecided = np.ones(len(starts), bool)
    for name in columns:
        values = ranks[name].to_numpy(zero_copy_only=False).astype(np.float64)
        finite = np.isfinite(values)
        has = np.add.reduceat(finite, starts) > 0  # the step measured this phase
        take = undecided & has
        complete = take & (np.add.reduceat(finite, starts) == count)
        top = np.maximum.reduceat(np.where(finite, values, -np.inf), starts)
        mean = np.add.reduceat(np.where(finite, values, 0.0), starts) / count
        for i in np.flatnonzero(complete).tolist():
            out[int(step[starts[i]])] = (float(top[i]), float(mean[i]))
        undecided &= ~has
    return out
