"""Where a reader takes a run's per-step and per-rank figures from: its run store when
it has one, else its plans (``--source auto|store|plans``); and a window of the store's
rows as `WindowRows` (only that window's rows and only the columns the analysis reads
are read, whatever the length of the run).

The store keeps, per rank, the plan's load over the ideal and the speed the planner
assumed, not the work itself: the work at nominal speed is their product up to the
step's ideal load, which the share of the step's work divides out. Ratios of the
exchanges' bandwidth do not depend on the token dimension, so the store does not need it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from knapformer.contract.nan_reduce import nan_to_zero
from knapformer.contract.phases import RECORDED_PHASES
from knapformer.contract.plan_io import parse_step_range
from knapformer.contract.run_store import as_numpy, has_store, read_table
from knapformer.contract.runfiles import PLANS_FILE, single_run
from knapformer.contract.store_schema import phase_column
from knapformer.diagnosis.store_window import WindowRows
from knapformer.errors import KnapformerError

Source = Literal["auto", "store", "plans"]
#: Where a reader takes its figures from (`knapformer.cli.source.SOURCE_HELP` tells users).
SOURCES: tuple[str, ...] = ("auto", "store", "plans")
#: What the store's predicted work is shown in (a share of the step's work).
SHARE_AXIS = "predicted work (share of the step)"
_RANK_COLUMNS = ["step", "rank", "bag", "predicted_load", "speed", "tokens_moved"]
#: The link probe's: each rank's fastest link inside its node, and to another node.
_LINK_COLUMNS = ["link_gbps", "link_cross_gbps"]


def use_store(run: str | os.PathLike, source: str) -> bool:
    """Whether a reader of ``run`` reads its store (``source``: `SOURCES`); a
    `KnapformerError` for ``store`` on a run without one, or an unknown source."""
    if source not in SOURCES:
        raise KnapformerError(f"--source must be one of {', '.join(SOURCES)}, not {source!r}")
    if source == "plans":
        return False
    found = has_store(run)
    if source == "store" and not found:
        raise KnapformerError(f"{run}: no run store (store/ beside its plans); try --source plans")
    return found


def reader_run(path: str | os.PathLike, source: str) -> tuple[Path, bool]:
    """The run at ``path``: its plans file, or its folder when its store stands alone
    (no plans file), and whether to read its store (`use_store`)."""
    path = Path(path)
    if source in ("auto", "store") and path.is_dir() and has_store(path):
        return (path / PLANS_FILE if (path / PLANS_FILE).is_file() else path), True
    run = single_run(path)
    return run, use_store(run, source)


def run_folder(run: Path) -> Path:
    """The folder of a run that `reader_run` gave (its plans file's, or itself)."""
    return run if run.is_dir() else run.parent


def step_window(
    run: str | os.PathLike, steps: str | None, last: int | None
) -> tuple[int | None, int | None]:
    """The steps ``first..last`` a store reader reads: ``steps`` (``A:B``) when given, else
    the last ``last`` steps of the store (None: all of them)."""
    if steps is not None:
        return parse_step_range(steps)
    if last is None:
        return None, None
    column = read_table(run, "steps", columns=["step"])["step"]
    if len(column) == 0:
        return None, None
    return int(column[max(len(column) - last, 0)].as_py()), None


def window_rows(run: str | os.PathLike, first: int | None, last: int | None) -> WindowRows:
    """The rows of steps ``first..last`` of ``run``'s store as `WindowRows` (a
    `KnapformerError` when the store holds none of them)."""
    phases = [phase_column(p) for p in RECORDED_PHASES]
    ranks = read_table(run, "ranks", (first, last), _RANK_COLUMNS + _LINK_COLUMNS + phases)
    steps = read_table(run, "steps", (first, last), ["step", "floor_load"]).sort_by("step")
    if len(ranks) == 0:
        span = f"{'' if first is None else first}:{'' if last is None else last}"
        raise KnapformerError(f"{Path(run)}: the run store holds no step in {span}")
    step, rank = as_numpy(ranks["step"]), as_numpy(ranks["rank"])
    if not _ordered(step, rank):  # the writer appends each step's rows in rank order
        order = np.lexsort((rank, step))
        ranks = ranks.take(order)
        step, rank = step[order], rank[order]
    kept = step[np.concatenate(([True], step[1:] != step[:-1]))]
    # the floor of each step the ranks have (NaN for one the steps table lacks)
    listed = as_numpy(steps["step"])
    at = np.searchsorted(listed, kept).clip(max=max(len(listed) - 1, 0))
    floor = np.where(listed[at] == kept, _floats(steps["floor_load"])[at], np.nan)
    load = _floats(ranks["predicted_load"])
    # in place: `_floats` of a float32 or integer column is a copy of its own
    speed = nan_to_zero(_floats(ranks["speed"]), copy=False, nan=1.0)  # null: nominal
    count = len(kept)
    return WindowRows(
        step=step,
        rank=rank,
        bag=as_numpy(ranks["bag"]),
        phase_ms={  # float32, as stored (NaN: null)
            p: as_numpy(ranks[phase_column(p)])
            for p in RECORDED_PHASES
            if ranks[phase_column(p)].null_count < len(ranks)
        },
        work=load * speed,
        load=load,
        moved_tokens=nan_to_zero(_floats(ranks["tokens_moved"]), copy=False),
        steps=kept,
        mean_load=np.ones(count),
        floor=floor,
        token_dim=np.ones(count),
        shown_total=np.ones(count),
        load_axis=SHARE_AXIS,
        best_intra_gbps=_probed(ranks["link_gbps"]),
        best_cross_gbps=_probed(ranks["link_cross_gbps"]),
    )


def _probed(link: pa.ChunkedArray) -> np.ndarray | None:
    """A link probe column as floats (NaN: not probed); None when no row was probed."""
    return _floats(link) if link.null_count < len(link) else None


def _ordered(step: np.ndarray, rank: np.ndarray) -> bool:
    """Whether rows are by step, then rank."""
    later = (step[1:] > step[:-1]) | ((step[1:] == step[:-1]) & (rank[1:] > rank[:-1]))
    return bool(later.all())


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    """A column as float64, null as NaN."""
    return as_numpy(column).astype(np.float64, copy=False)
