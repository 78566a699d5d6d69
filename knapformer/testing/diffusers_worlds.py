"""Tiny random diffusers Flux and Wan models trained balanced on real gloo groups, for
tests/test_diffusers_flux.py, tests/test_diffusers_wan.py and bench/integration.py.

Each rank's samples are fixed (rank 0 much heavier than the others, some ranks without
any, prompts of mixed lengths), so the test process can run the unmodified model on
every sample alone and compare. Launching a gloo world and importing diffusers in every
worker dominate a test's time, so `trained` runs every variant of both models in ONE
world per world size, once per process (the Flux and the Wan test share it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from knapformer.testing.dist_helpers import run_world

# ---------------------------------------------------------------------------- Flux
FLUX_CONFIG = dict(
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
FLUX_D = 64  # heads x head dim
# (image tokens, text tokens) of each rank's samples: rank 0 much heavier, one sample
# with a long prompt (its first chunk is text only), rank 3 holds no sample at all.
FLUX_SAMPLES = {
    4: [[(24, 64), (30, 6)], [(6, 4)], [(8, 3), (5, 2)], []],
    8: [[(24, 64), (30, 6)], [(6, 4)], [(8, 3), (5, 2)], [], [(20, 9)], [(3, 3)], [], [(7, 1)]],
}

# ----------------------------------------------------------------------------- Wan
WAN_CONFIG = dict(
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
WAN_D, WAN_TEXT_LEN = 48, 6
# (frames, height, width) of each rank's videos and each prompt's length: rank 0 much
# heavier, rank 3 (and at 8 ranks rank 5) without any.
WAN_VIDEOS = {
    4: [[(6, 8, 8), (2, 4, 4)], [(1, 4, 6)], [(3, 4, 4), (1, 2, 2)], []],
    8: [[(6, 8, 8), (2, 4, 4)], [(1, 4, 6)], [(3, 4, 4), (1, 2, 2)], [],
        [(2, 4, 4)], [], [(1, 2, 4)], [(4, 4, 4)]],
}  # fmt: skip
WAN_PROMPTS = {
    4: [[6, 2], [4], [3, 5], []],
    8: [[6, 2], [4], [3, 5], [], [1], [], [6], [2]],
}
# One rank (tests/test_diffusers_gpu.py: one GPU) holds all the samples of four.
for _table in (FLUX_SAMPLES, WAN_VIDEOS, WAN_PROMPTS):
    _table[1] = [[s for per_rank in _table[4] for s in per_rank]]
del _table

# name: (topology, options). Every combination the integration promises, and a
# deliberately broken integration (Ulysses skipped) that the comparison must catch.
# "bf16": model, inputs and loss weights in bfloat16, compared with the unmodified model
# run in bfloat16 (bags, so Ulysses and packing change the reduction order).
VARIANTS = {
    4: {
        "flux": {
            "bags+checkpointing": ("g1n2+g2n1", {"checkpointing": True}),
            "replicas+plan_ahead": ("g2n1", {"plan_ahead": True}),
            "fsdp2+checkpointing": ("g4n1", {"fsdp": True, "checkpointing": True}),
            "broken": ("g1n2+g2n1", {"broken": True}),
            "bf16": ("g1n2+g2n1", {"bf16": True}),
            "bf16+broken": ("g1n2+g2n1", {"bf16": True, "broken": True}),
        },
        "wan": {
            "bags+checkpointing": ("g1n2+g2n1", {"checkpointing": True}),
            "replicas+fsdp2+plan_ahead": ("g2n1", {"fsdp": True, "plan_ahead": True}),
            "broken": ("g1n2+g2n1", {"broken": True}),
            "bf16": ("g1n2+g2n1", {"bf16": True}),
            "bf16+broken": ("g1n2+g2n1", {"bf16": True, "broken": True}),
        },
    },
    8: {
        "flux": {"bags+checkpointing": ("g1n2+g2n1+g4n1", {"checkpointing": True})},
        "wan": {"bags+fsdp2+plan_ahead": ("g1n2+g2n1+g4n1", {"fsdp": True, "plan_ahead": True})},
    },
}


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():  # AdaLN-zero starts at zero: make every path count
            p.normal_(0, 0.1)
    return model


def flux_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The fp32 weights, rounded to ``dtype``: every dtype's model is the same one."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return _randomised(FluxTransformer2DModel(**FLUX_CONFIG)).to(dtype)


def wan_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return _randomised(WanTransformer3DModel(**WAN_CONFIG)).to(dtype)


def dtype_of(options: dict) -> torch.dtype:
    return torch.bfloat16 if options.get("bf16") else torch.float32


def device_of(options: dict) -> torch.device:
    """Where a variant runs: ``options["device"]`` ("cuda" on an NCCL world), else CPU."""
    return torch.device(options.get("device", "cpu"))


def _on(samples: list[tuple], device: torch.device) -> list[tuple]:
    return [tuple(t.to(device) for t in s) for s in samples]


def cast(samples: list[list[tuple]], dtype: torch.dtype, keep: tuple[int, ...] = ()):
    """``flux_samples`` / ``wan_samples`` with every floating-point field in ``dtype`` but
    the fields at ``keep``, as the pipelines do: Flux's casts its RoPE ids (small integers,
    exact in bf16) and timestep, Wan's keeps the timestep fp32 (`WAN_KEEP`)."""
    return [
        [
            tuple(t.to(dtype) if t.is_floating_point() and i not in keep else t
                  for i, t in enumerate(s))
            for s in per_rank
        ]
        for per_rank in samples
    ]  # fmt: skip


