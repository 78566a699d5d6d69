"""Fault injection for the demo and the tests: one rank raises, stalls, dies or passes a
tensor of the wrong shape at a given step, in a given phase, so that what every other
rank reports can be checked against a known answer (`knapformer.runtime.roll_call`).

`Fault` (torch-free, in `knapformer.local.config`) says which rank, what, when and where;
`faulty` makes a `SequenceBalancer` class (or a subclass, such as the slow rank's) that
injects it. The kinds:

- ``raise``: a ``RuntimeError`` such as a CUDA out-of-memory error would be. In a
  balancer phase it is raised inside that call, before its collective; in ``forward`` it
  is raised right after ``route`` returns, as the training loop's own code would.
- ``stall``: the rank stops for ``stall_s`` seconds, as a hung data loader, a deadlock or
  a descheduled process would, then goes on; in ``plan_ahead`` the plan-ahead thread
  stalls, not the training thread. A test may end it early with ``release()``: the rank
  then raises `StallReleased` rather than go on into collectives its peers have left.
- ``kill``: the process ends at once (SIGKILL), as the kernel's OOM killer would end it.
- ``shape``: the rank gives the phase a tensor of another shape: ``route`` one row too
  many (its own shape error), ``pre_attn`` / ``post_attn`` another head_dim (a layout its
  peers do not share), ``gather_sequences`` one row too few.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from knapformer.local.config import Fault
from knapformer.runtime.balancer import SequenceBalancer

#: How long a stall lasts when nothing releases it: longer than any job waits.
FOREVER_S = 24 * 3600.0


class SimulatedFault(RuntimeError):
    """The exception a ``raise`` fault raises (a RuntimeError, like CUDA's own OOM)."""


class StallReleased(SimulatedFault):
    """A stalled rank whose ``release()`` came true: it leaves the step."""


class FaultInjection:
    """Mixed into a `SequenceBalancer` class by `faulty`: ``fault`` strikes once, on this
    rank (the caller makes the balancer on the faulty rank only)."""

    def __init__(
        self,
        *args: Any,
        fault: Fault,
        stall_s: float = FOREVER_S,
        release: Callable[[], bool] | None = None,
        on_strike: Callable[[float], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fault, self.stall_s, self.release = fault, stall_s, release
        self.on_strike = on_strike  # told the time.time() the fault strikes (e.g. before a kill)
        self.struck = False
        self.struck_at: float | None = None  # time.time() when the fault struck
        if fault.phase == "plan_ahead" and self._path.__class__.__name__ == "AheadPath":
            work = self._path.thread._work
            self._path.thread._work = lambda request: self._side_job(work, request)
        if fault.phase == "probe":
            probe = self._prober.probe
            self._prober.probe = lambda: self._strike("probe") or probe()

    # -------------------------------------------------------------- the phases
    def plan_routing(self, *args: Any, **kwargs: Any):
        self._strike("plan", step=self.step + 1)
        return super().plan_routing(*args, **kwargs)

    def route(self, packed_seqs, features=None):
        if self._due("route") and self.fault.kind == "shape":
            self._mark()
            packed_seqs = torch.cat([packed_seqs, packed_seqs[:1]])
        self._strike("route")
        routed = super().route(packed_seqs, features)
        self._strike("forward")
        return routed

    def pre_attn(self, q, k, v):
        if self._due("pre_attn") and self.fault.kind == "shape":
            self._mark()
            q, k, v = (torch.cat([x, x[..., :1]], dim=-1) for x in (q, k, v))
        self._strike("pre_attn")
        return super().pre_attn(q, k, v)

    def post_attn(self, out):
        if self._due("post_attn") and self.fault.kind == "shape":
            self._mark()
            out = torch.cat([out, out[..., :1]], dim=-1)
        self._strike("post_attn")
        return super().post_attn(out)

    def reverse_route(self, seqs, features=None):
        self._strike("reverse_route")
        return super().reverse_route(seqs, features)

    def gather_sequences(self, x):
        return super().gather_sequences(self._per_sequence(x))

    def per_token(self, x):
        return super().per_token(self._per_sequence(x))

    def _per_sequence(self, x):
        """``x``, one row short when a shape fault is due in gather_sequences."""
        if self._due("gather_sequences") and self.fault.kind == "shape":
            self._mark()
            x = x[:-1]
        self._strike("gather_sequences")
        return x

    def all_reduce(self, tensor, op=None, group=None):
        self._strike("allreduce")
        return super().all_reduce(tensor, op, group)

    def _side_job(self, work: Callable[[Any], Any], request: Any) -> Any:
        if type(request).__name__ == "StepRequest":
            self._strike("plan_ahead", step=self._planner.next_step)
        return work(request)

    # --------------------------------------------------------------- striking
    def _due(self, phase: str, step: int | None = None) -> bool:
        f = self.fault
        step = self.step if step is None else step
        return not self.struck and f.phase == phase and step == f.step

    def _mark(self) -> None:
        self.struck, self.struck_at = True, time.time()
        if self.on_strike is not None:
            self.on_strike(self.struck_at)

    def _strike(self, phase: str, step: int | None = None) -> None:
        """Inject the fault if it is due here (``step``: the step the phase serves)."""
        if not self._due(phase, step) or self.fault.kind == "shape":
            return
        self._mark()
        kind, at = self.fault.kind, f"step {self.fault.step}, {phase}"
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stall":
            until = time.monotonic() + self.stall_s
            while time.monotonic() < until:
                if self.release is not None and self.release():
                    raise StallReleased(f"rank {self.fault.rank} stalled at {at}, released")
                time.sleep(0.05)
            return
        if phase not in ("forward", "plan_ahead"):
            self.journal.call = phase  # raised inside the balancer's call, as its own OOM
        raise SimulatedFault(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (simulated by the fault "
            f"injection: rank {self.fault.rank}, {at})"
        )


def faulty(base: type[SequenceBalancer] = SequenceBalancer) -> type:
    """``base`` with `FaultInjection` mixed in: construct it as ``base`` with ``fault=``
    (and ``stall_s=``, ``release=`` for a stall) added."""
    return type(f"Faulty{base.__name__}", (FaultInjection, base), {})
