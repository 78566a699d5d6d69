"""Train a tiny random diffusers Flux model balanced across CPU processes, under DDP.

Run: ``torchrun --standalone --nproc-per-node 4 examples/train_flux.py [--steps 20]
[--out runs/flux]``, then ``knapformer stragglers runs/flux/plans.jsonl`` or
``knapformer dashboard runs/flux``. Images of mixed sizes, prompts of mixed lengths, and
rank 0 gets the large images. Each sample is what the model takes for one sample; lines
marked ``# KF`` are what balancing changes in the unbalanced loop (docs/diffusers.md
counts them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from torch.nn.parallel import DistributedDataParallel as DDP

from knapformer import PlanRecorder, SequenceBalancer  # KF
from knapformer.integrations.diffusers import balance  # KF

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
topology = "g1n2+g2n1" if world == 4 else f"g1n{world}"  # KF
balancer = SequenceBalancer(
    topology,
    process_group=dist.new_group(),
    run="flux",
    recorder=PlanRecorder(args.out / "plans.jsonl"),
)  # KF
model = DDP(balance(model))  # KF (unbalanced: DDP(model))


def make_batch(gen: torch.Generator) -> tuple[list[dict], list[torch.Tensor]]:
    """This rank's samples and their targets: rank 0 large images, the others small."""
    sides = [16, 24, 32] if rank == 0 else [4, 6, 8]
    samples, targets = [], []
    for _ in range(3):
        h = w = sides[int(torch.randint(3, (), generator=gen))]
        lt = int(torch.randint(4, 40, (), generator=gen))
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        image, noise = torch.randn(1, h * w, 16, generator=gen), torch.randn(1, h * w, 16)
        t = torch.rand(1, generator=gen)  # Flux's timestep is in [0, 1]
        samples.append(dict(
            hidden_states=(1 - t) * image + t * noise,  # rectified flow
            encoder_hidden_states=torch.randn(1, lt, 32, generator=gen),
            pooled_projections=torch.randn(1, 16, generator=gen), timestep=t,
            img_ids=torch.stack([torch.zeros(h * w), rows.reshape(-1), cols.reshape(-1)], 1),
            txt_ids=torch.zeros(lt, 3),
        ))  # fmt: skip
        targets.append(noise - image)
    return samples, targets


balancer.time_optimizer(opt)  # optional: every opt.step() is a phase of its step
gen = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    samples, targets = make_batch(gen)
    with balancer.timed("forward_backward"):  # optional: where the step's time goes
        outs = model(samples, balancer)  # KF (unbalanced: [model(**s).sample for s in samples])
        per_sample = lambda i, out, targets=targets: ((out - targets[i]) ** 2).mean()  # noqa: E731
        loss = outs.sum(per_sample) / len(samples)  # KF (unbalanced: sum over the outputs)
        loss.backward()  # DDP averages the gradients over the ranks
    opt.step()
    opt.zero_grad()
    if rank == 0:
        s = balancer.last_plan.stats
        print(f"step {step}: rank 0 loss {loss.item():.4f}, imbalance "
              f"{s.imbalance_before:.2f} -> {s.imbalance_after:.2f}")  # fmt: skip
balancer.finish()  # KF
balancer.close()  # KF
dist.barrier()  # no rank tears the default group down while a peer still uses it
dist.destroy_process_group()
