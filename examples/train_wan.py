"""Train a tiny random diffusers Wan (text-to-video) model balanced across CPU processes.

Run: ``torchrun --standalone --nproc-per-node 4 examples/train_wan.py [--steps 20]
[--out runs/wan]``, then ``knapformer stragglers runs/wan/plans.jsonl`` or
``knapformer dashboard runs/wan``. Videos of mixed sizes and frame counts, prompts of
mixed lengths (zero-padded to one length, as the Wan pipeline pads them), and rank 0
gets the long videos. Data parallel by hand here (one all-reduce per gradient); lines
marked ``# KF`` are what balancing changes in the unbalanced loop (docs/diffusers.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from knapformer import PlanRecorder, SequenceBalancer  # KF
from knapformer.integrations.diffusers import balance  # KF

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
topology = "g1n2+g2n1" if world == 4 else f"g1n{world}"  # KF
balancer = SequenceBalancer(
    topology, run="wan", recorder=PlanRecorder(args.out / "plans.jsonl")
)  # KF
balanced = balance(model)  # KF
PROMPT_LEN = 24


def make_batch(gen: torch.Generator) -> tuple[list[dict], list[torch.Tensor]]:
    """This rank's videos: rank 0 trains on long ones, the others on clips."""
    frames, side = ([4, 6, 8], [12, 16]) if rank == 0 else ([1, 2], [4, 8])
    samples, targets = [], []
    for _ in range(2):
        f = frames[int(torch.randint(len(frames), (), generator=gen))]
        s = side[int(torch.randint(len(side), (), generator=gen))]
        video, noise = torch.randn(1, 8, f, s, s, generator=gen), torch.randn(1, 8, f, s, s)
        prompt = torch.zeros(1, PROMPT_LEN, 32)
        n = int(torch.randint(4, PROMPT_LEN, (), generator=gen))
        prompt[0, :n] = torch.randn(n, 32, generator=gen)
        t = torch.rand(1, generator=gen)  # rectified flow; Wan's timesteps are t * 1000
        samples.append(dict(hidden_states=(1 - t) * video + t * noise, timestep=t * 1000,
                            encoder_hidden_states=prompt))  # fmt: skip
        targets.append(noise - video)
    return samples, targets


balancer.time_optimizer(opt)  # optional: every opt.step() is a phase of its step
gen = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    samples, targets = make_batch(gen)
    with balancer.timed("forward_backward"):  # optional: where the step's time goes
        outs = balanced(samples, balancer)  # KF (unbalanced: [model(**s).sample for s in samples])
        per_sample = lambda i, out, targets=targets: ((out - targets[i]) ** 2).mean()  # noqa: E731
        loss = outs.sum(per_sample) / len(samples)  # KF (unbalanced: sum over the outputs)
        loss.backward()
    for p in model.parameters():  # data parallel: average the gradients
        balancer.all_reduce(p.grad)  # KF (dist.all_reduce, timed as waiting)
        p.grad /= world
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