WAN_KEEP = (1,)  # Wan's timestep, in [0, 1000): bf16 would move it by up to 2


def _flux_timestep(gen: torch.Generator) -> torch.Tensor:
    """A timestep in [0, 1] that stays exact in bf16 through Flux's own
    ``timestep.to(dtype) * 1000``: a random one moves by up to 4 (of 1000) there, and the
    random weights' time embedding turns that into an O(1) change, hiding the arithmetic
    noise floor that the bf16 comparison measures."""
    return 2.0 ** -torch.randint(0, 5, (), generator=gen).float()


def flux_samples(world: int) -> list[list[tuple]]:
    """Every rank's samples (the same on every process): image ``(L_img, 8)``, text
    ``(L_txt, 12)``, pooled ``(8,)``, timestep ``()``, image ids, text ids, loss weights."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for per_rank in FLUX_SAMPLES[world]:
        mine = []
        for li, lt in per_rank:
            mine.append(
                (
                    torch.randn(li, 8, generator=gen),
                    torch.randn(lt, 12, generator=gen),
                    torch.randn(8, generator=gen),
                    _flux_timestep(gen),
                    torch.randint(0, 8, (li, 3), generator=gen).float(),
                    torch.zeros(lt, 3),
                    torch.randn(li, 8, generator=gen),
                )
            )
        out.append(mine)
    return out


def wan_samples(world: int) -> list[list[tuple]]:
    """Every rank's (latent ``(4, F, H, W)``, timestep, prompt zero-padded to
    ``(WAN_TEXT_LEN, 16)`` as the Wan pipeline pads it, loss weights)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for videos, prompts in zip(WAN_VIDEOS[world], WAN_PROMPTS[world], strict=True):
        mine = []
        for (f, h, w), n in zip(videos, prompts, strict=True):
            text = torch.zeros(WAN_TEXT_LEN, 16)
            text[:n] = torch.randn(n, 16, generator=gen)
            lat = torch.randn(4, f, h, w, generator=gen)
            t = torch.rand((), generator=gen) * 1000
            mine.append((lat, t, text, torch.randn(4, f, h, w, generator=gen)))
        out.append(mine)
    return out


def flux_batch(samples: list[tuple], dtype: torch.dtype = torch.float32):
    """A rank's `FluxBatch` (an empty one of ``dtype`` for a rank without samples)."""
    from knapformer.integrations.diffusers import FluxBatch

    if not samples:
        empty = torch.zeros(0, 3, dtype=dtype)
        return FluxBatch(torch.zeros(0, 8, dtype=dtype), [], torch.zeros(0, 12, dtype=dtype),
                         [], torch.zeros(0, 8, dtype=dtype), torch.zeros(0, dtype=dtype),
                         empty, empty)  # fmt: skip
    return FluxBatch.pack(*[[s[i] for s in samples] for i in range(6)])


def wan_batch(samples: list[tuple], dtype: torch.dtype = torch.float32):
    from knapformer.integrations.diffusers import WanBatch

    return WanBatch(
        [s[0] for s in samples],
        torch.stack([s[1] for s in samples]) if samples else torch.zeros(0),
        torch.stack([s[2] for s in samples])
        if samples
        else torch.zeros(0, WAN_TEXT_LEN, 16, dtype=dtype),
    )


