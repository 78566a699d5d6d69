"""What each step lost against an ideal one, and to what.

Per measured step (the figures of `knapformer.diagnosis.measured`, the window's affine
compute model of `knapformer.diagnosis.stragglers.rank_steps`):

- **measured**: the step's wall time (the median over ranks of ``step``; they end it
  together, in the gradient all-reduce), less the link probe when it ran (a diagnostic,
  not training: `knapformer.diagnosis.measured`);
- **ideal**: the total compute spread evenly at the group's rate (the mean over ranks of
  what a rank at the group's rate takes for the work the plan gave it), plus the token
  exchanges of a typical rank at the group's median bandwidth (values moved over the
  time in the exchanges less the time waiting in them, median over ranks).

The difference is split into the parts of `PARTS`, in ms (each >= 0 but ``other``),
which `PART_INFO` names and describes. The step is as long as its slowest path, so each
part is the rank that sets the pace: the largest compute, data wait and host work; the
transfer of a collective is the least any rank spent in it (the
last to arrive waited for nobody). The optimizer and the time between phases, which
every rank spends alike after the gradient all-reduce, count at their median (the step
is the median rank's). ``other`` is what no measured phase names (negative when the
parts overlap). The waiting inside collectives is no part: it is what the
slowest rank's parts cost the others.

Pure numpy, no readers: the CLI, the dashboard and the report all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from knapformer.contract.nan_reduce import nan_reduce
from knapformer.contract.phases import ALLREDUCE, DESCHEDULED, GATHER, OPTIMIZER, UNTIMED
from knapformer.diagnosis.measured import RankFigures
from knapformer.diagnosis.rank_steps import RankSteps, rank_steps


@dataclass(frozen=True)
class Part:
    """One part of a step's loss: how tables and sentences name it, and what it holds."""

    label: str
    meaning: str


#: Every part of a step's loss, in the order a table or a stacked chart shows them
#: (`StepLoss.parts`).
PART_INFO = {
    "layout_floor": Part(
        "layout floor",
        "the largest sequence over the largest bag, above the ideal load: no plan on "
        "these bags gets it back, other bags can (knapformer suggest)",
    ),
    "solver_gap": Part("solver gap", "the plan's largest predicted load above the layout floor"),
    "slow_ranks": Part(
        "slow ranks",
        "the longest measured compute above the longest the group's rate predicts for the "
        "plan (a slow GPU, or any rank slower than its peers)",
    ),
    "input": Part("input", "the longest wait of a rank for its next batch (data)"),
    "host": Part(
        "host work",
        "the most host work of a rank: planning without its gather, recording, the loop's "
        "host phase, garbage collection",
    ),
    "communication": Part(
        "communication",
        "the longest time a rank's token exchanges took with nobody waiting (its time in "
        "them less its wait for peers), above the ideal exchanges",
    ),
    "exchange_waits": Part(
        "waiting in exchanges",
        "the least any rank waited for its peers in the token exchanges: even the rank "
        "that sets the pace arrives first at some, when peers are late by turns (noise; "
        "on the CPU, peers waiting for a core)",
    ),
    GATHER: Part("length gather", "the transfer of the all-gather of lengths a step opens with"),
    ALLREDUCE: Part("gradient all-reduce", "the transfer of the gradient all-reduce"),
    OPTIMIZER: Part("optimizer", "the optimizer step (median over ranks)"),
    DESCHEDULED: Part(
        "waiting for a core",
        "on the CPU, the longest compute by the wall clock above the longest by CPU time: "
        "a rank ready to compute while its thread waited for a core",
    ),
    UNTIMED: Part(
        "between phases",
        "the time between the training loop's timed phases, inside none (median over "
        "ranks; measured when the loop times its forward_backward as a block)",
    ),
    "other": Part("other", "what no measured phase names (negative: the parts overlap)"),
}
PARTS = tuple(PART_INFO)


@dataclass(frozen=True)
class StepLoss:
    """One step: measured and ideal time and the parts of their difference (ms)."""

    step: int | None
    measured_ms: float
    ideal_ms: float
    ideal_compute_ms: float
    ideal_exchange_ms: float
    part_ms: dict[str, float] = field(default_factory=dict)  # every one of `PARTS`

    @property
    def lost_ms(self) -> float:
        return self.measured_ms - self.ideal_ms

    def parts(self) -> dict[str, float]:
        return {name: self.part_ms[name] for name in PARTS}

    def figure(self, name: str) -> float:
        """A figure by name: ``measured_ms``, ``ideal_ms``, ``lost_ms`` or a part."""
        return self.part_ms[name] if name in self.part_ms else getattr(self, name)

    def as_dict(self) -> dict:
        """Plain JSON-ready values (NaN as None), the parts beside the totals."""
        values = {k: v for k, v in asdict(self).items() if k != "part_ms"}
        values |= {"lost_ms": self.lost_ms, **self.parts()}
        return {
            k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in values.items()
        }


