"""`Journal`: this rank's ring buffer of the balancer's own collectives, the record that
says where a rank was when a step failed.

Every collective the balancer runs (`knapformer.contract.phases.JOURNAL_PHASES`) adds one
`Entry` when it starts and stamps it when it returns: the step, the phase it serves, the
bag (the index of the plan's bag for the Ulysses exchanges, -1 for the whole balance
group), a hash of the step's plan, whether it ran in the backward pass or on the
plan-ahead thread, and the wall-clock times it entered and left. The buffer holds the
latest `DEFAULT_SIZE` entries (older ones are overwritten), so it costs a list per
collective and nothing else: `bench/journal.py` measures it. ``call`` names the balancer
call the training thread is inside, so that a rank that raised there can say so (the
journal's entry only starts at the collective).

When a step fails, `knapformer.runtime.roll_call` publishes the latest entries through
the process group's store and every rank dumps its journal beside the incident
(`Journal.dump`, JSON); ``knapformer flight-recorder`` reads those dumps to map torch's
flight-recorder entries to steps, phases and bags.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from knapformer.contract.plan import RoutingPlan

#: Entries kept per rank: a few steps of a model with tens of layers (each layer runs
#: two Ulysses exchanges forward and two backward).
DEFAULT_SIZE = 1024
#: The version of a dumped journal's layout.
DUMP_VERSION = 1


@dataclass(slots=True)
class Entry:
    """One balancer collective on this rank; ``left`` is None while it runs."""

    seq: int  # this rank's running count of collectives
    step: int
    phase: str
    bag: int  # index in the plan's bags, -1: the whole balance group
    plan: int  # `plan_hash` of the step's plan (0 before the first plan)
    backward: bool
    side: bool  # on the plan-ahead thread
    entered: float  # time.time()
    left: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Entry:
        return cls(**{name: values[name] for name in cls.__slots__})


def in_backward() -> bool:
    """Whether the calling thread runs an autograd backward pass right now."""
    return torch._C._current_graph_task_id() != -1


def plan_hash(plan: RoutingPlan) -> int:
    """A 32-bit digest of what a plan moves (its sequences' sources, lengths and bags,
    the bags' sizes and the solver, whose rule cuts them into chunks): ranks routing by
    the same plan have the same hash. Made every step, so it reads no chunk column (a
    plan the planner made derives its chunk table only when it is read)."""
    head = f"{plan.step if plan.step is not None else -1} {plan.topology} {plan.solver}"
    digest = zlib.crc32(head.encode())
    seqs = plan.sequences
    for column in (seqs.src_gpu, seqs.length, seqs.bag):
        digest = zlib.crc32(np.ascontiguousarray(column, dtype=np.int64).tobytes(), digest)
    return digest


class Journal:
    """The ring buffer of one rank (global ``rank``); ``size`` entries, at least 1.

    The training thread and the plan-ahead thread both write to it: an entry is made
    whole before it is stored, and sequence numbers come from one atomic counter."""

    def __init__(self, rank: int, size: int = DEFAULT_SIZE) -> None:
        self.rank = rank
        self.size = max(int(size), 1)
        self._ring: list[Entry | None] = [None] * self.size
        self._seq = itertools.count()
        self.step = -1  # the training thread's step (-1 before the first plan)
        self.plan = 0  # plan_hash of that step's plan
        self.call: str | None = None  # the balancer call the training thread is inside
        self.latest: Entry | None = None  # the training thread's latest entry
        self.latest_side: Entry | None = None  # the plan-ahead thread's latest entry

    def start_step(self, step: int, plan: int) -> None:
        """The training thread's step is now ``step``, routed by a plan of hash ``plan``."""
        self.step, self.plan = step, plan

    def enter(
        self, phase: str, bag: int = -1, side: bool = False, step: int | None = None
    ) -> Entry:
        """A collective of ``phase`` starts (``step``: the plan-ahead thread's step)."""
        seq = next(self._seq)
        entry = Entry(
            seq,
            self.step if step is None else step,
            phase,
            bag,
            self.plan,
            in_backward(),
            side,
            time.time(),
        )
        self._ring[seq % self.size] = entry
        if side:
            self.latest_side = entry
        else:
            self.latest = entry
        return entry

    @staticmethod
    def leave(entry: Entry) -> None:
        entry.left = time.time()

    @property
    def count(self) -> int:
        """Entries made so far (those beyond ``size`` were overwritten)."""
        newest = max((e.seq for e in self._ring if e is not None), default=-1)
        return newest + 1

    def entries(self) -> list[Entry]:
        """The entries kept, oldest first."""
        return sorted((e for e in self._ring if e is not None), key=lambda e: e.seq)

    def dump(self, path: str | Path, **extra: Any) -> Path:
        """Write the journal as JSON to ``path`` (``extra``: more top-level fields, e.g.
        the process groups), atomically; returns the path."""
        path = Path(path)
        record = {
            "journal_version": DUMP_VERSION,
            "rank": self.rank,
            "pid": os.getpid(),
            "size": self.size,
            "count": self.count,
            "call": self.call,
            "entries": [e.as_dict() for e in self.entries()],
            **extra,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        # One scratch file per thread: the watcher and the training thread may both dump.
        scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        scratch.write_text(json.dumps(record, allow_nan=False) + "\n")
        os.replace(scratch, path)
        return path
