"""The one module that starts worker processes: a local process group on this machine.

The demo, replay, the tests and the benchmarks all run their workers with `launch`: it
starts ``world`` processes, joins them in one process group, supervises them and returns
what each rank's function returned. Inside a worker, `send`, `stop_requested` and
`report_progress` talk back to the launcher.

Start: workers fork from a server that imported torch once (a fresh interpreter importing
torch costs seconds of CPU, and up to 64 workers share a few cores); the server also
imports `knapformer.local.worker_sigint`, so workers are born with Ctrl-C ignored. They
meet through a file in a fresh folder rather than a TCP port (no race for a free port
between picking and binding it).

Supervision: the first worker to die or raise stops the rest (SIGTERM, a grace period,
SIGKILL) and is named once: a rank that died without raising (a signal, ``os._exit``),
else the rank whose exception came first. Its peers, which fail in their next collective
because of it, print nothing. A progress watchdog names the rank that stalls: workers
report the step they are at and a thread in each shows that its process is alive; when
the world stops progressing, the rank that shows no sign of life (stopped, or stuck
holding the GIL) or the one behind the others is named, instead of a peer whose
collective timed out. Ctrl-C or SIGTERM in the launcher sets a stop flag the workers can
read, so they leave together after the same step; whatever still runs after the grace
period is terminated. Workers also die with the launcher.

From PyTorch: processes are created by `torch.multiprocessing.start_processes`, the call
torchrun's `torch.distributed.elastic.multiprocessing.MultiprocessContext` makes itself.
The elastic `PContext` around it does not serve for supervision: its ``wait`` names the
first failed process in rank order among those it finds exited (often a peer that failed
because another rank died), then waits up to 30 s for the others; ``start`` installs its
own SIGINT/SIGTERM handlers over the command line's; its error files stamp failures to
the second, too coarse to order a failure before its peers' follow-on errors; and it has
no stop flag, progress watchdog or message stream. Those are written here, once.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as torch_mp

from knapformer.local.signals import deferring_sigint, handling, ignoring_sigint, interrupt

#: What every worker has imported before it forks.
PRELOAD = ("torch", "torch.distributed", "knapformer.balancer")
#: For workers that train: torch's first backward() imports symbolic_shapes (and sympy),
#: seconds per process.
TRAINING_PRELOAD = (*PRELOAD, "torch.fx.experimental.symbolic_shapes", "knapformer.local.models")
_TICK_S = 0.1  # how often the launcher looks at its workers
_HEARTBEAT_S = 1.0  # how often a worker's thread shows that its process is alive
_SETTLE_S = 1.0  # after a failure: time for the peers' follow-on failures to show


class WorkerFailed(RuntimeError):
    """Workers died, raised or stalled. ``ranks``: the ones to blame (empty: none stands
    out); ``rank``: the first of them or None; ``what``: what happened to them;
    ``traceback``: the exception's, when the rank raised."""

    def __init__(self, ranks: Sequence[int], what: str, traceback: str | None = None) -> None:
        who = {0: "the workers", 1: "worker rank"}.get(len(ranks), "worker ranks")
        names = ", ".join(map(str, ranks))
        super().__init__(f"{who} {names} {what}" if ranks else f"{who} {what}")
        self.ranks, self.what, self.traceback = list(ranks), what, traceback
        self.rank = self.ranks[0] if ranks else None
        if traceback:
            self.add_note(f"traceback of worker rank {self.rank}:\n{traceback.rstrip()}")


class _Stopped(SystemExit):
    """SIGTERM in a worker: unwinds its `finally` blocks, then exits without a traceback."""


@dataclass
class _Link:
    """What the launcher shares with every worker (handed to each as it starts)."""

    folder: str  # rendezvous file, per-rank results and failures
    world: int
    backend: str
    group_timeout_s: float
    messages: Any  # multiprocessing Queue of (rank, message)
    stop: Any  # multiprocessing Event: the launcher was asked to stop
    step: Any  # shared int64 per rank: the step it last reported (-1: none yet)
    alive: Any  # shared float per rank: time.monotonic() of its last heartbeat

    def path(self, kind: str, rank: int) -> str:
        return os.path.join(self.folder, f"{kind}{rank}.pkl")


