"""What each step lost against an ideal one, and to what.

Per measured step (the figures of `knapformer.diagnosis.measured`, the window's affine
compute model of `knapformer.diagnosis.stragglers.rank_steps`):

- **measured**: the step's wall time (the median over ranks of ``step``; they end it
  together, in the gradient all-reduce), less the link probe when it ran (a diagnostic,
  not training: `knapformer.diagnosis.measured`);
- **ideal**: the total compute spread evenly at the group's rate (the mean over ranks of
  what a rank at the group's rate takes for the work the plan gave it), plus the token
  exchanges of a typical rank at the group's median bandwidth (values moved over time
  in the exchanges, median over ranks).

The difference is split into, in ms (each >= 0):

- ``layout_floor``: the layout floor above the ideal (the largest sequence over the
  largest bag, `MeasuredStep.floor_load` - 1, times the ideal compute): no plan on these
  bags can get it back, other bags can (``knapformer suggest``);
- ``solver_gap``: the plan's largest predicted load above the floor (or above the ideal
  when the floor is below it), times the ideal compute;
- ``slow_ranks``: the longest measured compute above the longest the group's rate
  predicts for the plan (a slow GPU, or any rank slower than its peers);
- ``input``: the longest wait for data plus host work of a rank (the step ends when the
  last rank has its batch);
- ``communication``: the exchanges' time with nobody waiting (the least any rank spent
  in them) above the ideal exchanges;
- ``other``: what is left (the gradient all-reduce's transfer, the optimizer, what no
  figure names; negative when the parts overlap).

Pure numpy, no readers: the CLI, the dashboard and the report all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from knapformer.contract.nan_reduce import nan_reduce
from knapformer.diagnosis.measured import RankFigures
from knapformer.diagnosis.stragglers import RankSteps, rank_steps

#: The parts of a step's loss, in the order a table or a stacked chart shows them.
PARTS = ("layout_floor", "solver_gap", "slow_ranks", "input", "communication", "other")


@dataclass(frozen=True)
class StepLoss:
    """One step: measured and ideal time and the parts of their difference (ms)."""

    step: int | None
    measured_ms: float
    ideal_ms: float
    ideal_compute_ms: float
    ideal_exchange_ms: float
    layout_floor: float
    solver_gap: float
    slow_ranks: float
    input: float
    communication: float
    other: float

    @property
    def lost_ms(self) -> float:
        return self.measured_ms - self.ideal_ms

    def parts(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARTS}

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None)."""
        return {
            k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in {**asdict(self), "lost_ms": self.lost_ms}.items()
        }


def step_losses(figures: Sequence[RankFigures], m: RankSteps | None = None) -> list[StepLoss]:
    """The loss of every step of ``figures`` (``m``: their `rank_steps`, when at hand)."""
    figures = list(figures)
    if not figures:
        return []
    m = m if m is not None else rank_steps(figures)
    predicted = m.fit.predicted_ms if m.fit is not None else np.full(m.compute_ms.shape, np.nan)
    out = []
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN marks what was not measured
        for col, f in enumerate(figures):
            compute, pred = m.compute_ms[:, col], predicted[:, col]
            taking = np.isfinite(compute)
            step = m.step_ms[:, col] if m.step_ms.size else np.full(len(compute), np.nan)
            measured = nan_reduce(np.nanmedian, step)
            ideal_compute = nan_reduce(np.nanmean, np.where(taking, pred, np.nan))
            values, exchange = m.exchange_values[:, col], m.exchange_ms[:, col]
            moved = taking & (values > 0) & (exchange > 0)
            if moved.any():
                bandwidth = float(np.median(values[moved] / exchange[moved]))
                ideal_exchange = float(np.median(values[moved])) / bandwidth
                no_wait = nan_reduce(np.nanmin, exchange[moved])
            else:
                ideal_exchange = no_wait = 0.0
            floor = max(float(f.floor_load), 1.0) if np.isfinite(f.floor_load) else 1.0
            worst_load = _largest(m.predicted_load[:, col])
            data = np.nan_to_num(m.data_ms[:, col]) + np.nan_to_num(m.host_ms[:, col])
            parts = {
                "layout_floor": (floor - 1.0) * ideal_compute,
                "solver_gap": max(worst_load - floor, 0.0) * ideal_compute,
                "slow_ranks": max(_largest(compute) - _largest(pred), 0.0),
                "input": float(np.max(data[taking])) if taking.any() else 0.0,
                "communication": max(no_wait - ideal_exchange, 0.0),
            }
            parts = {k: (v if np.isfinite(v) else 0.0) for k, v in parts.items()}
            ideal = ideal_compute + ideal_exchange
            other = measured - ideal - sum(parts.values())
            out.append(
                StepLoss(
                    step=f.step,
                    measured_ms=measured,
                    ideal_ms=ideal,
                    ideal_compute_ms=ideal_compute,
                    ideal_exchange_ms=ideal_exchange,
                    other=other,
                    **parts,
                )
            )
    return out


def _largest(values: np.ndarray) -> float:
    """The largest value of ``values`` (NaN: none)."""
    return nan_reduce(np.nanmax, values)


def summarise(losses: Sequence[StepLoss]) -> dict[str, float]:
    """Medians over the steps: ``measured_ms``, ``ideal_ms``, ``lost_ms`` and every part."""
    if not losses:
        return {}
    names = ("measured_ms", "ideal_ms", "lost_ms", *PARTS)
    return {name: nan_reduce(np.nanmedian, [getattr(x, name) for x in losses]) for name in names}


def describe_loss(summary: dict[str, float]) -> str:
    """One line: ``each step took 250 ms against an ideal 120 ms: lost 130 ms to …``."""
    if not summary:
        return "no measured step"
    parts = sorted(PARTS, key=lambda name: -summary[name])
    shown = ", ".join(f"{name} {summary[name]:.0f} ms" for name in parts if summary[name] >= 0.5)
    return (
        f"a step took {summary['measured_ms']:.0f} ms against an ideal "
        f"{summary['ideal_ms']:.0f} ms (medians): lost {summary['lost_ms']:.0f} ms to "
        f"{shown or 'nothing that stands out'}"
    )
