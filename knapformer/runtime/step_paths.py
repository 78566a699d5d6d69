"""How a step's plan is made: the synchronous path and the plan-ahead path behind one
interface, so that `knapformer.runtime.balancer.SequenceBalancer` reads the same either way.

`StepPlanner` does the work both share: gather every rank's lengths (and the measurements
of an earlier step) and plan. A path decides where and when it runs:

- `SyncPath`: on the training thread and group, inside ``plan_routing``; the gather
  carries the previous step's measurements.
- `AheadPath`: on a background thread (`knapformer.runtime.plan_ahead`) over a gloo group
  of its own, from ``prefetch`` on; ``plan_routing`` takes the plan once every rank has
  confirmed, in one small all-gather on that group, that it was given the lengths it
  prefetched. The gather carries the measurements of the step before the previous one
  (the previous one is still running when the next is planned).

Both implement ``plan(request, begin) -> (Planned, ms waited for the GPU)``,
``prefetch(request)``, ``finish() -> measurements not sent yet`` and ``close()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from knapformer.contract.phases import FINISH, GATHER, PLAN_AHEAD
from knapformer.contract.plan import RoutingPlan
from knapformer.planning.history import LAG_STEPS, SpeedHistory, step_work
from knapformer.planning.planner import plan_routing
from knapformer.runtime.balancer_config import PlannerOptions
from knapformer.runtime.gather import StepGather, StepRequest
from knapformer.runtime.groups import BalanceGroups
from knapformer.runtime.marks import wait
from knapformer.runtime.plan_ahead import PlanAhead, Ticket
from knapformer.runtime.roll_call import RollCall
from knapformer.runtime.router import Group, RoutingTables
from knapformer.runtime.timing import GatheredStep, StepTimer

_FINISH = object()  # the plan-ahead request of `finish`


@dataclass
class Planned:
    """What planning a step gives the training thread."""

    plan: RoutingPlan
    tables: RoutingTables
    measured: GatheredStep | None  # every rank's timings of an earlier step, if any
    gather_ms: float  # time inside the gather collectives (or waiting for them)


class StepPlanner:
    """Gathers and plans one step after another, on whichever thread a path runs it
    (the state below is that thread's): step numbers, which measurements travelled, and
    with ``history`` the speeds learnt from them. Every gather is an entry of the
    ``roll_call``'s journal (``gather`` on the training thread, ``plan_ahead`` on the
    plan-ahead thread, ``finish``)."""

    def __init__(
        self,
        options: PlannerOptions,
        groups: BalanceGroups,
        device: torch.device,
        timer: StepTimer,
        phases: Sequence[str],
        history: SpeedHistory | None,
        roll_call: RollCall,
    ) -> None:
        self.options, self.groups, self.device = options, groups, device
        self.timer, self.phases, self.history = timer, tuple(phases), history
        self.roll_call = roll_call
        self.gather = StepGather(groups.group_ranks, self.phases)
        self.next_step = 0
        self.sent_upto = -1  # the latest step whose measurements were gathered

    def tables(self, plan: RoutingPlan) -> RoutingTables:
        return RoutingTables.build(plan, self.groups.rank, self.device, self.groups.bag_group)

    def plan_step(
        self,
        request: StepRequest,
        group: Group,
        device: torch.device,
        finished: Any,
        side: bool = False,
    ) -> Planned:
        """Gather and plan the next step (``side``: on the plan-ahead thread);
        ``finished``: the `FinishedStep` whose measurements the gather carries (None:
        none)."""
        o, step = self.options, self.next_step
        row = finished.row(self.phases) if finished is not None else [math.nan] * len(self.phases)
        head_step = finished.step if finished is not None else -1
        began = time.perf_counter()
        phase = PLAN_AHEAD if side else GATHER
        with self.roll_call.collective(phase, side=side, step=step):
            per_gpu, measured = self.gather.step(group, device, request, head_step, row)
        gather_ms = (time.perf_counter() - began) * 1e3
        speed = o.fixed_speed
        if self.history is not None:
            if measured is not None:
                self.history.measured(measured.step, measured.column("compute"))
            speed = self.history.speeds_for(step)
        plan = plan_routing(
            per_gpu,
            o.topology,
            o.model(request.token_dim),
            solver=o.solver,
            max_tokens_per_gpu=o.max_tokens_per_gpu,
            gpus=self.groups.group_ranks,
            step=step,
            run=o.run,
            gpu_speed=speed,
            **(o.auto.planner_kwargs() if o.auto is not None else {}),
        )
        tables = self.tables(plan)
        if self.history is not None:
            self.history.planned(step, step_work(plan))
        if measured is not None:
            self.sent_upto = measured.step
            self.timer.forget_upto(measured.step)
        self.next_step = step + 1
        return Planned(plan, tables, measured, gather_ms)

    def gather_the_rest(
        self, group: Group, device: torch.device, side: bool = False
    ) -> list[GatheredStep]:
        """`finish`: one head all-gather per ended step whose measurements have not
        travelled yet."""
        measured = []
        for step in range(self.sent_upto + 1, self.timer.closed_upto + 1):
            finished = self.timer.get(step)
            row = finished.row(self.phases) if finished is not None else None
            with self.roll_call.collective(FINISH, side=side, step=step):
                got = self.gather.finish(group, device, step if row else -1, row)
            if got is not None:
                measured.append(got)
            self.sent_upto = step
        self.timer.forget_upto(self.sent_upto)
        return measured


class StepPath(Protocol):
    """Where and when a step's plan is made (see the module's docstring)."""

    def plan(self, request: StepRequest, begin: Any) -> tuple[Planned, float]: ...
    def prefetch(self, request: StepRequest) -> None: ...
    def finish(self) -> list[GatheredStep]: ...
    def close(self) -> bool: ...


class SyncPath:
    """Plans inside ``plan_routing``, on the training thread and group."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner

    def plan(self, request: StepRequest, begin: Any) -> tuple[Planned, float]:
        # On CUDA the gather would wait for the previous step's GPU work anyway: wait for
        # it here, apart, so that it counts in that step and not in planning.
        waited = _wait_for(begin)
        p = self.planner
        measured_step = p.next_step - 1
        finished = p.timer.get(measured_step) if measured_step >= 0 else None  # just ended
        return p.plan_step(request, p.groups.group, p.device, finished), waited

    def prefetch(self, request: StepRequest) -> None:
        """Nothing to do: the plan is made when it is asked for."""

    def finish(self) -> list[GatheredStep]:
        p = self.planner
        return p.gather_the_rest(p.groups.group, p.device)

    def close(self) -> bool:
        return True


