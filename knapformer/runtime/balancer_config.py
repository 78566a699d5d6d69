"""`BalancerConfig`: every option of a `SequenceBalancer` as one object that checks itself
when it is made, with the per-step topology's options (`AutoTopology`), the link probe's
(`LinkProbeOptions`) and the failure journal's (`JournalOptions`) nested in it.

An invalid config cannot exist: each part raises `KnapformerError` naming the option and
the value from ``__post_init__``. What depends on the process group (the world fitting the
topology, one speed per GPU) is checked by `BalancerConfig.resolve` on every rank, whose
mistake the balancer turns into the same error on every rank
(`knapformer.runtime.agreement`). ``SequenceBalancer(topology, **options)`` with the flat
keywords of earlier versions builds one with `BalancerConfig.from_options`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from knapformer.contract.phases import DERIVED_PHASES
from knapformer.contract.topology import Topology, as_topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel
from knapformer.planning.history import COST_MODELS
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES, allowed_sizes
from knapformer.planning.planner import AUTO, check_solver, check_speed
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.groups import BalanceLayout
from knapformer.runtime.journal import DEFAULT_SIZE
from knapformer.runtime.link_probe import (
    DEFAULT_PROBE_BYTES,
    DEFAULT_PROBE_ROUNDS,
    check_probe_options,
)
from knapformer.runtime.roll_call import ANSWER_S


@dataclass(frozen=True)
class AutoTopology:
    """``topology="auto"``: every step's plan picks aligned groups of ``group_sizes``
    (powers of two, bounded by ``min_group`` / ``max_group``) inside nodes of ``node_size``
    ranks (default: ``comm``'s, 8), across nodes only with ``cross_node``; ``comm`` prices
    communication (a `CommModel` or a cluster name of
    `knapformer.planning.communication.CLUSTERS`; default ``"nvlink"``)."""

    node_size: int | None = None
    group_sizes: tuple[int, ...] = DEFAULT_GROUP_SIZES
    min_group: int | None = None
    max_group: int | None = None
    cross_node: bool = False
    comm: CommModel | str | None = None

    def __post_init__(self) -> None:
        comm = self.comm
        if comm is None or isinstance(comm, str):
            comm = CommModel.cluster(comm or "nvlink")
        elif not isinstance(comm, CommModel):
            raise KnapformerError(
                f"comm must be a CommModel or a cluster name, got {type(comm).__name__}"
            )
        if self.node_size is not None:
            comm = comm.with_(node_size=_whole(self.node_size, "node_size"))
        sizes = tuple(_whole(g, "a group size") for g in self.group_sizes)
        for name in ("min_group", "max_group"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _whole(value, name))
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "cross_node", bool(self.cross_node))

    def planner_kwargs(self) -> dict[str, Any]:
        """`knapformer.planning.planner.plan_routing`'s keywords for a per-step topology."""
        return {
            "comm": self.comm,
            "group_sizes": self.group_sizes,
            "min_group": self.min_group,
            "max_group": self.max_group,
            "cross_node": self.cross_node,
        }

    def sizes(self, world: int) -> tuple[int, ...]:
        """The group sizes allowed on ``world`` ranks (the planner's own rules)."""
        sizes, _ = allowed_sizes(
            world, int(self.comm.node_size), self.group_sizes, self.min_group,
            self.max_group, self.cross_node,
        )  # fmt: skip
        return sizes


@dataclass(frozen=True)
class LinkProbeOptions:
    """The link probe (`knapformer.runtime.link_probe`): every ``every`` steps (0: never),
    ``bytes`` each way per exchange, ``rounds`` rounds per probe."""

    every: int = 0
    bytes: int = DEFAULT_PROBE_BYTES
    rounds: int = DEFAULT_PROBE_ROUNDS

    def __post_init__(self) -> None:
        check_probe_options(self.every, self.bytes, self.rounds)


@dataclass(frozen=True)
class JournalOptions:
    """The step journal and named failures (`knapformer.runtime.roll_call`): ``size``
    entries kept per rank; ``answer_s``, how long a rank whose collective failed waits
    for its peers to say where they are."""

    size: int = DEFAULT_SIZE
    answer_s: float = ANSWER_S

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise KnapformerError(f"journal size must be a whole number >= 1, got {self.size!r}")
        if not (isinstance(self.answer_s, int | float) and 0 < self.answer_s <= 600):
            raise KnapformerError(
                f"answer_s must be a number of seconds in (0, 600], got {self.answer_s!r}"
            )


@dataclass(frozen=True)
class PlannerOptions:
    """The options a plan is made with (the same on every rank). ``topology`` is the
    string ``"auto"`` when ``auto`` holds the options of a per-step partition."""

    topology: Topology | str
    gamma: float
    solver: str
    max_tokens_per_gpu: int | None
    run: str | None
    time_scale: float | None
    fixed_speed: list[float] | None
    auto: AutoTopology | None = None

    def model(self, token_dim: int) -> WorkloadModel:
        if self.time_scale is None:
            return WorkloadModel(token_dim, self.gamma)
        return WorkloadModel(token_dim, self.gamma, self.time_scale, "ms")


@dataclass(frozen=True)
class BalancerConfig:
    """Every option of a `SequenceBalancer` (its docstring says what each does), checked
    when made. ``auto`` must be given (or is made with its defaults) exactly when
    ``topology`` is ``"auto"``."""

    topology: Topology | str
    gamma: float = 0.4
    solver: str = "knapformer"
    max_tokens_per_gpu: int | None = None
    run: str | None = None
    cost_model: str = "modelled"
    gpu_speed: tuple[float, ...] | None = None
    time_scale: float | None = None
    plan_ahead: bool = False
    phases: tuple[str, ...] = ()
    auto: AutoTopology | None = None
    link_probe: LinkProbeOptions = field(default_factory=LinkProbeOptions)
    time_gc: bool = False
    journal: JournalOptions = field(default_factory=JournalOptions)

    def __post_init__(self) -> None:
        is_auto = isinstance(self.topology, str) and self.topology.strip() == AUTO
        if is_auto:
            object.__setattr__(self, "topology", AUTO)
            if self.auto is None:
                object.__setattr__(self, "auto", AutoTopology())
        else:
            if self.auto is not None and self.auto != AutoTopology():
                raise KnapformerError(
                    f"auto-topology options are for topology='auto'; the fixed topology "
                    f"{self.topology} does not use them"
                )
            object.__setattr__(self, "auto", None)
            object.__setattr__(self, "topology", as_topology(self.topology))
        for name, kind in (("auto", AutoTopology), ("link_probe", LinkProbeOptions),
                           ("journal", JournalOptions)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise KnapformerError(f"{name} must be a {kind.__name__}, got {value!r}")
        object.__setattr__(self, "phases", tuple(self.phases))
        if self.gpu_speed is not None:
            object.__setattr__(self, "gpu_speed", tuple(_as_list(self.gpu_speed)))
        self._check()

    def _check(self) -> None:
        check_solver(self.solver, self.max_tokens_per_gpu)
        if self.cost_model not in COST_MODELS:
            raise KnapformerError(
                f"unknown cost_model {self.cost_model!r}; choose one of {', '.join(COST_MODELS)}"
            )
        if self.gpu_speed is not None and self.cost_model == "history":
            raise KnapformerError(
                "gpu_speed is learnt by cost_model='history'; pass one or the other"
            )
        scale = self.time_scale
        if scale is not None and not (isinstance(scale, int | float) and math.isfinite(scale)
                                      and scale > 0):  # fmt: skip
            raise KnapformerError(f"time_scale must be a positive number of ms, got {scale}")
        WorkloadModel(1, self.gamma)  # validates gamma now rather than at the first step
        for phase in self.phases:
            check_added_phase(phase)

    # ----------------------------------------------------------- the old keywords
    @classmethod
    def from_options(cls, topology: Topology | str, **options: Any) -> BalancerConfig:
        """A config from the flat keywords `SequenceBalancer` takes (``node_size`` ...
        ``comm`` for ``"auto"``, ``link_probe_every`` / ``_bytes`` / ``_rounds``)."""
        auto_given = {k: options.pop(k) for k in list(options) if k in _AUTO_DEFAULTS}
        probe = {k.removeprefix("link_probe_"): options.pop(k)
                 for k in list(options) if k.startswith("link_probe_")}  # fmt: skip
        if not (isinstance(topology, str) and topology.strip() == AUTO):
            for name, value in auto_given.items():
                if not _is_default(name, value):
                    raise KnapformerError(
                        f"{name}={value!r} is an option of topology='auto'; the fixed "
                        f"topology {topology} does not use it"
                    )
            auto = None
        else:
            auto = AutoTopology(**auto_given)
        return cls(topology, auto=auto, link_probe=LinkProbeOptions(**probe), **options)

    def flat(self) -> dict[str, Any]:
        """The options under their flat keyword names (what ranks compare, and what a
        message about a difference names)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("auto", "link_probe", "journal", "run", "time_gc")}  # fmt: skip
        auto = self.auto or AutoTopology()
        out |= {name: getattr(auto, name) for name in _AUTO_DEFAULTS}
        if self.auto is None:
            out |= _AUTO_DEFAULTS
        out |= {f"link_probe_{f.name}": getattr(self.link_probe, f.name)
                for f in fields(LinkProbeOptions)}  # fmt: skip
        return out

    # --------------------------------------------------------------- the world
    def resolve(
        self, parent_ranks: tuple[int, ...], rank: int
    ) -> tuple[PlannerOptions, BalanceLayout]:
        """The planner's options and the group layout on ``parent_ranks`` (this process:
        global ``rank``); a `KnapformerError` when the world does not fit."""
        if self.auto is None:
            layout = BalanceLayout(self.topology, parent_ranks, rank)
        else:
            layout = BalanceLayout(None, parent_ranks, rank, self.auto.sizes(len(parent_ranks)))
        speed = None
        if self.gpu_speed is not None:
            checked = check_speed(list(self.gpu_speed), layout.gpus_per_replica)
            speed = None if checked is None else checked.tolist()
        options = PlannerOptions(
            topology=self.topology,
            gamma=float(self.gamma),
            solver=self.solver,
            max_tokens_per_gpu=self.max_tokens_per_gpu,
            run=self.run,
            time_scale=None if self.time_scale is None else float(self.time_scale),
            fixed_speed=speed,
            auto=self.auto,
        )
        return options, layout


#: The flat keywords of `AutoTopology`, and their defaults.
_AUTO_DEFAULTS: Mapping[str, Any] = {
    "node_size": None, "group_sizes": DEFAULT_GROUP_SIZES, "min_group": None,
    "max_group": None, "cross_node": False, "comm": None,
}  # fmt: skip


def _is_default(name: str, value: Any) -> bool:
    default = _AUTO_DEFAULTS[name]
    if name == "group_sizes":
        return isinstance(value, Sequence) and tuple(value) == default
    return value == default


def check_added_phase(phase: str) -> None:
    """A phase a user adds (``phases=``, `SequenceBalancer.add_timing`) may not be one the
    timer derives when a step ends."""
    if phase in DERIVED_PHASES:
        raise KnapformerError(f"phase {phase!r} is derived when a step ends; pick another")


def _whole(value: Any, name: str) -> int:
    """``value`` as a positive int, or a `KnapformerError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise KnapformerError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _as_list(values: Any) -> list:
    if hasattr(values, "tolist"):
        return list(values.tolist())
    try:
        return list(values)
    except TypeError:
        raise KnapformerError(f"gpu_speed must be a sequence of numbers, got {values!r}") from None
