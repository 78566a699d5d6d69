"""`SpeedHistory`: the history cost model — each GPU's speed, learnt from its measured
compute, so that the planner gives a slow GPU (throttled, a bad link, another job on the
node) less work.

Each measured step gives every GPU a point: the work its plan gave it
(`knapformer.contract.stats.PlanStats.work_after`, workload at nominal speed) and its measured
``compute`` (ms; `knapformer.runtime.timing`). Over the last ``window`` steps the affine
compute model (`knapformer.planning.compute_model.fit_compute`: a fixed overhead shared by
the group plus a rate per GPU) is fitted, and a GPU's speed is the inverse of its rate
relative to the group's once its compute departs from the group's line persistently
(`ComputeFit.learnt`: by 30 % in 3 of 4 of at least 5 of the window's steps, in two
windows in a row; until then it stays 1), and for as long after as its rate departs
(given less work, its compute nears the others' while its rate stays), rounded to two
significant digits and kept within ``bounds`` (steady plans; the same number in JSON and
on every rank). During the first ``warmup`` measured steps nothing is learnt and the
planner assumes nominal speeds.

Why affine: every step has a fixed cost (launches, norms, the optimizer, Python). Divided
by the work (a line through the origin) it makes a lightly loaded GPU look slow, which the
planner would then feed even less. With the overhead fitted apart, the planner gives work in
proportion to the speeds it assumes, and at the fixed point every GPU's compute is equal.

Pure and deterministic: every rank of a balance group feeds it the same gathered figures
in step order, so all plan with the same speeds, and `recorded_speeds` recomputes a
recorded run's speeds from its plans (replayable).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike

from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError
from knapformer.planning.compute_model import fit_compute

#: The cost models of `knapformer.runtime.balancer.SequenceBalancer`: "modelled" plans with the
#: workload model (and fixed ``gpu_speed``); "history" also learns every GPU's speed here.
COST_MODELS = ("modelled", "history")
#: Measured steps before the first speeds are used.
WARMUP_STEPS = 3
#: Measured steps the affine model is fitted over.
WINDOW_STEPS = 8
#: No GPU is taken for more than 8x slower or faster than the median one.
SPEED_BOUNDS = (0.125, 8.0)
#: The plan of step s uses what was measured up to step s - LAG_STEPS: with planning ahead
#: the plan of step s is made while step s - 1 still runs, and both paths learn alike.
LAG_STEPS = 2


class SpeedHistory:
    """Speeds of ``num_gpus`` GPUs (positions of the balance group) from measured steps.

    Fed step by step (`planned`, `measured`), `speeds_for` gives the speeds the plan of a
    step uses: learnt from the steps up to it - `LAG_STEPS`, in order, as the balancer
    plans and as `recorded_speeds` recomputes them. `observe` feeds one step directly.
    """

    def __init__(
        self,
        num_gpus: int,
        warmup: int = WARMUP_STEPS,
        window: int = WINDOW_STEPS,
        bounds: tuple[float, float] = SPEED_BOUNDS,
    ) -> None:
        if num_gpus < 1 or warmup < 0 or window < 1:
            raise KnapformerError(
                f"SpeedHistory needs num_gpus >= 1, warmup >= 0 and window >= 1, got "
                f"{num_gpus}, {warmup}, {window}"
            )
        low, high = bounds
        if not 0 < low <= 1 <= high:
            raise KnapformerError(f"speed bounds must satisfy 0 < low <= 1 <= high, got {bounds}")
        self.num_gpus, self.warmup, self.bounds = num_gpus, warmup, (float(low), float(high))
        self._recent: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=window)
        self.observed = 0  # steps that gave speeds
        self._work: dict[int, np.ndarray] = {}  # per step, until it is learnt
        self._compute: dict[int, np.ndarray] = {}
        self._learnt_upto = -1
        self._speeds: list[float] | None = None  # learnt after the latest observed step
        self._slow = np.zeros(num_gpus, dtype=bool)  # GPUs learnt slower than the group
        self._candidate = np.zeros(num_gpus, dtype=bool)  # new slow GPUs of the last window

    def planned(self, step: int, work: ArrayLike) -> None:
        """The workload (num_gpus,) the plan of ``step`` gave each GPU (`step_work`)."""
        self._work[step] = np.asarray(work, dtype=np.float64)

    def measured(self, step: int, compute_ms: ArrayLike) -> None:
        """Each GPU's measured compute (num_gpus,) in ``step``."""
        self._compute[step] = np.asarray(compute_ms, dtype=np.float64)

    def speeds_for(self, step: int) -> list[float] | None:
        """The speeds to plan ``step`` with (`speeds`), once every step up to ``step`` -
        `LAG_STEPS` whose work and compute are both known has been observed, in order
        (each once; a step missing either is skipped)."""
        while self._learnt_upto < step - LAG_STEPS:
            self._learnt_upto += 1
            work = self._work.pop(self._learnt_upto, None)
            compute = self._compute.pop(self._learnt_upto, None)
            if work is not None and compute is not None:
                self.observe(work, compute)
        return self.speeds()

    def observe(self, work: ArrayLike, compute_ms: ArrayLike) -> None:
        """One step: ``work`` (num_gpus,) each GPU's workload, ``compute_ms`` (num_gpus,) its
        measured compute. GPUs without work or without a positive finite time give no
        figure; a step with fewer than two such GPUs is skipped."""
        work = np.asarray(work, dtype=np.float64).reshape(-1)
        compute = np.asarray(compute_ms, dtype=np.float64).reshape(-1)
        if work.shape != (self.num_gpus,) or compute.shape != (self.num_gpus,):
            raise KnapformerError(
                f"SpeedHistory of {self.num_gpus} GPUs got {work.size} workloads and "
                f"{compute.size} compute times"
            )
        valid = (work > 0) & np.isfinite(compute) & (compute > 0) & np.isfinite(work)
        if valid.sum() < 2:
            return
        self._recent.append((np.where(valid, work, np.nan), np.where(valid, compute, np.nan)))
        self.observed += 1
        if self.observed >= max(self.warmup, 1):
            self._learn()

    def _learn(self) -> None:
        """Fit the window; a GPU learnt slow stays so while its rate departs."""
        work = np.stack([w for w, _ in self._recent], axis=1)  # (num_gpus, steps)
        compute = np.stack([c for _, c in self._recent], axis=1)
        speed = fit_compute(work, compute).learnt(self._slow)
        # A GPU is learnt slow only once two windows in a row say so: in one window the
        # step-to-step noise of the lightly loaded GPUs can tilt the group's line, and
        # then the heavily loaded one seems to depart. One step later for a slow GPU.
        new = (speed < 1.0) & ~self._slow
        speed = np.where(new & ~self._candidate, 1.0, speed)
        self._candidate = new
        low, high = self.bounds
        rounded = [min(max(float(f"{s:.2g}"), low), high) for s in speed]
        self._slow = np.asarray(rounded) < 1.0
        self._speeds = None if all(s == 1.0 for s in rounded) else rounded

    def speeds(self) -> list[float] | None:
        """Each GPU's speed (1 = the median GPU), or None while warming up or when every
        GPU comes out nominal."""
        return None if self._speeds is None else list(self._speeds)


def step_work(plan: RoutingPlan) -> np.ndarray:
    """(num_gpus,) the workload ``plan`` gives each GPU of ``plan.gpus`` (speed 1)."""
    return np.asarray(plan.stats.work_after, dtype=np.float64)


def recorded_speeds(
    plans: Iterable[RoutingPlan], warmup: int = WARMUP_STEPS, window: int = WINDOW_STEPS
) -> dict[int, list[float] | None]:
    """The speeds the history cost model plans each recorded step with, recomputed from
    the recording (every step recorded, with measured ``compute``): plan s uses the steps
    up to s - `LAG_STEPS`, as `knapformer.runtime.balancer.SequenceBalancer` does."""
    ordered = sorted((p for p in plans if p.step is not None), key=lambda p: p.step)
    if not ordered:
        return {}
    history = SpeedHistory(len(ordered[0].gpus), warmup, window)
    speeds: dict[int, list[float] | None] = {}
    for plan in ordered:
        speeds[plan.step] = history.speeds_for(plan.step)
        history.planned(plan.step, step_work(plan))
        compute = None if plan.measurements is None else plan.measurements.per_rank_ms
        if compute and "compute" in compute:
            history.measured(plan.step, compute["compute"])
    return speeds
