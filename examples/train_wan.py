"""Train a tiny random diffusers Wan (text-to-video) model balanced across CPU processes.

Run: ``torchrun --standalone --nproc-per-node 4 examples/train_wan.py [--steps 20]
[--out runs/wan]``, then ``knapformer stragglers runs/wan/plans.jsonl`` or
``knapformer dashboard runs/wan``. Videos of mixed sizes and frame counts, prompts of
mixed lengths (zero-padded to one length, as the Wan pipeline pads them), and rank 0
gets the long videos. Lines marked ``# KF`` are what balancing adds to an unbalanced
loop (docs/diffusers.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from knapformer import PlanRecorder, SequenceBalancer  # KF
from knapformer.integrations.diffusers import BalancedWan, WanBatch  # KF

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--out", type=Path, default=Path("runs/wan"))
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights on every rank
model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4,
                              attention_head_dim=16, in_channels=8, out_channels=8,
                              text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2,
                              cross_attn_norm=True, rope_max_seq_len=64)  # fmt: skip
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
balancer = SequenceBalancer(
    "g1n2+g2n1" if world == 4 else f"g1n{world}",  # KF
    recorder=PlanRecorder(args.out / "plans.jsonl"),
    run="wan",
)  # KF
balanced = BalancedWan(model)  # KF
PROMPT_LEN = 24


def make_batch(gen: torch.Generator) -> tuple[WanBatch, list[torch.Tensor]]:
    """This rank's videos (C, F, H, W): rank 0 trains on long ones, the others on clips."""
    frames, side = ([4, 6, 8], [12, 16]) if rank == 0 else ([1, 2], [4, 8])
    latents, noise = [], []
    for _ in range(2):
        f = frames[int(torch.randint(len(frames), (), generator=gen))]
        s = side[int(torch.randint(len(side), (), generator=gen))]
        latents.append(torch.randn(8, f, s, s, generator=gen))
        noise.append(torch.randn(8, f, s, s, generator=gen))
    text = torch.zeros(2, PROMPT_LEN, 32)
    for i in range(2):
        n = int(torch.randint(4, PROMPT_LEN, (), generator=gen))
        text[i, :n] = torch.randn(n, 32, generator=gen)
    return WanBatch(latents, torch.rand(2, generator=gen), text), noise


gen = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    batch, noise = make_batch(gen)
    plan = balancer.plan_routing(batch.seq_lens(balanced.patch_size), balanced.inner_dim)  # KF
    t = batch.timestep  # in [0, 1]: rectified flow, Wan's timesteps are t * 1000
    noisy = [(1 - ti) * x + ti * e for ti, x, e in zip(t, batch.latents, noise, strict=True)]
    out = balanced(WanBatch(noisy, t * 1000, batch.text), balancer)  # KF
    target = balanced.patchify([e - x for x, e in zip(batch.latents, noise, strict=True)])
    # Normalise by the tokens of the whole world, not this rank's: the balancer moves
    # tokens, so a per-rank mean would weigh samples differently on different ranks.
    tokens = torch.tensor(float(out.numel()))
    dist.all_reduce(tokens)
    loss = ((out - target) ** 2).sum() / tokens
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
