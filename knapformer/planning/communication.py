"""What a step's communication costs, in the workload's own unit (docs/concepts.md,
"Communication and the layout floor").

A workload is the forward FLOPs of one transformer layer in TFLOP (times the model's
``scale``), so communication is charged per layer, forward, in the same unit: bytes cross
a link in ``bytes / bandwidth`` seconds, during which the GPU could have computed
``seconds * tflops`` TFLOP. With ``b`` bytes per value and token dimension ``d``:

- Ulysses, per attention layer: a GPU of a g-GPU group holding c tokens sends q, k, v
  before attention and receives the output after, ``4*c*d*b*(g-1)/g`` bytes leaving it
  (as many arrive, on the other direction of a full-duplex link); g = 1 exchanges nothing.
  Of its g-1 peers, those in its node are reached over the node's link (``intra_gbs``),
  the others over the network (``inter_gbs``); both run at once, so the slower share
  decides.
- route + reverse route, once per step: a GPU sends its moved-away tokens on route and
  the tokens it received back on reverse route, ``d*b`` bytes each, split the same way
  between node and network; per layer that is divided by ``layers``.

Nodes are runs of ``node_size`` consecutive GPUs of the balance group (positions in
``plan.gpus``). Defaults are nominal starting points to calibrate (`CLUSTERS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.errors import KnapformerError

DEFAULT_LAYERS = 57  # FLUX-like: 19 double + 38 single blocks
#: Nominal figures per GPU (bf16, H100-class: ~400 TFLOP/s achieved). "nvlink": an NVLink
#: node (~300 GB/s) with InfiniBand NDR between nodes (~50 GB/s); "infiniband": every
#: exchange at network speed (~50 GB/s, e.g. nodes without NVLink); "pcie": PCIe Gen4
#: (~25 GB/s) inside the node and out of it.
CLUSTERS: dict[str, dict[str, float]] = {
    "nvlink": {"intra_gbs": 300.0, "inter_gbs": 50.0},
    "infiniband": {"intra_gbs": 50.0, "inter_gbs": 50.0},
    "pcie": {"intra_gbs": 25.0, "inter_gbs": 25.0},
}
DEFAULT_CLUSTER = "nvlink"


@dataclass(frozen=True)
class CommModel:
    """Hardware figures that turn bytes into workload units (see module doc)."""

    tflops: float = 400.0  # achieved TFLOP/s of one GPU
    intra_gbs: float = CLUSTERS[DEFAULT_CLUSTER]["intra_gbs"]  # GB/s per GPU inside a node
    inter_gbs: float = CLUSTERS[DEFAULT_CLUSTER]["inter_gbs"]  # GB/s per GPU across nodes
    node_size: int = 8  # GPUs per node
    layers: int = DEFAULT_LAYERS
    dtype_bytes: int = 2  # bf16

    def __post_init__(self) -> None:
        for name in ("tflops", "intra_gbs", "inter_gbs", "node_size", "layers", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not np.isfinite(value) or value <= 0:
                raise KnapformerError(f"{name} must be a positive number, got {value!r}")
        for name in ("node_size", "layers", "dtype_bytes"):
            if int(getattr(self, name)) != getattr(self, name):
                raise KnapformerError(f"{name} must be a whole number, got {getattr(self, name)}")

    @classmethod
    def cluster(cls, name: str, **overrides: Any) -> CommModel:
        """The nominal figures of a cluster class (`CLUSTERS`), with ``overrides``."""
        if name not in CLUSTERS:
            raise KnapformerError(f"unknown cluster {name!r}; choose one of {', '.join(CLUSTERS)}")
        return cls(**{**CLUSTERS[name], **overrides})

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> CommModel:
        """The model a plan recorded in ``solver_options["comm"]`` (defaults if absent)."""
        saved = (options or {}).get("comm") or {}
        return cls(**{k: v for k, v in saved.items() if k in cls.__dataclass_fields__})

    def as_options(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> CommModel:
        return replace(self, **changes)

    def work_of(self, seconds: np.ndarray | float, scale: float = 1.0):
        """Workload units a GPU could have computed in ``seconds``."""
        return np.asarray(seconds) * self.tflops * scale

    def ms_of(self, work: np.ndarray | float, scale: float = 1.0):
        """Milliseconds of ``work`` workload units (per layer) at ``tflops``."""
        return np.asarray(work) / (self.tflops * scale) * 1e3

    def transfer_seconds(self, intra_bytes, inter_bytes):
        """Seconds to move bytes over the node link and the network at once."""
        return np.maximum(
            np.asarray(intra_bytes, dtype=np.float64) / (self.intra_gbs * 1e9),
            np.asarray(inter_bytes, dtype=np.float64) / (self.inter_gbs * 1e9),
        )

    def ulysses_per_token(self, token_dim: int, group_size: int, scale: float = 1.0) -> float:
        """Workload units per token a GPU holds in an aligned group of ``group_size`` GPUs,
        for one layer's Ulysses exchanges (0 for a group of one)."""
        g = int(group_size)
        if g <= 1:
            return 0.0
        per_peer = 4.0 * token_dim * self.dtype_bytes / g
        in_node = min(g, int(self.node_size)) - 1  # aligned: a group fills whole nodes
        seconds = self.transfer_seconds(per_peer * in_node, per_peer * (g - 1 - in_node))
        return float(self.work_of(seconds, scale))


