"""What a diffusers transformer declares to be balanced (`ModelSpec`), and the lookup of a
model's declaration by its class, which refuses a class it has none for by name.

diffusers' ``_cp_plan`` says where sequence tensors enter and leave a model for its own
context parallelism; what it leaves unsaid, and a declaration says, is what a sample is
made of when samples of different sizes share a rank:

- ``streams``: the token streams of one sample (``("text", "image")``), in the order the
  model joins them for joint attention; one sample is one sequence of them;
- ``blocks``: the block lists in the order the forward runs them, which block argument
  carries which stream (or `JOINT`, the streams joined), and which arguments the block
  returns new values of;
- ``tokens``: block arguments with a row per token (rotary tables), `Tok` per tensor;
- ``masks``: block arguments that mask padded rows of a stream: those rows are left out
  (their keys are masked for every query, and nothing else reads them);
- ``tail``: the model's first module after the blocks (it reads ``output``).

Every other tensor a block takes is the sample's own (timestep embedding, modulation,
a prompt for cross-attention) and becomes a `PerSample`; every other value must be the
same for every sample, unless ``ignored``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from knapformer.errors import KnapformerError

JOINT = "joint"  # every stream of the sample, joined in the declared order


@dataclass(frozen=True)
class Tok:
    """A block argument (or one tensor of it) with one row per token of ``stream`` (or of
    `JOINT`) along ``axis``."""

    stream: str
    axis: int = 0


@dataclass(frozen=True)
class Blocks:
    """One list of blocks: ``model.<name>``, its stream arguments, and the arguments
    whose new values it returns (in order; None for a value that is not kept)."""

    name: str
    streams: dict[str, str]
    returns: tuple[str | None, ...]


@dataclass(frozen=True)
class ModelSpec:
    """A model's declaration (module docstring)."""

    streams: tuple[str, ...]
    blocks: tuple[Blocks, ...]
    tokens: dict[str, Tok | tuple[Tok, ...]] = field(default_factory=dict)
    masks: dict[str, Tok] = field(default_factory=dict)
    tail: str = "norm_out"
    output: str = "image"
    ignored: tuple[str, ...] = ()

    def check(self, model: Any) -> None:
        """A `KnapformerError` naming the first declared part ``model`` lacks."""
        name = class_name(model)
        for part in [b.name for b in self.blocks] + [self.tail]:
            try:
                model.get_submodule(part)
            except AttributeError:
                raise KnapformerError(
                    f"{name}.{part} is missing: the declaration was written against "
                    "diffusers >=0.42,<0.43; check the installed version"
                ) from None


def class_name(model: Any) -> str:
    """The model's own class name (FSDP2's ``fully_shard`` swaps in a subclass,
    ``FSDP<name>``; a subclass of a declared class is not the declared class)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def spec_for(model: Any, specs: dict[str, ModelSpec]) -> ModelSpec:
    """``specs[class_name(model)]``, checked against ``model``; a class without a
    declaration raises `KnapformerError` naming it and the supported ones."""
    name = class_name(model)
    if name not in specs:
        raise KnapformerError(
            f"{name} is not supported: knapformer balances {', '.join(sorted(specs))}. "
            "Another model needs a declaration (docs/diffusers.md, 'Adding a model')"
        )
    spec = specs[name]
    spec.check(model)
    return spec
