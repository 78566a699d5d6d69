"""diffusers' Flux and Wan balanced on CUDA: NCCL at world size 1 (skipped without CUDA).

One rank holds every sample of the 4-rank CPU tests, so the adapters' packing, RoPE,
conditioning and un-patching, FSDP2 on a CUDA mesh, activation checkpointing, planning
ahead (a gloo side group beside NCCL) and the host-side row-layout check all run on the
GPU. Each CUDA variant is compared with the same variant run on the CPU over gloo, which
tests/test_diffusers_flux.py and tests/test_diffusers_wan.py hold equal to the unmodified
diffusers model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import run_flux_variant, run_wan_variant
from knapformer.testing.dist_helpers import run_world_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VARIANTS = {
    "fsdp2+checkpointing": {"fsdp": True, "checkpointing": True},
    "plan_ahead": {"plan_ahead": True},
    "bf16+fsdp2": {"bf16": True, "fsdp": True},
}
FP32_TOLERANCE = 1e-4  # relative to the largest value: CUDA's and the CPU's kernels differ
BF16_LIMIT = 0.1  # bf16 against fp32, as the CPU tests' noise-floor limit


def _worker(rank: int, world: int, device: str) -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)
        # cuDNN convolutions (Wan's patch embedding) default to TF32, ~1e-3 off fp32.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    runs = {"flux": run_flux_variant, "wan": run_wan_variant}
    return {
        (model, name): run(rank, world, "g1n1", {**options, "device": device})
        for model, run in runs.items()
        for name, options in VARIANTS.items()
    }


def _outputs(result: dict) -> torch.Tensor:
    outs = result["out"] if "out" in result else torch.cat([o.flatten() for o in result["outs"]])
    return outs.float().flatten()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_flux_and_wan_on_cuda_match_the_cpu_run(tmp_path):
    (cuda,) = run_world_backend(_worker, 1, tmp_path, "nccl", "cuda")
    (cpu,) = run_world_backend(_worker, 1, tmp_path, "gloo", "cpu")
    for (model, name), got in cuda.items():
        want = cpu[(model, "fsdp2+checkpointing")] if "bf16" in name else cpu[(model, name)]
        limit = BF16_LIMIT if "bf16" in name else FP32_TOLERANCE
        assert _outputs(got).numel() > 0 and torch.isfinite(_outputs(got)).all()
        worst = _rel(_outputs(got), _outputs(want))
        assert worst < limit, f"{model} {name}: outputs differ by {worst:.2e} from the CPU run"
        for param, grad in want["grads"].items():
            worst = _rel(got["grads"][param], grad)
            assert worst < limit, f"{model} {name}: {param}'s gradient differs by {worst:.2e}"