# ------------------------------------------------------------------------ launcher side
def launch(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    on_message: Callable[[int, Any], None] | None = None,
    on_start: Callable[[], None] | None = None,
    deadline_s: float | None = None,
    stall_s: float | None = None,
    grace_s: float = 5.0,
    start_method: str = "forkserver",
    preload: Sequence[str] = PRELOAD,
    backend: str = "gloo",
    group_timeout_s: float = 120.0,
    workdir: Path | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` worker processes joined in one process
    group (``backend``); returns what each rank returned, by rank.

    ``fn`` must be importable by name. ``on_message(rank, message)`` gets what workers
    `send`, as it arrives; ``on_start()`` runs once every worker has started. Raises
    `WorkerFailed` naming the rank when one dies or raises, when none progresses for
    ``stall_s`` and one is to blame, or at ``deadline_s``; ``KeyboardInterrupt`` on
    Ctrl-C or SIGTERM, after giving the workers ``grace_s`` to see `stop_requested` and
    leave. Either way every worker is stopped first (SIGTERM, SIGKILL after ``grace_s``).

    ``start_method``: ``"forkserver"`` forks workers from a server that imported
    ``preload``, safe whatever this process has run; ``"fork"`` forks this process, which
    imports ``preload`` now (workers inherit its state, patches included; unsafe once it
    has run OpenMP threads); where the method is unavailable, ``"spawn"``. ``workdir``:
    where the run's fresh folder goes (default: the system's temporary directory).
    """
    ctx = _context(start_method, preload)
    folder = tempfile.mkdtemp(prefix="knapformer-", dir=workdir)
    link = _Link(
        folder,
        world,
        backend,
        group_timeout_s,
        ctx.Queue(),
        ctx.Event(),
        ctx.Array("q", [-1] * world, lock=False),
        ctx.Array("d", [time.monotonic()] * world, lock=False),
    )
    procs: list[Any] = []
    try:
        with handling(signal.SIGTERM, interrupt):
            try:
                # Cut off half-way, a child still starting would find its resources gone.
                with deferring_sigint():
                    procs = torch_mp.start_processes(
                        _run_rank,
                        (fn, tuple(args), link),
                        world,
                        join=False,
                        start_method=ctx.get_start_method(),
                    ).processes
                if on_start is not None:
                    on_start()
                _supervise(procs, link, on_message, deadline_s, stall_s)
            except KeyboardInterrupt:
                link.stop.set()
                with ignoring_sigint():
                    until = time.monotonic() + grace_s
                    while time.monotonic() < until and any(p.exitcode is None for p in procs):
                        _relay(link, on_message, _TICK_S)
                    _relay(link, on_message, 0)
                raise
        return [_load(link.path("result", rank)) for rank in range(world)]
    finally:
        with ignoring_sigint():  # a second Ctrl-C must not cut the clean-up short
            _terminate(procs, grace_s)
            link.messages.close()
            shutil.rmtree(folder, ignore_errors=True)


def _context(start_method: str, preload: Sequence[str]) -> Any:
    if start_method not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*preload, "knapformer.local.worker_sigint"])
    elif start_method == "fork":
        for name in preload:
            importlib.import_module(name)
    return ctx


def _supervise(procs, link: _Link, on_message, deadline_s, stall_s) -> None:
    """Relay messages until every worker has returned; raise `WorkerFailed` at the first
    failure, at a stall someone is to blame for, or at the deadline."""
    started = time.monotonic()
    steps, moved = list(link.step), started
    while True:
        _relay(link, on_message, _TICK_S)
        codes = [p.exitcode for p in procs]
        if any(code not in (None, 0) for code in codes):
            raise _failure(procs, link, codes)
        if None not in codes:
            _relay(link, on_message, 0)  # what they sent just before returning
            return
        now = time.monotonic()
        if list(link.step) != steps:
            steps, moved = list(link.step), now
        if deadline_s is not None and now - started > deadline_s:
            blame = _stall(procs, link, now - moved)
            if blame is None:
                raise WorkerFailed(
                    [], f"did not finish within {deadline_s:g} s (all {_where(min(steps))})"
                )
            raise WorkerFailed(
                blame.ranks, f"{blame.what}; stopped at the {deadline_s:g} s deadline"
            )
        if stall_s is not None and now - moved > stall_s:
            blame = _stall(procs, link, now - moved)
            if blame is not None:
                raise blame


def _relay(link: _Link, on_message, wait_s: float) -> None:
    """Pass on what workers sent, waiting up to ``wait_s`` for the first message."""
    with contextlib.suppress(queue.Empty):
        rank, message = link.messages.get(timeout=wait_s)
        while True:
            if on_message is not None:
                on_message(rank, message)
            rank, message = link.messages.get_nowait()


def _failure(procs, link: _Link, first_codes: list[int | None]) -> WorkerFailed:
    """The failure to report. Peers of a failed rank fail in their next collective within
    moments, so let them settle, then blame the first rank that died without raising (a
    signal, ``os._exit``: its peers raise), else the rank whose exception came first."""
    until = time.monotonic() + _SETTLE_S
    while time.monotonic() < until and any(p.exitcode is None for p in procs):
        time.sleep(_TICK_S / 2)
    failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
    raised = {
        r: _load(link.path("failure", r)) for r in failed if os.path.exists(link.path("failure", r))
    }
    died = sorted(set(failed) - set(raised), key=lambda r: (first_codes[r] is None, r))
    if died:
        code = procs[died[0]].exitcode
        return WorkerFailed(
            died[:1], f"died ({_signal_name(-code)})" if code < 0 else f"exited with code {code}"
        )
    rank = min(raised, key=lambda r: raised[r][0])
    _, summary, trace = raised[rank]
    return WorkerFailed([rank], f"raised {summary}", trace)


def _stall(procs, link: _Link, quiet_s: float) -> WorkerFailed | None:
    """Whom to blame for a world that stopped progressing: ranks that show no sign of
    life, else the ranks behind the others; None when all are alive at the same step."""
    now = time.monotonic()
    running = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    silent = {r: now - link.alive[r] for r in running}
    frozen = [r for r in running if silent[r] > max(3 * _HEARTBEAT_S, quiet_s / 2)]
    if frozen:
        where, quiet = _where(link.step[frozen[0]]), silent[frozen[0]]
        return WorkerFailed(
            frozen, f"stopped responding {where} (no sign of life for {quiet:.0f} s)"
        )
    steps = {r: link.step[r] for r in running}
    low, high = min(steps.values(), default=0), max(steps.values(), default=0)
    if low == high:
        return None
    behind = [r for r in running if steps[r] == low]
    return WorkerFailed(
        behind, f"stalled {_where(low)} for {quiet_s:.0f} s while the others reached step {high}"
    )


def _where(step: int) -> str:
    return f"at step {step}" if step >= 0 else "before the first step"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _terminate(procs, grace_s: float) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``; reap all."""
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        with contextlib.suppress(OSError):
            p.terminate()
            os.kill(p.pid, signal.SIGCONT)  # a stopped worker must run to handle SIGTERM
    until = time.monotonic() + grace_s
    for p in live:
        p.join(max(0.0, until - time.monotonic()))
    for p in live:
        if p.exitcode is None:
            with contextlib.suppress(OSError):
                p.kill()
            p.join(5)


def _load(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


# -------------------------------------------------------------------------- worker side
_current: tuple[int, _Link] | None = None  # (rank, link) in a launched worker


def send(message: Any) -> None:
    """From a worker: hand ``message`` (small, picklable) to the launcher's ``on_message``."""
    if _current is None:
        raise RuntimeError("send() works only in a worker started by launch()")
    rank, link = _current
    link.messages.put((rank, message))


def stop_requested() -> bool:
    """From a worker: whether the launcher was asked to stop (False outside a worker)."""
    return _current is not None and _current[1].stop.is_set()


def report_progress(step: int) -> None:
    """From a worker: this rank has reached ``step`` (>= 0, growing), so the watchdog can
    name the rank that falls behind. Does nothing outside a launched worker."""
    if _current is not None:
        rank, link = _current
        link.step[rank] = step


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, link: _Link) -> None:
    """A worker process: join the group, run ``fn``, leave its result or failure behind."""
    global _current
    # The launcher decides when workers stop: ignore the terminal's Ctrl-C (the launcher
    # gets it too) and let SIGTERM unwind `finally` blocks (a recorder's flush).
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    parent = os.getppid()
    _current = (rank, link)
    threading.Thread(target=_heartbeat, args=(link.alive, rank), daemon=True).start()
    try:
        import torch.distributed as dist

        _join(rank, link)
        result = fn(rank, link.world, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        with open(link.path("result", rank), "wb") as f:
            pickle.dump(result, f)
    except BaseException as err:
        if isinstance(err, _Stopped) or link.stop.is_set() or os.getppid() != parent:
            # Being stopped: peers may be gone mid-collective; leave without a traceback
            # and without torch's teardown, which could wait for them.
            os._exit(143)
        failed_at = time.time()
        line = str(err).strip().splitlines()
        summary = f"{type(err).__name__}: {line[0]}" if line else type(err).__name__
        with open(link.path("failure", rank), "wb") as f:
            pickle.dump((failed_at, summary, traceback.format_exc()), f)
        sys.exit(1)  # quietly: the launcher names the rank that failed first


def _join(rank: int, link: _Link) -> None:
    """Join the group through the rendezvous file. One CPU thread each (many workers share
    few cores); a hung collective fails after the group timeout instead of never."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        link.backend,
        init_method=f"file://{link.folder}/rendezvous",
        rank=rank,
        world_size=link.world,
        timeout=datetime.timedelta(seconds=link.group_timeout_s),
    )


def _heartbeat(alive: Any, rank: int) -> None:
    while True:
        alive[rank] = time.monotonic()
        time.sleep(_HEARTBEAT_S)


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(128 + signum)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
