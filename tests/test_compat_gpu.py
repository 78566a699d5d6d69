"""knapformer.compat on the CUDA path: NCCL, world size 1, CUDA tensors (skipped without
CUDA; ``make gpu-check`` runs it with the other ``tests/test_*_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from knapformer.compat import SequenceBalancer
from knapformer.testing.dist_helpers import run_world_backend


def _cuda_worker(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    bal = SequenceBalancer("g1n1")
    lens = [7, 130, 1, 64]
    bal.plan_routing(lens, 64)
    _, y, _ = bal.route(torch.randn(sum(lens), 64, device="cuda"))
    q = torch.randn(y.shape[0], 4, 16, device="cuda")
    attn_lens, q2, _, _ = bal.pre_attn(q, q, q)
    post_lens, _ = bal.post_attn(q2)
    back_lens, _, _ = bal.reverse_route(y)
    bal.close()
    return {
        name: (str(t.device), t.dtype, t.tolist())
        for name, t in (("attn", attn_lens), ("post", post_lens), ("back", back_lens))
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lengths_follow_cuda_data(tmp_path):
    (res,) = run_world_backend(_cuda_worker, 1, tmp_path, "nccl")
    for name in ("attn", "post", "back"):
        device, dtype, values = res[name]
        assert device.startswith("cuda") and dtype == torch.int32, name
        assert values == [7, 130, 1, 64], name
