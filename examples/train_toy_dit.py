"""Train the reference ToyDiT with the KnapFormer balancer under torchrun, recording every
routing plan. The same code runs on gloo (CPU) and NCCL (one GPU per rank):

    torchrun --nproc_per_node 8 examples/train_toy_dit.py --steps 50 --out runs/toy
    knapformer dashboard runs/toy/plans.jsonl      # or: knapformer show runs/toy/plans.jsonl

Recording needs three lines (marked ``# (1)`` .. ``# (3)`` below).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from knapformer import PlanRecorder, SequenceBalancer
from knapformer.contract.topology import Topology
from knapformer.local.demo import DEMO_CODES, default_topology, model_shape, rank_codes
from knapformer.local.models import ToyDiT
from knapformer.planning.datamix import parse_mix, sample_lengths


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--topology", default=None, help="default: bags of 1, 1, 2, 4, ... GPUs")
    p.add_argument("--data-codes", default=DEMO_CODES, help="mix name or gGbBiIfFsS codes")
    p.add_argument("--length-scale", type=float, default=1 / 16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", type=Path, default=Path("runs/toy"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # several CPU ranks share the machine
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    topology = Topology.parse(args.topology or default_topology(world))
    d_model, n_heads = model_shape(topology)  # heads divisible by every bag size
    codes = rank_codes(parse_mix(args.data_codes), world)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ToyDiT(d_model, n_heads, args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    recorder = PlanRecorder(args.out / "plans.jsonl")  # (1) only rank 0 of a group writes
    balancer = SequenceBalancer(topology, recorder=recorder, run="toy")  # (2)
    balancer.time_optimizer(optimizer)  # every optimizer.step() is a phase of its step
    for step in range(args.steps):
        rng = np.random.default_rng([step, rank])
        lengths = sample_lengths([codes[rank]], rng, args.length_scale)[0]
        # A flow-matching target: each sequence's tokens are noisy views of one latent.
        latent = torch.randn(len(lengths), d_model).repeat_interleave(torch.as_tensor(lengths), 0)
        noise = torch.randn_like(latent)
        t = torch.rand(len(lengths), 1).repeat_interleave(torch.as_tensor(lengths), 0)
        noisy, target = ((1 - t) * latent + t * noise).to(device), (noise - latent).to(device)

        plan = balancer.plan_routing(lengths, token_dim=d_model)
        with balancer.timed("forward_backward"):
            pred = model(noisy, lengths.tolist(), balancer)  # route -> blocks -> reverse_route
            # This rank's share of the group's mean loss; summing gradients over the ranks
            # (below) then gives the gradient of the mean over all tokens of all replicas.
            elems = float(plan.sequences.length.sum()) * d_model * balancer.num_replicas
            sq_err = (pred - target).square().sum()
            optimizer.zero_grad()
            (sq_err / elems).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads] + [sq_err.detach().reshape(1)])
        balancer.all_reduce(flat)  # data parallel (DDP would do the same), timed as waiting
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()
        if rank == 0:
            stats = plan.stats
            print(
                f"step {step:3d}  loss {float(flat[-1]) / elems:.4f}  imbalance "
                f"{stats.imbalance_before:.2f} -> {stats.imbalance_after:.2f}  "
                f"moved {stats.moved_tokens} tokens",
                flush=True,
            )
    balancer.finish()  # optional: the last steps' measured times too
    balancer.close()  # (3) flushes the recorder
    dist.barrier()  # no rank tears the default group down while a peer still uses it
    dist.destroy_process_group()
    if rank == 0:
        print(f"plans in {args.out / 'plans.jsonl'}")


if __name__ == "__main__":
    main()
