"""Suggest a topology: enumerate the bag layouts that fit N GPUs, plan each of them, and
``topology="auto"`` (which picks every step's partition), on the same sampled steps of a
data mix, and rank them by modelled step time, communication included, so bigger bags
are not free.

The cost has one home, `knapformer.planning.communication.plan_cost` (docs/concepts.md,
"Communication and the layout floor"): per layer, forward, each GPU's compute (its load
after balancing at ``CommModel.tflops``) plus its Ulysses exchanges (node link or
network, ``CommModel.intra_gbs`` / ``inter_gbs``) plus its share of route and reverse
route; the slowest GPU sets the step, times ``CommModel.layers``. The unbalanced
baseline is the slowest GPU's own compute, no communication. Backward scales compute
and communication alike, so it does not change the ranking.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from knapformer.contract.limits import check_option
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError, OptionError
from knapformer.planning.communication import CommModel, plan_cost
from knapformer.planning.datamix import DataCode, mix_gpus, sample_lengths, scale_mix
from knapformer.planning.partitions import allowed_sizes
from knapformer.planning.planner import AUTO, DEFAULT_SOLVER, plan_routing
from knapformer.planning.workload import WorkloadModel

DEFAULT_TOKEN_DIM = 3072
_PARTS = 8  # mixed topologies split the GPUs in eighths between bag sizes


@dataclass(frozen=True)
class StepCost:
    """Modelled milliseconds of one step carried out as its plan says (all layers, the
    slowest GPU's parts: `knapformer.planning.communication.PlanCost`)."""

    step_ms: float  # modelled step time with balancing, communication included
    compute_ms: float  # compute of the slowest GPU
    ulysses_ms: float  # its Ulysses exchanges
    routing_ms: float  # its route + reverse_route
    unbalanced_ms: float  # step time with no balancing at all (compute only)
    imbalance_after: float
    makespan_over_lb: float
    topology: str  # the step's partition

    @classmethod
    def of(cls, plan: RoutingPlan, comm: CommModel) -> StepCost:
        cost, stats = plan_cost(plan, comm), plan.stats
        return cls(
            step_ms=cost.step_ms,
            compute_ms=cost.compute_ms,
            ulysses_ms=cost.ulysses_ms,
            routing_ms=cost.route_ms,
            unbalanced_ms=float(comm.ms_of(stats.makespan_before, cost.scale)) * comm.layers,
            imbalance_after=stats.imbalance_after,
            makespan_over_lb=stats.makespan_over_lb,
            topology=plan.topology,
        )

    @property
    def comm_ms(self) -> float:
        return self.ulysses_ms + self.routing_ms


@dataclass
class Suggestion:
    """One ranked topology (``"auto"``: the per-step choice); figures are means over the
    simulated steps."""

    topology: Topology | str
    costs: list[StepCost] = field(default_factory=list)

    @property
    def auto(self) -> bool:
        return self.topology == AUTO

    @property
    def name(self) -> str:
        return str(self.topology)

    @property
    def max_bag_size(self) -> int:
        """The largest bag of any step."""
        if not self.auto:
            return self.topology.max_bag_size
        return max((Topology.parse(c.topology).max_bag_size for c in self.costs), default=1)

    @property
    def partitions(self) -> Counter[str]:
        """How many steps used each partition."""
        return Counter(c.topology for c in self.costs)

    def _mean(self, name: str) -> float:
        return float(np.mean([getattr(c, name) for c in self.costs]))

    @property
    def step_ms(self) -> float:
        return self._mean("step_ms")

    @property
    def compute_ms(self) -> float:
        return self._mean("compute_ms")

    @property
    def ulysses_ms(self) -> float:
        return self._mean("ulysses_ms")

    @property
    def routing_ms(self) -> float:
        return self._mean("routing_ms")

    @property
    def comm_ms(self) -> float:
        return self._mean("comm_ms")

    @property
    def unbalanced_ms(self) -> float:
        return self._mean("unbalanced_ms")

    @property
    def imbalance_after(self) -> float:
        return self._mean("imbalance_after")

    @property
    def speedup(self) -> float:
        """Unbalanced step time / this topology's step time."""
        return self.unbalanced_ms / self.step_ms if self.step_ms > 0 else 1.0

    def reasons(self, best: Suggestion | None = None) -> str:
        """Why it ranks where it does, in a few words."""
        out = []
        if self.auto:
            picked = ", ".join(f"{t} ×{n}" for t, n in self.partitions.most_common())
            out.append(f"chose {picked}")
        if self.imbalance_after > 1.05:
            if self._mean("makespan_over_lb") < 1.02:
                out.append(
                    f"longest sequences need bigger bags than {self.max_bag_size} "
                    f"GPU(s): load {self.imbalance_after:.2f}x the mean"
                )
            else:
                out.append(f"load stays {self.imbalance_after:.2f}x the mean")
        else:
            out.append(f"balanced ({self.imbalance_after:.3f}x the mean)")
        share = self.ulysses_ms / self.step_ms if self.step_ms else 0.0
        out.append(
            "no Ulysses cost" if self.ulysses_ms == 0 else f"Ulysses {share:.0%} of the step"
        )
        if self.routing_ms > 0.01 * self.step_ms:
            out.append(f"routing {self.routing_ms / self.step_ms:.0%}")
        if best is not None and best is not self:
            out.append(f"+{(self.step_ms / best.step_ms - 1):.1%} vs best")
        return "; ".join(out)


def enumerate_topologies(
    num_gpus: int, max_bag: int = 8, max_sizes: int = 3, parts: int = _PARTS
) -> list[Topology]:
    """Topologies of ``num_gpus`` GPUs with power-of-two bag sizes <= ``max_bag``.

    All homogeneous ones (``gXnY``), plus mixed ones of 2..``max_sizes`` distinct bag
    sizes where each size gets a whole number of ``num_gpus / parts`` GPU slices (coarse,
    so the count stays small: ~130 for 32 GPUs). Ordered by bag sizes, deduplicated.
    """
    check_options(num_gpus, max_bag, steps=1)
    sizes = [1 << k for k in range(max_bag.bit_length()) if (1 << k) <= min(max_bag, num_gpus)]
    # Coarse slices: the largest divisor of num_gpus that is <= parts.
    parts = max(p for p in range(1, parts + 1) if num_gpus % p == 0)
    unit = num_gpus // parts
    found: dict[tuple[int, ...], Topology] = {}
    for size in sizes:
        if num_gpus % size == 0:
            topo = Topology.from_bag_sizes([size] * (num_gpus // size))
            found[topo.bag_sizes] = topo
    for k in range(2, max_sizes + 1):
        for subset in itertools.combinations(sizes, k):
            for shares in _compositions(parts, k):
                gpus = [share * unit for share in shares]
                if any(g % s for g, s in zip(gpus, subset, strict=True)):
                    continue
                bag_sizes = [s for s, g in zip(subset, gpus, strict=True) for _ in range(g // s)]
                topo = Topology.from_bag_sizes(bag_sizes)
                found.setdefault(topo.bag_sizes, topo)
    return [found[key] for key in sorted(found)]


def _compositions(total: int, k: int):
    """Ways of writing ``total`` as an ordered sum of ``k`` positive integers."""
    for cuts in itertools.combinations(range(1, total), k - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def check_options(num_gpus: int, max_bag: int, steps: int, seed: int = 0) -> None:
    """Raise a `KnapformerError` naming the first option out of range."""
    for name, value in (("gpus", num_gpus), ("max_bag", max_bag), ("steps", steps), ("seed", seed)):
        check_option(name, value)
    if max_bag & (max_bag - 1):
        raise OptionError(f"`max_bag` must be a power of two, got {max_bag}")


def fit_mix(codes: Sequence[DataCode], num_gpus: int) -> list[DataCode]:
    """The mix on ``num_gpus`` GPUs: itself, or repeated when ``num_gpus`` is a multiple."""
    have = mix_gpus(codes)
    if num_gpus == have:
        return list(codes)
    if num_gpus % have:
        raise OptionError(
            f"the data mix fills {have} GPUs; `gpus` {num_gpus} must be a multiple of {have}"
        )
    return scale_mix(codes, num_gpus // have)


def auto_sizes(num_gpus: int, max_bag: int, comm: CommModel) -> tuple[int, ...] | None:
    """The group sizes ``"auto"`` may use on ``num_gpus`` GPUs with bags of at most
    ``max_bag`` (None when it cannot cut them into nodes of ``comm.node_size``)."""
    sizes = tuple(1 << k for k in range(max_bag.bit_length()))
    try:
        return allowed_sizes(num_gpus, int(comm.node_size), sizes)[0]
    except KnapformerError:
        return None


def suggest(
    codes: Sequence[DataCode],
    num_gpus: int,
    max_bag: int = 8,
    steps: int = 4,
    gamma: float = 0.4,
    comm: CommModel | None = None,
    solver: str = DEFAULT_SOLVER,
    seed: int = 0,
    topologies: Sequence[Topology] | None = None,
    on_topology: Callable[[int, int], None] | None = None,
    token_dim: int = DEFAULT_TOKEN_DIM,
    auto: bool = True,
) -> list[Suggestion]:
    """Rank topologies by modelled step time under ``comm`` (default `CommModel`: the
    NVLink-class figures), best first; ties: fixed before auto, fewer and smaller bags
    first. With ``auto`` (and GPUs that `auto_sizes` can cut into nodes) ``"auto"`` is
    ranked too, choosing among groups of at most ``max_bag`` GPUs.

    Every candidate is planned on the same ``steps`` sampled steps. ``on_topology(i, n)``
    reports progress.
    """
    check_options(num_gpus, max_bag, steps, seed)
    comm = comm or CommModel()
    codes = fit_mix(codes, num_gpus)
    candidates: list[Topology | str] = list(
        topologies if topologies else enumerate_topologies(num_gpus, max_bag)
    )
    for topo in candidates:
        if topo.num_gpus != num_gpus:
            raise KnapformerError(f"topology {topo} has {topo.num_gpus} GPUs, not {num_gpus}")
    sizes = auto_sizes(num_gpus, max_bag, comm) if auto else None
    if sizes is not None:
        candidates.append(AUTO)
    model = WorkloadModel(token_dim=token_dim, gamma=gamma)
    rng = np.random.default_rng(seed)
    batches = [sample_lengths(codes, rng) for _ in range(steps)]
    out = []
    for i, topo in enumerate(candidates):
        suggestion = Suggestion(topo)
        extra = {} if topo != AUTO else {"comm": comm, "group_sizes": sizes}
        for step, lengths in enumerate(batches):
            plan = plan_routing(lengths, topo, model, solver=solver, step=step, **extra)
            suggestion.costs.append(StepCost.of(plan, comm))
        out.append(suggestion)
        if on_topology is not None:
            on_topology(i + 1, len(candidates))
    out.sort(
        key=lambda s: (
            round(s.step_ms, 9),
            s.auto,
            s.max_bag_size,
            () if s.auto else s.topology.bag_sizes,
        )
    )
    return out
