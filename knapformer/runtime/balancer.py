"""`SequenceBalancer`: plan every step, then move tokens to where the plan says.

Typical step (see ``knapformer/local/models.py`` for a model that does this)::

    plan = balancer.plan_routing(local_seq_lens, d, packed_seqs=packed)  # 2 all-gathers
    chunk_lens, x, feats = balancer.route(packed, {"pos": positions})   # 1 all-to-all
    ...  # per layer: q, k, v of the chunks (tokens, heads, head_dim)
    seq_lens, q, k, v = balancer.pre_attn(q, k, v)   # Ulysses inside the bag
    out = attention(q, k, v, seq_lens)                # whole sequences, heads/g heads
    chunk_lens, out = balancer.post_attn(out)
    ...
    seq_lens, y, _ = balancer.reverse_route(x)        # 1 all-to-all; rows as `packed`
    loss.backward()
    balancer.all_reduce(flat_grads)                   # data parallel, timed
    ...
    balancer.finish()  # after the last step: its measurements reach the recorder too
    balancer.close()   # waits for the group, then destroys the balancer's sub-groups

Works on the backend of the process group: NCCL with CUDA tensors, gloo with CPU
tensors. The balancer is a coordinator: the process groups are a `BalanceGroups`
(`knapformer.runtime.groups`), planning is a path (`knapformer.runtime.step_paths`:
synchronous, or ahead on a background thread), the exchanges are the router's
(`knapformer.runtime.router`), the timings the timer's (`knapformer.runtime.timing`).

Every rank must agree, and the balancer makes sure they do, collectively, so that a
mistake on one rank makes every rank raise `KnapformerError` rather than some wait in a
collective for a peer that already left (or gloo abort on a size mismatch): the
constructor's options (`knapformer.runtime.agreement`), ``plan_routing``'s arguments
(`knapformer.runtime.gather`), the width and dtype of what is routed
(`knapformer.runtime.router.check_same_rows`). Every sub-group it creates and every wait
it makes inherits the process group's timeout. Balance groups are consecutive ranks; a
world of k x (topology GPUs) ranks holds k replicas, each balanced on its own.

Per-step topology (``topology="auto"``): the process group is one balance group cut into
nodes of ``node_size`` ranks, and each step's plan chooses a partition into aligned groups
of the allowed sizes (`knapformer.planning.partitions`), pricing communication with
``comm`` (`knapformer.planning.communication.CommModel`). The sub-group of every aligned
group of every allowed size is created by the constructor, so a step only looks its bags
up (`knapformer.runtime.groups`); route, the Ulysses exchanges and reverse route of a step
run in the bags its plan lists (``plan.bags``).

Measurements (`knapformer.runtime.timing`): every rank times the collectives it runs here
and its compute apart from them; the few floats of step s travel to every rank in the
length all-gather of step s+1 (s+2 when planning ahead): no collective of their own. The
balancer attaches them to the plan of step s and hands that plan to the recorder, a
plain sink. With ``cost_model="history"`` every rank learns each GPU's speed from them
(`knapformer.planning.history`), identically, and plans with it.

Planning ahead (``plan_ahead=True``): ``prefetch(next_lengths, d)`` as soon as the next
batch is known; a background thread gathers the lengths over a gloo group of its own
and plans while this step computes, and the next ``plan_routing`` takes the plan once
every rank confirmed, on that group, that it got the prefetched lengths. No collective
of the training group is involved (no ordering hazard with NCCL); plans, step numbers
and recordings are those of the synchronous path.

In a ``torch.profiler`` trace the phases are named (`knapformer.runtime.marks`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.phases import (
    COLLECTIVE_PHASES,
    DERIVED_PHASES,
    DEVICE_PHASES,
    OPTIMIZER,
    PLAN,
)
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology, as_topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel
from knapformer.planning.history import COST_MODELS, SpeedHistory
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES, allowed_sizes
from knapformer.planning.planner import AUTO, check_solver, check_speed
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime import conditioning, marks
from knapformer.runtime.agreement import agree_on_options
from knapformer.runtime.gather import (  # GatherHead and the two tuples are re-exported
    GATHERING_CALLS,
    LOCAL_CHECKS,
    GatherHead,
    StepRequest,
)
from knapformer.runtime.groups import BalanceGroups, BalanceLayout, group_device
from knapformer.runtime.link_probe import (
    DEFAULT_PROBE_BYTES,
    DEFAULT_PROBE_ROUNDS,
    LinkProber,
    check_probe_options,
)
from knapformer.runtime.router import (
    BagTables,
    Features,
    Group,
    RoutingTables,
    check_rows,
    check_same_rows,
    exchange,
    flatten_features,
    unflatten_features,
)
from knapformer.runtime.step_paths import (
    AheadPath,
    AutoOptions,
    PlannerOptions,
    StepPath,
    StepPlanner,
    SyncPath,
)
from knapformer.runtime.timing import GatheredStep, StepTimer, cpu_clock_ms

__all__ = ["GATHERING_CALLS", "LOCAL_CHECKS", "GatherHead", "SequenceBalancer"]

# What holds the rows of a tensor given to route / reverse_route, pre_attn, post_attn.
_LOCAL_ROWS = "the sequence lengths given to plan_routing"
_CHUNK_ROWS = "the chunks routed to this rank"


class SequenceBalancer:
    """Balances packed sequences across the GPUs of a balance group.

    Args:
        topology: compute bags, e.g. ``"g1n2+g2n1+g4n1"`` (or a `Topology`); ``"auto"``:
            every step's plan chooses them (aligned groups of ``group_sizes``, see below),
            over one balance group of every rank of ``process_group``.
        gamma: attention weight of the workload model.
        solver: ``"knapformer"`` (default) or ``"greedy"``.
        process_group: the group to balance (default: WORLD). Sub-groups are created with
            ``torch.distributed.new_group``, so every rank of the default group must
            construct the balancer at the same point, with the same options: ranks that
            differ all raise `KnapformerError` naming the option.
        max_tokens_per_gpu: optional hard cap on tokens per GPU after routing.
        recorder: optional sink for finished plans (e.g. ``knapformer.PlanRecorder``):
            ``record(plan)`` gets each plan once every rank's measurements of its step
            are attached, ``close()`` is called by `close`; if it has ``wants(plan)``, only
            plans it wants are held back for their measurements.
        run: run name stored in every plan.
        cost_model: ``"modelled"`` (default): the workload model, with ``gpu_speed`` if
            given; ``"history"``: every GPU's speed learnt from its measured compute
            (`knapformer.planning.history`), recorded in each plan's ``gpu_speed``.
        gpu_speed: fixed relative speed of each GPU of the balance group (replay uses the
            recorded ones); not with ``"history"``.
        time_scale: ms per workload unit (from ``knapformer calibrate``): workloads, and
            every view of the plans, are then milliseconds.
        plan_ahead: gather and plan on a background thread over a gloo group of its own
            (see `prefetch`).
        phases: timing phases to gather besides `knapformer.contract.phases.RECORDED_PHASES`
            (what you add with `add_timing`); the same on every rank.
        node_size: ``"auto"`` only: ranks per node (default: ``comm``'s, 8); a group never
            crosses a node unless ``cross_node``.
        group_sizes, min_group, max_group: ``"auto"`` only: the allowed group sizes (powers
            of two) and bounds on them (``min_group=4``: no bag smaller than 4 GPUs).
        cross_node: ``"auto"`` only: allow sizes above ``node_size`` (whole nodes).
        comm: ``"auto"`` only: the `CommModel` (or a cluster name of
            `knapformer.planning.communication.CLUSTERS`) that prices communication.
        link_probe_every: every this many steps (0: never, the default), time a short
            exchange between pairs of ranks, a pair at a time per rank
            (`knapformer.runtime.link_probe`), and store it in the plan: it is what lets
            ``knapformer stragglers`` name the rank whose link is slow. Costs a barrier
            and a few exchanges per round.
        link_probe_bytes: bytes each way per probed exchange (default 8 MiB).
        link_probe_rounds: rounds per probe (default 7: each pair of 8 ranks once); a
            larger group is covered over several probes.
        time_gc: record the time Python's garbage collector holds the process as the
            ``gc`` phase, host work: a rank slowed by long collections is then
            ``slow_host``, not ``slow_gpu``. A collection inside the balancer's
            collectives or a host phase timed with `timed` stays in that phase; one in a
            phase you time yourself and pass to `add_timing` counts in both. Off by
            default: while on, a signal whose Python handler raises (Ctrl-C's
            ``KeyboardInterrupt``) is lost if it arrives during a collection
            (`knapformer.runtime.gc_clock`).
    """

    def __init__(
        self,
        topology: Topology | str,
        gamma: float = 0.4,
        solver: str = "knapformer",
        process_group: Group = None,
        max_tokens_per_gpu: int | None = None,
        recorder: Any = None,
        run: str | None = None,
        *,
        cost_model: str = "modelled",
        gpu_speed: Sequence[float] | None = None,
        time_scale: float | None = None,
        plan_ahead: bool = False,
        phases: Sequence[str] = (),
        node_size: int | None = None,
        group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES,
        min_group: int | None = None,
        max_group: int | None = None,
        cross_node: bool = False,
        comm: CommModel | str | None = None,
        link_probe_every: int = 0,
        link_probe_bytes: int = DEFAULT_PROBE_BYTES,
        link_probe_rounds: int = DEFAULT_PROBE_ROUNDS,
        time_gc: bool = False,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "SequenceBalancer needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first"
            )
        rank, phases = dist.get_rank(), tuple(phases)
        if process_group is None or process_group == dist.group.WORLD:
            parent_ranks = tuple(range(dist.get_world_size()))
        else:
            parent_ranks = tuple(dist.get_process_group_ranks(process_group))
        # Checked here without raising, then with every rank (before any sub-group is
        # made): a mistake on one rank, or ranks that differ, fail every rank alike.
        given = dict(
            topology=topology, gamma=gamma, solver=solver, max_tokens_per_gpu=max_tokens_per_gpu,
            cost_model=cost_model, gpu_speed=gpu_speed, time_scale=time_scale, phases=phases,
            node_size=node_size, group_sizes=tuple(group_sizes), min_group=min_group,
            max_group=max_group, cross_node=cross_node, comm=comm,
            link_probe_every=link_probe_every, link_probe_bytes=link_probe_bytes,
            link_probe_rounds=link_probe_rounds,
        )  # fmt: skip
        problem = None
        try:
            options, layout = _checked_options(given, run, parent_ranks, rank)
        except KnapformerError as err:
            problem = err
        shared = {name: _shown(value) for name, value in given.items()}
        shared |= {"plan_ahead": bool(plan_ahead), "process_group ranks": list(parent_ranks)}
        device = group_device(process_group)
        agree_on_options(shared, problem, process_group, parent_ranks, device)

        #: The `Topology`, or ``"auto"`` (each plan's ``topology`` is then its step's).
        self.topology: Topology | str = options.topology
        self.auto: AutoOptions | None = options.auto
        self.gamma, self.solver, self.time_scale = options.gamma, options.solver, options.time_scale
        self.max_tokens_per_gpu, self.run = max_tokens_per_gpu, run
        self.recorder, self.cost_model = recorder, cost_model
        self.rank: int = rank
        self._parent_group: Group = process_group
        self.groups = BalanceGroups.create(layout, process_group, plan_ahead)
        self.device = device  # NCCL moves CUDA tensors only; everything else runs on the CPU

        self.step: int = -1  # -1 until the first plan_routing
        self.last_plan: RoutingPlan | None = None
        self.tables: RoutingTables | None = None
        #: Every rank's timings of the latest step whose measurements arrived.
        self.last_gathered: GatheredStep | None = None
        self._timer = StepTimer(self.device, phases, time_gc)
        self.phases: tuple[str, ...] = self._timer.phases
        self._held: dict[int, RoutingPlan] = {}  # plans waiting for their measurements
        history = SpeedHistory(layout.gpus_per_replica) if cost_model == "history" else None
        planner = StepPlanner(options, self.groups, self.device, self._timer, self.phases, history)
        self._path: StepPath = AheadPath(planner) if plan_ahead else SyncPath(planner)
        self._prober = LinkProber(
            self.groups.group, self.groups.group_ranks, device, link_probe_every,
            link_probe_bytes, link_probe_rounds,
        )  # fmt: skip
        self._planner = planner
        self._finished = False
        self._closed = False

    # ------------------------------------------------------------------ groups
    @property
    def group(self) -> Group:
        """The balance group (None: the parent group is WORLD and holds one replica)."""
        return self.groups.group

    @property
    def group_ranks(self) -> list[int]:
        """Ranks of this rank's balance group."""
        return self.groups.group_ranks

    @property
    def my_bag(self) -> list[int]:
        """This rank's bag: the topology's, or under ``"auto"`` the latest plan's (its own
        rank alone before the first plan)."""
        if self.auto is None:
            return self.groups.my_bag
        plan = self.last_plan
        if plan is None:
            return [self.rank]
        return next(list(b) for b in plan.bags if self.rank in b)

    @property
    def num_replicas(self) -> int:
        return self.groups.layout.num_replicas

    # ---------------------------------------------------------------- timings
    @property
    def timings(self) -> dict[str, float]:
        """This rank's ms per phase for the current step so far (summed over calls; on
        CUDA reading them waits for the step's events)."""
        return self._timer.current()

    @property
    def previous_timings(self) -> dict[str, float]:
        """This rank's ms per phase of the previous step, with ``step`` (its wall time,
        from one `plan_routing` to the next) and ``compute`` (step minus the time inside
        collectives); on CUDA reading them waits for that step's events."""
        finished = self._timer.last_finished
        return {} if finished is None else dict(finished.values())

    def add_timing(self, phase: str, ms: float, cpu_ms: float | None = None) -> None:
        """Add a user-measured phase (e.g. ``"forward_backward"``; `knapformer.contract.plan` names
        the phases recorded by default, ``phases=`` adds more) to this step's timings;
        ``cpu_ms``: the training thread's CPU time in it, when known (`timed` measures
        both)."""
        _check_added_phase(phase)
        self._timer.add(phase, ms, cpu_ms)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time a part of the training loop as ``phase`` of this step, one line each::

            with balancer.timed("data"):  # waiting for the next batch
                batch = next(loader)
            with balancer.timed("forward_backward"):
                loss = model(batch, balancer).backward()
            with balancer.timed("optimizer"):  # or balancer.time_optimizer(opt) once
                opt.step()

        The device's phases (`knapformer.contract.phases.DEVICE_PHASES`) are timed with
        CUDA events on a GPU, the others (``data``, ``host``, one added with ``phases=``)
        by the host's wall and CPU clocks. A step's ``compute`` is what is left of it
        outside the collectives, the data wait, host work and the optimizer
        (`knapformer.runtime.timing`); when ``forward_backward`` is timed as a block,
        the step's time inside no phase is ``untimed`` (on the CPU)."""
        _check_added_phase(phase)
        timer = self._timer.timed if phase in DEVICE_PHASES else self._timer.host_timed
        with timer(phase):
            yield

    def time_optimizer(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """Time every ``optimizer.step()`` as the step's ``optimizer`` phase, through the
        optimizer's step hooks (instead of a ``timed`` block around each call). Returns
        the two hook handles; ``handle.remove()`` undoes it."""
        open_blocks: list[Any] = []

        def before(*_: Any) -> None:
            block = self.timed(OPTIMIZER)
            block.__enter__()
            open_blocks.append(block)

        def after(*_: Any) -> None:
            if open_blocks:
                open_blocks.pop().__exit__(None, None, None)

        return optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)

    @contextmanager
    def collective(self, phase: str = "allreduce") -> Iterator[None]:
        """Time a collective the training loop runs itself as ``phase`` (one of
        `knapformer.contract.phases.COLLECTIVE_PHASES`), so that it counts as waiting, not compute::

            with balancer.collective():  # e.g. around DDP's gradient synchronisation
                ...
        """
        if phase not in COLLECTIVE_PHASES:
            raise KnapformerError(
                f"{phase!r} is not a collective phase; choose one of {', '.join(COLLECTIVE_PHASES)}"
            )
        with self._timer.timed(phase):
            yield

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Group = None) -> None:
        """``torch.distributed.all_reduce`` (in place; default: sum over the process group
        the balancer was given, i.e. the data-parallel gradient all-reduce), timed as the
        ``allreduce`` collective."""
        op = dist.ReduceOp.SUM if op is None else op
        with self._timer.timed("allreduce"):
            dist.all_reduce(tensor, op=op, group=self._parent_group if group is None else group)

    # --------------------------------------------------------------- planning
    def plan_routing(
        self, local_seq_lens: Any, token_dim: int, packed_seqs: torch.Tensor | None = None
    ) -> RoutingPlan:
        """Plan this step from every rank's sequence lengths; collective over the group.

        ``local_seq_lens``: this rank's sequence lengths (list, numpy array or tensor), in
        the order the sequences are packed. ``token_dim``: the model's hidden size, the
        same on every rank. ``packed_seqs`` (optional): the ``(T_local, ...)`` tensor this
        rank will `route`; passing it checks its rows here, where a mismatch on one rank
        makes every rank raise (in `route` the others would wait in the all-to-all).
        Returns the plan (also ``self.last_plan``); ``plan.measurements.plan_ms`` is this
        rank's time for the whole call.

        Every check is collective: bad arguments on one rank (lengths, ``token_dim``,
        ``packed_seqs``), ranks disagreeing on ``token_dim``, or lengths beyond
        `MAX_RANK_TOKENS` / `MAX_SEQUENCES` make every rank of the group raise
        `KnapformerError` in this call, and none plans the step.

        Planning ahead, the plan `prefetch` made for these lengths is taken (made now if
        none was prefetched); lengths other than the prefetched ones, on any rank, make
        every rank raise `KnapformerError` and keep that plan for a call with the right
        ones.
        """
        self._require_training()
        with marks.mark(marks.PLAN):
            started, wall, cpu = time.perf_counter(), time.time(), cpu_clock_ms()
            begin = self._timer.boundary()
            self._timer.close(started, begin, cpu)  # the previous step ends here
            request = StepRequest.of(local_seq_lens, token_dim, packed_seqs)
            planned, waited = self._path.plan(request, begin)
            plan = planned.plan
            self.tables, self.last_plan, self.step = planned.tables, plan, plan.step
            elapsed = (time.perf_counter() - started) * 1e3 - waited
            plan.time = wall
            plan.measurements.plan_ms = elapsed  # what training paid: planning and the gather
            self._timer.open(plan.step, started, begin, cpu)
            self._timer.add(PLAN, elapsed, cpu_clock_ms() - cpu, outermost=True)
            self._timer.add("gather", planned.gather_ms, 0.0)  # its CPU time is the plan's
            if self._prober.due(plan.step):
                with marks.mark(marks.PROBE), self._timer.timed("probe"):
                    plan.measurements.link_probe = self._prober.probe()
            self._record(planned.measured, plan)
        return plan

    def prefetch(self, local_seq_lens: Any, token_dim: int, packed_seqs: Any = None) -> None:
        """Planning ahead: start gathering and planning the step with these arguments (the
        next `plan_routing` call's) in the background; returns at once. Collective over
        the group in the same way as `plan_routing`, which takes the result; several
        steps may be prefetched, and are taken in order. Does nothing without
        ``plan_ahead=True``."""
        self._require_training()
        self._path.prefetch(StepRequest.of(local_seq_lens, token_dim, packed_seqs))

    def use_plan(self, plan: RoutingPlan) -> None:
        """Route the following calls by ``plan`` (what `plan_routing` does with the plan it
        makes). Local: every rank of the group must be given the same plan, whose GPUs are
        the group's ranks. Replay uses it to execute a recorded plan."""
        self._require_open()
        self.tables = self._planner.tables(plan)
        self.last_plan = plan

    def finish(self) -> None:
        """Collective end of training (every rank of the group, right after the last step,
        before `close`): ends the last step and gathers the measurements not sent yet, so
        that the last plans are recorded with them. No `plan_routing` may follow. Without
        it, `close` records those plans without their measurements."""
        self._require_open()
        if self._finished:
            return
        # The last step ends here (call finish right after it): it gets its wall time,
        # and with it its compute, like every other step.
        self._timer.close(time.perf_counter(), self._timer.boundary(), cpu_clock_ms())
        for measured in self._path.finish():
            self._deliver(measured)
        self._finished = True

    # -------------------------------------------------------------- recording
    def _record(self, measured: GatheredStep | None, plan: RoutingPlan) -> None:
        """Hand the recorder what a plan_routing call brought: the measurements of an
        earlier step and the new plan."""
        if self.recorder is None:
            self._deliver(measured)
            return
        # Timed on the host whatever the device: what training pays for recording,
        # recorded with the step like any phase.
        with self._timer.host_timed("record"):
            self._deliver(measured)
            self._hold(plan)

    def _deliver(self, measured: GatheredStep | None) -> None:
        """Every rank's measurements of a step arrived: keep them, attach them to that
        step's held plan and hand it to the recorder (earlier held plans, which will get
        none, go as they are)."""
        if measured is None:
            return
        self.last_gathered = measured
        for step in sorted(self._held):
            if step > measured.step:
                break
            plan = self._held.pop(step)
            if step == measured.step:
                measured.attach(plan)
            self.recorder.record(plan)

    def _hold(self, plan: RoutingPlan) -> None:
        """Keep ``plan`` until its step's measurements arrive, if the recorder wants it."""
        wants = getattr(self.recorder, "wants", None)
        if wants is None or wants(plan):
            self._held[plan.step] = plan

    def _require_open(self) -> None:
        if self._closed:  # its sub-groups are destroyed
            raise RuntimeError("this SequenceBalancer is closed; create a new one")

    def _require_training(self) -> None:
        self._require_open()
        if self._finished:
            raise RuntimeError("finish() ended training on this SequenceBalancer; create a new one")

    def _require_tables(self) -> RoutingTables:
        self._require_open()
        if self.tables is None:
            raise RuntimeError("call plan_routing(...) before routing tokens")
        return self.tables

    # ---------------------------------------------------------------- routing
    def route(
        self, packed_seqs: torch.Tensor, features: Features = None
    ) -> tuple[list[int], torch.Tensor, Features]:
        """Send every chunk to its GPU: one all-to-all for the tokens and all features.

        ``packed_seqs``: ``(T_local, ...)``, this rank's sequences concatenated in the
        order of ``local_seq_lens``. ``features``: a tensor or dict/list of tensors with
        first dim ``T_local`` (any dtype; integers arrive bit-exact).
        Returns ``(chunk_lens, seqs (T_chunks, ...), features)``: the chunks this rank now
        holds, ordered by sequence id then chunk index.
        """
        t = self._require_tables()
        rows = (packed_seqs, "packed_seqs", features, t.num_local, _LOCAL_ROWS)
        with marks.mark(marks.ROUTE):
            moved = self._move("route", *rows, t.send_splits, t.recv_splits, pre_index=t.send_index)
        return list(t.chunk_lens), *moved

    def reverse_route(
        self, seqs: torch.Tensor, features: Features = None
    ) -> tuple[list[int], torch.Tensor, Features]:
        """Send chunks home: the inverse of `route` (rows back in the packed order).

        ``seqs``: ``(T_chunks, ...)``. Returns ``(local_seq_lens, seqs (T_local, ...),
        features)``.
        """
        t = self._require_tables()
        rows = (seqs, "seqs", features, t.num_chunk_tokens, _CHUNK_ROWS)
        with marks.mark(marks.REVERSE_ROUTE):
            back = self._move("reverse_route", *rows, t.recv_splits, t.send_splits,
                              post_index=t.restore_index)  # fmt: skip
        return list(t.local_lens), *back

    def _move(
        self,
        phase: str,
        x: torch.Tensor,
        name: str,
        features: Features,
        rows: int,
        holder: str,
        send: list[int],
        recv: list[int],
        **index: torch.Tensor,
    ) -> tuple[torch.Tensor, Features]:
        """Check that ``x`` and its features have the ``rows`` rows ``holder`` holds, and
        (with every rank) the same row layout as every rank's, then move them in one
        all-to-all timed as ``phase``; ``index`` reorders the rows before sending
        (``pre_index``) or after receiving (``post_index``)."""
        tensors = _inputs(x, name, features, rows, holder)
        timer = partial(self._timer.timed, phase)
        with timer():
            check_same_rows(phase, tensors, self.groups.host, self.group_ranks)
        outs = exchange(tensors, send, recv, self.group, **index, timer=timer)
        return outs[0], unflatten_features(features, outs[1:])

    # -------------------------------------------------------------- attention
    def pre_attn(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ulysses: trade chunks of all heads for whole sequences of H/g heads.

        ``q, k, v``: ``(T_chunks, H, D)`` from the routed tokens. In a bag of g > 1 GPUs
        returns ``(seq_lens, q, k, v)`` with ``(T_bag, H/g, D)``: the bag's whole
        sequences (lengths ``seq_lens``, what a varlen attention kernel needs) and this
        GPU's share of the heads. A single-GPU bag returns its inputs unchanged.
        """
        t = self._require_tables()
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_heads_layout(name, x)
            check_rows(name, x, t.num_chunk_tokens, _CHUNK_ROWS)
        if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
            raise KnapformerError(
                f"q, k, v must share shape and dtype, got {tuple(q.shape)}/{q.dtype}, "
                f"{tuple(k.shape)}/{k.dtype}, {tuple(v.shape)}/{v.dtype}"
            )
        heads = q.shape[1]
        # Checked against every bag size a step may use so that all ranks fail together,
        # not hang, and a head count that works for one step works for every step.
        bad = [g for g in self.groups.layout.bag_sizes if heads % g]
        if bad:
            raise KnapformerError(
                f"{heads} attention heads cannot be split evenly across bags of "
                f"{max(bad)} GPUs (topology {self.topology}); use a head count divisible "
                f"by every bag size"
            )
        bag = t.bag
        if bag is None:
            return list(t.chunk_lens), q, k, v
        with marks.mark(marks.PRE_ATTN):
            return self._heads_to_sequences(bag, q, k, v)

    def _heads_to_sequences(self, bag: BagTables, q, k, v):
        """``q, k, v (T_chunks, H, D)`` -> ``(T_bag, H/g, D)`` each, in one exchange."""
        rows, g, heads, dh = q.shape[0], bag.size, q.shape[1], q.shape[2]
        x = torch.stack([q, k, v], dim=1).reshape(rows, 3, g, heads // g, dh)
        x = x.permute(2, 0, 1, 3, 4).reshape(g * rows, 3, heads // g, dh)
        (y,) = exchange(
            [x],
            [rows] * g,
            bag.tokens_per_gpu,
            bag.group,
            post_index=bag.to_sequences,
            timer=partial(self._timer.timed, "pre_attn"),
        )
        q2, k2, v2 = y.unbind(dim=1)
        return list(bag.seq_lens), q2, k2, v2

    def post_attn(self, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Inverse of `pre_attn` for the attention output.

        ``out``: ``(T_bag, H/g, D)`` in the layout `pre_attn` returned. Returns
        ``(chunk_lens, out (T_chunks, H, D))``.
        """
        t = self._require_tables()
        _check_heads_layout("out", out)
        bag = t.bag
        if bag is None:
            check_rows("out", out, t.num_chunk_tokens, _CHUNK_ROWS)
            return list(t.chunk_lens), out
        check_rows("out", out, sum(bag.seq_lens), "the bag sequences from pre_attn")
        with marks.mark(marks.POST_ATTN):
            return list(t.chunk_lens), self._sequences_to_heads(bag, out, t.num_chunk_tokens)

    def _sequences_to_heads(self, bag: BagTables, out: torch.Tensor, rows: int) -> torch.Tensor:
        """``out (T_bag, H/g, D)`` -> ``(rows = T_chunks, H, D)``, in one exchange."""
        g = bag.size
        (y,) = exchange(
            [out],
            bag.tokens_per_gpu,
            [rows] * g,
            bag.group,
            pre_index=bag.from_sequences,
            timer=partial(self._timer.timed, "post_attn"),
        )
        y = y.reshape(g, rows, *out.shape[1:]).permute(1, 0, 2, 3)
        return y.reshape(rows, g * out.shape[1], out.shape[2])

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Tear down (idempotent; the parent group is the caller's and is left alone):

        1. let the plan-ahead thread finish what every rank submitted, then stop it;
        2. hand the recorder the plans still waiting for measurements (without them: see
           `finish`) and close it;
        3. wait for every rank of the balance group (a barrier), so that no collective of
           the balancer is in flight anywhere when
        4. the sub-groups are destroyed, the latest made first.

        The barrier is skipped while an exception propagates (peers may be gone). Destroy
        the default group after this, not before."""
        if self._closed:
            return
        self._closed = True
        self._timer.release()
        side_ended = self._path.close()
        if self.recorder is not None:
            for step in sorted(self._held):
                self.recorder.record(self._held.pop(step))
            self.recorder.close()
        if sys.exception() is None and dist.is_initialized():
            with marks.wait("barrier"):
                self.groups.barrier()
        # A thread still in a collective whose peers are gone: destroying its group under
        # it could crash the process; the daemon thread goes with the process.
        self.groups.destroy(keep=() if side_ended else (self.groups.side,))

    def __enter__(self) -> SequenceBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------- per-sequence data (runtime/conditioning.py)
    def sequence_index(self) -> torch.Tensor:
        """``(T_chunks,)`` int64: the plan sequence id of every row `route` returned."""
        return conditioning.sequence_index(self)

    def gather_sequences(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``(S_local, ...)`` per-sequence rows -> the group's ``(S, ...)``;
        collective over the balance group, autograd-aware (gradients go home)."""
        return conditioning.gather_sequences(self, x)

    def per_token(self, x: torch.Tensor) -> torch.Tensor:
        """``(S_local, ...)`` per sequence -> ``(T_chunks, ...)`` per routed token."""
        return conditioning.per_token(self, x)


def _checked_options(
    given: dict[str, Any], run: str | None, parent_ranks: tuple[int, ...], rank: int
) -> tuple[PlannerOptions, BalanceLayout]:
    """The constructor's options, checked on this rank alone (a `KnapformerError` names
    the first bad one), and the layout of its groups."""
    auto = _auto_options(given)
    if auto is None:
        topology: Topology | str = as_topology(given["topology"])
        layout = BalanceLayout(topology, parent_ranks, rank)
    else:
        topology = AUTO
        # The planner's own rules (every step applies them again), checked on this rank.
        sizes, _ = allowed_sizes(
            len(parent_ranks), int(auto.comm.node_size), auto.group_sizes, auto.min_group,
            auto.max_group, auto.cross_node,
        )  # fmt: skip
        layout = BalanceLayout(None, parent_ranks, rank, sizes)
    check_solver(given["solver"], given["max_tokens_per_gpu"])
    cost_model, time_scale = given["cost_model"], given["time_scale"]
    if cost_model not in COST_MODELS:
        raise KnapformerError(
            f"unknown cost_model {cost_model!r}; choose one of {', '.join(COST_MODELS)}"
        )
    if time_scale is not None and not (math.isfinite(time_scale) and time_scale > 0):
        raise KnapformerError(f"time_scale must be a positive number of ms, got {time_scale}")
    WorkloadModel(1, given["gamma"])  # validates gamma now rather than at the first step
    for phase in given["phases"]:
        _check_added_phase(phase)
    check_probe_options(
        given["link_probe_every"], given["link_probe_bytes"], given["link_probe_rounds"]
    )
    options = PlannerOptions(
        topology=topology,
        gamma=float(given["gamma"]),
        solver=given["solver"],
        max_tokens_per_gpu=given["max_tokens_per_gpu"],
        run=run,
        time_scale=None if time_scale is None else float(time_scale),
        fixed_speed=_as_speeds(given["gpu_speed"], layout.gpus_per_replica, cost_model),
        auto=auto,
    )
    return options, layout


#: The options only ``topology="auto"`` uses, and their defaults.
_AUTO_ONLY = {"node_size": None, "group_sizes": DEFAULT_GROUP_SIZES, "min_group": None,
              "max_group": None, "cross_node": False, "comm": None}  # fmt: skip


def _auto_options(given: dict[str, Any]) -> AutoOptions | None:
    """The per-step topology options (None for a fixed topology, which refuses them)."""
    if not (isinstance(given["topology"], str) and given["topology"].strip() == AUTO):
        for name, default in _AUTO_ONLY.items():
            if given[name] != default and not (name == "group_sizes" and
                                               tuple(given[name]) == default):  # fmt: skip
                raise KnapformerError(
                    f"{name}={given[name]!r} is an option of topology='auto'; the fixed "
                    f"topology {given['topology']} does not use it"
                )
        return None
    comm = given["comm"]
    if comm is None or isinstance(comm, str):
        comm = CommModel.cluster(comm or "nvlink")
    elif not isinstance(comm, CommModel):
        raise KnapformerError(
            f"comm must be a CommModel or a cluster name, got {type(comm).__name__}"
        )
    if given["node_size"] is not None:
        comm = comm.with_(node_size=_whole(given["node_size"], "node_size"))
    sizes = tuple(_whole(g, "a group size") for g in given["group_sizes"])
    bounds = {name: None if given[name] is None else _whole(given[name], name)
              for name in ("min_group", "max_group")}  # fmt: skip
    return AutoOptions(comm, sizes, **bounds, cross_node=bool(given["cross_node"]))


def _whole(value: Any, name: str) -> int:
    """``value`` as a positive int, or a `KnapformerError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise KnapformerError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _shown(value: Any) -> Any:
    """An option as ranks compare it: a topology in its canonical form, sequences as
    lists (a tuple and a list of the same values agree)."""
    if isinstance(value, Topology):
        return str(value)
    if isinstance(value, CommModel):
        return value.as_options()
    if isinstance(value, str):
        try:
            return str(as_topology(value)) if value.startswith("g") else value
        except KnapformerError:
            return value
    if isinstance(value, list | tuple):
        return [_shown(v) for v in value]
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    return value


def _check_added_phase(phase: str) -> None:
    """A phase a user adds (``phases=``, `SequenceBalancer.add_timing`) may not be one the
    timer derives when a step ends."""
    if phase in DERIVED_PHASES:
        raise KnapformerError(f"phase {phase!r} is derived when a step ends; pick another")


def _inputs(
    x: torch.Tensor, name: str, features: Features, rows: int, what: str
) -> list[torch.Tensor]:
    """``x`` and the flattened ``features`` for one exchange, once each has the ``rows``
    rows that ``what`` holds."""
    check_rows(name, x, rows, what)
    flat = flatten_features(features)
    keys = list(features) if isinstance(features, dict) else range(len(flat))
    for key, f in zip(keys, flat, strict=True):
        check_rows(f"feature {key!r}", f, rows, what)
    return [x, *flat]


def _check_heads_layout(name: str, x: Any) -> None:
    """A `KnapformerError` unless ``x`` is a (tokens, heads, head_dim) tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise KnapformerError(f"{name} must have shape (tokens, heads, head_dim), got {shape}")


def _as_speeds(gpu_speed: Sequence[float] | None, num_gpus: int, cost_model: str):
    """Fixed per-GPU speeds as floats (None: nominal); a clear error for bad ones."""
    if gpu_speed is None:
        return None
    if cost_model == "history":
        raise KnapformerError("gpu_speed is learnt by cost_model='history'; pass one or the other")
    speed = check_speed(gpu_speed, num_gpus)
    return None if speed is None else speed.tolist()
