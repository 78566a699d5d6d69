"""Named failures: when a collective of the balancer fails or times out, every surviving rank
finds out, through the process group's store (never through the broken group), which ranks
did not enter it or left the step earlier, and raises one `CollectiveFailure` naming them,
the step, the phase and the bag.

Each rank's `RollCall` keeps its status in the store (``status/<rank>``,
`knapformer.runtime.blame.Status`): its state (running, raised, failed, closed), the
latest entries of its step journal (`knapformer.runtime.journal`), the balancer call it
is inside, what it raised, its pid and host. The training thread writes it at every
step's start, and a watcher thread every `PUBLISH_S` while the journal moves (so a rank
that dies leaves its last position behind) and, looking every `WATCH_S`, at once when a
peer asks: a rank whose collective failed bumps ``asks`` and writes ``ask/<n>``, then
reads every peer's status until each has answered that call, has left (raised, failed,
closed), or is known gone (a dead process on the same host), or `ANSWER_S` has passed;
`knapformer.runtime.blame` says from those statuses whom to blame. Survivors therefore
name the culprit within the group's timeout plus `ANSWER_S`; a rank that is merely slow
answers from its watcher (a sleeping or blocked training thread holds no GIL).

A rank that raises inside a balanced step (its own error, or the training loop's between
the balancer's calls) says so before it leaves: `SequenceBalancer.close` (or its
``with`` block) while the exception propagates, or ``sys.excepthook`` /
``threading.excepthook`` for a script that never closes, or ``atexit`` for one that
exits mid-step. `close` waits for the other ranks through the store too, so a rank that
closes while its peers train (without ``finish()``) is named on every rank, and learns
it.

The first rank to name a failure writes the `knapformer.contract.incident.Incident`
beside the run's plans; every live rank dumps its journal there (and torch's
flight-recorder buffer when the job enabled one).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from knapformer.contract.incident import (
    FLIGHT_RECORDER_FOLDER,
    Culprit,
    Incident,
    journal_file,
    write_incident,
)
from knapformer.errors import CollectiveFailure, KnapformerError
from knapformer.runtime.blame import (
    CLOSED,
    FAILED,
    FAILING,
    RAISED,
    RUNNING,
    Collective,
    Status,
    blame,
    left_with,
    seen,
)
from knapformer.runtime.journal import Entry, Journal
from knapformer.runtime.router import name_ranks

#: Seconds between two looks of the watcher at the store (for a peer's roll call).
WATCH_S = 0.25
#: Seconds between two writes of a rank's position while its journal moves.
PUBLISH_S = 1.0
#: Seconds a rank whose collective failed waits for its peers' answers.
ANSWER_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class _Root:
    """The failure named first in a run, as the store keeps it: which collective, and the
    message its ranks raised."""

    where: tuple  # (step, phase, bag, backward)
    message: str

    @classmethod
    def of(cls, incident: Incident) -> _Root:
        bag = -1 if incident.bag is None else incident.bag
        return cls((incident.step, incident.phase, bag, incident.backward), incident.message)

    def dumps(self) -> bytes:
        return json.dumps({"where": list(self.where), "message": self.message}).encode()

    @classmethod
    def loads(cls, data: bytes) -> _Root:
        values = json.loads(data)
        return cls(tuple(values["where"]), values["message"])


class _InCollective:
    """The journal's entry around one collective call; a failure inside it (the backend's
    error: a timeout, a peer gone) becomes the named `CollectiveFailure`."""

    __slots__ = ("bag", "entry", "owner", "phase", "ranks", "side", "step")

    def __init__(self, owner, phase, bag, ranks, side, step) -> None:
        self.owner, self.phase, self.bag, self.ranks = owner, phase, bag, ranks
        self.side, self.step = side, step
        self.entry: Entry | None = None

    def __enter__(self) -> Entry:
        self.entry = self.owner.journal.enter(self.phase, self.bag, self.side, self.step)
        return self.entry

    def __exit__(self, kind, err, tb) -> bool:
        if err is None or not isinstance(err, RuntimeError):
            Journal.leave(self.entry)  # done, or a decision every rank made alike
            return False
        raise self.owner.failure(Collective(self.entry, self.ranks), err) from err


@dataclass(eq=False)
class RollCall:
    """One balancer's side of the roll call (the module doc): ``journal`` of this rank,
    ``ranks`` of its balance group, ``uid`` agreed by every rank of the parent group
    (the store's keys are ``knapformer/<uid>/...``), ``timeout_s`` of the groups,
    ``folder`` where the run's files go (None: none), ``groups``: the process groups to
    list in a journal dump (names and ranks)."""

    journal: Journal
    ranks: list[int]
    uid: int
    timeout_s: float
    run: str | None = None
    folder: Path | None = None
    groups: list[dict] = field(default_factory=list)
    answer_s: float = ANSWER_S
    state: str = RUNNING
    error: str | None = None
    finished: bool = False
    _answered: int = 0

    def __post_init__(self) -> None:
        base = dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"knapformer/{self.uid:x}/", base)
        self.rank = self.journal.rank
        self.host = socket.gethostname()
        self.thread_id = threading.get_ident()  # the training thread
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one status write at a time
        self._watcher = threading.Thread(
            target=self._watch, name="knapformer-roll-call", daemon=True
        )
        self._watcher.start()
        _LIVE.add(self)
        _install_hooks()
        self.step_started()

    def step_started(self) -> None:
        """The training thread starts a step (or the balancer): say so now, so that a rank
        that dies before the watcher looks leaves its step behind."""
        with contextlib.suppress(Exception):  # a store that fails is the watcher's to see
            self.publish()

    # -------------------------------------------------------------- the hot path
    def collective(
        self, phase: str, bag: int = -1, ranks: list[int] | None = None, side: bool = False,
        step: int | None = None,
    ) -> _InCollective:  # fmt: skip
        """Journal the collective run in the ``with`` block (``ranks``: its global ranks,
        default the balance group); a failure in it raises the named error."""
        return _InCollective(self, phase, bag, self.ranks if ranks is None else ranks, side, step)

    # ------------------------------------------------------------------ status
    def status(self) -> Status:
        j = self.journal
        return Status(
            rank=self.rank,
            pid=os.getpid(),
            host=self.host,
            state=self.state,
            time=time.time(),
            answered=self._answered,
            step=j.step,
            call=j.call,
            latest=None if j.latest is None else j.latest.as_dict(),
            side=None if j.latest_side is None else j.latest_side.as_dict(),
            error=self.error,
            finished=self.finished,
        )

    def publish(self) -> None:
        """Write this rank's status now (store errors are left to the caller)."""
        with self._lock:
            self.store.set(f"status/{self.rank}", self.status().dumps())

    def _read(self, rank: int) -> Status | None:
        key = f"status/{rank}"
        if not self.store.check([key]):
            return None
        return Status.loads(self.store.get(key))

    def _watch(self) -> None:
        """Publish this rank's position while it moves, and answer roll calls."""
        published, at = None, 0.0
        while not self._stop.wait(WATCH_S):
            try:
                asked = False
                while self.store.check([f"ask/{self._answered + 1}"]):
                    self._answered += 1
                    asked = True
                j = self.journal
                moved = (_mark(j.latest), _mark(j.latest_side), j.call, j.step)
                now = time.monotonic()
                if asked or (moved != published and now - at >= PUBLISH_S):
                    self.publish()
                    published, at = moved, now
            except Exception:  # the store is gone (its host died): nothing left to tell
                return
            if asked:  # a peer's step failed: this rank's journal goes beside the incident
                with contextlib.suppress(Exception):
                    self.dump()

    # ----------------------------------------------------------------- failures
    def failure(self, collective: Collective, err: BaseException) -> CollectiveFailure:
        """The named error of ``collective``, which raised ``err`` on this rank (the
        module doc); also written to the run."""
        self.state = FAILING  # peers naming the same failure see a fellow, not a culprit
        if self.folder is not None:  # now, while torch still holds the failed work as pending
            with contextlib.suppress(Exception):
                _dump_flight_recorder(self.folder, self.rank)
        cause = _first_line(err)
        try:
            self.publish()
            culprits, earlier = self._ask(collective)
        except Exception as store_err:  # the store is unreachable too
            culprits, earlier = [], None
            cause += f" (the other ranks could not be asked: {_first_line(store_err)})"
        said = [c.says for c in culprits] or [f"no rank was found missing or behind ({cause})"]
        message = f"{collective.describe()}: {'; '.join(said)}"
        e = collective.entry
        if earlier is not None and earlier.where != (e.step, e.phase, e.bag, e.backward):
            message += f"; first: {earlier.message}"  # another collective failed before
        earlier = None if earlier is None else earlier.message
        self.state, self.error = FAILED, message
        incident = Incident(
            run=self.run, time=time.time(), step=e.step, phase=e.phase, backward=e.backward,
            bag=e.bag if e.bag >= 0 else None, ranks=collective.ranks, reporter=self.rank,
            culprits=culprits, earlier=earlier, cause=cause, message=message,
        )  # fmt: skip
        self._record(incident)
        return CollectiveFailure(message, [c.rank for c in culprits])

    def _ask(self, collective: Collective) -> tuple[list[Culprit], _Root | None]:
        """Ask the collective's other ranks where they are; who is to blame, and the
        failure named first in this run if it was another one."""
        asked = self.store.add("asks", 1)
        self.store.set(f"ask/{asked}", str(self.rank))
        earlier = self._root()
        peers = [r for r in collective.ranks if r != self.rank]
        statuses: dict[int, Status] = {}
        gone: set[int] = set()
        waiting = set(peers)
        until = time.monotonic() + self.answer_s
        while waiting:
            for rank in sorted(waiting):
                got = self._read(rank)
                if got is None:
                    continue
                statuses[rank] = got
                if got.state != RUNNING or got.answered >= asked:
                    waiting.discard(rank)
                elif got.host == self.host and _process_gone(got.pid):
                    gone.add(rank)
                    waiting.discard(rank)
            if not waiting or time.monotonic() > until:
                break
            time.sleep(_POLL_S)
        now = time.time()
        culprits = []
        for rank in peers:
            culprit = blame(rank, statuses.get(rank), collective, asked, rank in gone, now)
            if culprit is not None:
                culprits.append(culprit)
        return culprits, earlier or self._root()

    def _root(self) -> _Root | None:
        """The failure named first in this run (the store's ``incident``), if any."""
        if not self.store.check(["incident"]):
            return None
        return _Root.loads(self.store.get("incident"))

    def _record(self, incident: Incident) -> None:
        """Claim the run's first incident (the store decides who was first) and write it
        beside the plans, with this rank's journal; failures to write are ignored (the
        error is raised either way)."""
        try:
            mine = _Root.of(incident).dumps()
            first = self.store.compare_set("incident", "", mine) == mine
            self.publish()
        except Exception:
            first = False
        if self.folder is None:
            return
        with contextlib.suppress(Exception):  # the named error matters more than its files
            if first:
                write_incident(incident, self.folder)
            self.dump()

    def dump(self) -> None:
        """Dump this rank's journal as it is now (and torch's flight recorder, when enabled
        and not dumped yet) beside the run's plans."""
        if self.folder is None:
            return
        status = self.status()
        self.journal.dump(
            journal_file(self.folder, self.rank), groups=self.groups, state=status.state,
            error=status.error, run=self.run,
        )  # fmt: skip
        if not (self.folder / FLIGHT_RECORDER_FOLDER / f"rank{self.rank}.json").exists():
            _dump_flight_recorder(self.folder, self.rank)

    # ------------------------------------------------------- leaving the step
    def raised(self, err: BaseException) -> None:
        """This rank leaves with ``err`` (its own, or its training loop's): tell the
        others before going (once; a failure this rank named is already told)."""
        if self.state != RUNNING:
            return
        self.state, self.error = RAISED, _first_line(err)
        with contextlib.suppress(Exception):  # the store is gone: "did not answer"
            self.publish()
        # A rank asked after a peer's failure dumped its journal then, as the incident
        # found it: being stopped afterwards (the launcher's SIGTERM) does not rewrite it.
        if self.folder is not None and not journal_file(self.folder, self.rank).exists():
            with contextlib.suppress(Exception):
                self.dump()

    def close(self, err: BaseException | None, finished: bool) -> None:
        """`SequenceBalancer.close`: while ``err`` propagates, say so and leave; else wait
        (through the store, at most the groups' timeout plus `ANSWER_S`) until every rank
        of the balance group has closed. A peer that failed or raised meanwhile, or did
        not close in time, is a `KnapformerError` naming it."""
        try:
            if err is not None:
                self.raised(err)
            elif self.state in (RUNNING, CLOSED):
                self._close_together(finished)
        finally:
            self.stop()

    def _close_together(self, finished: bool) -> None:
        self.state, self.finished = CLOSED, finished
        self.publish()
        key = f"closed/{self.ranks[0]}"
        self.store.add(key, 1)
        until = time.monotonic() + self.timeout_s + self.answer_s
        looked = time.monotonic()
        while int(self.store.get(key)) < len(self.ranks):  # a read: add() would write
            now = time.monotonic()
            if now > until or self.store.check(["incident"]) or now - looked > 0.5:
                looked = now
                problem = self._why_not_closed(now > until)
                if problem is not None:
                    raise KnapformerError(problem)
            time.sleep(_POLL_S / 2)

    def _why_not_closed(self, late: bool) -> str | None:
        """Why the balance group cannot close together (None: no reason yet)."""
        statuses = {r: self._read(r) for r in self.ranks if r != self.rank}
        bad = {r: s for r, s in statuses.items() if s is not None and s.state in (RAISED, FAILED)}
        if not bad and not late:
            return None
        step = self.journal.step
        unfinished = "" if self.finished else " without finish()"
        head = f"close(){unfinished} on rank {self.rank} at step {step}"
        if bad:
            first, status = min(bad.items())
            others = sorted(set(bad) - {first})
            also = f" ({name_ranks(others)} too)" if others else ""
            return f"{head}: the other ranks trained on: rank {first} {left_with(status)}{also}"
        missing = [r for r, s in statuses.items() if s is None or s.state != CLOSED]
        last = "; ".join(
            f"rank {r}: {seen(statuses[r].latest, time.time()) if statuses[r] else 'no status'}"
            for r in missing
        )
        return (
            f"{head}: {name_ranks(missing)} did not close their balancer within "
            f"{self.timeout_s + self.answer_s:g} s (last seen: {last})"
        )

    def stop(self, wait_s: float = 0.0) -> None:
        """End the watcher; ``wait_s`` > 0 also waits (at most that long) until it has left."""
        self._stop.set()
        _LIVE.discard(self)
        if wait_s > 0 and threading.current_thread() is not self._watcher:
            self._watcher.join(wait_s)


def _mark(entry: Entry | None) -> tuple | None:
    """What of a journal entry changes (whether it moved since the last look)."""
    return None if entry is None else (entry.seq, entry.left)


def _first_line(err: BaseException) -> str:
    line = str(err).strip().partition("\n")[0]
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (a zombie counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _dump_flight_recorder(folder: Path, rank: int) -> None:
    """torch's flight-recorder buffer of this process, as JSON, when the job enabled it
    (``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE``)."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if not size or not size.strip().isdigit() or int(size) <= 0:
        return
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        text = _dump_fr_trace_json()
    except (ImportError, RuntimeError):
        return
    path = folder / FLIGHT_RECORDER_FOLDER / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


# ------------------------------------------------ exceptions outside close()
_LIVE: weakref.WeakSet[RollCall] = weakref.WeakSet()
_HOOKED = False


def _install_hooks() -> None:
    """Once per process: report an exception that ends the training thread, and a process
    that exits mid-step, to the peers of every live balancer."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    before, before_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, err, tb):
        _report(err, threading.main_thread().ident)
        before(kind, err, tb)

    def thread_excepthook(args):
        if args.exc_value is not None and args.thread is not None:
            _report(args.exc_value, args.thread.ident)
        before_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    atexit.register(_at_exit)


def _report(err: BaseException, thread_id: int | None) -> None:
    for roll_call in list(_LIVE):
        if roll_call.thread_id == thread_id:
            roll_call.raised(err)


def _at_exit() -> None:
    for roll_call in list(_LIVE):
        if roll_call.state == RUNNING and not roll_call.finished and roll_call.journal.step >= 0:
            roll_call.raised(SystemExit(f"the process exited at step {roll_call.journal.step}"))
        # A daemon thread still inside the store's C++ call when the interpreter finalizes
        # is ended by forced unwinding through a noexcept frame: std::terminate, SIGABRT.
        roll_call.stop(wait_s=2 * WATCH_S)
