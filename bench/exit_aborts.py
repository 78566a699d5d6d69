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
the other ends (exit 1 with a Python traceback, the expected end of a survivor), and each
aborted process is listed with the last lines it printed; ``struck`` counts the jobs in
which the fault struck (the failing rank printed the simulated error, or was killed). The
two kinds of job run in turn, so that both see the same machine.

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
JOBS = ("plain", "balanced")


# ----------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    job: str, fault: str, world: int, fault_rank: int, timeout: float
) -> list[tuple[str, str]]:
    """One job of ``world`` processes; how each ended (``ok``, ``exit N``, ``abort``:
    SIGABRT or "terminate called", or ``signal NAME``) and the last lines it printed."""
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
            end = _end(proc.returncode, err)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            end = "hung"
        ends.append((end, " | ".join(err.strip().splitlines()[-2:])[-240:]))
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
    print(f"{'fault':<6} {'job':<9} {'struck':>7} {'processes':>9} {'aborts':>7} "
          f"{'jobs with one':>14}  how the others ended")  # fmt: skip
    aborts = []
    for fault in ("raise", "kill"):
        ends: dict[str, Counter] = {job: Counter() for job in JOBS}
        aborted_jobs, struck = Counter(), Counter()
        for run in range(args.runs):
            for job in JOBS:  # in turn: both kinds of job see the same machine
                job_ends = run_job(job, fault, args.world, args.fault_rank, args.timeout)
                ends[job].update(end for end, _ in job_ends)
                aborted_jobs[job] += any(end == "abort" for end, _ in job_ends)
                end, tail = job_ends[args.fault_rank]
                struck[job] += "(simulated)" in tail or end == "signal SIGKILL"
                aborts += [(fault, job, run, rank, tail) for rank, (end, tail)
                           in enumerate(job_ends) if end == "abort"]  # fmt: skip
        for job in JOBS:
            seen = ends[job]
            others = ", ".join(f"{n} {end}" for end, n in sorted(seen.items()) if end != "abort")
            print(f"{fault:<6} {job:<9} {struck[job]:>7} {sum(seen.values()):>9} "
                  f"{seen['abort']:>7} {aborted_jobs[job]:>7} of {args.runs:<4}  {others}",
                  flush=True)  # fmt: skip
    for fault, job, run, rank, tail in aborts:
        who = "the failing rank" if rank == args.fault_rank else "a survivor"
        print(f"abort: {fault} {job}, run {run}, rank {rank} ({who}): {tail}")
    print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
