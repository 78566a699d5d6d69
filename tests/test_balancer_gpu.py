"""The CUDA path: NCCL, world size 1, CUDA tensors (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_world_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _worker(rank: int, world: int) -> dict:
    from knapformer.balancer import SequenceBalancer
    from knapformer.local.models import ToyDiT

    torch.cuda.set_device(rank)
    bal = SequenceBalancer("g1n1")
    lens = [0, 7, 130, 1, 64]
    bal.plan_routing(lens, token_dim=64)
    x = torch.randn(sum(lens), 64, device="cuda")
    ids = torch.arange(sum(lens), device="cuda", dtype=torch.int64) + (1 << 60)
    chunk_lens, y, f = bal.route(x, {"ids": ids})
    _, back, fb = bal.reverse_route(y, f)
    torch.manual_seed(0)
    model = ToyDiT(64, 4, 2).cuda()
    out = model(x, lens, balancer=bal)
    out.sum().backward()
    ref = model(x, lens)
    return {
        "device": str(bal.device),
        "y_device": str(y.device),
        "identity": torch.equal(back, x) and torch.equal(fb["ids"], ids),
        "chunk_lens": chunk_lens,
        "model_close": torch.allclose(out, ref, atol=1e-5),
        "grads": all(
            p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()
        ),
        "timings": sorted(bal.timings),
    }


def test_cuda_nccl_world1(tmp_path):
    (res,) = run_world_backend(_worker, 1, tmp_path, "nccl")
    assert res["device"].startswith("cuda") and res["y_device"].startswith("cuda")
    assert res["identity"]
    assert res["chunk_lens"] == [7, 130, 1, 64]  # the zero-length sequence has no chunk
    assert res["model_close"] and res["grads"]
    assert res["timings"] == ["plan", "reverse_route", "route"]
