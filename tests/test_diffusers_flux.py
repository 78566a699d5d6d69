"""diffusers' FluxTransformer2DModel trained through the balancer on real gloo groups.

The workers (knapformer/testing/diffusers_worlds.py) run every variant (bags, replicas,
activation checkpointing, FSDP2, plan-ahead, and a deliberately broken integration) in
one world per world size, shared with the Wan test; they send back their outputs and
all-reduced gradients, and the assertions compare them here with the unmodified
diffusers model run on each sample alone, in this process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import VARIANTS, flux_model, flux_samples, trained

TOLERANCE = 1e-5  # relative to the largest value, fp32


def _reference(world: int):
    """The unmodified diffusers model on each sample alone: outputs and gradients."""
    model = flux_model()
    outs = []
    loss = 0
    for per_rank in flux_samples(world):
        mine = []
        for img, txt, pooled, t, iid, tid, w in per_rank:
            o = model(hidden_states=img[None], encoder_hidden_states=txt[None],
                      pooled_projections=pooled[None], timestep=t[None], img_ids=iid,
                      txt_ids=tid).sample[0]  # fmt: skip
            loss = loss + (o * w).sum()
            mine.append(o.detach())
        outs.append(torch.cat(mine) if mine else torch.zeros(0, 8))
    loss.backward()
    return outs, {n: p.grad for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 8])
def test_flux_balanced_equals_diffusers(world, tmp_path_factory):
    results = [r["flux"] for r in trained(world, tmp_path_factory.getbasetemp())]
    ref_out, ref_grads = _reference(world)
    for name in VARIANTS[world]["flux"]:
        worst_out = max(_rel(r[name]["out"], ref_out[i]) for i, r in enumerate(results))
        worst_grad = max(
            _rel(r[name]["grads"][p], g) for r in results for p, g in ref_grads.items()
        )
        if name == "broken":
            assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
            continue
        assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
        assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"
        assert any(r[name]["text_only"] for r in results), f"{name}: no chunk held text only"
    # a rank held no sample and another far more tokens than the rest
    assert any(not out.numel() for out in ref_out)
