"""A window of measured steps as rank × step matrices, with the window's affine fit.

`rank_steps` lines up the per-step `RankFigures` of plans; a reader of the run store
builds the same `RankSteps` from its columns at once (`knapformer.diagnosis.store_window`).
Every straggler view (the verdicts, the heatmaps, what each step lost) reads these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from knapformer.diagnosis.measured import RankFigures
from knapformer.planning.compute_model import ComputeFit, fit_compute


@dataclass(frozen=True)
class RankSteps:
    """Rank × step matrices over a window (rows: ``ranks``, columns: ``steps``); NaN where
    a rank was not in a step's plan."""

    ranks: np.ndarray  # (r,) sorted ranks
    steps: list[int | None]  # (s,) step numbers
    ratio: np.ndarray  # (r, s) rate under the window's affine fit (1 = the group's)
    compute_ms: np.ndarray  # (r, s)
    wait_ms: np.ndarray  # (r, s)
    predicted_share: np.ndarray  # (r, s)
    predicted_load: np.ndarray  # (r, s)
    predicted_shown: np.ndarray  # (r, s) predicted work in each plan's LoadUnit
    straggler: list[int | None]  # (s,) the straggler of each step
    phases: list[str]  # the compute phases the steps used, in first-seen order
    load_axis: str  # the unit of predicted_shown (that of the last step)
    fit: ComputeFit | None = None  # the affine fit ratio comes from
    step_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    data_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    host_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    gc_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s), of host_ms
    descheduled_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    exchange_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    exchange_wait_ms: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    exchange_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # (r, s)
    at_floor: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))  # (r, s)
    floor_load: np.ndarray = field(default_factory=lambda: np.zeros(0))  # (s,)
    #: phase of `knapformer.contract.phases.FIXED_PHASES` -> (r, s), where any step
    #: measured it (NaN where a step did not)
    fixed_ms: dict[str, np.ndarray] = field(default_factory=dict)


_OPTIONAL = (
    "step_ms", "data_ms", "host_ms", "gc_ms", "descheduled_ms", "exchange_ms",
    "exchange_wait_ms", "exchange_values",
)  # fmt: skip


def rank_steps(figures: Sequence[RankFigures]) -> RankSteps:
    """Line up per-step figures as rank × step matrices, with the window's affine fit."""
    ranks = np.unique(np.concatenate([f.gpus for f in figures])) if figures else np.zeros(0, int)
    shape = (len(ranks), len(figures))
    names = ("compute_ms", "wait_ms", "share", "load", "shown", *_OPTIONAL)
    out = {name: np.full(shape, np.nan) for name in names}
    at_floor = np.zeros(shape, dtype=bool)
    fixed: dict[str, np.ndarray] = {}
    for col, f in enumerate(figures):
        rows = np.searchsorted(ranks, f.gpus)
        out["compute_ms"][rows, col] = f.compute_ms
        out["wait_ms"][rows, col] = f.wait_ms
        out["share"][rows, col] = f.predicted_share
        out["load"][rows, col] = f.predicted_load
        out["shown"][rows, col] = f.predicted_shown
        for name in _OPTIONAL:
            values = getattr(f, name)
            if values is not None:
                out[name][rows, col] = values
        if f.at_floor is not None:
            at_floor[rows, col] = f.at_floor
        for phase, ms in (f.fixed_ms or {}).items():
            fixed.setdefault(phase, np.full(shape, np.nan))[rows, col] = ms
    fit = fit_compute(out["share"], out["compute_ms"])
    return RankSteps(
        ranks=ranks.astype(np.int64),
        steps=[f.step for f in figures],
        ratio=fit.rate_steps,
        compute_ms=out["compute_ms"],
        wait_ms=out["wait_ms"],
        predicted_share=out["share"],
        predicted_load=out["load"],
        predicted_shown=out["shown"],
        straggler=[f.straggler for f in figures],
        phases=list(dict.fromkeys(f.phase for f in figures)),
        load_axis=figures[-1].load_axis if figures else "",
        fit=fit,
        step_ms=out["step_ms"],
        data_ms=out["data_ms"],
        host_ms=out["host_ms"],
        gc_ms=out["gc_ms"],
        descheduled_ms=out["descheduled_ms"],
        exchange_ms=out["exchange_ms"],
        exchange_wait_ms=out["exchange_wait_ms"],
        exchange_values=out["exchange_values"],
        at_floor=at_floor,
        floor_load=np.array([f.floor_load for f in figures], dtype=np.float64),
        fixed_ms=fixed,
    )
