"""The model's own forward on one sample, its blocks stood in for: what enters the
blocks (`capture`), and what the model makes of the blocks' result (`finish`).

Everything a model does before its blocks (patch embedding, RoPE tables, timestep and
prompt embeddings, a text refiner) and after them (output norm, projection, unpatching)
is the model's own code, run at home on one sample at a time as ``model(**sample)``
would. Only the blocks are replaced, by stand-ins that return their inputs:

- `capture` records the arguments of the first call of every block list and stops at
  the tail module (the model's first module after the blocks);
- `finish` runs the forward again and hands the tail module the blocks' final result
  for this sample instead of what the stand-ins passed along.

The real blocks are never called here (they run once per step on the packed tokens), so
their FSDP2 all-gathers happen once per step on every rank, whatever its sample count.
Activation checkpointing is off during these passes (nothing here is worth recomputing).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.declarations import ModelSpec


class _AtTail(Exception):
    """Raised at the tail module to leave the forward once the blocks' inputs are known."""


class _StandIn(nn.Module):
    """Takes a block's place: reports the call, returns the inputs it would update."""

    def __init__(self, signature: inspect.Signature, returns: tuple, report: Callable):
        super().__init__()
        self.signature, self.returns, self.report = signature, returns, report

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop(next(iter(self.signature.parameters)))  # self
        self.report(values)
        out = tuple(values[n] if n is not None else None for n in self.returns)
        return out[0] if len(out) == 1 else out


def call_block(block: nn.Module, signature: inspect.Signature, values: dict[str, Any]) -> Any:
    """``block`` called with the arguments a stand-in of it recorded (by name; a ``*args``
    of the block's forward goes positionally, as the model passed it)."""
    bound = inspect.BoundArguments(signature, {next(iter(signature.parameters)): block, **values})
    return block(*bound.args[1:], **bound.kwargs)


def block_signature(model: nn.Module, name: str) -> inspect.Signature:
    """The signature of ``model.<name>[0]``'s forward (the class's, unwrapped)."""
    block = model.get_submodule(name)[0]
    block = getattr(block, "_checkpoint_wrapped_module", block)
    return inspect.signature(type(block).forward)


@contextmanager
def _stood_in(model: nn.Module, spec: ModelSpec, report: Callable) -> Iterator[None]:
    saved = {b.name: model.get_submodule(b.name) for b in spec.blocks}
    checkpointing = getattr(model, "gradient_checkpointing", False)
    try:
        for i, b in enumerate(spec.blocks):
            sig = block_signature(model, b.name)

            def tell(values, i=i):
                report(i, values)

            standins = [_StandIn(sig, b.returns, tell) for _ in saved[b.name]]
            setattr(model, b.name, nn.ModuleList(standins))
        if checkpointing:
            model.gradient_checkpointing = False
        yield
    finally:
        for name, blocks in saved.items():
            setattr(model, name, blocks)
        if checkpointing:
            model.gradient_checkpointing = checkpointing


@contextmanager
def _at_tail(model: nn.Module, spec: ModelSpec, hook: Callable) -> Iterator[None]:
    handle = model.get_submodule(spec.tail).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _forward(model: nn.Module, sample: dict[str, Any]) -> Any:
    return type(model).forward(model, **sample)


def capture(model: nn.Module, spec: ModelSpec, sample: dict[str, Any]) -> list[dict[str, Any]]:
    """The arguments of the first call of each block list, for ``sample`` alone."""
    first: dict[int, dict[str, Any]] = {}

    def stop(module, args, kwargs):
        raise _AtTail

    record = lambda i, values: first.setdefault(i, values)  # noqa: E731
    with _stood_in(model, spec, record), _at_tail(model, spec, stop):
        try:
            _forward(model, sample)
        except _AtTail:
            pass
        else:
            raise KnapformerError(
                f"{type(model).__name__}'s forward returned without calling its "
                f"declared tail module {spec.tail!r}"
            )
    missing = [b.name for i, b in enumerate(spec.blocks) if i not in first]
    if missing:
        raise KnapformerError(f"{type(model).__name__}'s forward did not call {missing[0]}")
    return [first[i] for i in range(len(spec.blocks))]


def finish(model: nn.Module, spec: ModelSpec, sample: dict[str, Any], final: torch.Tensor):
    """The model's output for ``sample`` when its blocks leave ``final`` (the declared
    output stream, ``(1, L, D)``): ``.sample`` of its output (or its first element)."""

    def hand_over(module, args, kwargs):
        given = args[0] if args else kwargs["hidden_states"]
        if given.shape != final.shape:
            raise KnapformerError(
                f"{type(model).__name__}.{spec.tail} reads {tuple(given.shape)}, but the "
                f"blocks' {spec.output} stream of this sample is {tuple(final.shape)}"
            )
        value = final.to(given.dtype)
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    with _stood_in(model, spec, lambda i, values: None), _at_tail(model, spec, hand_over):
        out = _forward(model, sample)
    return out.sample if hasattr(out, "sample") else out[0]
