"""A local process group: worker processes on this machine joined in one gloo group.

The demo, replay, the tests and the benchmarks all start one. Workers fork from a
server that imported torch once (a fresh interpreter importing torch costs seconds of
CPU, and up to 64 workers share a few cores), and they meet through a file in a fresh
folder rather than a TCP port (no race for a free port between picking and binding it).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from multiprocessing.context import BaseContext

#: What every worker needs imported before it forks.
PRELOAD = ("torch", "torch.distributed", "knapformer.balancer")


def worker_context(
    preload: Sequence[str] = PRELOAD, start_method: str = "forkserver"
) -> BaseContext:
    """A multiprocessing context for workers that have ``preload`` imported already.

    ``"forkserver"`` (default): workers fork from a server that imported it, safe
    whatever this process has run, and start with Ctrl-C ignored (`worker_sigint`).
    ``"fork"``: from this process, which imports it now; they inherit its state, patches
    included (unsafe once it has run OpenMP threads). Where the method is not available,
    ``"spawn"``.
    """
    if start_method not in mp.get_all_start_methods():
        start_method = "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*preload, "knapformer.local.worker_sigint"])
    elif start_method == "fork":
        for name in preload:
            importlib.import_module(name)
    return ctx


@contextlib.contextmanager
def rendezvous(prefix: str = "knapformer-") -> Iterator[str]:
    """An ``init_method`` for one group (a file in a fresh folder, removed afterwards)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield f"file://{folder}/rendezvous"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def join(
    rank: int, world: int, init_method: str, timeout_s: float = 120.0, backend: str = "gloo"
) -> None:
    """Join the group from a worker. One CPU thread each: many workers share few cores,
    and a hang fails after ``timeout_s`` instead of blocking forever."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
