"""What a demo run trains and records: `DemoConfig`, the one declaration of every
``knapformer demo`` option.

Each field carries its default and its help text (``metadata["help"]``); the command line
builds its options from these fields (`knapformer.cli.demo`), and the README's option list
is that command's ``--help``. A `DemoConfig` checks itself when it is made, so a bad value
is refused before any worker starts, with a message naming the option and the value.

Torch-free on purpose: the command line parses and checks options without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from knapformer.contract.limits import MAX_STEP, check_count
from knapformer.contract.runfiles import PLANS_FILE
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError, OptionError
from knapformer.planning.datamix import MIXED8, DataCode, parse_mix
from knapformer.planning.history import COST_MODELS
from knapformer.planning.partitions import allowed_sizes

DEMO_CODES = MIXED8  # the joint mix's data types on 8 GPUs, as in the 8-GPU samples
DEMO_OUT = Path("runs/demo")
HEAD_DIM = 16
LENGTH_SCALE = 1 / 16  # the mix's lengths shrunk so a step takes well under 1 s
MAX_WORLD = 64  # CPU worker processes: beyond this a workstation thrashes
MAX_HEAD_DIM = 256  # the widest heads of real DiTs; the model's d_model is heads x this
MAX_LAYERS = 64
MAX_HEADS = 64  # heads the topology may ask for (a multiple of every bag size)
#: Where an injected slow rank loses its time (`knapformer.local.slowdown`).
SLOW_KINDS = ("gpu", "host", "gc", "input", "link")
MAX_SEED = 2**63 - 1  # numpy's seed sequence takes non-negative ints, torch's 64-bit ones
#: What an injected fault does (`knapformer.local.faults`), and where in a step it strikes.
FAIL_KINDS = ("raise", "stall", "kill", "shape")
FAIL_PHASES = (
    "plan", "plan_ahead", "probe", "route", "forward", "pre_attn", "post_attn",
    "reverse_route", "gather_sequences", "allreduce",
)  # fmt: skip
#: Where a ``shape`` fault can give a tensor of the wrong shape.
SHAPE_PHASES = ("route", "pre_attn", "post_attn", "gather_sequences")
MAX_GROUP_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` does ``kind`` (`FAIL_KINDS`) at step ``step``, in ``phase``
    (`FAIL_PHASES`); checked when made."""

    rank: int
    kind: str = "raise"
    step: int = 3
    phase: str = "forward"

    def __post_init__(self) -> None:
        check_choice("fail_kind", self.kind, FAIL_KINDS)
        check_choice("fail_phase", self.phase, FAIL_PHASES)
        if self.kind == "shape" and self.phase not in SHAPE_PHASES:
            raise OptionError(
                f"`fail_kind` shape gives a tensor of another shape in {', '.join(SHAPE_PHASES)}, "
                f"not in {self.phase}"
            )
        check_count(self.step, MAX_STEP, "`fail_step`")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """An `OptionError` naming option ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise OptionError(f"unknown `{name}` {value!r}; choose one of {', '.join(choices)}")


def _option(default: Any, help: str, shown: str | None = None) -> Any:
    """A field with its default and its command-line help (``shown``: how ``--help``
    shows a default too long to print)."""
    return field(default=default, metadata={"help": help, "shown": shown})


@dataclass(frozen=True)
class DemoConfig:
    """What to train and where to record. ``steps=0`` trains until stopped.

    Frozen and checked in ``__post_init__``: an invalid config cannot exist.
    """

    steps: int = _option(200, "training steps; 0 trains until Ctrl-C")
    world_size: int = _option(8, "worker processes (CPU, gloo)")
    topology: str | None = _option(
        None,
        "compute bags, e.g. g1n2+g2n1+g4n1 (default: bags of 1, 1, 2, 4, ... GPUs, the "
        "largest one the largest power of two below --world-size; 6 gives g1n2+g4n1), or "
        "auto: every step's plan chooses them (aligned groups of 1, 2, 4, 8 GPUs inside a "
        "node of --node-size ranks)",
    )
    node_size: int = _option(
        8, "--topology auto: ranks per node (a power of two); a step's groups stay inside one"
    )
    data_codes: str = _option(
        DEMO_CODES,
        "data mix: a name (joint, mixres, lowres) or codes gGbBiIfFsS,...",
        shown="the joint mix's data types on 8 GPUs",
    )
    out: Path = _option(DEMO_OUT, f"directory for {PLANS_FILE}")  # noqa: RUF009 (immutable)
    record: bool = _option(
        True, "record the run: every step in the run store, full plans as --every says"
    )
    every: int = _option(
        1,
        "keep every k-th step's full plan (plus the steps a reader must open in full: "
        "imbalanced, or a rank 1.3x slow); the run store keeps every step",
    )
    segment_steps: int = _option(
        64, "close a run store segment (readable, safe from a crash) every k steps"
    )
    length_scale: float = _option(
        LENGTH_SCALE,
        "the data mix's sequence lengths times this, at most 1 (small: a step takes well "
        "under 1 s)",
    )
    n_layers: int = _option(2, "transformer blocks of the model")
    head_dim: int = _option(
        HEAD_DIM,
        "width of an attention head, even, at most 256; larger: more compute per token "
        "(d_model = heads x head_dim; bench/stragglers.py uses 64)",
    )
    lr: float = _option(2e-3, "AdamW learning rate")
    seed: int = _option(0, "seed of the weights and the data (the same on every rank)")
    run: str = _option("demo", "run name recorded in every plan")
    slow_rank: int | None = _option(
        None, "make this rank --slow-factor times slower, in the way --slow-kind says"
    )
    slow_factor: float = _option(
        2.0, "how much slower --slow-rank is (it loses F-1 times its compute every step)"
    )
    slow_kind: str = _option(
        "gpu",
        "where --slow-rank loses its time: gpu (its compute), host (CPU work outside the "
        "compute), gc (garbage collections), input (its next batch comes late), link (its "
        "token exchanges)",
    )
    link_probe_every: int = _option(
        2,
        "time a short exchange between pairs of ranks every k-th step (0: never), so that "
        "`knapformer stragglers` can name a rank whose link is slow (on 8 CPU workers a "
        "probe takes about a fifth of a step)",
    )
    cost_model: str = _option(
        "modelled",
        "modelled: the workload model; history: also learn each GPU's speed from its "
        "measured compute",
    )
    plan_ahead: bool = _option(False, "gather and plan each next step on a side channel")
    fail_rank: int | None = _option(None, "make this rank fail (see --fail-kind)")
    fail_kind: str = _option("raise", "raise, stall, kill or shape")
    fail_step: int = _option(3, "the step --fail-rank fails at")
    fail_phase: str = _option(
        "forward",
        "plan, plan_ahead, probe, route, forward (after route), pre_attn, post_attn, "
        "reverse_route, allreduce",
    )
    group_timeout: float = _option(120.0, "a collective's timeout (s)")
    profile: Path | None = _option(  # noqa: RUF009 (None or an immutable Path)
        None,
        "write a torch.profiler trace of every worker's training loop to this folder (the "
        "balancer's phases show as knapformer.* ranges); merge it with `knapformer trace "
        "RUN --merge DIR`",
    )

    def __post_init__(self) -> None:
        self._check_numbers()
        # Parse the topology (checking the model's heads) and the data mix now.
        _ = self.parsed_topology, self.codes

    def _check_numbers(self) -> None:
        check_count(self.steps, MAX_STEP, "`steps`")  # 0: until Ctrl-C
        check_count(self.world_size, MAX_WORLD, "`world_size`", low=1)  # CPU processes
        check_count(self.every, MAX_STEP, "`every`", low=1)
        check_count(self.segment_steps, MAX_STEP, "`segment_steps`", low=1)
        check_count(self.link_probe_every, MAX_STEP, "`link_probe_every`")
        check_count(self.n_layers, MAX_LAYERS, "`n_layers`", low=1)
        check_count(self.seed, MAX_SEED, "`seed`")
        if not (math.isfinite(self.length_scale) and 0 < self.length_scale <= 1):
            raise OptionError(f"`length_scale` must be a number in (0, 1], got {self.length_scale}")
        if self.head_dim < 2 or self.head_dim % 2 or self.head_dim > MAX_HEAD_DIM:
            raise OptionError(
                f"`head_dim` must be even, >= 2 (RoPE) and <= {MAX_HEAD_DIM}, got {self.head_dim}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise OptionError(f"`lr` must be a positive number, got {self.lr}")
        if self.slow_rank is not None and not 0 <= self.slow_rank < self.world_size:
            raise OptionError(
                f"`slow_rank` {self.slow_rank} is not a rank of the world "
                f"(0..{self.world_size - 1})"
            )
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise OptionError(f"`slow_factor` must be a number >= 1, got {self.slow_factor}")
        check_choice("slow_kind", self.slow_kind, SLOW_KINDS)
        check_choice("cost_model", self.cost_model, COST_MODELS)
        if not self.run.strip():
            raise OptionError("`run` must name the run, got an empty name")
        timeout = self.group_timeout
        if not (math.isfinite(timeout) and 1 <= timeout <= MAX_GROUP_TIMEOUT_S):
            raise OptionError(
                f"`group_timeout` must be a number of seconds in [1, {MAX_GROUP_TIMEOUT_S:g}], "
                f"got {self.group_timeout}"
            )
        if self.fail_rank is not None:
            self._check_fault()

    def _check_fault(self) -> None:
        if not 0 <= self.fail_rank < self.world_size:
            raise OptionError(
                f"`fail_rank` {self.fail_rank} is not a rank of the world "
                f"(0..{self.world_size - 1})"
            )
        fault = self.fault  # checks kind, phase and step
        if fault.phase == "gather_sequences":
            raise OptionError(
                "`fail_phase` gather_sequences: the demo's model has no per-sequence rows"
            )
        if fault.phase == "plan_ahead" and not self.plan_ahead:
            raise OptionError("`fail_phase` plan_ahead needs `plan_ahead`")
        every = self.link_probe_every
        if fault.phase == "probe" and (every == 0 or fault.step % every):
            raise OptionError(
                f"`fail_phase` probe at `fail_step` {fault.step}: the link probe runs every "
                f"{every or 'no'} step(s) (`link_probe_every`)"
            )
        if self.steps and fault.step >= self.steps:
            raise OptionError(f"`fail_step` {fault.step} is beyond the run's {self.steps} steps")

    @cached_property
    def fault(self) -> Fault | None:
        """The injected fault (None: none)."""
        if self.fail_rank is None:
            return None
        return Fault(self.fail_rank, self.fail_kind, self.fail_step, self.fail_phase)

    @property
    def auto(self) -> bool:
        """Whether every step's plan chooses its bags (``--topology auto``)."""
        return self.topology is not None and self.topology.strip() == "auto"

    @cached_property
    def parsed_topology(self) -> Topology | str:
        """The bags (``topology`` or `default_topology`), checked to fit the world and
        to give the model a head count every bag divides; ``"auto"`` for a per-step
        topology (its sizes: `bag_sizes`)."""
        if self.auto:
            _ = self.model_dims  # the heads split across every allowed group size
            return "auto"
        topo = Topology.parse(self.topology or default_topology(self.world_size))
        topo.num_replicas(self.world_size)  # raises when the world does not fit
        model_shape(topo, self.head_dim)
        return topo

    @cached_property
    def bag_sizes(self) -> tuple[int, ...]:
        """Every bag size a step may use, ascending (auto: the allowed group sizes)."""
        if not self.auto:
            return tuple(sorted(set(self.parsed_topology.bag_sizes)))
        try:
            sizes, _ = allowed_sizes(self.world_size, self.node_size)
        except KnapformerError as err:
            raise OptionError(f"--topology auto: {err}") from None
        return sizes

    @cached_property
    def model_dims(self) -> tuple[int, int]:
        """(d_model, n_heads) of the demo's model (`model_shape` of every bag size)."""
        return model_shape(Topology.from_bag_sizes(list(self.bag_sizes)), self.head_dim)

    @cached_property
    def codes(self) -> list[DataCode]:
        """One single-GPU data code per rank (`rank_codes` of the data mix)."""
        return rank_codes(parse_mix(self.data_codes), self.world_size)


