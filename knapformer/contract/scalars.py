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
from typing import Any, Protocol

import numpy as np

from knapformer.contract.plan import RoutingPlan
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
