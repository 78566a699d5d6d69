"""diffusers' WanTransformer3DModel trained through the balancer on real gloo groups.

Videos of mixed sizes (rank 0 much heavier, rank 3 with none), prompts of mixed lengths
zero-padded to one length as the Wan pipeline pads them; outputs and all-reduced
gradients are compared here with the unmodified model run on each sample alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.dist_helpers import run_world

CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    rope_max_seq_len=32,
)
D, TEXT_LEN = 48, 6
# (frames, height, width) of each rank's videos, and each prompt's length
VIDEOS = [[(6, 8, 8), (2, 4, 4)], [(1, 4, 6)], [(3, 4, 4), (1, 2, 2)], []]
PROMPTS = [[6, 2], [4], [3, 5], []]
VARIANTS = {
    "bags+checkpointing": ("g1n2+g2n1", {"checkpointing": True}),
    "fsdp2+plan_ahead": ("g4n1", {"fsdp": True, "plan_ahead": True}),
    "broken": ("g1n2+g2n1", {"broken": True}),
}
TOLERANCE = 1e-5


def _model():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def _samples() -> list[list[tuple]]:
    """Every rank's (latent, timestep, padded prompt, loss weights)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for videos, prompts in zip(VIDEOS, PROMPTS, strict=True):
        mine = []
        for (f, h, w), n in zip(videos, prompts, strict=True):
            text = torch.zeros(TEXT_LEN, 16)
            text[:n] = torch.randn(n, 16, generator=gen)
            lat = torch.randn(4, f, h, w, generator=gen)
            t = torch.rand((), generator=gen) * 1000
            mine.append((lat, t, text, torch.randn(4, f, h, w, generator=gen)))
        out.append(mine)
    return out


def _run_variant(rank: int, world: int, topology: str, options: dict) -> dict:
    import torch.distributed as dist

    from knapformer.integrations.diffusers import BalancedWan, WanBatch
    from knapformer.runtime.balancer import SequenceBalancer

    model = _model()
    if options.get("checkpointing"):
        model.enable_gradient_checkpointing()
    if options.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    balanced = BalancedWan(model)
    bal = SequenceBalancer(topology, plan_ahead=options.get("plan_ahead", False))
    if options.get("broken"):  # Ulysses skipped: attention sees only its own chunk
        bal.pre_attn = lambda q, k, v: (bal.tables.chunk_lens, q, k, v)
        bal.post_attn = lambda out: (bal.tables.chunk_lens, out)
    mine = _samples()[rank]
    batch = WanBatch(
        [s[0] for s in mine],
        torch.stack([s[1] for s in mine]) if mine else torch.zeros(0),
        torch.stack([s[2] for s in mine]) if mine else torch.zeros(0, TEXT_LEN, 16),
    )
    bal.plan_routing(batch.seq_lens(balanced.patch_size), D)
    out = balanced(batch, bal)  # (T, C * patch): a rank without samples has 0 rows
    weights = balanced.patchify([s[3] for s in mine])
    (out * weights).sum().backward()
    outs = balanced.unpatchify(out, batch)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if options.get("fsdp"):
            g = g.full_tensor() * world  # FSDP2 averages over the mesh
        else:
            dist.all_reduce(g)
        grads[name] = g
    bal.close()
    return {"outs": [o.detach() for o in outs], "grads": grads}


def _worker(rank: int, world: int) -> dict:
    return {name: _run_variant(rank, world, *spec) for name, spec in VARIANTS.items()}


def _reference():
    model = _model()
    outs, loss = [], 0
    for mine in _samples():
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


@pytest.mark.timeout(240)
def test_wan_balanced_equals_diffusers(tmp_path):
    results = run_world(_worker, 4, tmp_path)
    ref_outs, ref_grads = _reference()
    for name in VARIANTS:
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