def default_topology(world_size: int) -> str:
    """Bags of 1, 1, 2, 4, ... GPUs: the largest bag is the largest power of two below the
    world size, the rest of the ranks are split the same way (8 ranks: ``g1n2+g2n1+g4n1``,
    6: ``g1n2+g4n1``, 12: ``g1n2+g2n1+g8n1``). Every world of 3 or more ranks gets a
    multi-GPU bag, so a long video sequence can be split instead of setting the step time
    on its own; `topology_note` says what a smaller world cannot do."""
    sizes, rest = [], max(int(world_size), 1)
    while rest > 1:
        biggest = 1 << ((rest - 1).bit_length() - 1)  # the largest power of two below rest
        sizes.append(biggest)
        rest -= biggest
    sizes += [1] * rest
    return str(Topology.from_bag_sizes(sizes))


def topology_note(topology: Topology) -> str | None:
    """Why ``topology`` cannot balance the demo's data well, or None when it can."""
    if topology.num_gpus == 1:
        return "one GPU: there is nothing to balance (use --world-size 3 or more)"
    if topology.max_bag_size == 1:
        return (
            "every bag is one GPU: the balancer moves whole sequences but cannot split a "
            "long one, which then sets the step time alone (a multi-GPU bag needs "
            f"--world-size 3 or more, or a --topology with one, e.g. {default_topology(4)})"
        )
    return None


def rank_codes(codes: list[DataCode], world_size: int) -> list[DataCode]:
    """One single-GPU data code per rank, spreading the mix's GPUs evenly over the world
    (a 32-GPU mix on 8 ranks takes every 4th GPU's data; an 8-GPU mix on 16 repeats)."""
    per_gpu = [
        DataCode(1, c.batch, c.resolution, c.frames, c.video) for c in codes for _ in range(c.gpus)
    ]
    return [per_gpu[r * len(per_gpu) // world_size] for r in range(world_size)]


def model_shape(topology: Topology, head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(d_model, n_heads): heads must split evenly across every bag size (Ulysses)."""
    heads = topology.heads_for(4)
    if heads > MAX_HEADS:
        raise KnapformerError(
            f"topology {topology} needs {heads} attention heads (a multiple of every bag "
            "size); use bag sizes with a smaller common multiple"
        )
    return heads * head_dim, heads
