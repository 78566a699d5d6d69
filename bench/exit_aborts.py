"""How often a process aborts at exit (SIGABRT, or gloo's "terminate called without an
active exception") after a rank of its job failed: a balanced job against a plain-torch
control with the same fault, in the same run.

Each run starts ``--world`` processes as torchrun would (``env://``, a TCPStore on rank 0's
port), on gloo with a ``--timeout`` s group timeout: `knapformer.testing.torchrun_job`. The
plain job runs an all-to-all and an all-reduce per step; the balanced job trains a ToyDiT
through `SequenceBalancer` and runs the same all-reduce. At step 2, rank ``--fault-rank``
raises an out-of-memory error in its own code (``raise``) or is killed (``kill``); nothing
catches anything, so every process ends the way an uncaught exception ends a torchrun
worker. A process counts as
an abort when it ended by SIGABRT or printed "terminate called"; the table also counts
the other ends (exit 1 with a Python traceback, the expected end of a survivor).

    python bench/exit_aborts.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from knapformer.testing.torchrun_job import FAIL_STEP

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(job: str, fault: str, world: int, fault_rank: int, timeout: float) -> list[str]:
    """One job of ``world`` processes; how each ended: ``ok``, ``exit N``, ``abort``
    (SIGABRT or "terminate called") or ``signal NAME``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), PYTHONPATH=str(ROOT))  # fmt: skip
    procs = []
    command = [sys.executable, "-m", "knapformer.testing.torchrun_job", "--job", job, "--fault",
               fault, "--fault-rank", str(fault_rank), "--timeout", str(timeout)]  # fmt: skip
    for rank in range(world):
        procs.append(subprocess.Popen(command, env=env | {"RANK": str(rank)},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    ends = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=10 * timeout + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            ends.append("hung")
            continue
        ends.append(_end(proc.returncode, err))
    return ends


def _end(code: int, stderr: str) -> str:
    if code == -signal.SIGABRT or "terminate called" in stderr:
        return "abort"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return "ok" if code == 0 else f"exit {code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="jobs per fault and kind of job")
    parser.add_argument("--world", type=int, default=4, choices=(4, 8))
    parser.add_argument("--timeout", type=float, default=5.0, help="the group timeout (s)")
    parser.add_argument("--fault-rank", type=int, default=3)
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"{args.runs} jobs of {args.world} gloo processes per row; rank {args.fault_rank} fails "
          f"at step {FAIL_STEP}; group timeout {args.timeout:g} s")  # fmt: skip
    print(f"{'fault':<6} {'job':<9} {'processes':>9} {'aborts':>7} {'jobs with one':>14}  "
          "how the others ended")  # fmt: skip
    for fault in ("raise", "kill"):
        for job in ("plain", "balanced"):
            ends, aborted_jobs = Counter(), 0
            for _ in range(args.runs):
                job_ends = run_job(job, fault, args.world, args.fault_rank, args.timeout)
                ends.update(job_ends)
                aborted_jobs += "abort" in job_ends
            others = ", ".join(f"{n} {end}" for end, n in sorted(ends.items()) if end != "abort")
            print(f"{fault:<6} {job:<9} {sum(ends.values()):>9} {ends['abort']:>7} "
                  f"{aborted_jobs:>7} of {args.runs:<4}  {others}", flush=True)  # fmt: skip
    print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
