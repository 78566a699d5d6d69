"""The run store's rows of one plan: what `knapformer.runtime.store_writer` appends.

Every figure comes from where the readers take it: the plan's statistics
(`knapformer.contract.stats`) and its measurements as `knapformer.diagnosis.measured.
measure` reads them (rate, waits, layout floor, straggler), so a store row and a reader
working on the full plan agree. Built on the writer thread, never the training thread.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from knapformer.contract.phases import RECORDED_PHASES
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.stats import bag_runs, measured_step_ms
from knapformer.contract.store_schema import MS_QUANTUM, phase_column
from knapformer.diagnosis.measured import MeasuredStep, RankFigures, layout_floor, measure
from knapformer.diagnosis.stragglers import THRESHOLDS


@dataclasses.dataclass
class PlanRows:
    """One plan's rows: ``ranks`` column -> (n,) array (None: null throughout), the step's
    ``step`` row, its figures for the segment's loss (None: nothing measured) and whether
    a reader must be able to open its full plan (`worth_keeping`)."""

    ranks: dict[str, np.ndarray | None]
    step: dict[str, object]
    figures: RankFigures | None
    notable: bool


def quantise_ms(values: np.ndarray) -> np.ndarray:
    """Times as stored: float32 rounded to `MS_QUANTUM` (NaN stays NaN, i.e. null)."""
    return (np.round(np.asarray(values, np.float64) / MS_QUANTUM) * MS_QUANTUM).astype(np.float32)


def plan_rows(plan: RoutingPlan) -> PlanRows:
    """The rows of ``plan`` (which must have a step number)."""
    st = plan.stats
    n = len(plan.gpus)
    measured = measure(plan, links=False)
    per_rank = {} if plan.measurements is None else plan.measurements.per_rank_ms
    load = st.load_after / st.mean_load if st.mean_load > 0 else np.full(n, np.nan)
    rate = None if measured is None else measured.compute_ratio.astype(np.float32)
    ranks: dict[str, np.ndarray | None] = {
        "step": np.full(n, plan.step, dtype=np.int64),
        "time": np.full(n, np.nan if plan.time is None else plan.time),
        "rank": np.asarray(plan.gpus, dtype=np.int32),
        "bag": st.gpu_bag.astype(np.int32),
        "predicted_load": load.astype(np.float32),
        "rate": rate,
        "tokens_in": st.tokens_before.astype(np.int32),
        "tokens_out": st.tokens_after.astype(np.int32),
        "tokens_moved": (st.tokens_sent + st.tokens_received).astype(np.int32),
        "speed": None if plan.gpu_speed is None else np.asarray(plan.gpu_speed, np.float32),
        "wait_ms": None if measured is None else quantise_ms(measured.total_wait_ms),
        "link_gbps": _link_gbps(measured, plan.gpus),
    }
    for phase in RECORDED_PHASES:
        values = per_rank.get(phase)
        ranks[phase_column(phase)] = None if values is None else quantise_ms(values)
    slowest, slowest_rate = _slowest(measured)
    step = {
        "step": plan.step,
        "time": plan.time,
        "gpus": n,
        "partition": plan.topology,
        "bags": bag_runs(plan.bags),
        "imbalance_before": st.imbalance_before,
        "imbalance_after": st.imbalance_after,
        "floor_load": layout_floor(plan),
        "makespan_over_lb": st.makespan_over_lb,
        "moved_tokens": st.moved_tokens,
        "total_tokens": st.total_tokens,
        "plan_ms": None if plan.measurements is None else plan.measurements.plan_ms,
        "step_ms": measured_step_ms(plan.measurements),
        "straggler": None if measured is None else measured.straggler,
        "slowest_rank": slowest,
        "slowest_rate": slowest_rate,
    }
    figures = None if measured is None else dataclasses.replace(measured.figures(), probed=None)
    return PlanRows(ranks, step, figures, worth_keeping(step, measured))


def worth_keeping(step: dict[str, object], measured: MeasuredStep | None) -> bool:
    """Whether a reader must be able to open this step's full plan whatever ``every``
    says: its imbalance after balancing exceeds the layout floor by the straggler
    analysis's ``heavy_load`` (1.1x), or a rank's rate reached its ``slow_ratio`` (1.3x)
    on work enough for a verdict to name it (``rate_work_share`` of the median)."""
    floor = step["floor_load"]
    floor = max(float(floor), 1.0) if np.isfinite(floor) else 1.0
    if float(step["imbalance_after"]) > THRESHOLDS.heavy_load * floor:
        return True
    if measured is None:
        return False
    share = measured.predicted_share
    readable = share >= THRESHOLDS.rate_work_share * float(np.median(share))
    rate = measured.compute_ratio[readable]
    return bool(np.any(rate[np.isfinite(rate)] >= THRESHOLDS.slow_ratio))


def _slowest(measured: MeasuredStep | None) -> tuple[int | None, float | None]:
    """(rank, rate) of the step's highest rate (None, None: none measured)."""
    if measured is None:
        return None, None
    rate = measured.compute_ratio
    if not np.isfinite(rate).any():
        return None, None
    at = int(np.nanargmax(rate))
    return int(measured.gpus[at]), float(rate[at])


def _link_gbps(measured: MeasuredStep | None, gpus: list[int]) -> np.ndarray | None:
    """(n,) each rank's fastest probed link in GB/s; None when the step ran no probe."""
    probed = None if measured is None else measured.probed
    if probed is None or not len(probed.a):
        return None
    best = np.full(len(gpus), np.nan)
    gbps = probed.gbps
    at = {int(g): i for i, g in enumerate(gpus)}
    for end in (probed.a, probed.b):
        rows = np.fromiter((at[int(r)] for r in end), np.int64, len(end))
        np.fmax.at(best, rows, gbps)
    return best.astype(np.float32)
