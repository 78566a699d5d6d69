"""Train a tiny random diffusers Flux model balanced across CPU processes.

Run: ``torchrun --standalone --nproc-per-node 4 examples/train_flux.py [--steps 20]
[--out runs/flux]``, then ``knapformer stragglers runs/flux/plans.jsonl`` or
``knapformer dashboard runs/flux``. Images of mixed sizes, prompts of mixed lengths, and
rank 0 gets the large images. Lines marked ``# KF`` are what balancing adds to an
unbalanced loop (docs/diffusers.md counts them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from knapformer import PlanRecorder, SequenceBalancer  # KF
from knapformer.integrations.diffusers import BalancedFlux, FluxBatch  # KF

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--out", type=Path, default=Path("runs/flux"))
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights on every rank
model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                               attention_head_dim=32, num_attention_heads=4,
                               joint_attention_dim=32, pooled_projection_dim=16,
                               axes_dims_rope=(8, 12, 12))  # fmt: skip
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
balancer = SequenceBalancer(
    "g1n2+g2n1" if world == 4 else f"g1n{world}",  # KF
    recorder=PlanRecorder(args.out / "plans.jsonl"),
    run="flux",
)  # KF
balanced = BalancedFlux(model)  # KF


def make_batch(gen: torch.Generator) -> tuple[FluxBatch, torch.Tensor]:
    """This rank's samples: rank 0 trains on large images, the others on small ones."""
    side = [16, 24, 32] if rank == 0 else [4, 6, 8]
    imgs, txts, iids, tids = [], [], [], []
    for _ in range(3):
        h = w = side[int(torch.randint(3, (), generator=gen))]
        lt = int(torch.randint(4, 40, (), generator=gen))
        imgs.append(torch.randn(h * w, 16, generator=gen))
        txts.append(torch.randn(lt, 32, generator=gen))
        grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
        iids.append(torch.cat([torch.zeros(h * w, 1), grid.reshape(-1, 2)], 1).float())
        tids.append(torch.zeros(lt, 3))
    pooled, t = torch.randn(3, 16, generator=gen), torch.rand(3, generator=gen)
    batch = FluxBatch.pack(imgs, txts, pooled, t, iids, tids)
    noise = torch.randn_like(batch.image)
    return batch, noise


gen = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    batch, noise = make_batch(gen)
    plan = balancer.plan_routing(batch.seq_lens, model.inner_dim)  # KF
    t = batch.timestep.repeat_interleave(torch.tensor(batch.image_lens))[:, None]
    noisy = (1 - t) * batch.image + t * noise  # rectified flow
    out = balanced(FluxBatch(**{**batch.__dict__, "image": noisy}), balancer)  # KF
    # Normalise by the tokens of the whole world, not this rank's: the balancer moves
    # tokens, so a per-rank mean would weigh samples differently on different ranks.
    tokens = torch.tensor(float(out.numel()))
    dist.all_reduce(tokens)
    loss = ((out - (noise - batch.image)) ** 2).sum() / tokens
    loss.backward()
    for p in model.parameters():  # data parallel: sum the gradients
        balancer.all_reduce(p.grad)  # KF (dist.all_reduce, timed as waiting)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        s = plan.stats
        print(f"step {step}: rank 0 loss share {loss.item():.4f}, imbalance "
              f"{s.imbalance_before:.2f} -> {s.imbalance_after:.2f}")  # fmt: skip
balancer.finish()  # KF
balancer.close()  # KF
dist.destroy_process_group()
