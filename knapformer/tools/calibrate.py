"""Fit the workload model's time scale ``k`` and attention weight ``γ`` from measurements.

Two sources:

- a CSV of per-sequence measurements with a header naming the columns ``length``
  (tokens) and ``latency`` (ms; ``latency_ms`` is accepted too); other columns are
  ignored. Fit: ``latency ≈ k·(24·L·d² + γ·4·L²·d)/1e12``, linear in ``(k, k·γ)``.
- recorded plans whose ``measurements.per_rank_ms[phase]`` carries a measured time per
  GPU (the compute phase). After routing, GPU i of a bag of g GPUs runs the linear layers
  on the c tokens of its chunks and attention on 1/g of the heads of every sequence of
  its bag (Ulysses), so its time ≈ ``k·(Σ_chunks 24·c·d² + γ·Σ_s 4·L_s²·d/g)/1e12``.
  That is linear in ``(a, b) = (k, k·γ)`` with features ``Σ 24·c·d²/1e12`` and
  ``Σ 4·L²·d/(g·1e12)`` (`knapformer.contract.stats.terms_after`): one least-squares fit over all
  (plan, GPU) rows, then ``k = a`` and ``γ = b / a``.

Both are the one relative least-squares fit of `knapformer.planning.workload.fit_scale_gamma`
(per sequence through `WorkloadModel.calibrate`; per GPU on summed `WorkloadModel.terms`).

The fitted ``k`` converts workload units into milliseconds, so ``WorkloadModel(d, γ, k)``
predicts times directly.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from knapformer.contract.phases import COMPUTE_PHASES, compute_phase
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import Problem, read_plans
from knapformer.contract.runfiles import single_run
from knapformer.contract.stats import terms_after
from knapformer.errors import KnapformerError, OptionError, file_error
from knapformer.planning.workload import WorkloadModel, fit_scale_gamma

#: A fit that explains less of the variation between the measured times than this is not
#: a model of them: its γ would steer the balancer by noise.
MIN_USABLE_R2 = 0.5
#: A fit whose typical point (the median) is further off its measured time than this
#: predicts no better than the guess it replaces.
MAX_USABLE_MEDIAN_ERROR = 0.10
#: Fewer points than this cannot tell two parameters from noise: two fit exactly, and a
#: fit is judged on the points beyond them.
MIN_USABLE_POINTS = 4
#: Lengths spanning less than this ratio (longest / shortest) cannot tell attention, which
#: grows as L², from the linear layers, which grow as L: γ is then a guess.
MIN_LENGTH_SPREAD = 4.0


@dataclass
class Calibration:
    """A fit and the points it was fitted on (``predicted`` and ``measured`` in ms)."""

    model: WorkloadModel
    rel_rms_error: float
    measured: np.ndarray  # (n,)
    predicted: np.ndarray  # (n,)
    labels: list[str]  # (n,) what each point is, e.g. "L=4096" or "step 3 GPU 5"
    source: str  # "csv" or "plans"
    phase: str | None = None
    skipped: list[Problem] = field(default_factory=list)  # bad records of the file, skipped
    #: (m,) the sequence lengths the points were measured on (every sequence of the plans)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: phases the plans measured (empty for a CSV)
    measured_phases: tuple[str, ...] = ()
    steps: int = 0  # plans that gave points

    @property
    def scale(self) -> float:
        return self.model.scale

    @property
    def gamma(self) -> float:
        return self.model.gamma

    @property
    def r2(self) -> float:
        resid = self.measured - self.predicted
        total = float(np.sum((self.measured - self.measured.mean()) ** 2))
        return 1.0 - float(np.sum(resid**2)) / total if total > 0 else 1.0

    @property
    def relative_errors(self) -> np.ndarray:
        """(n,) how far each prediction is off its measured time, as a fraction of it."""
        return np.abs(self.predicted - self.measured) / self.measured

    @property
    def median_error(self) -> float:
        return float(np.median(self.relative_errors))

    @property
    def max_error(self) -> float:
        return float(self.relative_errors.max())

    @property
    def error_line(self) -> str:
        """The errors people read: ``off by 4.1% (median), 12% at most``."""
        return f"off by {self.median_error:.1%} (median), {self.max_error:.0%} at most"

    @property
    def length_spread(self) -> float:
        """Longest over shortest non-empty sequence length the points cover (1 when one)."""
        lengths = self.lengths[self.lengths > 0]
        return float(lengths.max() / lengths.min()) if lengths.size else 1.0

    @property
    def unusable_reason(self) -> str | None:
        """Why the fit must not be used (None when it may): too few points, a typical
        point off by more than `MAX_USABLE_MEDIAN_ERROR`, or less than `MIN_USABLE_R2`
        of the variation between the measured times explained."""
        what = "per-sequence latencies" if self.source == "csv" else "per-GPU times"
        n = len(self.measured)
        if n < MIN_USABLE_POINTS:
            return f"only {n} measured {what}: a fit of 2 parameters needs {MIN_USABLE_POINTS}"
        r2 = self.r2
        if r2 < MIN_USABLE_R2:
            explained = "none" if r2 <= 0 else f"only {r2:.0%}"
            return (
                f"R² = {r2:.2f} < {MIN_USABLE_R2}: the model explains {explained} of the "
                f"variation between the {n} measured {what} ({self.error_line})"
            )
        if self.median_error > MAX_USABLE_MEDIAN_ERROR:
            return (
                f"predictions of the {n} measured {what} are {self.error_line}; a usable fit "
                f"is off by at most {MAX_USABLE_MEDIAN_ERROR:.0%} (median)"
            )
        return None

    @property
    def remedy(self) -> str:
        """What to measure to get a usable fit, from what this one was fitted on."""
        spread = self.length_spread
        lengths = self.lengths[self.lengths > 0]
        span = f"{int(lengths.min()):,}..{int(lengths.max()):,} tokens" if lengths.size else "none"
        if self.source == "csv":
            if len(self.measured) < MIN_USABLE_POINTS:
                return "time more sequences (several per length)."
            if spread < MIN_LENGTH_SPREAD:
                return (
                    f"the lengths span only {span} ({spread:.1f}×): time lengths at least "
                    f"{MIN_LENGTH_SPREAD:g}× apart, so attention (γ) can be told from the "
                    "linear layers."
                )
            return (
                "the latencies vary more than the model explains: time each sequence alone, "
                "after warm-up, synchronising the GPU, several times per length."
            )
        advice = []
        if self.phase != "compute":
            better = "compute" if "compute" in self.measured_phases else None
            advice.append(
                f"phase {self.phase!r} includes more than compute (waiting, collectives, host "
                "overhead): "
                + (
                    "fit `--phase compute`, which the plans also measure"
                    if better
                    else "record with a balancer that measures the `compute` phase"
                )
            )
        if self.steps < MIN_USABLE_POINTS:
            advice.append(f"record more steps (these plans give {self.steps})")
        if spread < MIN_LENGTH_SPREAD:
            advice.append(
                f"the sequences span only {span} ({spread:.1f}×): γ cannot be told from the "
                "linear layers; record steps with a wider mix of lengths"
            )
        if not advice:
            median_ms = float(np.median(self.measured))
            overhead = (
                f" (a median of {median_ms:.3g} ms is mostly fixed per-step overhead)"
                if median_ms < 1.0
                else ""
            )
            advice.append(
                f"the {self.phase!r} times of {self.steps} steps over lengths {span} vary "
                f"more than the model explains{overhead}: GPUs shared with other work, or "
                "per-step work the model does not count; time single sequences (a CSV of "
                "length,latency) to fit γ"
            )
        return "; ".join(advice) + "."


def read_measurements_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, latencies) from a CSV with a ``length,latency`` header."""
    path = Path(path)
    try:
        # utf-8-sig: spreadsheet programs start their CSV exports with a byte order mark.
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as err:
        raise file_error(path, err) from err
    with handle:
        reader = csv.DictReader(handle)
        fields = [f.strip().lower() for f in (reader.fieldnames or [])]
        names = {f.strip().lower(): f for f in (reader.fieldnames or [])}
        lat_key = next((names[k] for k in ("latency", "latency_ms") if k in names), None)
        if "length" not in names or lat_key is None:
            raise KnapformerError(
                f"{path}: expected a header with columns length,latency (ms); got {fields}"
            )
        lengths, latencies = [], []
        for line, row in enumerate(reader, start=2):
            try:
                lengths.append(float(row[names["length"]]))
                latencies.append(float(row[lat_key]))
            except (TypeError, ValueError):
                raise KnapformerError(
                    f"{path}:{line}: length and latency must be numbers, got "
                    f"{row[names['length']]!r}, {row[lat_key]!r}"
                ) from None
    if not lengths:
        raise KnapformerError(f"{path}: no measurements below the header")
    return np.asarray(lengths), np.asarray(latencies)


