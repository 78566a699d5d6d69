"""The run store's rows: of one plan (`plan_rows`), as tables, and a segment's rank
windows (`window_rows`): what `knapformer.runtime.store_writer` appends.

Every figure comes from where the readers take it: the plan's statistics
(`knapformer.contract.stats`) and its measurements as `knapformer.diagnosis.measured.
measure` reads them (rate, waits, layout floor, straggler), so a store row and a reader
working on the full plan agree. Built on the writer thread, never the training thread.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pyarrow as pa

from knapformer.contract.phases import COMPUTE_PHASES, RECORDED_PHASES
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.stats import bag_runs, measured_step_ms
from knapformer.contract.store_schema import (
    MS_QUANTUM,
    RANK_WINDOWS,
    RANKS,
    STEPS,
    phase_column,
)
from knapformer.diagnosis.measured import MeasuredStep, RankFigures, layout_floor, measure
from knapformer.diagnosis.stragglers import THRESHOLDS

_TIME_COLUMNS = {f.name for f in (*RANKS, *STEPS) if f.name.endswith("_ms")}
#: The columns that stand for compute in a rank window, best first (`COMPUTE_PHASES`).
_COMPUTE_COLUMNS = tuple(phase_column(p) for p in COMPUTE_PHASES if phase_column(p) in RANKS.names)


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
        "link_gbps": _link_gbps(measured, plan.gpus, cross_node=False),
        "link_cross_gbps": _link_gbps(measured, plan.gpus, cross_node=True),
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


def _link_gbps(measured: MeasuredStep | None, gpus: list[int], cross_node: bool):
    """(n,) each rank's fastest probed link of one kind (to a GPU of its own node, or of
    another) in GB/s, NaN for a rank with no such pair; None when the step ran no probe of
    that kind."""
    probed = None if measured is None else measured.probed
    if probed is None:
        return None
    kind = probed.cross_node == cross_node
    if not kind.any():
        return None
    best = np.full(len(gpus), np.nan)
    gbps = probed.gbps[kind]
    at = {int(g): i for i, g in enumerate(gpus)}
    for end in (probed.a[kind], probed.b[kind]):
        rows = np.fromiter((at[int(r)] for r in end), np.int64, len(end))
        np.fmax.at(best, rows, gbps)
    return best.astype(np.float32)


def window_rows(
    first: int, last: int, rank: np.ndarray, rate: np.ndarray, compute: np.ndarray
) -> pa.Table:
    """One ``rank_windows`` row per rank of a segment from its rank-steps' (rank, rate,
    compute ms), each (m,)."""
    order = np.argsort(rank, kind="stable")
    rank, rate, compute = rank[order], rate[order].astype(np.float64), compute[order]
    ranks, starts, counts = np.unique(rank, return_index=True, return_counts=True)
    measured = np.isfinite(rate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank never measured: NaN
        if len(counts) and (counts == counts[0]).all():
            shape = (len(ranks), int(counts[0]))
            rate_median = np.nanmedian(rate.reshape(shape), axis=1)
            compute_median = np.nanmedian(compute.reshape(shape), axis=1)
        else:
            rate_median = np.array([np.nanmedian(r) for r in np.split(rate, starts[1:])])
            compute_median = np.array([np.nanmedian(c) for c in np.split(compute, starts[1:])])
        rate_max = np.fmax.reduceat(rate, starts) if len(rate) else np.zeros(0)
    slow = measured & (np.nan_to_num(rate) >= THRESHOLDS.slow_ratio)
    n = len(ranks)
    columns = {
        "first_step": np.full(n, first, np.int64),
        "last_step": np.full(n, last, np.int64),
        "rank": ranks.astype(np.int32),
        "steps": _sums(measured, starts, n),
        "rate_median": rate_median.astype(np.float32),
        "rate_max": rate_max.astype(np.float32),
        "slow_steps": _sums(slow, starts, n),
        "compute_ms_median": quantise_ms(compute_median),
    }
    return pa.table(
        {k: pa.array(v, RANK_WINDOWS.field(k).type, from_pandas=True) for k, v in columns.items()}
    )


def _sums(flags: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    return np.add.reduceat(flags.astype(np.int32), starts) if n else np.zeros(0, np.int32)


def window_figures(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, rate, compute ms) of ``ranks`` rows, compute by the first of
    `_COMPUTE_COLUMNS` that holds a value."""
    nan = np.full(table.num_rows, np.nan, np.float32)
    compute = nan
    for name in _COMPUTE_COLUMNS:
        column = table[name]
        if column.null_count < len(column):
            compute = column.to_numpy(zero_copy_only=False)
            break
    rate = (
        table["rate"].to_numpy(zero_copy_only=False) if table["rate"].null_count < len(nan) else nan
    )
    return table["rank"].to_numpy(), rate, compute


def concat_columns(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


def ranks_table(columns: dict[str, np.ndarray | None]) -> pa.Table:
    """A ``ranks`` table of one plan's columns (NaN and None: null)."""
    n = len(columns["rank"])
    arrays = []
    for field in RANKS:
        values = columns[field.name]
        if values is None:
            arrays.append(pa.nulls(n, field.type))
        else:
            nan = pa.types.is_floating(field.type)
            arrays.append(pa.array(values, field.type, from_pandas=nan))
    return pa.Table.from_arrays(arrays, schema=RANKS)


def steps_table(rows: list[dict]) -> pa.Table:
    """A ``steps`` table of dict rows (non-finite floats: null; times quantised)."""
    columns = {}
    for field in STEPS:
        values = [row.get(field.name) for row in rows]
        if pa.types.is_floating(field.type):
            values = np.array([np.nan if v is None else float(v) for v in values])
            values[~np.isfinite(values)] = np.nan
            if field.name in _TIME_COLUMNS:
                values = quantise_ms(values)
            columns[field.name] = pa.array(values, field.type, from_pandas=True)
        else:
            columns[field.name] = pa.array(values, field.type)
    return pa.table(columns, schema=STEPS)
