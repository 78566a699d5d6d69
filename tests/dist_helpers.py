"""Run a function on a real gloo process group of spawned CPU processes.

Each worker writes its return value with ``torch.save``; the parent reads them back,
so assertions (and their messages) live in the test process.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from knapformer.local.local_world import join

# torch's first backward() imports symbolic_shapes (and sympy): seconds per process.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.fx.experimental.symbolic_shapes",
    "numpy",
    "knapformer.balancer",
    "knapformer.local.models",
]


def _entry(
    rank: int, fn: Callable, world: int, out_dir: str, args: tuple, backend: str = "gloo"
) -> None:
    join(rank, world, f"file://{out_dir}/rendezvous", timeout_s=60, backend=backend)
    try:
        result = fn(rank, world, *args)
    except BaseException:
        # spawn reports only the first rank to die, often a peer of the real failure
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_world(fn: Callable, world: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; their results by rank."""
    return run_world_backend(fn, world, tmp_path, "gloo", *args)


def run_world_backend(
    fn: Callable, world: int, tmp_path: Path, backend: str, *args: Any
) -> list[Any]:
    """Like `run_world` on the given backend (``"nccl"`` for the CUDA path)."""
    out_dir = tmp_path / f"world{world}"
    out_dir.mkdir(parents=True, exist_ok=True)
    # A fork server that imported torch once starts every worker of the session in
    # milliseconds instead of seconds; it has run no torch ops, so forking it is safe.
    multiprocessing.set_forkserver_preload(_PRELOAD)
    mp.start_processes(
        _entry,
        args=(fn, world, str(out_dir), args, backend),
        nprocs=world,
        start_method="forkserver",
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
