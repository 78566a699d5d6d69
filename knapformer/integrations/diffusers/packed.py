"""What the Flux and Wan forwards share: running a module's own ``__call__`` with a packed
forward, and the tokens of one balanced (or unbalanced) step.

Why through ``__call__``: FSDP2's ``fully_shard`` gathers a module's parameters in a
forward pre-hook and schedules its gradient reduce-scatter from hooks on its outputs;
``torch.distributed._composable.checkpoint`` and diffusers' hooks work the same way.
Calling a block's sub-modules from outside would skip them. So every block (and the
model) gets an instance ``forward`` that runs a packed function when it is handed a
`Packed` and the class's own forward otherwise: ``model(...)`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from knapformer.integrations.attention import attention
from knapformer.runtime.conditioning import gather_sequences, sequence_index
from knapformer.runtime.router import host_to_device

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


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


def sample_of_token(lens: Sequence[int], device: torch.device) -> torch.Tensor:
    """``(sum(lens),)`` int64: the sample each row of a packed batch belongs to, built on
    the host (from ``lens``, never from a device tensor) and queued to ``device``."""
    lens_t = torch.as_tensor(list(lens), dtype=torch.int64)
    return host_to_device(torch.repeat_interleave(torch.arange(len(lens_t)), lens_t), device)


def call(module: nn.Module, fn: Callable[..., Any], *args: Any, checkpointed: bool = False):
    """``fn(module, *args)`` through ``module.__call__`` (its hooks run), optionally under
    non-reentrant activation checkpointing (recomputed in backward, hooks and all)."""
    if checkpointed and torch.is_grad_enabled():
        return checkpoint(module, Packed(fn), *args, use_reentrant=False)
    return module(Packed(fn), *args)


class Tokens:
    """The token rows of one step on this rank and how to reach their sequences.

    Without a balancer the rows are this rank's own packed sequences; with one, the
    chunks `route` brought here. Either way `attend` runs attention within whole
    sequences and `per_sequence` / `index` give the per-sequence rows of the sequences
    held here: a block works the same on both.
    """

    def __init__(self, balancer: SequenceBalancer | None, local_lens: list[int]):
        self.balancer = balancer
        self.local_lens = [int(n) for n in local_lens]

    def route(self, x: torch.Tensor, features: Any) -> tuple[torch.Tensor, Any]:
        """``x (T_local, d)`` and per-token features -> the rows this rank computes."""
        if self.balancer is None:
            self._seq = sample_of_token(self.local_lens, x.device)
            self.chunk_lens = self.local_lens
            return x, features
        self.chunk_lens, x, features = self.balancer.route(x, features)
        self._seq = sequence_index(self.balancer)
        return x, features

    def reverse(self, x: torch.Tensor) -> torch.Tensor:
        """Rows back where `route` took them from: ``(T_local, ...)``."""
        if self.balancer is None:
            return x
        return self.balancer.reverse_route(x)[1]

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``(S_local, ...)`` per-sequence rows -> ``(S_held, ...)``, the
        sequences whose tokens this rank holds (gradients go home)."""
        if self.balancer is not None:
            x = gather_sequences(self.balancer, x)
        return x.index_select(0, self.held)

    @property
    def held(self) -> torch.Tensor:
        """``(S_held,)`` the sequence ids held here, ascending."""
        self._held_and_index()
        return self._held

    @property
    def index(self) -> torch.Tensor:
        """``(T,)`` each row's place in `held`: ``per_sequence(x)[index]`` is per token."""
        self._held_and_index()
        return self._index

    def _held_and_index(self) -> None:
        if not hasattr(self, "_held"):
            self._held, self._index = torch.unique(self._seq, return_inverse=True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Self-attention within whole sequences: ``(T, H, D)`` -> ``(T, H, D)``; with a
        balancer, through the Ulysses exchanges of the bag."""
        if self.balancer is None:
            return attention(q, k, v, self.chunk_lens)
        seq_lens, q, k, v = self.balancer.pre_attn(q, k, v)
        return self.balancer.post_attn(attention(q, k, v, seq_lens))[1]

    def held_lens(self) -> list[int]:
        """Rows of each held sequence (they are contiguous: routed chunks are ordered by
        sequence)."""
        return torch.bincount(self.index, minlength=len(self.held)).tolist()


def modulate(norm_x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """AdaLN's ``norm(x) * (1 + scale) + shift`` with per-token ``scale``, ``shift``."""
    return norm_x * (1 + scale) + shift
