"""Every supported diffusers transformer trained through the balancer on real gloo groups,
against the unmodified model run on each sample alone.

The workers (knapformer/testing/diffusers_worlds.py) run every variant of every model in
one world per world size (4 and 8 ranks: rank 0 far heavier, ranks without samples,
images or videos and prompts of mixed sizes): bags of 1, 2 and 4 GPUs, replicas,
activation checkpointing, FSDP2, planning ahead, the first API (BalancedFlux,
BalancedWan), DDP, bf16, and a deliberately broken integration that must be caught.
They send back outputs and gradients summed over the ranks; the assertions are here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.diffusers_worlds import VARIANTS, dtype_of, reference, trained

TOLERANCE = 1e-5  # fp32, relative
# A gradient tensor is compared at least at this fraction of the model's largest: some
# are sums that cancel to nearly nothing, rounding noise left (an attention key bias's is
# zero in exact arithmetic: softmax ignores a shift of all of a query's scores; Wan
# image-to-video's text cross-attention, over 512 keys mostly padding, is nearly flat).
GRAD_SCALE_FLOOR = 1e-3
BF16_FACTOR = 2.0  # balanced bf16 within this factor of the unbalanced bf16 error


def _max_rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor, 1e-30)
    return float((a.float() - b.float()).abs().max()) / scale if b.numel() else 0.0


def _worst(results: list[dict], name: str, ref) -> tuple[float, float]:
    """Worst relative difference of outputs and of gradients from ``ref``."""
    ref_outs, ref_grads = ref
    floor = GRAD_SCALE_FLOOR * max(float(g.abs().max()) for g in ref_grads.values())
    outs = [_max_rel(o, r) for res, refs in zip(results, ref_outs, strict=True)
            for o, r in zip(res[name]["outs"], refs, strict=True)]  # fmt: skip
    grads = [_max_rel(res[name]["grads"][p], g, floor) for res in results
             for p, g in ref_grads.items()]  # fmt: skip
    return max(outs, default=0.0), max(grads)


def _references() -> None:
    """Every reference the tests read (cached), computed while the worlds run."""
    for world, variants in VARIANTS.items():
        for model, _, options in variants.values():
            dtype = dtype_of(options)
            reference(model, world, dtype, options.get("loss") == "mean")
            if dtype != torch.float32:
                reference(model, world, torch.float32, False)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    with ThreadPoolExecutor(1) as pool:
        ready = pool.submit(_references)
        out = trained(base)
        ready.result()
    return out


def _fp32_variants():
    return [(w, n) for w in (4, 8) for n, (_, _, opts) in VARIANTS[w].items()
            if dtype_of(opts) == torch.float32 and not opts.get("ddp_refused")]  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "name"), _fp32_variants())
def test_balanced_equals_diffusers_fp32(worlds, world, name):
    model, _, options = VARIANTS[world][name]
    results = worlds[world]
    ref = reference(model, world, torch.float32, options.get("loss") == "mean")
    assert any(not refs for refs in ref[0]), "a rank should hold no sample"
    worst_out, worst_grad = _worst(results, name, ref)
    if options.get("broken"):
        assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
        return
    assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
    assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"


def _rel_norm(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a.float() - b.float()).norm()) / max(float(b.float().norm()), floor, 1e-30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["flux", "wan"])
def test_bf16_balanced_within_twice_the_unbalanced_error(worlds, model):
    """Per output and per parameter: the balanced bf16 run's error against fp32 is at most
    twice the unmodified model's in bf16 (each sample alone), and the broken copy's is
    not."""
    results = worlds[4]
    fp32 = reference(model, 4, torch.float32, False)
    bf16 = reference(model, 4, torch.bfloat16, False)
    floor = 1e-3 * max(float(g.norm()) for g in fp32[1].values())
    for name in (f"{model}/bf16", f"{model}/bf16+broken"):
        worst = 0.0
        for p, g32 in fp32[1].items():
            unbalanced = _rel_norm(bf16[1][p], g32, floor)
            balanced = _rel_norm(results[0][name]["grads"][p], g32, floor)
            worst = max(worst, balanced / max(unbalanced, 2**-9))
        outs = [(_rel_norm(o, r, 0.0), _rel_norm(u, r, 0.0))
                for res, refs, unb in zip(results, fp32[0], bf16[0], strict=True)
                for o, r, u in zip(res[name]["outs"], refs, unb, strict=True)]  # fmt: skip
        worst_out = max(b / max(u, 2**-9) for b, u in outs)
        if name.endswith("broken"):
            assert max(worst, worst_out) > BF16_FACTOR, "the broken copy went unnoticed in bf16"
        else:
            assert worst <= BF16_FACTOR, f"{name}: a gradient is {worst:.2f}x the bf16 error"
            assert worst_out <= BF16_FACTOR, f"{name}: outputs {worst_out:.2f}x the bf16 error"


@pytest.mark.timeout(600)
def test_ddp_wrapping_balanced_synchronises_and_the_others_are_refused(worlds):
    """``DDP(balance(model))`` (the balancer on a group of its own) gives the gradients of
    the world's per-token mean (tested with the other fp32 variants); a DDP-wrapped model
    balanced outside DDP, or a balancer on DDP's own group, raise on every rank."""
    refused = [r["flux/ddp_refused"]["refused"] for r in worlds[4]]
    for outside, shared in refused:
        assert outside and "wrap the balanced module instead" in outside
        assert shared and "process group of its own" in shared
