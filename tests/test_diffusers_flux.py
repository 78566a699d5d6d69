"""diffusers' FluxTransformer2DModel trained through the balancer on real gloo groups.

One spawn per world runs every variant (replicas, activation checkpointing, FSDP2,
plan-ahead, and a deliberately broken integration); workers send back their outputs
and all-reduced gradients, and the assertions compare them here with the unmodified
diffusers model run on each sample alone, in this process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from knapformer.testing.dist_helpers import run_world

CONFIG = dict(
    patch_size=1,
    in_channels=8,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=12,
    pooled_projection_dim=8,
    axes_dims_rope=(4, 6, 6),
)
D = 64  # heads x head dim
# (image tokens, text tokens) of each rank's samples: rank 0 much heavier, one sample
# with a long prompt (its first chunk is text only), rank 3 holds no sample at all.
SAMPLES = {
    4: [[(24, 64), (30, 6)], [(6, 4)], [(8, 3), (5, 2)], []],
    8: [[(24, 64), (30, 6)], [(6, 4)], [(8, 3), (5, 2)], [], [(20, 9)], [(3, 3)], [], [(7, 1)]],
}
VARIANTS = {
    # name: (topology, options)
    "bags+checkpointing": ("g1n2+g2n1", {"checkpointing": True}),
    "replicas+plan_ahead": ("g2n1", {"plan_ahead": True}),
    "fsdp2+checkpointing": ("g4n1", {"fsdp": True, "checkpointing": True}),
    "broken": ("g1n2+g2n1", {"broken": True}),
}
TOLERANCE = 1e-5  # relative to the largest value, fp32


def _model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG)
    with torch.no_grad():
        for p in model.parameters():  # AdaLN-zero starts at zero: make every path count
            p.normal_(0, 0.1)
    return model


def _samples(world: int) -> list[list[tuple]]:
    """Every rank's samples (the same on every process): image, text, pooled, timestep,
    image ids, text ids, loss weights."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for per_rank in SAMPLES[world]:
        mine = []
        for li, lt in per_rank:
            mine.append(
                (
                    torch.randn(li, 8, generator=gen),
                    torch.randn(lt, 12, generator=gen),
                    torch.randn(8, generator=gen),
                    torch.rand((), generator=gen),
                    torch.randint(0, 8, (li, 3), generator=gen).float(),
                    torch.zeros(lt, 3),
                    torch.randn(li, 8, generator=gen),
                )
            )
        out.append(mine)
    return out


def _batch(samples):
    from knapformer.integrations.diffusers import FluxBatch

    if not samples:
        empty = torch.zeros(0, 3)
        return FluxBatch(torch.zeros(0, 8), [], torch.zeros(0, 12), [], torch.zeros(0, 8),
                         torch.zeros(0), empty, empty)  # fmt: skip
    return FluxBatch.pack(*[[s[i] for s in samples] for i in range(6)])


def _run_variant(rank: int, world: int, topology: str, options: dict) -> dict:
    import torch.distributed as dist

    from knapformer.integrations.diffusers import BalancedFlux
    from knapformer.runtime.balancer import SequenceBalancer

    model = _model()
    if options.get("checkpointing"):
        model.enable_gradient_checkpointing()
    if options.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    balanced = BalancedFlux(model)
    bal = SequenceBalancer(topology, plan_ahead=options.get("plan_ahead", False))
    if options.get("broken"):  # Ulysses skipped: attention sees only its own chunk
        bal.pre_attn = lambda q, k, v: (bal.tables.chunk_lens, q, k, v)
        bal.post_attn = lambda out: (bal.tables.chunk_lens, out)
    mine = _samples(world)[rank]
    batch = _batch(mine)
    bal.plan_routing(batch.seq_lens, D)
    out = balanced(batch, bal)
    weights = torch.cat([s[6] for s in mine]) if mine else torch.zeros(0, 8)
    (out * weights).sum().backward()
    # what routing did: did any chunk here hold text tokens only?
    text_only = _text_only_chunk(bal, world)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if options.get("fsdp"):
            g = g.full_tensor() * world  # FSDP2 averages over the mesh
        else:
            dist.all_reduce(g)
        grads[name] = g
    bal.close()
    return {"out": out.detach(), "grads": grads, "text_only": text_only}


def _text_only_chunk(bal, world: int) -> bool:
    """Whether a chunk routed to this rank holds only text tokens (text comes first)."""
    plan, chunks = bal.last_plan, bal.last_plan.chunks
    text = _plan_text_lens(plan, world)
    return any(
        int(chunks.dst_gpu[c]) == bal.rank
        and chunks.offset[c] + chunks.length[c] <= text[int(chunks.seq[c])]
        for c in range(len(chunks))
    )


def _plan_text_lens(plan, world: int) -> list[int]:
    by_rank = {int(r): [lt for _, lt in SAMPLES[world][r]] for r in plan.gpus}
    out = []
    for src in plan.sequences.src_gpu:
        out.append(by_rank[int(src)].pop(0))
    return out


def _worker(rank: int, world: int) -> dict:
    return {name: _run_variant(rank, world, *spec) for name, spec in VARIANTS.items()}


def _reference(world: int):
    """The unmodified diffusers model on each sample alone: outputs and gradients."""
    model = _model()
    outs = []
    loss = 0
    for per_rank in _samples(world):
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_flux_balanced_equals_diffusers(world, tmp_path):
    results = run_world(_worker, world, tmp_path)
    ref_out, ref_grads = _reference(world)
    for name in VARIANTS:
        worst_out = max(_rel(r[name]["out"], ref_out[i]) for i, r in enumerate(results))
        worst_grad = max(
            _rel(r[name]["grads"][p], g) for r in results for p, g in ref_grads.items()
        )
        if name == "broken":
            assert worst_out > 1e-3, "skipping the Ulysses exchange went unnoticed"
            continue
        assert worst_out < TOLERANCE, f"{name}: outputs differ by {worst_out:.2e} (relative)"
        assert worst_grad < TOLERANCE, f"{name}: gradients differ by {worst_grad:.2e}"
    for name in VARIANTS:
        assert any(r[name]["text_only"] for r in results), f"{name}: no chunk held text only"