@dataclass(frozen=True)
class PlanCost:
    """Per-GPU cost of one plan, per layer, forward, in workload units; each (num_gpus,).

    ``compute`` is the Ulysses-exact compute (`PlanStats.load_after`, the compute-only
    figure); ``ulysses`` and ``route`` the communication. ``load`` adds them up.
    """

    compute: np.ndarray
    ulysses: np.ndarray
    route: np.ndarray
    comm: CommModel
    scale: float

    @property
    def communication(self) -> np.ndarray:
        return self.ulysses + self.route

    @property
    def load(self) -> np.ndarray:
        return self.compute + self.communication

    @property
    def slowest(self) -> int:
        """Position of the GPU every other waits for (lowest position on a tie)."""
        return int(np.argmax(self.load))

    @property
    def makespan(self) -> float:
        return float(self.load.max(initial=0.0))

    @property
    def compute_makespan(self) -> float:
        return float(self.compute.max(initial=0.0))

    def _ms(self, per_layer: float) -> float:
        return float(self.comm.ms_of(per_layer, self.scale)) * self.comm.layers

    @property
    def step_ms(self) -> float:
        """Modelled forward time of the step, all layers: the slowest GPU's load."""
        return self._ms(self.makespan)

    @property
    def compute_ms(self) -> float:
        """The slowest GPU's compute, all layers."""
        return self._ms(float(self.compute[self.slowest]))

    @property
    def comm_ms(self) -> float:
        """The slowest GPU's communication (Ulysses + route), all layers."""
        return self._ms(float(self.communication[self.slowest]))

    @property
    def ulysses_ms(self) -> float:
        return self._ms(float(self.ulysses[self.slowest]))

    @property
    def route_ms(self) -> float:
        return self._ms(float(self.route[self.slowest]))


def plan_cost(plan: RoutingPlan, comm: CommModel | None = None) -> PlanCost:
    """The modelled per-GPU cost of ``plan`` under ``comm`` (default: the model the plan
    recorded, else `CommModel`'s defaults)."""
    comm = comm or CommModel.from_options(plan.solver_options)
    stats = plan.stats
    d = plan.token_dim
    if d is None:
        raise KnapformerError("the plan has no token_dim: its communication cannot be modelled")
    scale = 1.0 if plan.scale is None else float(plan.scale)
    sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    pos = gpu_positions(np.asarray(plan.gpus, dtype=np.int64))
    chunks = plan.chunks
    ulysses, route = communication_loads(
        comm, d, scale, sizes[stats.gpu_bag], stats.tokens_after,
        pos[chunks.src_gpu], pos[chunks.dst_gpu], chunks.length,
    )  # fmt: skip
    return PlanCost(stats.load_after, ulysses, route, comm, scale)


def communication_loads(comm, token_dim, scale, group_size, tokens_after, src, dst, length):
    """Per-GPU communication of one step, per layer, in workload units: (ulysses, route),
    each (num_gpus,). ``group_size``, ``tokens_after`` (num_gpus,): the size of each GPU's
    bag and the tokens it holds after routing; ``src``, ``dst``, ``length`` (num_chunks,):
    each chunk's source and destination GPU positions and tokens. The planner prices its
    candidate partitions with it before a plan exists (`plan_cost` for a plan)."""
    n = len(group_size)
    sizes, size_of = np.unique(np.asarray(group_size), return_inverse=True)
    per_size = np.array([comm.ulysses_per_token(token_dim, int(g), scale) for g in sizes])
    per_token = per_size[size_of] if n else np.zeros(0)
    ulysses = per_token * tokens_after  # a link's speed does not follow the GPU's
    # Chunks that stay weigh nothing (adding 0.0 leaves a bin's running sum as it was).
    moved = np.where(src != dst, np.asarray(length, dtype=np.float64), 0.0)
    across = (src // comm.node_size) != (dst // comm.node_size)
    # Route sends a GPU's moved tokens, reverse route the ones it received: bytes leaving it,
    # binned by GPU over the node link (0..n-1) and over the network (n..2n-1).
    leaving = np.bincount(src + n * across, weights=moved, minlength=2 * n) + np.bincount(
        dst + n * across, weights=moved, minlength=2 * n
    )
    token_bytes = token_dim * comm.dtype_bytes
    seconds = comm.transfer_seconds(leaving[:n] * token_bytes, leaving[n:] * token_bytes)
    route = comm.work_of(seconds, scale) / comm.layers
    return ulysses, route
