"""diffusers' FluxTransformer2DModel trained through the balancer on real gloo groups.

The workers (knapformer/testing/diffusers_worlds.py) run every variant (bags, replicas,
activation checkpointing, FSDP2, plan-ahead, bf16, and a deliberately broken
integration) in one world per world size, shared with the Wan test; they send back their
outputs and all-reduced gradients, and the assertions compare them here with the
unmodified diffusers model run on each sample alone, in this process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import (
    VARIANTS,
    cast,
    check_bf16_variants,
    dtype_of,
    flux_model,
    flux_samples,
    trained,
)

TOLERANCE = 1e-5  # relative to the largest value, fp32
# bf16: the balanced run may differ from the unbalanced bf16 run by at most the bf16 noise
# floor (the unbalanced bf16 run against fp32, measured here), which must itself be small.
FLOOR_LIMIT = 0.1


def _reference(world: int, dtype: torch.dtype = torch.float32):
    """The unmodified diffusers model on each sample alone, in ``dtype``: outputs per rank
    ``(T_img, 8)`` and gradients, both as fp32."""
    model = flux_model(dtype)
    outs = []
    loss = 0
    for per_rank in cast(flux_samples(world), dtype):
        mine = []
        for img, txt, pooled, t, iid, tid, w in per_rank:
            o = model(hidden_states=img[None], encoder_hidden_states=txt[None],
                      pooled_projections=pooled[None], timestep=t[None], img_ids=iid,
                      txt_ids=tid).sample[0]  # fmt: skip
            loss = loss + (o * w).sum()
            mine.append(o.detach().float())
        outs.append(torch.cat(mine) if mine else torch.zeros(0, 8))
    loss.backward()
    return outs, {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def _worst(outs, grads, reference) -> tuple[float, float]:
    """Worst relative difference of outputs (per rank) and of gradients (one dict per
    rank) from ``reference = (outputs per rank, gradients)``."""
    ref_out, ref_grads = reference
    worst_out = max(_rel(o, r) for o, r in zip(outs, ref_out, strict=True))
    worst_grad = max(_rel(g[p], r) for g in grads for p, r in ref_grads.items())
    return worst_out, worst_grad


def _of(results, name: str):
    return [r[name]["out"] for r in results], [r[name]["grads"] for r in results]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 8])
def test_flux_balanced_equals_diffusers(world, tmp_path_factory):
    results = [r["flux"] for r in trained(world, tmp_path_factory.getbasetemp())]
    reference = _reference(world)
    for name, (_, options) in VARIANTS[world]["flux"].items():
        if dtype_of(options) != torch.float32:
            continue
        worst_out, worst_grad = _worst(*_of(results, name), reference)
        if options.get("broken"):
            assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
            continue
        assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
        assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"
        assert any(r[name]["text_only"] for r in results), f"{name}: no chunk held text only"
    # a rank held no sample and another far more tokens than the rest
    assert any(not out.numel() for out in reference[0])


@pytest.mark.timeout(300)
def test_flux_bf16_balanced_within_noise_floor(tmp_path_factory):
    """bf16 balanced vs the unmodified model in bf16, unbalanced: no further from it than
    bf16 itself is from fp32 (outputs and gradients each), and the broken copy is."""
    results = [r["flux"] for r in trained(4, tmp_path_factory.getbasetemp())]
    bf16 = _reference(4, torch.bfloat16)
    out_floor, grad_floor = _worst(bf16[0], [bf16[1]], _reference(4))
    assert max(out_floor, grad_floor) < FLOOR_LIMIT, (out_floor, grad_floor)
    worst_of = lambda name: _worst(*_of(results, name), bf16)  # noqa: E731
    assert check_bf16_variants(VARIANTS[4]["flux"], worst_of, (out_floor, grad_floor))
