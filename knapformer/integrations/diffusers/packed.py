"""Running a function inside a module's own ``__call__``: how a balanced step runs inside
the model's, so that the hooks on it fire once per step.

FSDP2's ``fully_shard`` gathers a module's parameters in a forward pre-hook and
schedules their gradient reduce-scatter from hooks on its outputs; DDP and diffusers'
hooks work the same way. `install` gives the model an instance ``forward`` that runs a
packed function when it is handed a `Packed`, and the class's own forward otherwise:
``model(...)`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Packed:
    """Marks a call as packed: ``module(Packed(fn), *args)`` runs ``fn(module, *args)``."""

    fn: Callable[..., Any]


def install(module: nn.Module) -> None:
    """Give ``module`` the packed-or-own forward (idempotent; survives FSDP2's class swap,
    which keeps the instance dictionary)."""
    if "_knapformer_dispatch" in module.__dict__:
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], Packed):
            return args[0].fn(module, *args[1:], **kwargs)
        return type(module).forward(module, *args, **kwargs)

    module.forward = forward  # an instance attribute shadows the class's forward
    module._knapformer_dispatch = True


def call(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(module, *args)`` through ``module.__call__`` (its hooks run)."""
    return module(Packed(fn), *args)
