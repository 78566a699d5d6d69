"""Every step of a run, for the dashboard's per-step figures: the run store's ``steps``
table (one row per step, whatever ``--every`` kept of the full plans) followed live, and
the plans recorded after its last closed segment.

The timeline, the header's cards and the step picker's notes read `step_columns`: the
store's rows and, after them, the summaries of the newest full plans (the open segment's
steps are not readable yet). A full plan is read only for the step shown.

`StoreFollower` re-reads the table only when its list of closed segments changes (a
directory listing otherwise), and then only the new segments when the old ones are all
still there: a run that closes a segment every few minutes for weeks is read once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from knapformer.visualization.figures import PartitionSpan
from knapformer.visualization.run_figures import TIMELINE_COLUMNS

from knapformer.contract.run_store import (
    as_numpy,
    has_store,
    list_segments,
    read_table,
    store_folder,
)
from knapformer.contract.stats import StepSummary
from knapformer.errors import KnapformerError

#: How many plans of earlier steps may follow a newer one in the file: a step's plan kept
#: for a reader (a verdict named it) is written by the store's writer thread, up to its
#: queue (256 plans) after the plans the training thread wrote.
_LATE_PLANS = 1024


@dataclass(frozen=True)
class StoreSteps:
    """The ``steps`` rows of a store's closed ``segments``: `TIMELINE_COLUMNS` as numpy
    (NaN where a figure was not measured), ordered by step, and the runs of steps on one
    partition (``spans``: a few, where a column of strings would be one a step)."""

    segments: tuple[str, ...]
    columns: dict[str, np.ndarray]
    spans: list[PartitionSpan]

    @property
    def count(self) -> int:
        return len(self.columns["step"])

    @property
    def last_step(self) -> int | None:
        return int(self.columns["step"][-1]) if self.count else None


def _read(plans: Path, first: int | None) -> tuple[dict[str, np.ndarray], list[PartitionSpan]]:
    """The columns and partition spans of the store's steps from ``first`` on."""
    wanted = [*TIMELINE_COLUMNS, "partition", "bags"]
    table = read_table(plans, "steps", (first, None), columns=wanted)
    # as stored (float32 figures; NaN where not measured): ~40 bytes a step
    columns = {name: as_numpy(table[name]) for name in TIMELINE_COLUMNS}
    return columns, _spans(columns["step"], table["partition"], table["bags"])


def _spans(step: np.ndarray, topology: pa.ChunkedArray, bags: pa.ChunkedArray) -> list:
    """Runs of consecutive rows with one (topology, bags) (`PartitionSpan`): the strings
    compared as dictionary codes, and made Python strings only where a run starts."""
    if not len(step):
        return []
    changed = np.zeros(len(step) - 1, bool)
    for column in (topology, bags):
        codes = pc.dictionary_encode(column, null_encoding="encode").combine_chunks().indices
        codes = as_numpy(codes)  # never null: a null is a code of its own
        changed |= codes[1:] != codes[:-1]
    starts = [0, *(np.flatnonzero(changed) + 1).tolist()]
    ends = [*(i - 1 for i in starts[1:]), len(step) - 1]
    return [
        (topology[a].as_py(), bags[a].as_py(), int(step[a]), int(step[b]))
        for a, b in zip(starts, ends, strict=True)
    ]


def _joined(old: list[PartitionSpan], new: list[PartitionSpan]) -> list[PartitionSpan]:
    """``old`` then ``new`` spans, the run across their border as one."""
    if old and new and old[-1][:2] == new[0][:2]:
        return [*old[:-1], (*old[-1][:3], new[0][3]), *new[1:]]
    return [*old, *new]


