"""GPU memory per NCCL communicator made as the balancer makes its groups, sharing
resources or not.

One process, NCCL at world size 1 bound to GPU 0 (so that torch splits new groups from
it), ``--groups`` groups of this rank made with `knapformer.runtime.groups.share_options`,
each used once; the memory is the drop in the device's free memory. Prints one JSON line.

A one-rank communicator has no peers, hence no per-peer buffers: the figure is the floor
of what a communicator costs, not what one of g GPUs holds. ``bench/gpu.py`` (part 4,
`communicator_memory`) runs this twice, with ``KNAPFORMER_SHARE_COMMUNICATORS`` 1 and 0,
a process each (NCCL reads its own switch once per process).

    python bench/comm_memory.py [--groups 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from knapformer.runtime.groups import SHARE_ENV, share_options

COMM_GROUPS = 8  # communicators made in each run


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


# ------------------------------------------------------- bench/gpu.py, part 4
def communicator_memory(device: torch.device) -> dict:
    """MB of GPU memory per communicator, sharing on and off (`bench/comm_memory.py`)."""
    if device.type != "cuda":
        return {"measured": False, "why": "GPU memory needs CUDA"}
    runs = {}
    script = Path(__file__).resolve()
    for name, share in (("shared", "1"), ("own", "0")):
        env = {**os.environ, SHARE_ENV: share}
        cmd = [sys.executable, str(script), "--groups", str(COMM_GROUPS)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"comm_memory.py with sharing {share} failed: {last}")
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"measured": True, **runs}


def print_comms(console: Console, res: dict) -> None:
    if not res["measured"]:
        console.print(f"4. communicators: not measured ({res['why']})")
        return
    table = Table(title="4. GPU memory per NCCL communicator (one-rank groups: the floor)")
    for col in ("resources", "groups", "MB each", "sharing asked by", "split from world"):
        table.add_column(col, justify="right")
    for name in ("shared", "own"):
        r = res[name]
        table.add_row(name, str(r["groups"]), f"{r['mb_per_communicator']:.1f}",
                      r["sharing"], str(r["split_from_world"]))  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=COMM_GROUPS)
    print(json.dumps(measure(parser.parse_args().groups)))


if __name__ == "__main__":
    main()
