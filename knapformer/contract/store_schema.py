"""The run store's tables: the one place that names their columns, types and units.

A run keeps, beside its sampled full plans (JSONL), one narrow row per rank per step
(`RANKS`), one row per step (`STEPS`) and, per closed segment, one row per rank
summarising it (`RANK_WINDOWS`), as Parquet segments in ``<run>/store/``
(`knapformer.contract.run_store` reads them, `knapformer.runtime.store_writer` writes
them). docs/recording.md ("Run store") shows every column.

Units: times in ms as float32 rounded to 1/128 ms (`MS_QUANTUM`): the low mantissa bits
are then zero and compress away (``bench/run_store.py`` measures it against int32
hundredths of a ms: 7 % more bytes, for plain ms in every reader); loads and
rates are ratios (1.00 = the group's); tokens are counts. A figure that was not
measured is null, never 0.
"""

from __future__ import annotations

import pyarrow as pa

from knapformer.contract.phases import RECORDED_PHASES

#: Version of the tables' layout, in every segment's metadata (`META_SCHEMA`).
STORE_VERSION = 1
#: The folder of a run's store, beside its ``plans.jsonl``.
STORE_FOLDER = "store"
#: The file holding the run's identity (`META_RUN`), written when the store is created.
RUN_FILE = "run.json"
#: Times are rounded to this many ms (a power of two: exact in float32, see the module doc).
MS_QUANTUM = 1.0 / 128

# Parquet key-value metadata of every segment: which store and table it belongs to.
META_SCHEMA = b"knapformer.store"
META_RUN = b"knapformer.run_id"
META_TABLE = b"knapformer.table"


#: The parts of a step's loss, as `knapformer.diagnosis.step_loss.PARTS` names them (the
#: contract may not import the diagnosis; tests/test_run_store.py checks they agree).
LOSS_PARTS = (
    "layout_floor", "solver_gap", "slow_ranks", "input", "host", "communication",
    "exchange_waits", "gather", "allreduce", "optimizer", "descheduled", "untimed", "other",
)  # fmt: skip


def phase_column(phase: str) -> str:
    """The `RANKS` column of a measured phase: ``<phase>_ms``."""
    return f"{phase}_ms"


def loss_column(part: str) -> str:
    """The `STEPS` column of a part of a step's loss (`LOSS_PARTS`): ``lost_<part>_ms``."""
    return f"lost_{part}_ms"


_MS = pa.float32()

#: One row per rank per step: what the plan gave the rank and what it measured.
RANKS = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("time", pa.float64()),  # unix seconds of the step's plan
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("bag", pa.int32(), nullable=False),  # bag id in the step's plan
        pa.field("predicted_load", pa.float32()),  # the plan's load / the ideal (1.00)
        # measured compute per predicted work over the group's median (1 = as the typical
        # rank; `knapformer.diagnosis.measured.compute_ratio`); null: not measured
        pa.field("rate", pa.float32()),
        pa.field("tokens_in", pa.int32()),  # tokens of its own sequences (before routing)
        pa.field("tokens_out", pa.int32()),  # tokens it computes (after routing)
        pa.field("tokens_moved", pa.int32()),  # tokens route sent from it plus brought to it
        pa.field("speed", pa.float32()),  # learnt speed the planner assumed (null: nominal)
        pa.field("wait_ms", _MS),  # waited for peers, over every collective
        # the link probe's, in the steps that ran it (null: no pair of that kind): its
        # fastest link to a GPU of its own node, and to a GPU of another node
        pa.field("link_gbps", pa.float32()),
        pa.field("link_cross_gbps", pa.float32()),
        *(pa.field(phase_column(p), _MS) for p in RECORDED_PHASES),
    ]
)

#: One row per step: the plan's figures, the measured step and what it lost.
STEPS = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("time", pa.float64()),
        pa.field("gpus", pa.int32(), nullable=False),
        pa.field("partition", pa.string()),  # the topology the step used
        pa.field("bags", pa.string()),  # where its bags sat (`stats.bag_runs`)
        pa.field("imbalance_before", pa.float32()),  # max / mean load
        pa.field("imbalance_after", pa.float32()),
        pa.field("floor_load", pa.float32()),  # layout floor / mean load (1.00 = the ideal)
        pa.field("makespan_over_lb", pa.float32()),
        pa.field("moved_tokens", pa.int64()),
        pa.field("total_tokens", pa.int64()),
        pa.field("plan_ms", _MS),
        pa.field("step_ms", _MS),  # measured: the longest rank's step
        pa.field("straggler", pa.int32()),  # the rank the others waited for (null: none)
        pa.field("slowest_rank", pa.int32()),  # the rank of the highest rate
        pa.field("slowest_rate", pa.float32()),
        pa.field("full_plan", pa.bool_(), nullable=False),  # its full plan is in the JSONL
        # `knapformer.diagnosis.step_loss` over the step's segment (the window's fit)
        pa.field("measured_ms", _MS),
        pa.field("ideal_ms", _MS),
        pa.field("lost_ms", _MS),
        *(pa.field(loss_column(p), _MS) for p in LOSS_PARTS),
    ]
)

#: Per closed segment, one row per rank: what a whole-run view draws without reading
#: `RANKS` (a 1,024-GPU x 100,000-step run holds 10^8 rank rows, this 10^6 at most).
RANK_WINDOWS = pa.schema(
    [
        pa.field("first_step", pa.int64(), nullable=False),
        pa.field("last_step", pa.int64(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("steps", pa.int32(), nullable=False),  # steps in which it was measured
        pa.field("rate_median", pa.float32()),
        pa.field("rate_max", pa.float32()),
        # steps at a rate >= the straggler analysis's slow_ratio (1.3)
        pa.field("slow_steps", pa.int32(), nullable=False),
        pa.field("compute_ms_median", _MS),
    ]
)

#: Columns added after a table's first layout, which a segment written before may lack:
#: its rows read them as null (before ``link_cross_gbps``, ``link_gbps`` held the fastest
#: link of either kind).
LATER_COLUMNS: dict[str, frozenset[str]] = {"ranks": frozenset({"link_cross_gbps"})}
#: Every table by its name (a segment's file name starts with it).
TABLES: dict[str, pa.Schema] = {"ranks": RANKS, "steps": STEPS, "rank_windows": RANK_WINDOWS}
#: The column every table's segments are ordered and windowed by.
STEP_COLUMN = {"ranks": "step", "steps": "step", "rank_windows": "first_step"}
