"""Who is to blame for a failed collective of the balancer: what each rank tells the others
about itself (`Status`, kept in the process group's store by
`knapformer.runtime.roll_call`), and the clause that names a rank from it (`blame`).

A peer is not to blame when it waits in the same collective (a fellow), or when it failed
itself (it names its own culprits). Otherwise it raised (what, and in which call or after
which collective), closed its balancer (with or without ``finish()``), did not answer (its
process gone or frozen; where it was last seen), is inside another collective, or never
entered this one (where it was last seen, and how long ago).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from knapformer.contract.incident import Culprit
from knapformer.runtime.journal import Entry
from knapformer.runtime.router import name_ranks

RUNNING, RAISED, FAILING, FAILED, CLOSED = "running", "raised", "failing", "failed", "closed"


@dataclass
class Status:
    """What one rank tells the others about itself (the module doc)."""

    rank: int
    pid: int
    host: str
    state: str
    time: float
    answered: int = 0  # the latest roll call it answered
    step: int = -1
    call: str | None = None
    latest: dict | None = None  # `Entry.as_dict` of its training thread's latest collective
    side: dict | None = None  # and of its plan-ahead thread's
    error: str | None = None  # what it raised (raised) or the failure it named (failed)
    finished: bool = False

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes) -> Status:
        return cls(**json.loads(data))


@dataclass
class Collective:
    """What a failed collective was: ``entry`` in the journal over global ``ranks``."""

    entry: Entry
    ranks: list[int]

    def describe(self) -> str:
        e = self.entry
        where = f"{e.phase}{' (backward)' if e.backward else ''}"
        if e.bag >= 0:
            where += f" of bag {e.bag}"
        return f"step {e.step}, {where} ({name_ranks(self.ranks)})"

    def same_as(self, other: dict | None) -> bool:
        """Whether a peer's journal entry ``other`` is this collective, still running."""
        e = self.entry
        return (
            other is not None
            and other["left"] is None
            and (other["step"], other["phase"], other["bag"], other["backward"])
            == (e.step, e.phase, e.bag, e.backward)
        )


def blame(
    rank: int, s: Status | None, collective: Collective, asked: int, gone: bool, now: float
) -> Culprit | None:
    """Whether peer ``rank`` (its last status ``s``) is to blame for ``collective``, and
    why; None for a fellow waiting in the same collective, or one that failed in it."""
    if s is None:
        return Culprit(
            rank=rank, kind="no_answer",
            says=f"rank {rank} never reported to the store (its process is gone or frozen)",
        )  # fmt: skip
    entry = s.side if collective.entry.side else s.latest
    last = _last(entry, now)
    if s.state == RAISED:
        where = f"in {s.call}" if s.call else _after(entry)
        says = f"rank {rank} raised {s.error} {where} (step {s.step})"
        return Culprit(rank=rank, kind="raised", says=says, error=s.error, **last)
    if s.state in (FAILING, FAILED):  # it names a failure itself: `first` says which
        return None
    if s.state == CLOSED:
        kind = "finished" if s.finished else "closed"
        how = "finished training (finish(), then close())" if s.finished else (
            f"closed its balancer without finish() at step {s.step}"
        )  # fmt: skip
        return Culprit(rank=rank, kind=kind, says=f"rank {rank} {how}", **last)
    if s.answered < asked:
        why = "its process is gone" if gone else "its process is gone or frozen"
        says = f"rank {rank} did not answer ({why}; last seen: {seen(entry, now)})"
        return Culprit(rank=rank, kind="no_answer", says=says, **last)
    if collective.same_as(entry):
        return None
    if entry is not None and entry["left"] is None:
        says = f"rank {rank} is in {seen(entry, now)} instead"
        return Culprit(rank=rank, kind="elsewhere", says=says, **last)
    says = f"rank {rank} never entered it (last seen: {seen(entry, now)})"
    return Culprit(rank=rank, kind="never_entered", says=says, **last)


def _last(entry: dict | None, now: float) -> dict[str, Any]:
    """A culprit's ``last_*`` fields from its latest journal entry."""
    if entry is None:
        return {}
    since = entry["left"] if entry["left"] is not None else entry["entered"]
    return {
        "last_step": entry["step"],
        "last_phase": entry["phase"],
        "last_bag": entry["bag"],
        "seconds_ago": max(now - since, 0.0),
    }


def _phase_of(entry: dict) -> str:
    text = entry["phase"] + (" (backward)" if entry["backward"] else "")
    return text + (f" of bag {entry['bag']}" if entry["bag"] >= 0 else "")


def seen(entry: dict | None, now: float) -> str:
    """Where a journal entry puts a rank: ``route, step 3, 20.1 s ago``."""
    if entry is None:
        return "no balancer collective yet"
    if entry["left"] is None:
        return f"{_phase_of(entry)}, step {entry['step']}, for {now - entry['entered']:.1f} s"
    return f"{_phase_of(entry)}, step {entry['step']}, {max(now - entry['left'], 0.0):.1f} s ago"


def _after(entry: dict | None) -> str:
    if entry is None:
        return "before its first balancer collective"
    return f"after {_phase_of(entry)} (in the training loop's code)"


def left_with(s: Status) -> str:
    return f"raised {s.error}" if s.state == RAISED else f"failed: {s.error}"
