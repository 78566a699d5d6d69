"""DistributedDataParallel and a balanced model: synchronised, or refused.

DDP all-reduces gradients from hooks that its own forward arms. ``DDP(balance(model))``
runs the balanced forward inside DDP's, and works. A model that a DDP wraps (as
``accelerator.prepare`` does) but that is balanced and run outside that DDP's forward,
``balance(ddp.module)``, would leave every rank with its own gradients, silently: it is
refused. The live DDPs holding the model are found once, at the first step (a scan of
the garbage collector's objects); a DDP made after that is not seen.

DDP all-reduces each gradient bucket as soon as it is ready in backward, on its process
group, while the balanced backward runs its own collectives (route, per-sample rows,
Ulysses): on one group the ranks would issue them in different orders. So under DDP the
balancer must have a group of its own (``SequenceBalancer(..., process_group=
torch.distributed.new_group())``); the default one is refused.
"""

from __future__ import annotations

import gc
import weakref

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from knapformer.errors import KnapformerError


class DdpGuard:
    """Raises when ``model`` is under a DDP whose forward is not the one running."""

    def __init__(self, model: nn.Module):
        self.model = weakref.ref(model)
        self.holders: list[weakref.ref] | None = None

    def check(self, balancer) -> None:
        model = self.model()
        if model is None:
            return
        if self.holders is None:
            self.holders = [weakref.ref(d) for d in _live_ddps() if _holds(d.module, model)]
        running = DistributedDataParallel._get_active_ddp_module()
        if running is not None and balancer is not None and _shared(running, balancer):
            raise KnapformerError(
                "under DistributedDataParallel the balancer needs a process group of its "
                "own (DDP all-reduces gradients on its group during backward, while the "
                "balanced backward runs its exchanges): SequenceBalancer(..., "
                "process_group=torch.distributed.new_group())"
            )
        for ref in self.holders:
            ddp = ref()
            if ddp is None or ddp is running or getattr(ddp, "_use_python_reducer", False):
                continue
            raise KnapformerError(
                f"the balanced {type(model).__name__} is wrapped in DistributedDataParallel but "
                "runs outside its forward, so its gradients would not be synchronised: wrap "
                "the balanced module instead, DDP(balance(model)), and call the DDP "
                "(docs/diffusers.md, 'DDP, FSDP2 and accelerate')"
            )


def _shared(ddp: DistributedDataParallel, balancer) -> bool:
    """Whether the balancer's collectives run on the DDP's process group."""
    mine = balancer.group if balancer.group is not None else dist.group.WORLD
    theirs = ddp.process_group
    world = dist.distributed_c10d._get_default_group()
    return mine is theirs or (
        mine in (dist.group.WORLD, world) and theirs in (dist.group.WORLD, world)
    )


def _live_ddps() -> list[DistributedDataParallel]:
    return [o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel)]


def _holds(root: nn.Module, model: nn.Module) -> bool:
    return any(m is model for m in root.modules())
