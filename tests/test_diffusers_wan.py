"""diffusers' WanTransformer3DModel trained through the balancer on real gloo groups.

Videos of mixed sizes (rank 0 much heavier, ranks without any), prompts of mixed
lengths zero-padded to one length as the Wan pipeline pads them; the workers
(knapformer/testing/diffusers_worlds.py, one world per world size shared with the Flux
test) send back outputs and all-reduced gradients, compared here with the unmodified
model run on each sample alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import VARIANTS, trained, wan_model, wan_samples

TOLERANCE = 1e-5


def _reference(world: int):
    model = wan_model()
    outs, loss = [], 0
    for mine in wan_samples(world):
        per = []
        for lat, t, text, w in mine:
            o = model(hidden_states=lat[None], timestep=t[None],
                      encoder_hidden_states=text[None]).sample[0]  # fmt: skip
            loss = loss + (o * w).sum()
            per.append(o.detach())
        outs.append(per)
    loss.backward()
    return outs, {n: p.grad for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 8])
def test_wan_balanced_equals_diffusers(world, tmp_path_factory):
    results = [r["wan"] for r in trained(world, tmp_path_factory.getbasetemp())]
    ref_outs, ref_grads = _reference(world)
    assert any(not refs for refs in ref_outs)  # a rank holds no video
    for name in VARIANTS[world]["wan"]:
        worst_out = max(
            (_rel(o, ref) for r, refs in zip(results, ref_outs, strict=True)
             for o, ref in zip(r[name]["outs"], refs, strict=True)),
            default=0.0,
        )  # fmt: skip
        worst_grad = max(
            _rel(r[name]["grads"][p], g) for r in results for p, g in ref_grads.items()
        )
        if name == "broken":
            assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
            continue
        assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
        assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"
