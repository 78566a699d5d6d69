"""A complete balanced training loop: CPU, gloo, 4 processes.

Run: ``torchrun --standalone --nproc-per-node 4 docs/examples/train_balanced.py
[--plan-ahead]`` (docs/integration.md shows its output). With CUDA, use "nccl", CUDA
tensors and ``torch.cuda.set_device``. ``--plan-ahead`` gathers and plans each next step
on a side channel while this one trains; the plans are the same.
"""

import sys

import torch
import torch.distributed as dist

from knapformer import SequenceBalancer
from knapformer.local.models import ToyDiT

AHEAD = "--plan-ahead" in sys.argv
STEPS, D = 3, 64

dist.init_process_group("gloo")  # "nccl" with CUDA tensors on GPUs
rank = dist.get_rank()
torch.manual_seed(0)  # same initial weights on every rank
model = ToyDiT(d_model=D, n_heads=4, n_layers=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
balancer = SequenceBalancer("g1n2+g2n1", plan_ahead=AHEAD)  # bags [0] [1] [2,3]
balancer.time_optimizer(opt)  # every opt.step() is the step's optimizer phase

gen = torch.Generator().manual_seed(rank)
batches = []  # this rank's packed batches: very different sequence lengths on different ranks
for _ in range(STEPS):
    seq_lens = torch.randint(8, 64 if rank else 700, (4,), generator=gen).tolist()
    x = torch.randn(sum(seq_lens), D, generator=gen)
    batches.append((seq_lens, x, torch.randn(sum(seq_lens), D, generator=gen)))

for step, (seq_lens, x, target) in enumerate(batches):
    plan = balancer.plan_routing(seq_lens, token_dim=D)  # same plan on every rank
    if step + 1 < STEPS:  # the loader knows the next batch: plan it while this one trains
        balancer.prefetch(batches[step + 1][0], token_dim=D)  # no-op without plan_ahead
    with balancer.timed("forward_backward"):  # one line per phase of your loop
        out = model(x, seq_lens, balancer=balancer)  # route -> blocks -> reverse_route
        loss = torch.nn.functional.mse_loss(out, target, reduction="sum")  # rows match x
        loss.backward()
    for p in model.parameters():  # data parallel: sum gradients over ranks, timed as waiting
        balancer.all_reduce(p.grad)
    opt.step()  # timed as the optimizer phase (time_optimizer, above)
    opt.zero_grad()
    if rank == 0:
        s, before = plan.stats, balancer.previous_timings  # {} before the first step ended
        print(
            f"step {plan.step}: imbalance {s.imbalance_before:.2f} -> {s.imbalance_after:.2f}, "
            f"moved {s.moved_tokens} of {s.total_tokens} tokens, "
            f"plan {plan.measurements.plan_ms:.1f} ms"
            + (f"; step before: {before['compute']:.1f} ms of compute" if before else "")
        )
balancer.finish()  # collective: the last step's times reach the recorder too
balancer.close()  # waits for every rank, then destroys the balancer's sub-groups
dist.barrier()  # no rank tears the default group down while a peer still uses it
dist.destroy_process_group()
