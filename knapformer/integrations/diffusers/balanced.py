"""`balance(model)`: a diffusers transformer trained through the balancer, from its
declaration (`knapformer.integrations.diffusers.models`).

``balance(model)(samples, balancer)`` takes this rank's samples, each the keyword
arguments ``model(**sample)`` takes for that sample alone (a batch of one), plans the
step over the tokens of every rank's samples, runs every block of the model once on
the tokens the plan gives this rank, and returns what ``model(**sample).sample`` returns
for each sample. ``model`` keeps its own modules and weights; ``model(...)`` is
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import register_pytree_node

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.attention_hooks import install as install_attention_hooks
from knapformer.integrations.diffusers.ddp import DdpGuard
from knapformer.integrations.diffusers.declarations import ModelSpec, spec_for
from knapformer.integrations.diffusers.layouts import StepLayouts
from knapformer.integrations.diffusers.models import SPECS
from knapformer.integrations.diffusers.packed import call, install
from knapformer.integrations.diffusers.step import (
    agree,
    held_values,
    home_rows,
    local_placement,
    local_tensors,
    placement,
    prepare,
    run_blocks,
    sample_outputs,
)

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


@dataclass
class BalancedOutputs:
    """Each sample's output (``model(**sample).sample``), in sample order: iterate it or
    index it like a list. ``anchor``: a zero joined to every parameter of the model, so
    that a loss built on it reaches them all (also on a rank without samples).

    A dataclass, so that FSDP2 (which walks dataclass fields for output tensors) sees the
    anchor: on a rank without samples its root pre-backward hook must fire first thing
    in backward, as on every other rank, or their all-gathers would come in different
    orders; DDP walks it by pytree (registered below)."""

    samples: list[torch.Tensor]
    anchor: torch.Tensor

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.samples[i]

    def sum(self, loss: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``sum(loss(i, out_i)) + anchor``: a scalar in the graph, also with no sample."""
        total = self.anchor
        for i, out in enumerate(self.samples):
            total = total + loss(i, out)
        return total


register_pytree_node(
    BalancedOutputs,
    lambda o: ([*o.samples, o.anchor], None),
    lambda children, _: BalancedOutputs(list(children[:-1]), children[-1]),
)


class BalancedModel(nn.Module):
    """The balanced forward of a declared diffusers transformer (module docstring)."""

    def __init__(self, model: nn.Module, spec: ModelSpec | None = None):
        super().__init__()
        self.spec = spec if spec is not None else spec_for(model, SPECS)
        self.spec.check(model)
        self.model = model
        install(model)
        install_attention_hooks(model)
        self._ddp = DdpGuard(model)

    def forward(
        self, samples: Sequence[dict[str, Any]], balancer: SequenceBalancer | None = None,
        plan: bool = True,
    ) -> BalancedOutputs:  # fmt: skip
        """``samples``: this rank's, each ``model(**sample)``'s arguments for one sample.
        With ``balancer``, plans the step (``plan_routing``, collective) unless ``plan``
        is False (then the plan of this step must already be made, for `seq_lens`);
        without, runs this rank's samples where they are."""
        self._ddp.check(balancer)
        samples = [dict(s) for s in samples]
        return call(self.model, _packed, self.spec, samples, balancer, plan)

    @torch.no_grad()
    def seq_lens(self, samples: Sequence[dict[str, Any]]) -> list[int]:
        """Tokens of each sample's joint sequence (what the step plans with; for
        ``balancer.prefetch``). Runs the model's code before the blocks."""
        prepared, _ = call(self.model, _prepared, self.spec, [dict(s) for s in samples])
        return [int(p.joint.shape[0]) for p in prepared]


def balance(model: nn.Module) -> BalancedModel:
    """``model``'s balanced forward; refuses a class without a declaration by name."""
    return BalancedModel(model)


def _prepared(model, spec, samples):
    return prepare(model, spec, samples)


def _packed(model, spec: ModelSpec, samples, balancer, plan: bool) -> BalancedOutputs:
    """The step, inside ``model.__call__`` (its FSDP2 and DDP hooks fire once)."""
    prepared, signature = prepare(model, spec, samples)
    lengths = [p.lengths for p in prepared]
    device = next(model.parameters()).device
    if balancer is None:
        if signature is None:
            return BalancedOutputs([], _anchor(model, spec))
        facts = local_placement(lengths)
    else:
        signature, by_rank = agree(balancer, spec, signature, lengths)
        seq_lens = [sum(x) for x in lengths]
        if plan:
            balancer.plan_routing(seq_lens, signature.width)
        elif balancer.tables is None or list(balancer.tables.local_lens) != seq_lens:
            planned = None if balancer.tables is None else list(balancer.tables.local_lens)
            raise KnapformerError(
                f"this step's plan was made for {planned} tokens per sample, the samples "
                f"have {seq_lens}: call plan_routing with the batch's seq_lens first"
            )
        facts = placement(balancer, by_rank)
    row_stream, row_sample, held, sequences = facts
    x, features, values = local_tensors(prepared, signature, device)
    if balancer is not None:
        _, x, features = balancer.route(x, features)
        # Routed with the tokens, features come out requiring grad; a model may write
        # into a tensor it multiplied by one (CogVideoX's in-place RoPE), so detach
        # those that did not need it at home.
        needs = [need for *_, need in signature.features]
        features = [f if need else f.detach() for f, need in zip(features, needs, strict=True)]
    layouts = StepLayouts(spec.streams, row_stream, row_sample, device, balancer, sequences)
    finals = run_blocks(model, spec, layouts, x, features, held_values(balancer, values, held),
                        signature)  # fmt: skip
    home = home_rows(balancer, layouts, finals, spec)
    outputs = sample_outputs(model, spec, samples, prepared, home)
    anchor = _anchor(model, spec) + home.sum() * 0
    return BalancedOutputs(outputs, anchor)


def _anchor(model: nn.Module, spec: ModelSpec) -> torch.Tensor:
    """A zero joined to every parameter outside the blocks (the blocks run on every rank,
    so theirs are joined already)."""
    blocks = tuple(f"{b.name}." for b in spec.blocks)
    total = None
    for name, p in model.named_parameters():
        if p.requires_grad and not name.startswith(blocks):
            part = p.reshape(-1)[:1].sum() * 0
            total = part if total is None else total + part
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return total
