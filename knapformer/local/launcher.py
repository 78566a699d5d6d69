"""The one module that starts worker processes: a local process group on this machine.

`launch` runs a function on ``world`` processes joined in one process group, supervises
them and returns what each rank returned (`run_fresh`: one function in one fresh
interpreter, no group); in a worker, `send`, `stop_requested` and
`report_progress` talk back. Workers fork from a server that imported torch once (a fresh
interpreter importing it costs seconds; up to 64 workers share a few cores) and
`knapformer.local.worker_sigint`, so they are born ignoring Ctrl-C; they meet through a
file in a fresh folder, not a TCP port (no race for a free port).

The first worker to die or raise stops the rest (SIGTERM, grace, SIGKILL) and is named
once: a rank that died without raising, else the rank its peers' balancers named
(`knapformer.errors.CollectiveFailure`, a rank that stalled), else the one whose
exception came first; its peers, failing in their next collective because of it, print
nothing. When the world
stops progressing, the rank whose heartbeat thread went quiet (stopped, or holding the
GIL), or else the one behind in the steps workers report, is named, not a peer whose
collective timed out. Ctrl-C or SIGTERM sets a stop flag, so that workers can leave
together after the same step. Workers die with the launcher.

From PyTorch: `torch.multiprocessing.start_processes` creates the processes, as it does
for torchrun's elastic `MultiprocessContext`. Elastic's `PContext` is not used around it:
its ``wait`` blames the first exited process in rank order (often a peer of the real
failure) and then waits up to 30 s for the rest, ``start`` replaces the command line's
SIGINT/SIGTERM handlers, its error files stamp failures to the second (too coarse to
order a failure before its peers'), and it has no stop flag, watchdog or messages.
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
PRELOAD = ("torch", "torch.distributed", "knapformer.runtime.balancer")
#: For workers that train: torch's first backward() imports sympy, seconds per process.
TRAINING_PRELOAD = (*PRELOAD, "torch.fx.experimental.symbolic_shapes", "knapformer.local.models")
_TICK_S = 0.1  # how often the launcher looks at its workers
_HEARTBEAT_S = 1.0
_SETTLE_S = 1.0  # after a failure, time for the peers' follow-on failures to show


class WorkerFailed(RuntimeError):
    """A worker died, raised or stalled: ``rank`` (None: no single one to blame), ``what``
    happened to it, and ``traceback``, the exception's if it raised. ``failures``: every
    rank that raised, and what (``ExceptionType: first line``); ``results``: what the
    ranks that returned returned, by rank."""

    def __init__(self, rank: int | None, what: str, traceback: str | None = None) -> None:
        super().__init__(f"the workers {what}" if rank is None else f"worker rank {rank} {what}")
        self.rank, self.what, self.traceback = rank, what, traceback
        self.failures: dict[int, str] = {}
        self.results: dict[int, Any] = {}
        if traceback:
            self.add_note(f"traceback of worker rank {rank}:\n{traceback.rstrip()}")


class _Stopped(SystemExit):
    """SIGTERM in a worker: unwinds its `finally` blocks, exits without a traceback."""


class _Messages:
    """Workers' messages to the launcher, on one pipe that the sender writes itself.

    Not a ``multiprocessing.Queue``: its ``put`` leaves the pickling and the write to a
    feeder thread that runs later, in the middle of the sender's next step, and on a busy
    host that thread takes the GIL and the CPU from the training thread. The demo's rank 0,
    the one rank that reports, then measured up to a third more compute per unit of work
    than its peers (see `send`). Here ``put`` pickles and writes at once (microseconds for
    a step report), in the time the caller measures. A full pipe (64 KiB unread) makes it
    wait for the launcher, which reads every `_TICK_S`."""

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._lock = ctx.Lock()  # one message at a time: a long one is written in pieces

    def put(self, item: Any) -> None:
        data = pickle.dumps(item)
        with self._lock:
            self._writer.send_bytes(data)

    def get(self, timeout: float) -> Any:
        """The next message; `queue.Empty` when none came within ``timeout`` s."""
        if not self._reader.poll(timeout):
            raise queue.Empty
        return pickle.loads(self._reader.recv_bytes())

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


@dataclass
class _Link:
    """What the launcher shares with every worker."""

    folder: str  # rendezvous file, per-rank results and failures
    world: int
    backend: str
    group_timeout_s: float
    messages: _Messages  # (rank, message) from the workers
    stop: Any  # multiprocessing Event: the launcher was asked to stop
    step: Any  # shared int64 per rank: the step it last reported (-1: none yet)
    alive: Any  # shared float per rank: time.monotonic() of its last heartbeat (0: none)

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
    workdir: Path | None = None,  # where the run's fresh folder goes (default: temp)
    settle_s: float = _SETTLE_S,
) -> list[Any]:
    """``fn(rank, world, *args)`` (importable by name) on ``world`` processes in a
    ``backend`` group; returns what each rank returned, by rank.

    ``on_message(rank, message)`` gets what workers `send`; ``on_start()`` runs once all
    have started. Raises `WorkerFailed` naming the rank that died or raised, or that is to
    blame when none progressed for ``stall_s`` or at ``deadline_s``; ``KeyboardInterrupt``
    on Ctrl-C or SIGTERM, after ``grace_s`` for the workers to see `stop_requested`. Either
    way all are stopped (SIGTERM, SIGKILL after ``grace_s``), the survivors of a failure
    once they have ended or ``settle_s`` has passed (time for their balancers to name the
    failed rank). ``start_method``:
    ``"forkserver"`` forks a server that imported ``preload``; ``"fork"`` forks this
    process, patches included (unsafe once it ran OpenMP threads); else ``"spawn"``.
    """
    ctx = _context(start_method, preload)
    method = ctx.get_start_method()
    folder = tempfile.mkdtemp(prefix="knapformer-", dir=workdir)
    step, alive = ctx.Array("q", [-1] * world, lock=False), ctx.Array("d", world, lock=False)
    link = _Link(folder, world, backend, group_timeout_s, _Messages(ctx), ctx.Event(), step, alive)
    procs: list[Any] = []
    try:
        with handling(signal.SIGTERM, interrupt):
            try:
                # Ctrl-C waits until all have started: one cut off half-way would find
                # the resources handed to it gone, and print a traceback.
                with deferring_sigint():
                    procs = torch_mp.start_processes(
                        _run_rank, (fn, tuple(args), link), world, join=False, start_method=method
                    ).processes
                if on_start is not None:
                    on_start()
                _supervise(procs, link, on_message, deadline_s, stall_s, settle_s)
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


def run_fresh(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (importable by name) in a fresh interpreter, spawned, not forked:
    none of this process's imports, threads or heap. Returns what it returned; raises
    `WorkerFailed` if it raised or died. Stopped (SIGTERM) if this process is interrupted
    meanwhile, and it dies with this process."""
    folder = tempfile.mkdtemp(prefix="knapformer-fresh-")
    path = os.path.join(folder, "result.pkl")
    proc = multiprocessing.get_context("spawn").Process(target=_fresh, args=(fn, args, path))
    try:
        proc.start()
        try:
            proc.join()
        except BaseException:  # a timeout or Ctrl-C: stop it before raising
            proc.terminate()
            proc.join()
            raise
        if not os.path.exists(path):
            raise WorkerFailed(None, f"exited with code {proc.exitcode} and no result")
        kind, value = _load(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if kind == "raised":
        raise WorkerFailed(*value)
    return value


def _fresh(fn: Callable[..., Any], args: tuple, path: str) -> None:
    _die_with_parent()
    try:
        kept: tuple = ("returned", fn(*args))
    except WorkerFailed as err:
        kept = ("raised", (err.rank, err.what, err.traceback))
    except Exception as err:
        kept = ("raised", (None, f"raised {_summary(err)}", traceback.format_exc()))
    with open(path, "wb") as f:
        pickle.dump(kept, f)


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


def _supervise(procs, link: _Link, on_message, deadline_s, stall_s, settle_s) -> None:
    """Relay messages until every worker has returned; raise `WorkerFailed` at the first
    failure, at a stall someone is to blame for, or at the deadline."""
    started = moved = time.monotonic()
    steps = list(link.step)
    while True:
        _relay(link, on_message, _TICK_S)
        codes = [p.exitcode for p in procs]
        if any(code not in (None, 0) for code in codes):
            raise _failure(procs, link, codes, settle_s, on_message)
        if None not in codes:
            return _relay(link, on_message, 0)  # what they sent just before returning
        now = time.monotonic()
        if list(link.step) != steps:
            steps, moved = list(link.step), now
        late = deadline_s is not None and now - started > deadline_s
        if late or (stall_s is not None and now - moved > stall_s):
            blame = _stall(procs, link, now - moved)
            if late and blame is None:
                raise WorkerFailed(None, f"did not finish in {deadline_s:g} s (all {_at(steps)})")
            if late:
                raise WorkerFailed(
                    blame.rank, f"{blame.what}; stopped at the {deadline_s:g} s deadline"
                )
            if blame is not None:
                raise blame


def _relay(link: _Link, on_message, wait_s: float) -> None:
    """Pass on what workers sent, waiting up to ``wait_s`` for the first message."""
    with contextlib.suppress(queue.Empty):
        rank, message = link.messages.get(wait_s)
        while True:
            if on_message is not None:
                on_message(rank, message)
            rank, message = link.messages.get(0)


def _failure(
    procs, link: _Link, first_codes: list[int | None], settle_s: float, on_message
) -> WorkerFailed:
    """Peers of a failed rank fail in their next collective within moments (or name it,
    within ``settle_s``): let them settle, then blame the first rank that died without
    raising (a signal, ``os._exit``; its peers raise), else the rank its peers named,
    else the rank whose exception came first."""
    until = time.monotonic() + settle_s
    while time.monotonic() < until and any(p.exitcode is None for p in procs):
        _relay(link, on_message, _TICK_S / 2)
    failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
    raised = {
        r: _load(link.path("failure", r)) for r in failed if os.path.exists(link.path("failure", r))
    }
    died = sorted(set(failed) - set(raised), key=lambda r: (first_codes[r] is None, r))
    err = _blame(procs, raised, died)
    err.failures = {r: raised[r][1] for r in sorted(raised)}
    err.results = {
        r: _load(link.path("result", r))
        for r in range(len(procs))
        if os.path.exists(link.path("result", r))
    }
    return err


def _blame(procs, raised: dict[int, tuple], died: list[int]) -> WorkerFailed:
    """Whom to name (`_failure`): ``raised`` holds each raising rank's (time, summary,
    traceback, the culprits its balancer named)."""
    if not died:
        named: dict[int, list[int]] = {}
        for r, failure in sorted(raised.items()):
            for culprit in failure[3]:
                named.setdefault(culprit, []).append(r)
        first = min(raised, key=lambda r: raised[r][0])
        if named and first not in named:
            culprit = max(named, key=lambda c: (len(named[c]), -c))
            who = named[culprit]
            says = raised[who[0]][1].removeprefix("CollectiveFailure: ")
            whose = f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
            return WorkerFailed(culprit, f"was named by {whose}: {says}")
        return WorkerFailed(first, f"raised {raised[first][1]}", raised[first][2])
    code = procs[died[0]].exitcode
    if code > 0:
        return WorkerFailed(died[0], f"exited with code {code}")
    with contextlib.suppress(ValueError):  # a real-time signal has no name
        return WorkerFailed(died[0], f"died ({signal.Signals(-code).name})")
    return WorkerFailed(died[0], f"died (signal {-code})")


def _stall(procs, link: _Link, quiet_s: float) -> WorkerFailed | None:
    """Whom to blame for a world that stopped progressing: a rank with no heartbeat, else
    one behind the others; None while all are alive at the same step. (A rank that has
    not started beating is still starting: it is behind, if anything.)"""
    now = time.monotonic()
    running = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    for rank in running:
        silent = now - link.alive[rank]
        if link.alive[rank] > 0 and silent > max(3 * _HEARTBEAT_S, quiet_s / 2):
            return WorkerFailed(
                rank,
                f"stopped responding {_at([link.step[rank]])} (no sign of life for {silent:.0f} s)",
            )
    steps = [link.step[rank] for rank in running]
    if min(steps, default=0) == max(steps, default=0):
        return None
    rank = running[steps.index(min(steps))]
    return WorkerFailed(
        rank, f"stalled {_at(steps)} for {quiet_s:.0f} s while the others reached step {max(steps)}"
    )


def _at(steps: Sequence[int]) -> str:
    return "before the first step" if min(steps) < 0 else f"at step {min(steps)}"


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
    """From a worker: hand ``message`` (small, picklable) to the launcher's ``on_message``.

    Pickled and written before it returns, on the calling thread: time the call, and a
    training loop has measured all that reporting cost it (nothing is left to a thread
    that would run during its next step)."""
    if _current is None:
        raise RuntimeError("send() works only in a worker started by launch()")
    _current[1].messages.put((_current[0], message))


def stop_requested() -> bool:
    """From a worker: whether the launcher was asked to stop (False outside a worker)."""
    return _current is not None and _current[1].stop.is_set()


def report_progress(step: int) -> None:
    """From a worker: this rank reached ``step`` (>= 0, growing), so the watchdog can name
    a rank that falls behind. Does nothing outside a launched worker."""
    if _current is not None:
        _current[1].step[_current[0]] = step


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, link: _Link) -> None:
    """A worker process: join the group, run ``fn``, leave its result or failure behind."""
    global _current
    # The launcher decides when workers stop: ignore the terminal's Ctrl-C (the launcher
    # gets it too) and let SIGTERM unwind `finally` blocks (a recorder's flush).
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    parent, _current = os.getppid(), (rank, link)
    threading.Thread(target=_heartbeat, args=(link.alive, rank), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # many workers share few cores
        dist.init_process_group(
            link.backend,
            init_method=f"file://{link.folder}/rendezvous",
            rank=rank,
            world_size=link.world,
            timeout=datetime.timedelta(seconds=link.group_timeout_s),  # a hang fails
        )
        result = fn(rank, link.world, *args)
        if dist.is_initialized():
            # Every rank returned: wait for all before tearing down, so that none closes
            # its connections while a peer is still inside a collective with it (gloo
            # then aborts that peer: "terminate called without an active exception").
            dist.barrier()
            dist.destroy_process_group()
        with open(link.path("result", rank), "wb") as f:
            pickle.dump(result, f)
    except BaseException as err:
        if isinstance(err, _Stopped) or link.stop.is_set() or os.getppid() != parent:
            # Being stopped: peers may be gone mid-collective; leave without a traceback
            # and without torch's teardown, which could wait for them.
            os._exit(143)
        failed_at = time.time()
        with open(link.path("failure", rank), "wb") as f:
            culprits = list(getattr(err, "culprits", None) or [])
            pickle.dump((failed_at, _summary(err), traceback.format_exc(), culprits), f)
        sys.exit(1)  # quietly: the launcher names the rank that failed first


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies: no orphans (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _summary(err: BaseException) -> str:
    """``ExceptionType: first line of its message`` (the type alone without a message)."""
    line = str(err).strip().partition("\n")[0]
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def _heartbeat(alive: Any, rank: int) -> None:
    while True:
        alive[rank] = time.monotonic()
        time.sleep(_HEARTBEAT_S)


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(128 + signum)
