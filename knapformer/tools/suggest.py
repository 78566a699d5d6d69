"""Suggest a topology: enumerate the bag layouts that fit N GPUs, simulate each on a data
mix and rank them by a modelled step time that charges for communication, so bigger
bags are not free.

Cost model (all per training step, forward pass; backward scales compute and
communication alike, so it does not change the ranking):

- compute of GPU i per layer: ``load_i / tflops`` seconds, where ``load_i`` is its
  workload after balancing (``(24·L·d² + γ·4·L²·d)/1e12`` summed over its share of the
  sequences, i.e. TFLOPs of one layer) and ``tflops`` the sustained TFLOP/s of one GPU;
- Ulysses all-to-all of GPU i per layer in a bag of g > 1 GPUs: 4 all-to-alls (q, k, v
  to head shards, the output back), each sending ``(g-1)/g`` of its ``T_i`` tokens of
  ``d`` values: ``4·(g-1)/g·T_i·d·bytes / bandwidth``;
- a layer takes ``max_i (compute_i + ulysses_i)`` (GPUs wait for the slowest);
- balancing (route + reverse_route, once per step): ``2·max_i max(sent_i, received_i)
  ·d·bytes / bandwidth``;
- step = ``layers · layer + balancing``. The unbalanced baseline is
  ``layers · max_i load_before_i / tflops`` (no bags, no communication).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from knapformer.contract.limits import MAX_GPUS, MAX_SIM_STEPS, check_count
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError, OptionError
from knapformer.planning.datamix import DataCode, mix_gpus, sample_lengths, scale_mix
from knapformer.planning.planner import DEFAULT_SOLVER, plan_routing
from knapformer.planning.workload import WorkloadModel

DEFAULT_TFLOPS = 400.0  # sustained bf16 TFLOP/s of one H100-class GPU (~40% of peak)
DEFAULT_BANDWIDTH_GBS = 100.0  # all-to-all bandwidth per GPU, GB/s
DEFAULT_LAYERS = 32
_PARTS = 8  # mixed topologies split the GPUs in eighths between bag sizes


@dataclass(frozen=True)
class CostModel:
    """Hardware figures that turn workloads and tokens into milliseconds (see module doc)."""

    token_dim: int = 3072
    dtype_bytes: int = 2
    tflops: float = DEFAULT_TFLOPS
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS
    layers: int = DEFAULT_LAYERS

    def __post_init__(self) -> None:
        for name in ("token_dim", "dtype_bytes", "tflops", "bandwidth_gbs", "layers"):
            value = getattr(self, name)
            if not np.isfinite(value) or value <= 0:
                raise KnapformerError(f"{name} must be a positive number, got {value}")

    def bytes_ms(self, num_bytes: np.ndarray | float) -> np.ndarray | float:
        return num_bytes / (self.bandwidth_gbs * 1e9) * 1e3

    def step_cost(self, plan: RoutingPlan) -> StepCost:
        """Modelled milliseconds of one step carried out as ``plan`` says."""
        stats = plan.stats
        sizes = np.array([len(b) for b in plan.bags], dtype=np.float64)[stats.gpu_bag]
        token_bytes = self.token_dim * self.dtype_bytes
        compute = stats.load_after / self.tflops * 1e3  # per layer, ms
        ulysses = self.bytes_ms(4.0 * (sizes - 1) / sizes * stats.tokens_after * token_bytes)
        layer = float(np.max(compute + ulysses))
        slowest = int(np.argmax(compute + ulysses))
        busiest = float(np.maximum(stats.tokens_sent, stats.tokens_received).max())
        balancing = float(self.bytes_ms(2.0 * busiest * token_bytes))
        return StepCost(
            step_ms=self.layers * layer + balancing,
            compute_ms=self.layers * float(compute[slowest]),
            ulysses_ms=self.layers * float(ulysses[slowest]),
            balancing_ms=balancing,
            unbalanced_ms=self.layers * stats.makespan_before / self.tflops * 1e3,
            imbalance_after=stats.imbalance_after,
            makespan_over_lb=stats.makespan_over_lb,
        )


@dataclass(frozen=True)
class StepCost:
    step_ms: float  # modelled step time with balancing
    compute_ms: float  # compute of the slowest GPU (all layers)
    ulysses_ms: float  # Ulysses all-to-alls of the slowest GPU (all layers)
    balancing_ms: float  # route + reverse_route
    unbalanced_ms: float  # step time with no balancing at all
    imbalance_after: float
    makespan_over_lb: float


@dataclass
class Suggestion:
    """One ranked topology; figures are means over the simulated steps."""

    topology: Topology
    costs: list[StepCost] = field(default_factory=list)

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
    def balancing_ms(self) -> float:
        return self._mean("balancing_ms")

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
        if self.imbalance_after > 1.05:
            if self._mean("makespan_over_lb") < 1.02:
                out.append(
                    f"longest sequences need bigger bags than {self.topology.max_bag_size} "
                    f"GPU(s): load {self.imbalance_after:.2f}x the mean"
                )
            else:
                out.append(f"load stays {self.imbalance_after:.2f}x the mean")
        else:
            out.append(f"balanced ({self.imbalance_after:.3f}x the mean)")
        share = self.ulysses_ms / self.step_ms if self.step_ms else 0.0
        out.append(
            "no Ulysses cost"
            if self.topology.max_bag_size == 1
            else f"Ulysses {share:.0%} of the step"
        )
        if self.balancing_ms > 0.01 * self.step_ms:
            out.append(f"routing {self.balancing_ms / self.step_ms:.0%}")
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
    check_count(num_gpus, MAX_GPUS, "`gpus`", low=1)
    if max_bag <= 0 or max_bag & (max_bag - 1):
        raise OptionError(f"`max_bag` must be a power of two, got {max_bag}")
    check_count(steps, MAX_SIM_STEPS, "`steps`", low=1)
    if seed < 0:
        raise OptionError(f"`seed` must be >= 0 (a seed of numpy's generator), got {seed}")


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


def suggest(
    codes: Sequence[DataCode],
    num_gpus: int,
    max_bag: int = 8,
    steps: int = 4,
    gamma: float = 0.4,
    cost: CostModel | None = None,
    solver: str = DEFAULT_SOLVER,
    seed: int = 0,
    topologies: Sequence[Topology] | None = None,
    on_topology: Callable[[int, int], None] | None = None,
) -> list[Suggestion]:
    """Rank topologies by modelled step time, best first (ties: fewer, smaller bags first).

    Every topology is planned on the same ``steps`` sampled steps. ``on_topology(i, n)``
    reports progress.
    """
    check_options(num_gpus, max_bag, steps, seed)
    cost = cost or CostModel()
    codes = fit_mix(codes, num_gpus)
    candidates = list(topologies) if topologies else enumerate_topologies(num_gpus, max_bag)
    for topo in candidates:
        if topo.num_gpus != num_gpus:
            raise KnapformerError(f"topology {topo} has {topo.num_gpus} GPUs, not {num_gpus}")
    model = WorkloadModel(token_dim=cost.token_dim, gamma=gamma)
    rng = np.random.default_rng(seed)
    batches = [sample_lengths(codes, rng) for _ in range(steps)]
    out = []
    for i, topo in enumerate(candidates):
        suggestion = Suggestion(topo)
        for step, lengths in enumerate(batches):
            plan = plan_routing(lengths, topo, model, solver=solver, step=step)
            suggestion.costs.append(cost.step_cost(plan))
        out.append(suggestion)
        if on_topology is not None:
            on_topology(i + 1, len(candidates))
    out.sort(key=lambda s: (round(s.step_ms, 9), s.topology.max_bag_size, s.topology.bag_sizes))
    return out
