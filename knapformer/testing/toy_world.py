"""The reference ToyDiT and its data as the balancer's exactness tests build them: every
rank (and the unbalanced reference) makes the same model and the same tokens from fixed
seeds, in float64 so that a balanced run can be compared tightly."""

from __future__ import annotations

import torch

D_MODEL, HEADS, LAYERS = 32, 8, 2


def toy_model() -> torch.nn.Module:
    """The ToyDiT every rank builds alike (seed 0), in float64."""
    from knapformer.local.models import ToyDiT

    torch.manual_seed(0)
    return ToyDiT(D_MODEL, HEADS, LAYERS).double()


def toy_data(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D_MODEL) inputs and (T, D_MODEL) loss weights for every token of ``lengths``
    (sequence lengths per rank), T their total: the same on every rank (seed 1)."""
    total = sum(sum(x) for x in lengths)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(total, D_MODEL, generator=gen, dtype=torch.float64)
    return x, torch.randn(total, D_MODEL, generator=gen, dtype=torch.float64)


def toy_reference(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, every sequence of ``lengths``, no balancer: the (T, D_MODEL) outputs
    and the flat parameter gradients of the weighted-sum loss a balanced run must match."""
    model = toy_model()
    x, w = toy_data(lengths)
    out = model(x, [n for per in lengths for n in per])
    (out * w).sum().backward()
    return out.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])
