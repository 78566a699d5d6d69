"""Every supported diffusers model trained balanced on real gloo groups, for
tests/test_diffusers_models.py (and tests/test_diffusers_gpu.py on CUDA).

Each rank's samples are fixed (`RANK_SAMPLES`: rank 0 far heavier than the others, ranks
without any, prompts of mixed lengths), so that the test process can run the unmodified
model on every sample alone and compare. Launching a gloo world and importing diffusers
dominate a test's time, so `trained` runs every variant of every model in ONE world per
world size, once per process, and both worlds' ranks fork from one driver that imported
diffusers (each rank importing it again cost 2.8 s of CPU; 12 ranks on 2 cores).

A variant's loss is ``sum_i (out_i * w_i).sum()`` over this rank's samples, ``w_i`` fixed
random weights of sample i (`loss_weights`), divided by the world's output elements for
``"mean"`` (the per-token mean over the world); its gradients come back summed over the
ranks (FSDP2 and DDP average them: times the world size).
"""

from __future__ import annotations

import functools
import gc
import importlib
import tempfile
from pathlib import Path
from typing import Any

import torch

from knapformer.local.launcher import TRAINING_PRELOAD, launch, run_fresh
from knapformer.testing.diffusers_models import MODELS, cast, one_thread, samples_for

# Indices into each model's sizes (big first): rank 0 heavy, ranks 3 (and 5) empty.
RANK_SAMPLES = {
    1: [[0, 1, 2, 3, 4]],  # tests/test_diffusers_gpu.py: one GPU
    4: [[0, 1], [2], [3, 4], []],
    8: [[0, 1], [2], [3, 4], [], [5], [], [4], [2]],
}
TOPOLOGY = {4: "g1n2+g2n1", 8: "g1n2+g2n1+g4n1"}
_EVERY = ("flux", "flux2", "qwen_image", "sd3", "wan", "wan_i2v", "hunyuan_video", "ltx_video",
          "cogvideox")  # fmt: skip
_FSDP = ("flux", "wan", "qwen_image")

# name: (model, topology, options). Options: checkpointing, fsdp, plan_ahead, loss
# ("sum" or "mean"), bf16, broken (Ulysses skipped: the comparison must catch it),
# legacy (through BalancedFlux / BalancedWan), ddp (DDP(balance(model))), ddp_refused.
VARIANTS: dict[int, dict[str, tuple[str, str, dict[str, Any]]]] = {
    4: {
        **{f"{m}/bags": (m, TOPOLOGY[4], {}) for m in _EVERY if m not in ("flux", "qwen_image")},
        "flux/bags+checkpointing+mean": ("flux", TOPOLOGY[4], {"checkpointing": True,
                                                               "loss": "mean"}),
        "qwen_image/bags+fsdp2": ("qwen_image", TOPOLOGY[4], {"fsdp": True}),
        "flux/fsdp2+checkpointing": ("flux", "g4n1", {"fsdp": True, "checkpointing": True}),
        "flux/legacy+replicas+plan_ahead": ("flux", "g2n1", {"legacy": True, "plan_ahead": True}),
        "flux/broken": ("flux", TOPOLOGY[4], {"broken": True}),
        "flux/bf16": ("flux", TOPOLOGY[4], {"bf16": True}),
        "flux/bf16+broken": ("flux", TOPOLOGY[4], {"bf16": True, "broken": True}),
        "flux/ddp": ("flux", TOPOLOGY[4], {"ddp": True, "loss": "mean"}),
        "flux/ddp_refused": ("flux", TOPOLOGY[4], {"ddp_refused": True}),
        "wan/replicas+fsdp2+plan_ahead": ("wan", "g2n1", {"fsdp": True, "plan_ahead": True}),
        "wan/legacy+checkpointing": ("wan", TOPOLOGY[4], {"legacy": True, "checkpointing": True}),
        "wan/bf16": ("wan", TOPOLOGY[4], {"bf16": True}),
        "wan/bf16+broken": ("wan", TOPOLOGY[4], {"bf16": True, "broken": True}),
    },
    8: {
        f"{m}/bags" + ("+fsdp2" if m in _FSDP else "") + ("+checkpointing" if m == "sd3" else ""):
        (m, TOPOLOGY[8], {"fsdp": m in _FSDP, "checkpointing": m == "sd3"})
        for m in _EVERY
    },
}  # fmt: skip


def sizes(model: str, world: int) -> list[list[Any]]:
    table = MODELS[model].sizes
    return [[table[i] for i in per_rank] for per_rank in RANK_SAMPLES[world]]


def world_samples(model: str, world: int, dtype: torch.dtype = torch.float32):
    """Every rank's samples of ``model`` (the same on every process), in ``dtype``."""
    per_rank = samples_for(model, sizes(model, world))
    return [[cast(s, dtype) for s in mine] for mine in per_rank]


def _device(options: dict) -> torch.device:
    """Where a variant runs: ``options["device"]`` ("cuda" on an NCCL world), else CPU."""
    return torch.device(options.get("device", "cpu"))


