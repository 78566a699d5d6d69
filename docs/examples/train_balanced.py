"""A complete balanced training loop: CPU, gloo, 4 processes.

Run: ``torchrun --standalone --nproc-per-node 4 docs/examples/train_balanced.py``
(docs/integration.md shows its output). With CUDA, use "nccl", CUDA tensors and
``torch.cuda.set_device``.
"""

import torch
import torch.distributed as dist

from knapformer import SequenceBalancer
from knapformer.local.models import ToyDiT

dist.init_process_group("gloo")  # "nccl" with CUDA tensors on GPUs
rank = dist.get_rank()
torch.manual_seed(0)  # same initial weights on every rank
model = ToyDiT(d_model=64, n_heads=4, n_layers=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
balancer = SequenceBalancer("g1n2+g2n1")  # bags [0] [1] [2,3]

gen = torch.Generator().manual_seed(rank)
for _ in range(3):
    # this rank's packed batch: very different sequence lengths on different ranks
    seq_lens = torch.randint(8, 64 if rank else 700, (4,), generator=gen).tolist()
    x = torch.randn(sum(seq_lens), 64, generator=gen)
    target = torch.randn(sum(seq_lens), 64, generator=gen)

    plan = balancer.plan_routing(seq_lens, token_dim=64)  # same plan on every rank
    out = model(x, seq_lens, balancer=balancer)  # route -> blocks -> reverse_route
    loss = torch.nn.functional.mse_loss(out, target, reduction="sum")  # rows match x
    loss.backward()
    for p in model.parameters():  # data parallel: sum gradients over ranks
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        s = plan.stats
        print(
            f"step {plan.step}: imbalance {s.imbalance_before:.2f} -> {s.imbalance_after:.2f}, "
            f"moved {s.moved_tokens} of {s.total_tokens} tokens, "
            f"plan {plan.measurements.plan_ms:.1f} ms"
        )
balancer.close()
dist.destroy_process_group()
