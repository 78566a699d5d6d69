"""GPU memory per NCCL communicator, made as the balancer makes its groups
(`knapformer.runtime.groups.share_options`): one process, NCCL at world size 1 bound to
GPU 0 (so that torch splits new groups from it), ``--groups`` groups of this rank, each
used once; the memory is the drop in the device's free memory. Prints one JSON line.

A one-rank communicator has no peers, hence no per-peer buffers: the figure is the floor
of what a communicator costs, not what one of g GPUs holds. ``bench/gpu.py`` (part 4)
runs this twice, with ``KNAPFORMER_SHARE_COMMUNICATORS`` 1 and 0, a process each (NCCL
reads its own switch once per process).

    python bench/comm_memory.py [--groups 8]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from knapformer.runtime.groups import share_options


def _sharing(options) -> str:
    """How sharing was asked for: not at all, per communicator, or by NCCL's switch."""
    if options is None:
        return "off"
    return "config.split_share" if hasattr(options.config, "split_share") else "NCCL env"


def measure(groups: int) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        x = torch.ones(1, device=device)
        dist.all_reduce(x)  # the default group's communicator, before counting
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(device)[0]
        made = []
        for _ in range(groups):
            made.append(dist.new_group([0], pg_options=share_options("nccl")))
            dist.all_reduce(x, group=made[-1])
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info(device)[0]
        world = dist.group.WORLD._get_backend(device)
        splits = world.comm_split_count() if hasattr(world, "comm_split_count") else None
    finally:
        dist.destroy_process_group()
    return {
        "groups": groups,
        "sharing": _sharing(share_options("nccl")),
        "split_from_world": splits,
        "mb_per_communicator": (free_before - free_after) / groups / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    print(json.dumps(measure(parser.parse_args().groups)))


if __name__ == "__main__":
    main()
