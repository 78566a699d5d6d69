"""Balanced diffusers models on CUDA: NCCL at world size 1 (skipped without CUDA).

One rank holds every sample of the 4-rank CPU tests, so each model's capture, packing,
per-sample values, attention hooks and unpatching, FSDP2 on a CUDA mesh, activation
checkpointing, planning ahead (a gloo side group beside NCCL) and bf16 run on the GPU.
Each CUDA variant is compared with the same variant run on the CPU over gloo, which
tests/test_diffusers_models.py holds equal to the unmodified diffusers model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import run_variant
from knapformer.testing.dist_helpers import run_world_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VARIANTS = {
    ("flux", "fsdp2+checkpointing"): {"fsdp": True, "checkpointing": True},
    ("flux", "plan_ahead"): {"plan_ahead": True},
    ("qwen_image", "masks"): {},
    ("hunyuan_video", "masks"): {},
    ("wan", "bf16+fsdp2"): {"bf16": True, "fsdp": True},
}
FP32_TOLERANCE = 1e-4  # relative to the largest value: CUDA's and the CPU's kernels differ
BF16_LIMIT = 0.1  # bf16 against the CPU's bf16 run


def _worker(rank: int, world: int, device: str) -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)
        # cuDNN convolutions (patch embeddings) and matmuls default to TF32, ~1e-3 off.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return {key: run_variant(rank, world, key[0], "g1n1", {**options, "device": device})
            for key, options in VARIANTS.items()}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_models_on_cuda_match_the_cpu_run(tmp_path):
    (cuda,) = run_world_backend(_worker, 1, tmp_path, "nccl", "cuda")
    (cpu,) = run_world_backend(_worker, 1, tmp_path, "gloo", "cpu")
    for key, got in cuda.items():
        want, limit = cpu[key], BF16_LIMIT if "bf16" in key[1] else FP32_TOLERANCE
        for o, w in zip(got["outs"], want["outs"], strict=True):
            assert torch.isfinite(o).all() and _rel(o, w) < limit, f"{key}: outputs differ"
        for param, grad in want["grads"].items():
            worst = _rel(got["grads"][param], grad)
            assert worst < limit, f"{key}: {param}'s gradient differs by {worst:.2e}"
