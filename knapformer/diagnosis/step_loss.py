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

from knapformer.contract.nan_reduce import nan_reduce, nan_to_zero
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
    """The loss of every step of the window ``m``, every step at once (column by column
    took 10 s for 1,000 steps of 1,024 ranks)."""
    predicted = m.fit.predicted_ms if m.fit is not None else np.full(m.compute_ms.shape, np.nan)
    if not len(m.steps):
        return []
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN marks what was not measured
        totals, parts = _window_parts(m, predicted)
    names = list(parts)
    rows = np.stack([parts[name] for name in names], axis=1).tolist()
    measured, ideal_compute, ideal_exchange = (totals[k].tolist() for k in ("m", "c", "e"))
    return [
        StepLoss(
            step=step,
            measured_ms=measured[col],
            ideal_ms=ideal_compute[col] + ideal_exchange[col],
            ideal_compute_ms=ideal_compute[col],
            ideal_exchange_ms=ideal_exchange[col],
            part_ms=dict(zip(names, rows[col], strict=True)),
        )
        for col, step in enumerate(m.steps)
    ]


def _window_parts(
    m: RankSteps, predicted: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per step (s,): the measured, ideal compute and ideal exchange time (``m``, ``c``,
    ``e``), and every part of what it lost (NaN as 0; ``other`` what is left)."""
    compute, shape = m.compute_ms, m.compute_ms.shape
    taking = np.isfinite(compute)
    nan = np.full(shape, np.nan)

    def columns(reduce, values: np.ndarray) -> np.ndarray:
        return nan_reduce(reduce, values, axis=0)

    def matrix(values: np.ndarray) -> np.ndarray:
        return values if values.size else nan

    measured = columns(np.nanmedian, matrix(m.step_ms))
    ideal_compute = columns(np.nanmean, np.where(taking, predicted, np.nan))
    values, exchange = m.exchange_values, m.exchange_ms
    # the bandwidth of what the exchanges moved, not of the time ranks waited in them
    transfer = exchange - nan_to_zero(m.exchange_wait_ms)
    moved = taking & (values > 0) & (transfer > 0)
    bandwidth = columns(np.nanmedian, np.where(moved, values / transfer, np.nan))
    typical = columns(np.nanmedian, np.where(moved, values, np.nan))
    # nothing moved: an exchange's whole time is its overhead
    ideal_exchange = np.where(moved.any(axis=0), typical / bandwidth, 0.0)
    no_wait = np.where(
        taking.any(axis=0), columns(np.nanmax, np.where(taking, transfer, np.nan)), 0.0
    )
    floor_load = np.asarray(m.floor_load, np.float64)
    floor = np.where(np.isfinite(floor_load), np.maximum(floor_load, 1.0), 1.0)
    worst_load = columns(np.nanmax, m.predicted_load)

    def fixed(phase: str) -> np.ndarray:
        return m.fixed_ms.get(phase, nan)

    descheduled = nan_to_zero(m.descheduled_ms) if m.descheduled_ms.size else 0.0
    slowest = columns(np.nanmax, compute)
    waits = m.exchange_wait_ms
    parts = {
        "layout_floor": (floor - 1.0) * ideal_compute,
        "solver_gap": np.maximum(worst_load - floor, 0.0) * ideal_compute,
        "slow_ranks": np.maximum(slowest - columns(np.nanmax, predicted), 0.0),
        "input": columns(np.nanmax, np.where(taking, m.data_ms, np.nan)),
        "host": columns(np.nanmax, np.where(taking, m.host_ms, np.nan)),
        "communication": np.maximum(no_wait - ideal_exchange, 0.0),
        "exchange_waits": columns(np.nanmin, np.where(taking, waits, np.nan))
        if waits.size
        else np.zeros(shape[1]),
        GATHER: columns(np.nanmin, fixed(GATHER)),
        ALLREDUCE: columns(np.nanmin, fixed(ALLREDUCE)),
        OPTIMIZER: columns(np.nanmedian, fixed(OPTIMIZER)),
        DESCHEDULED: np.maximum(columns(np.nanmax, compute + descheduled) - slowest, 0.0),
        UNTIMED: columns(np.nanmedian, fixed(UNTIMED)),
    }
    parts = {k: np.where(np.isfinite(v), v, 0.0) for k, v in parts.items()}
    parts["other"] = measured - ideal_compute - ideal_exchange - sum(parts.values())
    return {"m": measured, "c": ideal_compute, "e": ideal_exchange}, parts


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