def calibrate_lengths(lengths, latencies, token_dim: int) -> Calibration:
    """Fit from per-sequence (length, latency ms) pairs, each (n,) (`WorkloadModel.calibrate`)."""
    lengths = np.asarray(lengths, dtype=np.float64).ravel()
    latencies = np.asarray(latencies, dtype=np.float64).ravel()
    model, error = WorkloadModel.calibrate(lengths, latencies, int(token_dim))
    return Calibration(
        model=model,
        rel_rms_error=error,
        measured=latencies,
        predicted=model.workload(lengths),
        labels=[f"L={int(n)}" for n in lengths],
        source="csv",
        lengths=lengths,
    )


def pick_phase(plans: Sequence[RoutingPlan], phase: str | None) -> str:
    """The measured phase to fit: ``phase`` if given, else the phase that stands for
    compute (`knapformer.contract.phases.compute_phase`) among those the plans measure."""
    seen: dict[str, None] = {}
    for plan in plans:
        if plan.measurements is not None:
            seen.update(dict.fromkeys(plan.measurements.per_rank_ms))
    if phase is not None:
        if phase not in seen:
            raise KnapformerError(
                f"no plan measures phase {phase!r}; measured phases: {', '.join(seen) or 'none'}"
            )
        return phase
    chosen = compute_phase(seen)
    if chosen is None:
        raise OptionError(
            "no plan carries per-rank times of a compute phase "
            f"({', '.join(COMPUTE_PHASES)}); measured phases: {', '.join(seen) or 'none'}. "
            "Name one with `phase`"
        )
    return chosen