class StoreFollower:
    """The store beside one plans file, read as its closed segments grow (`refresh`)."""

    def __init__(self, plans: str | os.PathLike):
        self.plans = Path(plans)
        self.steps: StoreSteps | None = None
        self.problem: str | None = None

    def refresh(self) -> bool:
        """Read what closed since the last call; True when `steps` or `problem` changed.
        Without a store `steps` stays None; a store that cannot be read keeps None too,
        and `problem` says why (the plans' figures stand in)."""
        try:
            if not has_store(self.plans):
                return self._set(None, None)
            store = store_folder(self.plans)
            names = tuple(s.path.name for s in list_segments(store, "steps"))
            if self.steps is not None and names == self.steps.segments:
                return self._set(self.steps, None)
            return self._set(StoreSteps(names, *self._read(names)), None)
        except KnapformerError as err:
            return self._set(None, f"the run store cannot be read: {err}")

    def _read(self, names: tuple[str, ...]) -> tuple[dict, list[PartitionSpan]]:
        """The rows of segments ``names``; only the new ones read when every segment read
        before is still listed (none compacted meanwhile)."""
        old = self.steps
        if old is None or not old.count or names[: len(old.segments)] != old.segments:
            return _read(self.plans, None)
        columns, spans = _read(self.plans, old.last_step + 1)
        joined = {k: np.concatenate([old.columns[k], columns[k]]) for k in TIMELINE_COLUMNS}
        return joined, _joined(old.spans, spans)

    def _set(self, steps: StoreSteps | None, problem: str | None) -> bool:
        changed = steps is not self.steps or problem != self.problem
        self.steps, self.problem = steps, problem
        return changed


def _summary_columns(summaries: list[StepSummary]) -> dict[str, np.ndarray]:
    """`TIMELINE_COLUMNS` of numbered plans' summaries (a summary keeps the moved share,
    so it stands as ``moved_tokens`` of one token in all)."""

    def column(values) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in values], np.float64)

    return {
        "step": np.array([s.step for s in summaries], np.int64),
        "imbalance_before": column(s.imbalance_before for s in summaries),
        "imbalance_after": column(s.imbalance_after for s in summaries),
        "moved_tokens": column(s.moved_fraction for s in summaries),
        "total_tokens": np.ones(len(summaries)),
        "plan_ms": column(s.plan_ms for s in summaries),
        "step_ms": column(s.step_ms for s in summaries),
    }


def step_columns(steps: StoreSteps, summaries: list[StepSummary]) -> dict[str, np.ndarray]:
    """Every step known: the store's rows, then the plans of steps after its last one
    (oldest first; `TIMELINE_COLUMNS`)."""
    newer = newer_plans(steps, summaries)
    if not newer:
        return steps.columns
    more = _summary_columns(newer)
    return {k: np.concatenate([steps.columns[k], more[k]]) for k in TIMELINE_COLUMNS}


def newer_plans(steps: StoreSteps, summaries: list[StepSummary]) -> list[StepSummary]:
    """The plans of steps after the store's last closed one, by step (the open segment's,
    which the store does not show yet)."""
    last = steps.last_step
    newer, older = [], 0
    for s in reversed(summaries):  # the newest plans are at the file's end
        if s.step is not None and (last is None or s.step > last):
            newer.append(s)
        elif (older := older + 1) > _LATE_PLANS:
            break
    return sorted(newer, key=lambda s: s.step)


def partition_spans(steps: StoreSteps, summaries: list[StepSummary]) -> list[PartitionSpan]:
    """The partition of every step known: the store's spans, then the plans of steps
    after its last one (`newer_plans`)."""
    spans = steps.spans
    for s in newer_plans(steps, summaries):
        spans = _joined(spans, [(s.topology, s.bags, s.step, s.step)])
    return spans


def step_count(steps: StoreSteps | None, summaries: list[StepSummary]) -> int:
    """How many steps the run holds: every step known with a store, else its plans."""
    return len(summaries) if steps is None else steps.count + len(newer_plans(steps, summaries))


def mean_speedup(columns: dict[str, np.ndarray]) -> float | None:
    """The modelled speedup (makespan before / after) averaged over the steps: the mean
    load is the same before and after balancing, so it is the imbalances' ratio. Steps
    with nothing to do after balancing are left out, as the plans' mean leaves them."""
    before, after = columns["imbalance_before"], columns["imbalance_after"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = before / after
    ratio = ratio[np.isfinite(ratio)]
    return float(ratio.mean()) if len(ratio) else None


def nearest_kept(summaries: list[StepSummary], wanted: int) -> int | None:
    """The index of the full plan whose step is nearest ``wanted`` (the earlier on a
    tie); None without numbered plans."""
    best = None
    for i, s in enumerate(summaries):
        if s.step is not None and (best is None or abs(s.step - wanted) < best[0]):
            best = (abs(s.step - wanted), i)
    return None if best is None else best[1]
