"""The trace's steps (`knapformer.tools.trace.TraceStep`) from a run store: each rank's
measured phases from ``ranks``, the step's figures from ``steps``, for a window of steps
(only its rows are read). A step's plan figures the store does not keep (how many
sequences and chunks) are left out of its arguments; the rest is what the plans give."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from knapformer.contract.phases import RECORDED_PHASES
from knapformer.contract.run_store import read_table
from knapformer.contract.scalars import store_step_figures
from knapformer.contract.store_schema import phase_column
from knapformer.tools.trace import TraceStep, counters_of


def store_steps(run: str | os.PathLike, first: int | None, last: int | None) -> Iterator[TraceStep]:
    """The `TraceStep` of every step ``first..last`` of ``run``'s store, in step order."""
    columns = [phase_column(p) for p in RECORDED_PHASES]
    ranks = read_table(run, "ranks", (first, last), ["step", "rank", "bag", *columns])
    steps = read_table(
        run, "steps", (first, last), ["step", "partition", "moved_tokens", "total_tokens"]
    )
    plan = {row["step"]: row for row in steps.to_pylist()}
    per_step = _rows_by_step(ranks, columns)
    for step, time, figures in store_step_figures(run, first, last):
        row = plan.get(step, {})
        ranks_of, bags, times = per_step.get(step, ([], [], None))
        size = {b: bags.count(b) for b in set(bags)}
        yield TraceStep(
            step=step,
            time=time,
            ranks=ranks_of,
            labels=[
                f"GPU {r} · bag {b} · {size[b]} GPU{'s' if size[b] != 1 else ''}"
                for r, b in zip(ranks_of, bags, strict=True)
            ],
            times=times,
            figures={
                "topology": row.get("partition"),
                "moved_tokens": row.get("moved_tokens"),
                "total_tokens": row.get("total_tokens"),
            },
            counters=counters_of(figures),
        )


def _rows_by_step(
    ranks: pa.Table, columns: list[str]
) -> dict[int, tuple[list[int], list[int], list[dict[str, float]] | None]]:
    """Step -> (ranks, bags, each rank's measured phase -> ms, None when none was)."""
    if len(ranks) == 0:
        return {}
    ranks = ranks.sort_by([("step", "ascending"), ("rank", "ascending")])
    step = ranks["step"].to_numpy()
    measured = {
        c.removesuffix("_ms"): ranks[c].to_numpy(zero_copy_only=False).astype(np.float64)
        for c in columns
        if ranks[c].null_count < len(ranks)
    }
    rank, bag = ranks["rank"].to_pylist(), ranks["bag"].to_pylist()
    starts = [*np.flatnonzero(np.r_[True, step[1:] != step[:-1]]).tolist(), len(step)]
    out = {}
    for lo, hi in itertools.pairwise(starts):
        times = [
            {p: float(v[i]) for p, v in measured.items() if np.isfinite(v[i])}
            for i in range(lo, hi)
        ]
        out[int(step[lo])] = (rank[lo:hi], bag[lo:hi], times if any(times) else None)
    return out