def gpu_features(plan: RoutingPlan, token_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU of ``plan.gpus``: (linear, attention) workload terms it computes, each (n,)."""
    return terms_after(plan, *WorkloadModel(int(token_dim)).terms(plan.sequences.length))


def calibrate_plans(
    plans: Sequence[RoutingPlan], token_dim: int | None = None, phase: str | None = None
) -> Calibration:
    """Fit from plans carrying per-rank times (see module doc)."""
    if not plans:
        raise KnapformerError("no plans to calibrate from")
    phase = pick_phase(plans, phase)
    lin, att, measured, labels, lengths = [], [], [], [], []
    for index, plan in enumerate(plans):
        times = None if plan.measurements is None else plan.measurements.per_rank_ms.get(phase)
        if times is None:
            continue
        d = token_dim or plan.token_dim
        if d is None:
            raise OptionError(
                f"plan {index} (step {plan.step}) records no token_dim; give `token_dim`"
            )
        if len(times) != len(plan.gpus):
            raise KnapformerError(
                f"plan {index} (step {plan.step}): phase {phase!r} has {len(times)} times "
                f"for {len(plan.gpus)} GPUs"
            )
        linear, attention = gpu_features(plan, d)
        lin.append(linear)
        att.append(attention)
        measured.append(np.asarray(times, dtype=np.float64))
        step = plan.step if plan.step is not None else index
        labels.extend(f"step {step} GPU {g}" for g in plan.gpus)
        lengths.append(np.asarray(plan.sequences.length, dtype=np.float64))
        token_dim = d
    linear, attention, y = np.concatenate(lin), np.concatenate(att), np.concatenate(measured)
    scale, gamma, error = fit_scale_gamma(linear, attention, y)
    model = WorkloadModel(token_dim=int(token_dim), gamma=gamma, scale=scale, unit="ms")
    predicted = model.scale * (linear + model.gamma * attention)
    phases = {p for plan in plans if plan.measurements for p in plan.measurements.per_rank_ms}
    return Calibration(
        model,
        error,
        y,
        predicted,
        labels,
        "plans",
        phase,
        lengths=np.concatenate(lengths),
        measured_phases=tuple(sorted(phases)),
        steps=len(measured),
    )


def calibrate_file(
    path: str | Path, token_dim: int | None = None, phase: str | None = None
) -> Calibration:
    """Calibrate from a ``.csv`` of (length, latency), a plan file (JSON/JSONL) or a run
    folder (`single_run`).

    Bad records of a plan file are skipped and listed in ``Calibration.skipped``."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        if token_dim is None:
            raise OptionError("a CSV of measurements needs `token_dim` (the model's hidden size)")
        lengths, latencies = read_measurements_csv(path)
        return calibrate_lengths(lengths, latencies, token_dim)
    # A recording cut by a crash may end in a partial line: skip bad records, say which.
    result = read_plans(single_run(path), on_error="skip")
    if not result.plans:
        unreadable = [p for p in result.problems if p.line is None]
        if unreadable:  # a missing file, a folder, an empty file: say that, not "no plan"
            raise KnapformerError(str(unreadable[0]))
        raise KnapformerError(f"{path}: no valid plan to calibrate from")
    return replace(calibrate_plans(result.plans, token_dim, phase), skipped=result.problems)
