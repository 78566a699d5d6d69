"""The reference ToyDiT trains under FSDP2 (fully_shard per block and at the root) with
activation checkpointing on 4 gloo ranks, balanced, one rank holding no sequence: its
outputs and gradients are those of the plain model on every sequence in one process."""

from __future__ import annotations

import pytest
import torch

from knapformer.testing.dist_helpers import run_world

D, HEADS, LAYERS = 32, 4, 2
LENGTHS = [[300, 7, 40], [5], [], [12, 9]]


def _model():
    from knapformer.local.models import ToyDiT

    torch.manual_seed(0)
    return ToyDiT(D, HEADS, LAYERS)


def _data():
    gen = torch.Generator().manual_seed(1)
    total = sum(map(sum, LENGTHS))
    return torch.randn(total, D, generator=gen), torch.randn(total, D, generator=gen)


def _worker(rank: int, world: int) -> dict:
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from knapformer.runtime.balancer import SequenceBalancer

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        checkpoint(block)  # recomputed in backward, Ulysses exchanges included
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    bal = SequenceBalancer("g1n2+g2n1")
    x, w = _data()
    start = sum(map(sum, LENGTHS[:rank]))
    rows = slice(start, start + sum(LENGTHS[rank]))
    bal.plan_routing(LENGTHS[rank], D)
    out = model(x[rows], LENGTHS[rank], balancer=bal)
    (out * w[rows]).sum().backward()
    grads = {n: p.grad.full_tensor() * world for n, p in model.named_parameters()}
    bal.close()
    return {"out": out.detach(), "grads": grads}


@pytest.mark.timeout(180)
def test_toy_dit_under_fsdp2_and_checkpointing(tmp_path):
    results = run_world(_worker, 4, tmp_path)
    model = _model()
    x, w = _data()
    ref = model(x, [n for per in LENGTHS for n in per])
    (ref * w).sum().backward()
    got = torch.cat([r["out"] for r in results])
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        for rank, r in enumerate(results):
            torch.testing.assert_close(
                r["grads"][name], p.grad, rtol=1e-5, atol=1e-5, msg=f"{name} on rank {rank}"
            )
