"""One rank of a job started the way torchrun starts one (``env://``: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), without the demo's launcher, for the
tests and ``bench/exit_aborts.py``: how a rank's failure reaches its peers, and how each
process ends, when nothing but torch and the balancer is there.

    python -m knapformer.testing.torchrun_job --job balanced --fault raise --fault-rank 3

``--job plain`` runs an all-to-all and an all-reduce per step, torch only (the control);
``--job balanced`` trains a ToyDiT through a `SequenceBalancer`. At step `FAIL_STEP`, rank
``--fault-rank`` raises an out-of-memory error in its own code, between the balancer's
calls (``raise``), or is killed (``kill``). Nothing catches anything; with ``--no-close``
the culprit never closes its balancer, so only ``sys.excepthook`` can tell its peers. A
surviving rank prints ``named: <its error>`` on stdout before its exception ends it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist

STEPS, FAIL_STEP = 5, 2


def _fail(fault: str) -> None:
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def plain(rank: int, fault: str, fault_rank: int) -> None:
    world = dist.get_world_size()
    for step in range(STEPS):
        x = torch.randn(world * 16, 32)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        if rank == fault_rank and step == FAIL_STEP:
            _fail(fault)
        dist.all_reduce(out)


def balanced(rank: int, fault: str, fault_rank: int, close: bool) -> None:
    from contextlib import nullcontext

    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer

    topology = {2: "g2n1", 4: "g1n2+g2n1", 8: "g1n2+g2n1+g4n1"}[dist.get_world_size()]
    balancer = SequenceBalancer(topology)
    torch.manual_seed(0)
    model = ToyDiT(32, 4, 1)
    culprit = rank == fault_rank
    try:
        with balancer if close or not culprit else nullcontext():
            for step in range(STEPS):
                lengths = [8 + rank, 5 + step]
                balancer.plan_routing(lengths, token_dim=32)
                if culprit and step == FAIL_STEP:
                    _fail(fault)  # the training loop's own code, between the balancer's calls
                model(torch.randn(sum(lengths), 32), lengths, balancer).sum().backward()
                balancer.all_reduce(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            balancer.finish()
    except Exception as err:
        if not culprit:
            print(f"named: {type(err).__name__}: {err}", flush=True)
        raise


def _init(timeout_s: float) -> None:
    """The process group, over a TCPStore on rank 0 as torchrun's: the ranks first meet in
    the store (as long as their imports take), then join a group whose collectives wait at
    most ``timeout_s``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world)])  # every rank has imported torch
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("plain", "balanced"), default="balanced")
    parser.add_argument("--fault", choices=("raise", "kill"), default="raise")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5.0, help="the group timeout (s)")
    parser.add_argument("--no-close", action="store_true", help="the culprit never closes")
    args = parser.parse_args()
    _init(args.timeout)
    rank = dist.get_rank()
    if args.job == "plain":
        plain(rank, args.fault, args.fault_rank)
    else:
        balanced(rank, args.fault, args.fault_rank, not args.no_close)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
