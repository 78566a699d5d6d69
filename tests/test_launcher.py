"""The launcher, the one way this project starts worker processes, with real workers:
results by rank, the failing rank named once, stalls blamed on the rank that stalled,
Ctrl-C turned into a stop flag, and no other module that creates processes."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from knapformer.local.launcher import (
    WorkerFailed,
    launch,
    report_progress,
    run_fresh,
    send,
    stop_requested,
)

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ worker functions
# Module level, so that the fork server's children can import them by name.
def _sum_of_ranks(rank: int, world: int, tag: str) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    send(("hello", rank))
    return {"rank": rank, "world": world, "sum": float(total), "tag": f"{tag}{rank}"}


def _rank2_raises(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    send(os.getpid())
    dist.barrier()
    if rank == 2:
        raise ValueError("rank two is broken")
    if rank == 0:
        time.sleep(600)  # outside any collective: only the launcher can stop it
    dist.all_reduce(torch.ones(1))  # fails once rank 2 is gone


def _rank1_hangs(rank: int, world: int, how: str) -> None:
    import torch.distributed as dist

    for step in range(3):
        if rank == 1 and step == 2 and how == "sleep":
            time.sleep(600)  # behind: the others report step 2 and wait for it
        report_progress(step)
        if rank == 1 and step == 2 and how == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)  # at the others' step, but frozen
        dist.barrier()


def _until_stopped(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    step = 0
    while True:
        report_progress(step)
        flag = torch.tensor([float(stop_requested())])
        dist.all_reduce(flag)  # every rank leaves after the same step
        if flag.item() > 0:
            send(("left", step))
            return step
        if rank == 0:
            send(("step", step))
        time.sleep(0.02)
        step += 1


def _sigint_dispositions(rank: int, world: int) -> tuple[bool, bool]:
    """(this worker ignores SIGINT, its fork server ignores SIGINT)."""
    status = Path(f"/proc/{os.getppid()}/status").read_text()
    ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
    server_ignores = bool(ignored >> (signal.SIGINT - 1) & 1)
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN, server_ignores


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -------------------------------------------------------------------------- tests
def test_results_come_back_by_rank_and_messages_name_their_sender():
    seen = []
    results = launch(_sum_of_ranks, 3, ("w",), on_message=lambda r, m: seen.append((r, m)))
    assert results == [{"rank": r, "world": 3, "sum": 3.0, "tag": f"w{r}"} for r in range(3)]
    assert sorted(seen) == [(r, ("hello", r)) for r in range(3)]


def test_the_first_failure_stops_the_rest_and_is_named_once():
    pids: list[int] = []
    with pytest.raises(WorkerFailed) as caught:
        launch(_rank2_raises, 4, on_message=lambda rank, pid: pids.append(pid), grace_s=2)
    err = caught.value
    # Ranks 1 and 3 failed too, in their collective, after rank 2: only rank 2 is named.
    assert err.rank == 2
    assert str(err) == "worker rank 2 raised ValueError: rank two is broken"
    assert "_rank2_raises" in err.traceback and "rank two is broken" in err.traceback
    assert "Connection closed" not in err.traceback
    # Rank 0 was asleep outside any collective: the launcher stopped it.
    assert len(pids) == 4 and not any(_running(pid) for pid in pids)


def test_a_stalled_rank_is_named_not_the_peers_waiting_for_it():
    with pytest.raises(WorkerFailed) as caught:
        launch(_rank1_hangs, 3, ("sleep",), stall_s=2, grace_s=1)
    assert caught.value.rank == 1
    assert re.fullmatch(
        r"worker rank 1 stalled at step 1 for \d+ s while the others reached step 2",
        str(caught.value),
    ), str(caught.value)


def test_a_deadline_stops_a_hung_world_and_names_the_frozen_rank():
    # Rank 1 reported the same step as the others, then froze (SIGSTOP): only its
    # missing heartbeat tells it from its peers, which wait in the barrier.
    with pytest.raises(WorkerFailed) as caught:
        launch(_rank1_hangs, 3, ("freeze",), deadline_s=25, grace_s=1)
    message = str(caught.value)
    assert caught.value.rank == 1
    assert message.startswith("worker rank 1 stopped responding at step 2 (no sign of life")
    assert message.endswith("stopped at the 25 s deadline")


@pytest.fixture
def ctrl_c_as_in_a_script():
    """Python's own SIGINT handler for the test: a suite started as a background job
    (``make test &``) inherits SIGINT ignored, and a Ctrl-C sent to it would never come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_sets_the_stop_flag_and_the_workers_leave_together(ctrl_c_as_in_a_script):
    seen = []

    def on_message(rank, message):
        seen.append((rank, message))
        if message == ("step", 3):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the launcher

    with pytest.raises(KeyboardInterrupt):
        launch(_until_stopped, 3, on_message=on_message)
    left = {rank: step for rank, (kind, step) in seen if kind == "left"}
    assert sorted(left) == [0, 1, 2], seen  # every worker left on its own ...
    assert len(set(left.values())) == 1 and left[0] >= 3  # ... after the same step


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_workers_start_with_ctrl_c_ignored_and_the_parent_keeps_it():
    # A terminal's Ctrl-C reaches the workers too; one still bootstrapping must not die
    # with a traceback, so they are born ignoring it: their fork server ignores it.
    before = signal.getsignal(signal.SIGINT)
    assert launch(_sigint_dispositions, 2) == [(True, True)] * 2
    assert signal.getsignal(signal.SIGINT) is before