def _on(sample: dict, device: torch.device) -> dict:
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return {k: tuple(map(move, v)) if isinstance(v, tuple) else move(v) for k, v in sample.items()}


def dtype_of(options: dict) -> torch.dtype:
    return torch.bfloat16 if options.get("bf16") else torch.float32


def _prepared(model: torch.nn.Module, world: int, options: dict, spec) -> torch.nn.Module:
    """``model`` with the variant's checkpointing and FSDP2 (per block, then the root)."""
    if options.get("checkpointing"):
        model.enable_gradient_checkpointing()
    if options.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(_device(options).type, (world,))
        for b in spec.blocks:
            for block in model.get_submodule(b.name):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _balancer(topology: str, options: dict):
    from knapformer.runtime.balancer import SequenceBalancer

    group = None
    if options.get("ddp"):  # DDP all-reduces in backward on WORLD: a group of its own
        import torch.distributed as dist

        group = dist.new_group(list(range(dist.get_world_size())))
    bal = SequenceBalancer(topology, plan_ahead=options.get("plan_ahead", False),
                           process_group=group)  # fmt: skip
    if options.get("broken"):  # Ulysses skipped: attention sees only its own chunk
        bal.pre_attn = lambda q, k, v: (bal.tables.chunk_lens, q, k, v)
        bal.post_attn = lambda out: (bal.tables.chunk_lens, out)
    return bal


def _forward(model, name: str, mine: list[dict], bal, options: dict):
    """This rank's outputs (``model(**sample).sample`` of each) and a zero in the graph."""
    from knapformer.integrations.diffusers import balance

    if options.get("legacy"):
        return (_legacy_flux if name == "flux" else _legacy_wan)(model, mine, bal)
    outs = balance(model)(mine, bal)
    return list(outs), outs.anchor


def _legacy_flux(model, mine: list[dict], bal):
    """Through `BalancedFlux` and `FluxBatch.pack` (from empty lists on a rank without)."""
    from knapformer.integrations.diffusers import BalancedFlux, FluxBatch

    first = lambda key: [s[key][0] for s in mine]  # noqa: E731
    batch = FluxBatch.pack(first("hidden_states"), first("encoder_hidden_states"),
                           first("pooled_projections"), first("timestep"),
                           [s["img_ids"] for s in mine], [s["txt_ids"] for s in mine],
                           guidance=first("guidance"))  # fmt: skip
    bal.plan_routing(batch.seq_lens, model.inner_dim)
    rows = BalancedFlux(model)(batch, bal)  # (T_img, C)
    return [r[None] for r in rows.split(batch.image_lens)], rows.sum() * 0


def _legacy_wan(model, mine: list[dict], bal):
    """Through `BalancedWan` and `WanBatch`."""
    from knapformer.integrations.diffusers import BalancedWan, WanBatch

    wan = BalancedWan(model)
    text = [s["encoder_hidden_states"] for s in mine]
    batch = WanBatch([s["hidden_states"][0] for s in mine],
                     torch.cat([s["timestep"] for s in mine]) if mine else torch.zeros(0),
                     torch.cat(text) if text else torch.zeros(0, 8, 16))  # fmt: skip
    bal.plan_routing(batch.seq_lens(wan.patch_size), wan.inner_dim)
    rows = wan(batch, bal)  # (T, C * patch)
    return [v[None] for v in wan.unpatchify(rows, batch)], rows.sum() * 0


