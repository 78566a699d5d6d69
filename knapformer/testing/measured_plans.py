"""Plans with synthesised per-rank measurements, as a recorded run would carry them.

A step is simulated in the order the balancer runs it: length gather, route, compute
before attention, the Ulysses exchange into attention (``pre_attn``: each GPU of a bag
waits there for its slowest peer), the rest of the compute with the exchange back
(``post_attn``, the same), reverse route and the gradient all-reduce, where every rank
waits for the last one to finish. Compute is proportional to the work the plan gave a
rank at nominal speed, times noise; a slow rank's compute is ``slow_factor`` times that,
so the others' time in the next collective grows by the difference.
"""

from __future__ import annotations

import numpy as np

from knapformer.contract.plan import Measurements, RoutingPlan
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

#: the share of a step's compute that runs before attention's exchange
_BEFORE_ATTENTION = 0.4
_TRANSFER_MS = {"gather": 0.3, "route": 2.0, "pre_attn": 1.0, "post_attn": 1.0,
                "reverse_route": 2.0, "allreduce": 3.0}  # fmt: skip


def with_measurements(
    plan: RoutingPlan,
    rng: np.random.Generator,
    mean_compute_ms: float = 100.0,
    slow_rank: int | None = None,
    slow_factor: float = 1.0,
    noise: float = 0.05,
    speeds: dict[int, float] | None = None,
    optimizer_ms: float = 0.0,
    untimed_ms: float = 0.0,
) -> RoutingPlan:
    """``plan`` with ``measurements.per_rank_ms`` of every recorded phase of a step (plus
    ``compute``): compute ~ work at nominal speed, scaled so the mean rank takes
    ``mean_compute_ms``, with lognormal ``noise``; ``slow_rank`` takes ``slow_factor``
    times as long; ``speeds`` (rank -> relative speed) slows several ranks at once.
    ``optimizer_ms`` / ``untimed_ms`` (when > 0, with noise): an optimizer step after the
    all-reduce and time between the loop's phases, each on every rank."""
    st = plan.stats
    n = len(plan.gpus)
    work = st.work_after
    scale = mean_compute_ms / float(work.mean()) if work.mean() > 0 else 0.0
    compute = work * scale * rng.lognormal(0.0, noise, n)
    slowdown = np.ones(n)
    for rank, speed in (speeds or {}).items():
        slowdown[plan.gpus.index(rank)] /= speed
    if slow_rank is not None:
        slowdown[plan.gpus.index(slow_rank)] *= slow_factor
    compute *= slowdown

    def transfer(name: str) -> np.ndarray:
        return _TRANSFER_MS[name] * rng.lognormal(0.0, noise, n)

    bag = st.gpu_bag
    alone = np.bincount(bag)[bag] == 1

    def bag_exchange(progress: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(time in the exchange, progress after it): peers wait for the bag's slowest."""
        latest = np.zeros(bag.max() + 1)
        np.maximum.at(latest, bag, progress)
        spent = np.where(alone, 0.0, latest[bag] - progress + transfer(name))
        return spent, progress + spent

    times = {"gather": transfer("gather"), "route": transfer("route")}
    clock = times["gather"] + times["route"]
    times["pre_attn"], clock = bag_exchange(clock + _BEFORE_ATTENTION * compute, "pre_attn")
    times["post_attn"], clock = bag_exchange(clock + (1 - _BEFORE_ATTENTION) * compute, "post_attn")
    times["reverse_route"] = transfer("reverse_route")
    clock = clock + times["reverse_route"]
    times["allreduce"] = clock.max() - clock + transfer("allreduce")
    step = clock + times["allreduce"]
    for name, ms in (("optimizer", optimizer_ms), ("untimed", untimed_ms)):
        if ms > 0:
            times[name] = ms * rng.lognormal(0.0, noise, n)
            step = step + times[name]
    per_rank = {name: t.tolist() for name, t in times.items()}
    per_rank["compute"] = compute.tolist()
    per_rank["step"] = step.tolist()
    return plan.model_copy(update={"measurements": Measurements(plan_ms=1.0, per_rank_ms=per_rank)})


def measured_run(
    steps: int,
    topology: str = "g1n2+g2n1+g4n1",
    codes: str = "g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0",
    seed: int = 0,
    **measurement: object,
) -> list[RoutingPlan]:
    """``steps`` balanced plans of a data mix, each with synthesised measurements
    (`with_measurements` keywords)."""
    rng = np.random.default_rng(seed)
    model = WorkloadModel(3072, 0.4)
    mix = parse_mix(codes)
    return [
        with_measurements(
            plan_routing(sample_lengths(mix, rng), topology, model, step=s, run="measured"),
            rng,
            **measurement,
        )
        for s in range(steps)
    ]