KILLED = """
import os, signal, sys
from knapformer.local.launcher import WorkerFailed, launch

def work(rank, world):
    import torch, torch.distributed as dist
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # the peers fail here, because rank 2 is gone

if __name__ == "__main__":
    try:
        launch(work, 4)
    except WorkerFailed as err:
        sys.exit(f"error: {err}")
"""


def test_a_killed_worker_is_named_as_itself_without_peer_tracebacks(tmp_path):
    # In a fresh interpreter, so that everything the workers print is captured here.
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 1, output
    assert out.stderr.strip() == "error: worker rank 2 died (SIGKILL)", output
    assert "Traceback" not in output and "Connection closed" not in output


# ------------------------------------------------------------- one way to start workers
PROCESS_MODULES = (
    "multiprocessing",
    "torch.multiprocessing",
    "torch.distributed.elastic.multiprocessing",
    "concurrent.futures.process",
)
SOURCE_DIRS = ("knapformer", "dashboard", "visualization", "tests", "bench", "examples", "docs")


def _process_apis(path: Path) -> list[str]:
    """The process-creating APIs ``path`` imports or calls (running a command with
    ``subprocess`` is not creating workers)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr.startswith(("fork", "spawn", "posix_spawn"))
        ):
            names = [f"os.{node.attr}"]
        found += [
            name
            for name in names
            if name.startswith("os.")
            or name.endswith("ProcessPoolExecutor")
            or any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES)
        ]
    return found


def test_the_scan_sees_each_way_of_creating_processes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import multiprocessing as mp\nimport torch.multiprocessing\n"
        "from torch import multiprocessing\nfrom concurrent.futures import ProcessPoolExecutor\n"
        "import os, subprocess\nos.fork()\nsubprocess.run(['ls'])\nos.cpu_count()\n"
    )
    assert _process_apis(sample) == [
        "multiprocessing",
        "torch.multiprocessing",
        "torch.multiprocessing",
        "concurrent.futures.ProcessPoolExecutor",
        "os.fork",
    ]


def test_only_the_launcher_creates_processes():
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")] + list(ROOT.glob("*.py"))
    creators = {str(p.relative_to(ROOT)): apis for p in files if (apis := _process_apis(p))}
    assert list(creators) == ["knapformer/local/launcher.py"], creators


def test_run_fresh_returns_from_another_interpreter_and_names_what_it_raised():
    assert run_fresh(os.getpid) != os.getpid()
    assert run_fresh(divmod, 17, 5) == (3, 2)
    with pytest.raises(WorkerFailed, match="raised ValueError: invalid literal") as failed:
        run_fresh(int, "seventeen")
    assert "Traceback" in failed.value.traceback