def run_variant(rank: int, world: int, name: str, topology: str, options: dict) -> dict:
    """One balanced forward and backward of model ``name`` on this rank's samples: its
    outputs and the gradients summed over the world (fp32, CPU)."""
    import torch.distributed as dist

    from knapformer.errors import KnapformerError
    from knapformer.integrations.diffusers import SPECS, balance

    tiny, dtype = MODELS[name], dtype_of(options)
    device = _device(options)
    model = _prepared(tiny.build(dtype).to(device), world, options, SPECS[tiny.cls])
    bal = _balancer(topology, options)
    mine = [_on(s, device) for s in world_samples(name, world, dtype)[rank]]
    if options.get("ddp_refused"):  # a DDP-wrapped model run outside DDP; DDP on WORLD
        from torch.nn.parallel import DistributedDataParallel

        refused, ddp = [], DistributedDataParallel(model)  # kept: a live DDP
        for run in (lambda: balance(ddp.module)(mine, bal),
                    lambda: DistributedDataParallel(balance(model))(mine, bal)):  # fmt: skip
            try:
                run()
                refused.append(None)
            except KnapformerError as err:
                refused.append(str(err))
        bal.close()
        return {"refused": refused}
    if options.get("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(balance(model))
        result = ddp(mine, bal)
        outs, anchor = list(result), result.anchor
    else:
        outs, anchor = _forward(model, name, mine, bal, options)
    loss = anchor
    elements = torch.tensor(float(sum(o.numel() for o in outs)), device=device)
    dist.all_reduce(elements)
    scale = 1 / float(elements) if options.get("loss") == "mean" else 1.0
    for o, w in zip(outs, _weights_of(name, world, rank, outs), strict=True):
        loss = loss + (o * w).sum() * scale
    loss.backward()
    grads = _summed_grads(model, world, options)
    bal.close()
    return {"outs": [o.detach().float().cpu() for o in outs], "grads": grads}


def _weights_of(name: str, world: int, rank: int, outs: list[torch.Tensor]):
    before = sum(len(per) for per in RANK_SAMPLES[world][:rank])
    out = []
    for i, o in enumerate(outs):
        gen = torch.Generator().manual_seed(1000 + before + i)
        out.append(torch.randn(o.shape, generator=gen).to(o.device, o.dtype))
    return out


def _summed_grads(model, world: int, options: dict) -> dict[str, torch.Tensor]:
    """Summed in fp32, so that a bf16 comparison measures the model, not this sum."""
    import torch.distributed as dist

    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if options.get("fsdp"):  # FSDP2 averages over the mesh
        return {n: g * world for n, g in _unsharded(grads, world).items()}
    if options.get("ddp"):  # DDP averages too
        return {n: g.float().cpu() * world for n, g in grads.items()}
    # One all-reduce for all: each is a round of every rank on shared cores.
    flat = torch.cat([g.float().reshape(-1) for g in grads.values()])
    dist.all_reduce(flat)
    summed = flat.cpu().split([g.numel() for g in grads.values()])
    # Copies: a view would pickle the whole flat storage with it.
    return {n: s.view(g.shape).clone() for (n, g), s in zip(grads.items(), summed, strict=True)}


def _unsharded(grads: dict[str, Any], world: int) -> dict[str, torch.Tensor]:
    """FSDP2's sharded gradients whole (fp32, CPU), in one exchange, not one per tensor:
    FSDP2 shards dim 0 (``Shard(0)``), rank r holding its r-th chunk."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mine = {}
    for name, g in grads.items():
        if tuple(g.placements) != (Shard(0),):
            raise AssertionError(f"{name}'s gradient is laid out {g.placements}, not Shard(0)")
        mine[name] = g.to_local().float().cpu()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {name: torch.cat([theirs[name] for theirs in every]) for name in grads}


def _worker(rank: int, world: int) -> dict[str, dict]:
    return {name: run_variant(rank, world, *spec) for name, spec in VARIANTS[world].items()}


# What the ranks use, imported once by the driver (FSDP2, DTensor and DDP on first use).
_DRIVER_PRELOAD = (
    *TRAINING_PRELOAD,
    *("diffusers", "knapformer.integrations.diffusers", "torch.distributed.fsdp"),
    *("torch.distributed.tensor", "torch.nn.parallel"),
)


def _drive(folder: str) -> dict[int, list[dict[str, dict]]]:
    """The fresh driver of `trained`: imports diffusers once, then forks each world's
    ranks from itself (a single thread that never ran a parallel op: safe to fork)."""
    torch.set_num_threads(1)
    for module in _DRIVER_PRELOAD:
        importlib.import_module(module)
    import diffusers

    for tiny in MODELS.values():
        getattr(diffusers, tiny.cls)  # diffusers imports a model's module on first use
    # The imports' objects (~400k) are never garbage: frozen, the workers' collections
    # (and the DDP guard's scan of live objects, once per balanced model) skip them.
    gc.freeze()
    return {w: launch(_worker, w, backend="gloo", start_method="fork",
                      preload=_DRIVER_PRELOAD, group_timeout_s=60, workdir=Path(folder))
            for w in VARIANTS}  # fmt: skip


@functools.cache
def trained(workdir: Path) -> dict[int, list[dict[str, dict]]]:
    """Every variant of `VARIANTS`, each world size's in one gloo world (once per
    process): ``{world: by rank, {variant: result}}``.

    Importing diffusers costs seconds of CPU per process: one spawned driver imports it
    and forks the ranks of both worlds, instead of every rank importing it again."""
    folder = tempfile.mkdtemp(prefix="diffusers-worlds-", dir=workdir)
    return run_fresh(_drive, folder)


@functools.cache
def reference(name: str, world: int, dtype: torch.dtype = torch.float32, mean: bool = False):
    """The unmodified model on each sample alone, in ``dtype``, with the workers' loss:
    outputs per rank (fp32) and gradients (fp32). Cached: several variants share it."""
    with one_thread():
        return _reference(name, world, dtype, mean)


def _reference(name: str, world: int, dtype: torch.dtype, mean: bool):
    model = MODELS[name].build(dtype)
    outs, loss = [], 0
    for rank, mine in enumerate(world_samples(name, world, dtype)):
        per = [model(**s).sample for s in mine]
        outs.append(per)
        for o, w in zip(per, _weights_of(name, world, rank, per), strict=True):
            loss = loss + (o * w).sum()
    if mean:
        loss = loss / sum(o.numel() for per in outs for o in per)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return [[o.detach().float() for o in per] for per in outs], grads
