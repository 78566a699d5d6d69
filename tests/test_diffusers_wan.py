"""diffusers' WanTransformer3DModel trained through the balancer on real gloo groups.

Videos of mixed sizes (rank 0 much heavier, ranks without any), prompts of mixed
lengths zero-padded to one length as the Wan pipeline pads them; the workers
(knapformer/testing/diffusers_worlds.py, one world per world size shared with the Flux
test) send back outputs and all-reduced gradients, compared here with the unmodified
model run on each sample alone, in fp32 and in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import (
    VARIANTS,
    WAN_KEEP,
    cast,
    check_bf16_variants,
    dtype_of,
    trained,
    wan_model,
    wan_samples,
)

TOLERANCE = 1e-5
FLOOR_LIMIT = 0.1  # as in tests/test_diffusers_flux.py


def _reference(world: int, dtype: torch.dtype = torch.float32):
    """Per rank, each video's output ``(4, F, H, W)``; the gradients; both as fp32."""
    model = wan_model(dtype)
    outs, loss = [], 0
    for mine in cast(wan_samples(world), dtype, WAN_KEEP):
        per = []
        for lat, t, text, w in mine:
            o = model(hidden_states=lat[None], timestep=t[None],
                      encoder_hidden_states=text[None]).sample[0]  # fmt: skip
            loss = loss + (o * w).sum()
            per.append(o.detach().float())
        outs.append(per)
    loss.backward()
    return outs, {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _worst(outs, grads, reference) -> tuple[float, float]:
    """Worst relative difference of outputs (videos per rank) and of gradients (one dict
    per rank) from ``reference = (videos per rank, gradients)``."""
    ref_outs, ref_grads = reference
    worst_out = max(
        (_rel(o, ref) for mine, refs in zip(outs, ref_outs, strict=True)
         for o, ref in zip(mine, refs, strict=True)),
        default=0.0,
    )  # fmt: skip
    worst_grad = max(_rel(g[p], r) for g in grads for p, r in ref_grads.items())
    return worst_out, worst_grad


def _of(results, name: str):
    return [r[name]["outs"] for r in results], [r[name]["grads"] for r in results]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 8])
def test_wan_balanced_equals_diffusers(world, tmp_path_factory):
    results = [r["wan"] for r in trained(world, tmp_path_factory.getbasetemp())]
    reference = _reference(world)
    assert any(not refs for refs in reference[0])  # a rank holds no video
    for name, (_, options) in VARIANTS[world]["wan"].items():
        if dtype_of(options) != torch.float32:
            continue
        worst_out, worst_grad = _worst(*_of(results, name), reference)
        if options.get("broken"):
            assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
            continue
        assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
        assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"


@pytest.mark.timeout(300)
def test_wan_bf16_balanced_within_noise_floor(tmp_path_factory):
    """As the Flux bf16 test: balanced bf16 no further from the unmodified model in bf16
    than bf16 is from fp32, and the broken copy further."""
    results = [r["wan"] for r in trained(4, tmp_path_factory.getbasetemp())]
    bf16 = _reference(4, torch.bfloat16)
    out_floor, grad_floor = _worst(bf16[0], [bf16[1]], _reference(4))
    assert max(out_floor, grad_floor) < FLOOR_LIMIT, (out_floor, grad_floor)
    worst_of = lambda name: _worst(*_of(results, name), bf16)  # noqa: E731
    assert check_bf16_variants(VARIANTS[4]["wan"], worst_of, (out_floor, grad_floor))