@dataclass
class _Confirm:
    """The plan-ahead request of `plan_routing` checking the prefetched arguments."""

    prefetched: StepRequest
    given: StepRequest


class AheadPath:
    """Plans on a background thread over the side group, from ``prefetch`` on."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner
        self.side: Group = planner.groups.side
        # Any collective of the thread has failed by then (the group's own timeout), and
        # its roll call has named whom to blame.
        self.wait_s = 2 * planner.groups.timeout_s + planner.roll_call.answer_s
        self.thread = PlanAhead(self._job)
        # plan_routing's check in flight, kept across a Ctrl-C so that a retry waits for
        # it rather than sending a second one its peers never match.
        self._pending: tuple[Ticket, Ticket, StepRequest] | None = None

    def plan(self, request: StepRequest, begin: Any) -> tuple[Planned, float]:
        """The oldest prefetched plan (prefetched now if there is none), once every rank
        has confirmed it was given what it prefetched; the wait counts as gather time."""
        ahead = self.thread
        if self._pending is None:
            ticket = ahead.oldest() or ahead.submit(request)
            check = ahead.submit(_Confirm(ticket.request, request), keep=False)
            self._pending = (ticket, check, request)
        ticket, check, asked = self._pending
        if not asked.same_as(request):
            raise RuntimeError(
                "plan_routing was interrupted while checking other arguments; call it again "
                "with the arguments of the interrupted call"
            )
        began = time.perf_counter()
        with wait("plan_ahead"):
            ahead.wait(check, self.wait_s)  # Ctrl-C: KeyboardInterrupt, kept for a retry
        self._pending = None
        check.outcome()  # every rank raises alike; the plan ticket stays for a retry
        with wait("plan_ahead"):
            ahead.wait(ticket, self.wait_s)
        ahead.take()
        planned = ticket.outcome()
        planned.gather_ms = (time.perf_counter() - began) * 1e3
        return planned, 0.0

    def prefetch(self, request: StepRequest) -> None:
        self.thread.submit(request)

    def finish(self) -> list[GatheredStep]:
        ahead = self.thread
        ticket = ahead.submit(_FINISH)
        with wait("plan_ahead"):
            ahead.wait(ticket, self.wait_s * (1 + len(ahead.outstanding())))
        measured = []
        for earlier in ahead.outstanding():
            ahead.take()
            if earlier is ticket:
                measured += earlier.outcome()
            elif earlier.error is None:  # prefetched, never used: its measurements
                measured.append(earlier.result.measured)
        return [m for m in measured if m is not None]

    def close(self) -> bool:
        """Let the thread run what every rank submitted, then stop it; False when it is
        still inside a collective (its group must then be left alone)."""
        self.planner.timer.notify()  # a wait for a step that never ends gives up
        queued = 1 + len(self.thread.outstanding())
        return self.thread.close(self.wait_s * queued)

    def _job(self, request: Any) -> Any:
        """What the thread runs for one request, on the side group (host)."""
        p, cpu = self.planner, torch.device("cpu")
        if request is _FINISH:
            return p.gather_the_rest(self.side, cpu, side=True)
        if isinstance(request, _Confirm):
            step = p.roll_call.journal.step + 1  # the step whose plan the training thread takes
            with p.roll_call.collective(PLAN_AHEAD, side=True, step=step):
                p.gather.confirm(self.side, cpu, request.prefetched, request.given, p.groups.rank)
            return None
        # The training thread may still be in the step whose measurements go with this
        # gather: wait for it to end, or give up when closing. The step has ended on
        # every rank or on none (all made the same calls), so all give up together.
        measured_step = p.next_step - LAG_STEPS
        finished = None
        if measured_step >= 0:
            finished = p.timer.finished(measured_step, self.thread.stop)
            if p.timer.closed_upto < measured_step:
                raise RuntimeError("the balancer was closed while planning ahead")
        return p.plan_step(request, self.side, cpu, finished, side=True)


def _wait_for(event: Any) -> float:
    """Ms the host waited for the GPU to reach ``event`` (0 on the CPU)."""
    if event is None:
        return 0.0
    began = time.perf_counter()
    event.synchronize()
    return (time.perf_counter() - began) * 1e3