def step_losses(figures: Sequence[RankFigures], m: RankSteps | None = None) -> list[StepLoss]:
    """The loss of every step of ``figures`` (``m``: their `rank_steps`, when at hand)."""
    figures = list(figures)
    if not figures:
        return []
    return window_losses(m if m is not None else rank_steps(figures))


def window_losses(m: RankSteps) -> list[StepLoss]:
    """The loss of every step of the window ``m``."""
    predicted = m.fit.predicted_ms if m.fit is not None else np.full(m.compute_ms.shape, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN marks what was not measured
        return [_step_loss(m, predicted, col) for col in range(len(m.steps))]


def _step_loss(m: RankSteps, predicted: np.ndarray, col: int) -> StepLoss:
    """The loss of the step in column ``col`` of ``m``."""
    compute, pred = m.compute_ms[:, col], predicted[:, col]
    taking = np.isfinite(compute)
    step = m.step_ms[:, col] if m.step_ms.size else np.full(len(compute), np.nan)
    measured = nan_reduce(np.nanmedian, step)
    ideal_compute = nan_reduce(np.nanmean, np.where(taking, pred, np.nan))
    values, exchange = m.exchange_values[:, col], m.exchange_ms[:, col]
    # the bandwidth of what the exchanges moved, not of the time ranks waited in them
    transfer = exchange - np.nan_to_num(m.exchange_wait_ms[:, col])
    moved = taking & (values > 0) & (transfer > 0)
    ideal_exchange = 0.0  # nothing moved: an exchange's whole time is its overhead
    if moved.any():
        bandwidth = float(np.median(values[moved] / transfer[moved]))
        ideal_exchange = float(np.median(values[moved])) / bandwidth
    no_wait = _largest(np.where(taking, transfer, np.nan)) if taking.any() else 0.0
    floor_load = float(m.floor_load[col])
    floor = max(floor_load, 1.0) if np.isfinite(floor_load) else 1.0
    worst_load = _largest(m.predicted_load[:, col])

    def fixed(phase: str) -> np.ndarray:
        matrix = m.fixed_ms.get(phase)
        return np.full(len(compute), np.nan) if matrix is None else matrix[:, col]

    descheduled = np.nan_to_num(m.descheduled_ms[:, col]) if m.descheduled_ms.size else 0.0
    parts = {
        "layout_floor": (floor - 1.0) * ideal_compute,
        "solver_gap": max(worst_load - floor, 0.0) * ideal_compute,
        "slow_ranks": max(_largest(compute) - _largest(pred), 0.0),
        "input": _largest(np.where(taking, m.data_ms[:, col], np.nan)),
        "host": _largest(np.where(taking, m.host_ms[:, col], np.nan)),
        "communication": max(no_wait - ideal_exchange, 0.0),
        "exchange_waits": nan_reduce(
            np.nanmin, np.where(taking, m.exchange_wait_ms[:, col], np.nan)
        )
        if m.exchange_wait_ms.size
        else 0.0,
        GATHER: nan_reduce(np.nanmin, fixed(GATHER)),
        ALLREDUCE: nan_reduce(np.nanmin, fixed(ALLREDUCE)),
        OPTIMIZER: nan_reduce(np.nanmedian, fixed(OPTIMIZER)),
        DESCHEDULED: max(_largest(compute + descheduled) - _largest(compute), 0.0),
        UNTIMED: nan_reduce(np.nanmedian, fixed(UNTIMED)),
    }
    parts = {k: (float(v) if np.isfinite(v) else 0.0) for k, v in parts.items()}
    parts["other"] = measured - ideal_compute - ideal_exchange - sum(parts.values())
    return StepLoss(
        step=m.steps[col],
        measured_ms=measured,
        ideal_ms=ideal_compute + ideal_exchange,
        ideal_compute_ms=ideal_compute,
        ideal_exchange_ms=ideal_exchange,
        part_ms=parts,
    )


def _largest(values: np.ndarray) -> float:
    """The largest value of ``values`` (NaN: none)."""
    return nan_reduce(np.nanmax, values)


def summarise(losses: Sequence[StepLoss]) -> dict[str, float]:
    """Medians over the steps: ``measured_ms``, ``ideal_ms``, ``lost_ms`` and every part."""
    if not losses:
        return {}
    names = ("measured_ms", "ideal_ms", "lost_ms", *PARTS)
    return {name: nan_reduce(np.nanmedian, [x.figure(name) for x in losses]) for name in names}


def describe_loss(summary: dict[str, float]) -> str:
    """One line: ``each step took 250 ms against an ideal 120 ms: lost 130 ms to …``."""
    if not summary:
        return "no measured step"
    parts = sorted(PARTS, key=lambda name: -summary[name])
    shown = ", ".join(
        f"{PART_INFO[name].label} {summary[name]:.0f} ms" for name in parts if summary[name] >= 0.5
    )
    return (
        f"a step took {summary['measured_ms']:.0f} ms against an ideal "
        f"{summary['ideal_ms']:.0f} ms (medians): lost {summary['lost_ms']:.0f} ms to "
        f"{shown or 'nothing that stands out'}"
    )
