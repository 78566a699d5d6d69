"""Fault injection for the demo: one rank loses time every step, in the place a given
fault would put it, so that the diagnosis can be checked against a known answer.

Every kind loses the same time: ``factor - 1`` times the rank's measured compute (the
step without its collectives, data wait and host work; ``gpu`` by the thread's CPU
clock, the others by the wall clock) since the last injection, taken at the points of
the step where a slow rank makes the group wait (before ``reverse_route``, the forward
pass's last exchange, and when the training loop calls `SlowBalancer.lag`, before the
gradient all-reduce). Where the time goes is the kind:

- ``gpu``: a slower device in the middle of the compute, as a throttled GPU or another
  job on it: the thread waits ``factor - 1`` times the CPU time it computed, as for a
  device computing meanwhile, and tells the timer so (`StepTimer.add_device`: on the CPU
  the compute is the thread's CPU time, which a wait does not count). A wait, not a busy
  loop: a slow GPU slows no other GPU, and a busy loop would take the cores the other
  workers share. It scales the whole measured compute, its fixed part included: on a GPU
  the fixed part is mostly kernels too (norms, the optimizer), and a throttled GPU runs
  those slower as well. The affine model (`knapformer.planning.compute_model`) then sees
  a rate of at least ``factor``; only Python's own dispatch, which a slow GPU does not
  slow, is scaled here when it should not be, and that errs towards naming the rank.
- ``host``: the CPU burns the time as host work (timed as the ``host`` phase), as a
  busy logger or another process on its cores would. The device's compute is untouched.
- ``gc``: Python's garbage collector runs full collections until the time is lost,
  where no phase times them (a heap the collector walks for long, as in a training loop
  that keeps many objects alive); a balancer made with ``time_gc=True``, as the demo's
  are, sees them through ``gc.callbacks`` (the ``gc`` phase,
  `knapformer.runtime.gc_clock`). A full collection takes tens of ms in a worker, so the
  loss is rounded up to whole collections.
- ``input``: the next batch comes that much later (timed by the training loop as the
  ``data`` phase, see `SlowBalancer.wait_for_input`), as a slow data loader.
- ``link``: every exchange of the rank (``torch.distributed.all_to_all_single``,
  inside the balancer's timed ``route`` / ``pre_attn`` / ``post_attn`` / ``reverse_route``,
  and the link probe's ``batch_isend_irecv``) takes longer in proportion to the bytes it
  moves, as a link slow per byte would: the delay per byte is what the previous step owed
  over the bytes its token exchanges moved (the first step loses nothing; a step that
  routes nothing sets it by its probe's bytes), and the probe pays it too. Its peers wait
  inside the same exchanges, so in an all-to-all every rank sees it take longer; only the
  link probe, which times one pair at a time, tells whose link it is
  (`knapformer.contract.probe`).

Sleeping at the end of the step instead would put the slowdown behind every exchange,
where no plan could shorten it and no peer would wait for it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch.distributed as dist

from knapformer.contract.phases import HOST
from knapformer.local.config import SLOW_KINDS
from knapformer.runtime.balancer import SequenceBalancer
from knapformer.runtime.timing import cpu_clock_ms, outside_compute_ms, wall_clock_ms


class SlowBalancer(SequenceBalancer):
    """A `SequenceBalancer` on a rank that loses ``slow_factor - 1`` (>= 0) times its
    compute every step, in the place ``slow_kind`` says (the module doc); everything else
    as its parent."""

    def __init__(self, *args, slow_factor: float, slow_kind: str = "gpu", **kwargs) -> None:
        if slow_kind not in SLOW_KINDS:
            raise ValueError(f"slow_kind {slow_kind!r} is not one of {', '.join(SLOW_KINDS)}")
        super().__init__(*args, **kwargs)
        self.slow_factor = float(slow_factor)
        self.slow_kind = slow_kind
        # (host clock, ms not compute, CPU clock, CPU ms not compute) at the last injection
        self._since: tuple[float, float, float, float] | None = None
        self._ended_steps_ms = 0.0  # time that was not compute, in the steps that ended
        self._ended_steps_cpu = 0.0  # the same by the CPU clock
        self._owed_ms = 0.0  # time the next batch is held back (input), the step owes (link)
        self._bytes = 0  # bytes the token exchanges moved in this step (link)
        self._probe_bytes = 0  # bytes the link probe moved in this step (link)
        self._ms_per_byte = 0.0  # the link's delay, from the step before (link)
        self.lost_ms = 0.0  # time lost so far, by every kind (what it injected)
        self._originals: dict[str, object] = {}  # the torch.distributed calls a link holds back
        if slow_kind == "link":
            for name in ("all_to_all_single", "batch_isend_irecv"):
                self._originals[name] = getattr(dist, name)
            dist.all_to_all_single = self._held_all_to_all
            dist.batch_isend_irecv = self._held_p2p

    def plan_routing(self, *args, **kwargs):
        if self._since is None:
            self._mark()
        # The step's timings start afresh: keep what the ending one spent outside compute.
        self._ended_steps_ms += self._in_step()
        self._ended_steps_cpu += self._timer.outside_cpu_ms()
        if self.slow_kind == "link":  # a new step: its delay per byte is the last one's
            moved = self._bytes or self._probe_bytes  # the probe alone: nothing was routed
            if moved:
                self._ms_per_byte = self._owed_ms / moved
            self._owed_ms, self._bytes, self._probe_bytes = 0.0, 0, 0
        return super().plan_routing(*args, **kwargs)

    def reverse_route(self, seqs, features=None):
        self.lag()  # before the forward pass's last exchange
        return super().reverse_route(seqs, features)

    def lag(self) -> None:
        """Lose ``slow_factor - 1`` times the compute since the last call, as the kind says."""
        if self._since is not None:
            began, outside, cpu_began, cpu_outside = self._since
            if self.slow_kind == "gpu":
                cpu = cpu_clock_ms() - cpu_began - (self._outside_cpu() - cpu_outside)
                owed = max(cpu, 0.0) * (self.slow_factor - 1)
                time.sleep(owed / 1e3)
                self._timer.add_device(owed)
                self.lost_ms += owed
            else:
                compute = (time.perf_counter() - began) * 1e3 - (self._outside() - outside)
                owed = max(compute, 0.0) * (self.slow_factor - 1)
                if self.slow_kind == "host":
                    with self.timed(HOST):
                        burn(owed)
                elif self.slow_kind == "gc":
                    owed = collect(owed)
                else:  # input, link: paid where the batch or the exchanges come
                    self._owed_ms += owed
                if self.slow_kind != "link":  # the link's is counted as its exchanges pay
                    self.lost_ms += owed
        self._mark()

    def wait_for_input(self) -> float:
        """Hold the next batch back by what is owed (``input`` only; the training loop
        calls it inside the time it measures as ``data``); returns the ms it slept."""
        if self.slow_kind != "input":
            return 0.0
        return self._pay()

    def close(self) -> None:
        super().close()
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _held_all_to_all(self, output, input, *args, **kwargs):
        self._bytes += self._hold_back([output, input])
        return self._originals["all_to_all_single"](output, input, *args, **kwargs)

    def _held_p2p(self, ops):
        self._probe_bytes += self._hold_back([op.tensor for op in ops])
        return self._originals["batch_isend_irecv"](ops)

    def _hold_back(self, tensors) -> int:
        """Sleep for the bytes ``tensors`` move at the link's delay per byte; returns them."""
        moved = sum(t.numel() * t.element_size() for t in tensors)
        delay = moved * self._ms_per_byte
        if delay > 0:
            time.sleep(delay / 1e3)
            self.lost_ms += delay
        return moved

    def _pay(self) -> float:
        owed, self._owed_ms = self._owed_ms, 0.0
        if owed > 0:
            time.sleep(owed / 1e3)
        return owed

    def _mark(self) -> None:
        self._since = (time.perf_counter(), self._outside(), cpu_clock_ms(), self._outside_cpu())

    def _outside(self) -> float:
        """Ms spent outside compute (collectives, data, host work) since the first step."""
        return self._ended_steps_ms + self._in_step()

    def _outside_cpu(self) -> float:
        """The same by the thread's CPU clock."""
        return self._ended_steps_cpu + self._timer.outside_cpu_ms()

    def _in_step(self) -> float:
        """Ms the open step has spent outside compute so far."""
        return outside_compute_ms(self.timings)


def collect(ms: float) -> float:
    """Run full garbage collections until ``ms`` of wall time have passed (at least one
    when ``ms`` > 0); returns the wall-clock ms they took."""
    began = wall_clock_ms()
    while ms > 0 and wall_clock_ms() - began < ms:
        gc.collect()
    return wall_clock_ms() - began


def burn(ms: float, clock: Callable[[], float] = wall_clock_ms) -> float:
    """Keep the thread busy until ``clock`` (ms: the wall clock, or `cpu_clock_ms` for
    ``ms`` of its own CPU time) has advanced by ``ms``; returns the wall-clock ms it took."""
    began, end = wall_clock_ms(), clock() + ms
    x = 0
    while clock() < end:
        x += 1
    return wall_clock_ms() - began
