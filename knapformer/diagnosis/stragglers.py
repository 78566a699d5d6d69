"""Which rank is slow, and why: per-rank verdicts over a window of measured steps.

Per rank, over the window's measured steps (`knapformer.diagnosis.measured` defines each figure):
predicted share of the work, measured compute, their ratio, time waiting in
collectives, how often it was the step's straggler (last arrival where the ranks waited
longest), and a verdict:

- ``slow_gpu``: the rank takes persistently longer than the plan predicts for the work
  it was given — its compute ratio is at least `Thresholds.slow_ratio` in at least
  `Thresholds.persistence` of the window's steps, and its median ratio is too. The
  hardware (throttling, a bad link, another job) is slow, not the data.
- ``data_imbalance``: the plan itself put too much there — its predicted load is at
  least `Thresholds.heavy_load` times the ideal in at least `Thresholds.persistence` of
  the steps, median included (a rank that is both is ``slow_gpu``).
- ``ok`` otherwise, and for a rank with fewer than `Thresholds.min_steps` measured steps
  (nothing can be persistent yet).

Medians and the persistence rule make one noisy step (a page fault, a garbage
collection, a late kernel launch) name nobody. Every threshold is in `THRESHOLDS`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from knapformer.diagnosis.measured import RankFigures

Verdict = Literal["slow_gpu", "data_imbalance", "ok"]
#: The order a header or a table names verdicts in: the most actionable first.
VERDICTS: tuple[Verdict, ...] = ("slow_gpu", "data_imbalance", "ok")


@dataclass(frozen=True)
class Thresholds:
    """Where a verdict starts. The defaults are `THRESHOLDS`."""

    #: compute ratio from which a step counts as slow for a rank: 30 % over the plan's
    #: prediction (measured noise on a quiet GPU is a few %; an injected 2x shows as 2)
    slow_ratio: float = 1.3
    #: predicted load (1.00 = the ideal) from which a step counts as overloaded by the plan
    heavy_load: float = 1.1
    #: fraction of the window's measured steps that must agree for a verdict
    persistence: float = 0.6
    #: measured steps a rank needs before it can get any verdict but ``ok``
    min_steps: int = 3


THRESHOLDS = Thresholds()
#: Steps analysed by default: the most recent ones, so a verdict describes the run now.
WINDOW = 20


@dataclass(frozen=True)
class RankVerdict:
    """One rank over the window (medians over its measured steps)."""

    rank: int
    verdict: Verdict
    predicted_share: float  # of the step's work, at nominal speed
    predicted_load: float  # the plan's predicted time relative to the ideal (1.00)
    measured_ms: float  # compute
    ratio: float  # measured compute ÷ predicted (1 = as the plan predicted)
    wait_ms: float  # in collectives, per step
    last_arrivals: int  # steps in which it was the straggler
    slow_steps: int  # steps with ratio >= slow_ratio
    heavy_steps: int  # steps with predicted load >= heavy_load
    steps: int  # measured steps of the window it took part in

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None)."""
        return {
            k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


@dataclass(frozen=True)
class RankSteps:
    """Rank × step matrices over a window (rows: ``ranks``, columns: ``steps``); NaN where
    a rank was not in a step's plan."""

    ranks: np.ndarray  # (r,) sorted ranks
    steps: list[int | None]  # (s,) step numbers
    ratio: np.ndarray  # (r, s) compute ratio
    compute_ms: np.ndarray  # (r, s)
    wait_ms: np.ndarray  # (r, s)
    predicted_share: np.ndarray  # (r, s)
    predicted_load: np.ndarray  # (r, s)
    predicted_shown: np.ndarray  # (r, s) predicted work in each plan's LoadUnit
    straggler: list[int | None]  # (s,) the straggler of each step
    phases: list[str]  # the compute phases the steps used, in first-seen order
    load_axis: str  # the unit of predicted_shown (that of the last step)


def rank_steps(figures: Sequence[RankFigures]) -> RankSteps:
    """Line up per-step figures as rank × step matrices."""
    ranks = np.unique(np.concatenate([f.gpus for f in figures])) if figures else np.zeros(0, int)
    shape = (len(ranks), len(figures))
    out = {
        name: np.full(shape, np.nan)
        for name in ("ratio", "compute_ms", "wait_ms", "share", "load", "shown")
    }
    for col, f in enumerate(figures):
        rows = np.searchsorted(ranks, f.gpus)
        out["ratio"][rows, col] = f.compute_ratio
        out["compute_ms"][rows, col] = f.compute_ms
        out["wait_ms"][rows, col] = f.wait_ms
        out["share"][rows, col] = f.predicted_share
        out["load"][rows, col] = f.predicted_load
        out["shown"][rows, col] = f.predicted_shown
    return RankSteps(
        ranks=ranks.astype(np.int64),
        steps=[f.step for f in figures],
        ratio=out["ratio"],
        compute_ms=out["compute_ms"],
        wait_ms=out["wait_ms"],
        predicted_share=out["share"],
        predicted_load=out["load"],
        predicted_shown=out["shown"],
        straggler=[f.straggler for f in figures],
        phases=list(dict.fromkeys(f.phase for f in figures)),
        load_axis=figures[-1].load_axis if figures else "",
    )


@dataclass(frozen=True)
class StragglerReport:
    """Verdicts of every rank over a window of steps."""

    ranks: list[RankVerdict]  # by rank
    steps: list[int | None]  # the measured steps analysed
    phases: list[str]  # the measured phases that stood for compute
    thresholds: Thresholds

    @property
    def named(self) -> list[RankVerdict]:
        """Ranks whose verdict is not ``ok``: slow GPUs first, then by how far off."""
        bad = [r for r in self.ranks if r.verdict != "ok"]
        return sorted(bad, key=lambda r: (VERDICTS.index(r.verdict), -_severity(r)))

    @property
    def straggler(self) -> RankVerdict | None:
        """The one rank to name in a header (None: every rank is ok)."""
        named = self.named
        return named[0] if named else None


def describe(r: RankVerdict) -> str:
    """One line naming a rank's verdict and why: ``slow_gpu: rank 5 — 2.04× the compute the
    plan predicts, in 15 of 15 steps``."""
    if r.verdict == "slow_gpu":
        why = f"{r.ratio:.2f}× the compute the plan predicts, in {r.slow_steps} of {r.steps} steps"
    elif r.verdict == "data_imbalance":
        why = (
            f"the plan gives it {r.predicted_load:.2f}× the ideal load, in {r.heavy_steps} of "
            f"{r.steps} steps"
        )
    else:
        why = f"{r.ratio:.2f}× the compute the plan predicts (median of {r.steps} steps)"
    return f"{r.verdict}: rank {r.rank} — {why}"


def _severity(r: RankVerdict) -> float:
    value = r.ratio if r.verdict == "slow_gpu" else r.predicted_load
    return value if np.isfinite(value) else 0.0


def analyse(
    figures: Sequence[RankFigures],
    window: int | None = WINDOW,
    thresholds: Thresholds = THRESHOLDS,
) -> StragglerReport:
    """Verdicts over the last ``window`` steps of ``figures`` (None or 0: all of them)."""
    if window:
        figures = list(figures)[-window:]
    m = rank_steps(figures)
    th = thresholds
    took_part = np.isfinite(m.compute_ms)  # (r, s); NaN marks a rank absent from a step
    rated = np.isfinite(m.ratio)
    steps, rated_steps = took_part.sum(axis=1), rated.sum(axis=1)
    with np.errstate(invalid="ignore"):  # NaN compares False: absent steps never count
        slow_steps = (m.ratio >= th.slow_ratio).sum(axis=1)
        heavy_steps = (m.predicted_load >= th.heavy_load).sum(axis=1)
    ratio, load = row_medians(m.ratio), row_medians(m.predicted_load)
    slow = (rated_steps >= th.min_steps) & (ratio >= th.slow_ratio)
    slow &= slow_steps >= th.persistence * rated_steps
    heavy = (steps >= th.min_steps) & (load >= th.heavy_load)
    heavy &= heavy_steps >= th.persistence * steps
    named = [s for s in m.straggler if s is not None]
    last = np.bincount(np.searchsorted(m.ranks, named), minlength=len(m.ranks))
    columns = {
        "predicted_share": row_medians(m.predicted_share).tolist(),
        "predicted_load": load.tolist(),
        "measured_ms": row_medians(m.compute_ms).tolist(),
        "ratio": ratio.tolist(),
        "wait_ms": row_medians(m.wait_ms).tolist(),
        "last_arrivals": last.tolist(),
        "slow_steps": slow_steps.tolist(),
        "heavy_steps": heavy_steps.tolist(),
        "steps": steps.tolist(),
    }
    verdicts = [
        RankVerdict(
            rank=rank,
            verdict="slow_gpu" if slow[i] else "data_imbalance" if heavy[i] else "ok",
            **{name: values[i] for name, values in columns.items()},
        )
        for i, rank in enumerate(m.ranks.tolist())
    ]
    return StragglerReport(verdicts, m.steps, m.phases, th)


def row_medians(matrix: np.ndarray) -> np.ndarray:
    """(r,) the median of each row's finite values (NaN for a row with none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: NaN, said here
        return np.nanmedian(matrix, axis=1) if matrix.size else np.full(len(matrix), np.nan)