def _prepared(model, world: int, blocks, options: dict):
    """``model`` with the variant's checkpointing and FSDP2 (per block, then the root)."""
    if options.get("checkpointing"):
        model.enable_gradient_checkpointing()
    if options.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device_of(options).type, (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _balancer(topology: str, options: dict):
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer(topology, plan_ahead=options.get("plan_ahead", False))
    if options.get("broken"):  # Ulysses skipped: attention sees only its own chunk
        bal.pre_attn = lambda q, k, v: (bal.tables.chunk_lens, q, k, v)
        bal.post_attn = lambda out: (bal.tables.chunk_lens, out)
    return bal


def _summed_grads(model, world: int, fsdp: bool) -> dict[str, torch.Tensor]:
    """Summed in fp32, so that a bf16 comparison measures the model, not this sum."""
    import torch.distributed as dist

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if fsdp:
            g = g.full_tensor().float() * world  # FSDP2 averages over the mesh
        else:
            g = g.float()
            dist.all_reduce(g)
        grads[name] = g.cpu()
    return grads


def run_flux_variant(rank: int, world: int, topology: str, options: dict) -> dict:
    """One balanced forward and backward of `flux_model` on this rank's samples: its
    output ``(T_img, 8)``, the gradients summed over the world, and whether a chunk
    routed here held text tokens only."""
    from knapformer.integrations.diffusers import BalancedFlux

    dtype, device = dtype_of(options), device_of(options)
    model = flux_model(dtype).to(device)
    blocks = (*model.transformer_blocks, *model.single_transformer_blocks)
    model = _prepared(model, world, blocks, options)
    balanced = BalancedFlux(model)
    bal = _balancer(topology, options)
    mine = _on(cast(flux_samples(world), dtype)[rank], device)
    batch = flux_batch(mine, dtype)
    bal.plan_routing(batch.seq_lens, FLUX_D)
    out = balanced(batch, bal)
    weights = torch.cat([s[6] for s in mine]) if mine else torch.zeros(0, 8, dtype=dtype)
    (out * weights).sum().backward()
    text_only = _text_only_chunk(bal, world)
    grads = _summed_grads(model, world, options.get("fsdp", False))
    bal.close()
    return {"out": out.detach().cpu(), "grads": grads, "text_only": text_only}


def _text_only_chunk(bal, world: int) -> bool:
    """Whether a chunk routed to this rank holds only text tokens (text comes first)."""
    plan, chunks = bal.last_plan, bal.last_plan.chunks
    by_rank = {int(r): [lt for _, lt in FLUX_SAMPLES[world][r]] for r in plan.gpus}
    text = [by_rank[int(src)].pop(0) for src in plan.sequences.src_gpu]
    return any(
        int(chunks.dst_gpu[c]) == bal.rank
        and chunks.offset[c] + chunks.length[c] <= text[int(chunks.seq[c])]
        for c in range(len(chunks))
    )


def run_wan_variant(rank: int, world: int, topology: str, options: dict) -> dict:
    """One balanced forward and backward of `wan_model` on this rank's videos: each
    video's output ``(4, F, H, W)`` and the gradients summed over the world."""
    from knapformer.integrations.diffusers import BalancedWan

    dtype, device = dtype_of(options), device_of(options)
    model = wan_model(dtype).to(device)
    model = _prepared(model, world, model.blocks, options)
    balanced = BalancedWan(model)
    bal = _balancer(topology, options)
    mine = _on(cast(wan_samples(world), dtype, WAN_KEEP)[rank], device)
    batch = wan_batch(mine, dtype)
    bal.plan_routing(batch.seq_lens(balanced.patch_size), WAN_D)
    out = balanced(batch, bal)  # (T, C * patch): a rank without samples has 0 rows
    weights = balanced.patchify([s[3] for s in mine])
    (out * weights).sum().backward()
    outs = balanced.unpatchify(out, batch)
    grads = _summed_grads(model, world, options.get("fsdp", False))
    bal.close()
    return {"outs": [o.detach().cpu() for o in outs], "grads": grads}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    runners = {"flux": run_flux_variant, "wan": run_wan_variant}
    return {
        model: {name: runners[model](rank, world, *spec) for name, spec in variants.items()}
        for model, variants in VARIANTS[world].items()
    }


@functools.cache
def trained(world: int, workdir: Path) -> list[dict[str, dict[str, Any]]]:
    """Every variant of `VARIANTS[world]`, run in one gloo world of ``world`` ranks (once
    per process): by rank, ``{"flux" | "wan": {variant: result}}``."""
    return run_world(_worker, world, workdir)


def check_bf16_variants(
    variants: dict, worst_of: Callable[[str], tuple[float, float]], floor: tuple[float, float]
) -> int:
    """Assert each bf16 variant of ``variants`` (name -> (world options, options)) is no
    further from the unmodified model in bf16 than bf16 is from fp32 (``floor``: outputs,
    gradients), and each broken one further; ``worst_of(name)`` gives the variant's worst
    (output, gradient) difference. Returns how many sound variants were checked."""
    out_floor, grad_floor = floor
    checked = 0
    for name, (_, options) in variants.items():
        if dtype_of(options) != torch.bfloat16:
            continue
        worst_out, worst_grad = worst_of(name)
        within = worst_out <= out_floor and worst_grad <= grad_floor
        if options.get("broken"):
            assert not within, "skipping the Ulysses exchange went unnoticed in bf16"
            continue
        checked += 1
        assert within, (
            f"{name}: outputs differ by {worst_out:.2e} (floor {out_floor:.2e}), "
            f"gradients by {worst_grad:.2e} (floor {grad_floor:.2e})"
        )
    return checked
