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

Options: ``SequenceBalancer(topology, **options)`` or ``SequenceBalancer(BalancerConfig(...))``
(`knapformer.runtime.balancer_config`, which says what each option does).

Every rank must agree, and the balancer makes sure they do, collectively, so that a
mistake on one rank makes every rank raise `KnapformerError` rather than some wait in a
collective for a peer that already left (or gloo abort on a size mismatch): the
constructor's options (`knapformer.runtime.agreement`), ``plan_routing``'s arguments
(`knapformer.runtime.gather`), the rows, heads and per-sequence rows of every exchange
(`knapformer.runtime.layouts`). Every sub-group it creates and every wait it makes
inherits the process group's timeout. Balance groups are consecutive ranks; a world of
k x (topology GPUs) ranks holds k replicas, each balanced on its own.

When a rank fails anyway (raises in its forward, stalls, dies), every surviving rank
raises one `knapformer.errors.CollectiveFailure` naming it, the step, the phase and the
bag, within the group's timeout plus a few seconds: each rank journals its collectives
(`knapformer.runtime.journal`) and, when one fails, asks the others where they are
through the process group's store (`knapformer.runtime.roll_call`); the incident and the
journals are written beside the recorder's plans.

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

import inspect
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial, wraps
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from knapformer.contract.phases import (
    ALLREDUCE,
    COLLECTIVE_PHASES,
    DEVICE_PHASES,
    GATHER_SEQUENCES,
    OPTIMIZER,
    PLAN,
    POST_ATTN,
    PRE_ATTN,
    PROBE,
)
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel
from knapformer.planning.history import SpeedHistory
from knapformer.planning.partitions import DEFAULT_GROUP_SIZES
from knapformer.runtime import conditioning, marks, ulysses
from knapformer.runtime.agreement import agree_on_config
from knapformer.runtime.balancer_config import BalancerConfig, PlannerOptions, check_added_phase
from knapformer.runtime.blame import FAILED
from knapformer.runtime.gather import (  # GatherHead and the two tuples are re-exported
    GATHERING_CALLS,
    LOCAL_CHECKS,
    GatherHead,
    StepRequest,
)
from knapformer.runtime.groups import BalanceGroups, BalanceLayout, group_device
from knapformer.runtime.journal import Journal, plan_hash
from knapformer.runtime.layouts import check_same_heads, check_same_rows, check_same_sequences
from knapformer.runtime.link_probe import DEFAULT_PROBE_BYTES, DEFAULT_PROBE_ROUNDS, LinkProber
from knapformer.runtime.roll_call import RollCall
from knapformer.runtime.router import (
    Features,
    Group,
    RoutingTables,
    check_rows,
    exchange,
    flatten_features,
    unflatten_features,
)
from knapformer.runtime.step_paths import AheadPath, StepPath, StepPlanner, SyncPath
from knapformer.runtime.timing import GatheredStep, StepTimer, cpu_clock_ms

__all__ = ["GATHERING_CALLS", "LOCAL_CHECKS", "BalancerConfig", "GatherHead", "SequenceBalancer"]

# What holds the rows of a tensor given to route / reverse_route, pre_attn, post_attn.
_LOCAL_ROWS = "the sequence lengths given to plan_routing"
_CHUNK_ROWS = "the chunks routed to this rank"


def _call(name: str) -> Callable:
    """Journal that the training thread is inside the balancer's call ``name`` while the
    method runs: left set when it raises, so that the rank can say where."""

    def decorate(method: Callable) -> Callable:
        @wraps(method)
        def journaled(self: SequenceBalancer, *args: Any, **kwargs: Any) -> Any:
            self.journal.call = name
            result = method(self, *args, **kwargs)
            self.journal.call = None
            return result

        return journaled

    return decorate


class SequenceBalancer:
    """Balances packed sequences across the GPUs of a balance group.

    Args:
        topology: compute bags, e.g. ``"g1n2+g2n1+g4n1"`` (or a `Topology`), ``"auto"``
            (every step's plan chooses them), or a whole `BalancerConfig`, which then
            holds every option below but ``process_group`` and ``recorder``.
        process_group: the group to balance (default: WORLD). Sub-groups are created with
            ``torch.distributed.new_group``, so every rank of the default group must
            construct the balancer at the same point, with the same options: ranks that
            differ all raise `KnapformerError` naming the option.
        recorder: optional sink for finished plans (e.g. ``knapformer.PlanRecorder``):
            ``record(plan)`` gets each plan once every rank's measurements of its step
            are attached, ``close()`` is called by `close`; if it has ``wants(plan)``, only
            plans it wants are held back for their measurements. A failed step's incident
            and the ranks' journals are written in the folder of its ``path``.
        gamma, solver, max_tokens_per_gpu, run, cost_model, gpu_speed, time_scale,
        plan_ahead, phases, time_gc: the options of `BalancerConfig` of those names.
        node_size, group_sizes, min_group, max_group, cross_node, comm: ``"auto"`` only,
            `BalancerConfig.auto` (an `AutoTopology`).
        link_probe_every, link_probe_bytes, link_probe_rounds: `BalancerConfig.link_probe`
            (a `LinkProbeOptions`: ``every``, ``bytes``, ``rounds``).
    """

    def __init__(
        self,
        topology: Topology | str | BalancerConfig,
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
        rank = dist.get_rank()
        if process_group is None or process_group == dist.group.WORLD:
            parent_ranks = tuple(range(dist.get_world_size()))
        else:
            parent_ranks = tuple(dist.get_process_group_ranks(process_group))
        given = dict(
            gamma=gamma, solver=solver, max_tokens_per_gpu=max_tokens_per_gpu, run=run,
            cost_model=cost_model, gpu_speed=gpu_speed, time_scale=time_scale,
            plan_ahead=plan_ahead, phases=tuple(phases), node_size=node_size,
            group_sizes=tuple(group_sizes), min_group=min_group, max_group=max_group,
            cross_node=cross_node, comm=comm, link_probe_every=link_probe_every,
            link_probe_bytes=link_probe_bytes, link_probe_rounds=link_probe_rounds,
            time_gc=time_gc,
        )  # fmt: skip
        device = group_device(process_group)
        config, options, layout, uid = agree_on_config(
            topology, given, _KEYWORD_DEFAULTS, process_group, parent_ranks, rank, device
        )
        self._parent_group: Group = process_group
        self._parent_ranks = list(parent_ranks)
        self.rank: int = rank
        self.device = device  # NCCL moves CUDA tensors only; everything else runs on the CPU
        self._build(config, options, layout, uid, recorder)

    def _build(
        self,
        config: BalancerConfig,
        options: PlannerOptions,
        layout: BalanceLayout,
        uid: int,
        recorder: Any,
    ) -> None:
        """Make the balancer's parts once every rank agreed on ``config``: its groups
        (collective), timer, journal and roll call, planning path and link prober."""
        #: Every option, as one `BalancerConfig`.
        self.config: BalancerConfig = config
        #: The `Topology`, or ``"auto"`` (each plan's ``topology`` is then its step's).
        self.topology: Topology | str = options.topology
        self.auto = config.auto
        self.gamma, self.solver, self.time_scale = options.gamma, options.solver, options.time_scale
        self.max_tokens_per_gpu, self.run = config.max_tokens_per_gpu, config.run
        self.recorder, self.cost_model = recorder, config.cost_model
        self.groups = BalanceGroups.create(layout, self._parent_group, config.plan_ahead)

        self.step: int = -1  # -1 until the first plan_routing
        self.last_plan: RoutingPlan | None = None
        self.tables: RoutingTables | None = None
        self._my_bag: tuple[int, list[int]] = (-1, [self.rank])  # the plan's bag of this rank
        self._sequences: tuple[RoutingTables, conditioning.SequenceTables] | None = None
        #: Every rank's timings of the latest step whose measurements arrived.
        self.last_gathered: GatheredStep | None = None
        self._timer = StepTimer(self.device, config.phases, config.time_gc)
        self.phases: tuple[str, ...] = self._timer.phases
        self._held: dict[int, RoutingPlan] = {}  # plans waiting for their measurements
        #: This rank's step journal; the roll call that names a failed collective's culprits.
        self.journal = Journal(self.rank, config.journal.size)
        self._watch = RollCall(
            self.journal, self.groups.group_ranks, uid, self.groups.timeout_s, config.run,
            _run_folder(recorder), _group_names(self.groups), config.journal.answer_s,
        )  # fmt: skip
        history = SpeedHistory(layout.gpus_per_replica) if config.cost_model == "history" else None
        planner = StepPlanner(
            options, self.groups, self.device, self._timer, self.phases, history, self._watch
        )
        self._path: StepPath = AheadPath(planner) if config.plan_ahead else SyncPath(planner)
        probe = config.link_probe
        self._prober = LinkProber(
            self.groups.group, self.groups.group_ranks, self.device, probe.every, probe.bytes,
            probe.rounds,
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
        return list(self._my_bag[1])

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
        check_added_phase(phase)
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
        check_added_phase(phase)
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
        self._require_open()
        if group is None:
            group, ranks = self._parent_group, self._parent_ranks
        else:
            ranks = dist.get_process_group_ranks(group)
        with self._collective(ALLREDUCE, ranks=ranks):
            dist.all_reduce(tensor, op=op, group=group)

    # --------------------------------------------------------------- planning
    @_call("plan_routing")
    def plan_routing(
        self, local_seq_lens: Any, token_dim: int, packed_seqs: torch.Tensor | None = None
    ) -> RoutingPlan:
        """Plan this step from every rank's sequence lengths; collective over the group.

        ``local_seq_lens``: this rank's sequence lengths (list, numpy array or tensor), in
        the order the sequences are packed. ``token_dim``: the model's hidden size, the
        same on every rank. ``packed_seqs`` (optional): the ``(T_local, ...)`` tensor this
        rank will `route`; passing it checks its rows here.
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
            self._take(plan, planned.tables)
            elapsed = (time.perf_counter() - started) * 1e3 - waited
            plan.time = wall
            plan.measurements.plan_ms = elapsed  # what training paid: planning and the gather
            self._timer.open(plan.step, started, begin, cpu)
            self._timer.add(PLAN, elapsed, cpu_clock_ms() - cpu, outermost=True)
            self._timer.add("gather", planned.gather_ms, 0.0)  # its CPU time is the plan's
            if self._prober.due(plan.step):
                with marks.mark(marks.PROBE), self._collective(PROBE):
                    plan.measurements.link_probe = self._prober.probe()
            self._record(planned.measured, plan)
        return plan

    def _take(self, plan: RoutingPlan, tables: RoutingTables) -> None:
        """Route the following calls by ``plan`` and its ``tables``."""
        self.tables, self.last_plan = tables, plan
        if plan.step is not None:
            self.step = plan.step
        bag = plan.bag_of(self.rank)
        self._my_bag = (bag, [int(r) for r in plan.bags[bag]])
        self.journal.start_step(self.step, plan_hash(plan))
        self._watch.step_started()

    @_call("prefetch")
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
        self._take(plan, self._planner.tables(plan))

    @_call("finish")
    def finish(self) -> None:
        """Collective end of training (every rank of the group, right after the last step,
        before `close`): ends the last step and gathers the measurements not sent yet, so
        that the last plans are recorded with them. No `plan_routing` may follow. Without
        it, `close` records those plans without their measurements (on every rank alike:
        a rank that closes without it while the others call it is named on all)."""
        self._require_open()
        if self._finished:
            return
        # The last step ends here (call finish right after it): it gets its wall time,
        # and with it its compute, like every other step.
        self._timer.close(time.perf_counter(), self._timer.boundary(), cpu_clock_ms())
        for measured in self._path.finish():
            self._deliver(measured)
        self._finished = True
        self._watch.finished = True

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
        if self._watch.state == FAILED:  # its groups are broken: no collective may follow
            raise KnapformerError(
                f"this SequenceBalancer failed ({self._watch.error}); close it and create a new one"
            )

    def _require_training(self) -> None:
        self._require_open()
        if self._finished:
            raise RuntimeError("finish() ended training on this SequenceBalancer; create a new one")

    def _require_tables(self) -> RoutingTables:
        self._require_open()
        if self.tables is None:
            raise RuntimeError("call plan_routing(...) before routing tokens")
        return self.tables

    @contextmanager
    def _collective(self, phase: str, bag: int = -1, ranks: list[int] | None = None):
        """One collective of ``phase`` (over ``ranks``, default the balance group): timed,
        and journaled (its failure becomes the named `CollectiveFailure`)."""
        with self._timer.timed(phase), self._watch.collective(phase, bag, ranks):
            yield

    def _in_bag(self, phase: str) -> Callable[[], AbstractContextManager]:
        """`_collective` of ``phase`` in this rank's bag, as the router's timer."""
        bag, ranks = self._my_bag
        return partial(self._collective, phase, bag, ranks)

    # ---------------------------------------------------------------- routing
    @_call("route")
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

    @_call("reverse_route")
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
        """Check, with every rank, that ``x`` and its features have the ``rows`` rows
        ``holder`` holds and every rank's row layout, then move them in one all-to-all
        timed as ``phase``; ``index`` reorders the rows before sending (``pre_index``) or
        after receiving (``post_index``)."""
        tensors, problem = _inputs(x, name, features, rows, holder)
        collective = partial(self._collective, phase)
        with collective():
            check_same_rows(phase, tensors, problem, self.groups.host, self.group_ranks)
        outs = exchange(tensors, send, recv, self.group, **index, timer=collective)
        return outs[0], unflatten_features(features, outs[1:])

    # -------------------------------------------------------------- attention
    @_call("pre_attn")
    def pre_attn(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ulysses: trade chunks of all heads for whole sequences of H/g heads.

        ``q, k, v``: ``(T_chunks, H, D)`` from the routed tokens. In a bag of g > 1 GPUs
        returns ``(seq_lens, q, k, v)`` with ``(T_bag, H/g, D)``: the bag's whole
        sequences (lengths ``seq_lens``, what a varlen attention kernel needs) and this
        GPU's share of the heads. A single-GPU bag returns its inputs unchanged. The bag
        first checks, together, that its ranks give the same heads, head_dim and dtype.
        """
        t = self._require_tables()
        sizes = self.groups.layout.bag_sizes
        problem = ulysses.pre_attn_problem(q, k, v, t.num_chunk_tokens, sizes, self.topology)
        bag = t.bag
        if bag is None:
            if problem is not None:
                raise problem
            return list(t.chunk_lens), q, k, v
        with marks.mark(marks.PRE_ATTN):
            self._check_heads(PRE_ATTN, q, problem)
            q2, k2, v2 = ulysses.heads_to_sequences(bag, q, k, v, self._in_bag(PRE_ATTN))
        return list(bag.seq_lens), q2, k2, v2

    @_call("post_attn")
    def post_attn(self, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Inverse of `pre_attn` for the attention output.

        ``out``: ``(T_bag, H/g, D)`` in the layout `pre_attn` returned. Returns
        ``(chunk_lens, out (T_chunks, H, D))``.
        """
        t = self._require_tables()
        bag = t.bag
        if bag is None:
            problem = ulysses.post_attn_problem(out, t.num_chunk_tokens, _CHUNK_ROWS)
            if problem is not None:
                raise problem
            return list(t.chunk_lens), out
        rows = sum(bag.seq_lens)
        problem = ulysses.post_attn_problem(out, rows, "the bag sequences from pre_attn")
        with marks.mark(marks.POST_ATTN):
            self._check_heads(POST_ATTN, out, problem)
            back = ulysses.sequences_to_heads(bag, out, t.num_chunk_tokens, self._in_bag(POST_ATTN))
        return list(t.chunk_lens), back

    def _check_heads(self, phase: str, x: torch.Tensor, problem: Exception | None) -> None:
        """The bag's check, before its exchange, that its ranks' heads agree."""
        ranks = self._my_bag[1]
        with self._in_bag(phase)():
            check_same_heads(phase, x, problem, self.groups.host_bag_group(ranks), ranks)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Tear down (idempotent; the parent group is the caller's and is left alone):

        1. while an exception propagates (this rank's own, or its training loop's), tell
           the other ranks what it raised, through the store (they name it);
        2. let the plan-ahead thread finish what every rank submitted, then stop it;
        3. hand the recorder the plans still waiting for measurements (without them: see
           `finish`) and close it;
        4. otherwise wait, through the process group's store, for every rank of the
           balance group to close too, so that no collective of the balancer is in flight
           anywhere when the sub-groups are destroyed: a rank that closes while the others
           train (without `finish`) makes every rank raise `KnapformerError` naming it,
           this one included;
        5. destroy the sub-groups, the latest made first.

        Destroy the default group after this, not before."""
        self._close(sys.exception())

    def _close(self, err: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if err is not None:
            self._watch.raised(err)  # first: the peers may be waiting to know
        self._timer.release()
        side_ended = True
        try:
            side_ended = self._path.close()
            if self.recorder is not None:
                for step in sorted(self._held):
                    self.recorder.record(self._held.pop(step))
                self.recorder.close()
            if err is None and self.device.type == "cuda" and dist.is_initialized():
                torch.cuda.synchronize(self.device)  # no kernel of ours left in flight
            with marks.wait("barrier"):  # through the store, not the group
                self._watch.close(err, self._finished)
        finally:
            # A thread still in a collective whose peers are gone: destroying its group
            # under it could crash the process; the daemon thread goes with the process.
            self.groups.destroy(keep=() if side_ended else (self.groups.side,))

    def __enter__(self) -> SequenceBalancer:
        return self

    def __exit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        self._close(err)

    # ----------------------------------------- per-sequence data (runtime/conditioning.py)
    def _sequence_tables(self) -> conditioning.SequenceTables:
        """The current plan's `conditioning.SequenceTables` (built once per plan)."""
        tables = self._require_tables()
        if self._sequences is None or self._sequences[0] is not tables:
            built = conditioning.sequence_tables(self.last_plan, self.rank, self.device)
            self._sequences = (tables, built)
        return self._sequences[1]

    def sequence_index(self) -> torch.Tensor:
        """``(T_chunks,)`` int64: the plan sequence id of every row `route` returned."""
        return self._sequence_tables().index

    @_call("gather_sequences")
    def gather_sequences(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``(S_local, ...)`` per-sequence rows -> the group's ``(S, ...)``;
        collective over the balance group, autograd-aware (gradients go home). The group
        first checks, together, that every rank gives one row per sequence it planned and
        rows of one layout."""
        tables = self._checked_sequences(x)
        return conditioning.gather_rows(x, tables, self.group, self._gather_journal())

    @_call("per_token")
    def per_token(self, x: torch.Tensor) -> torch.Tensor:
        """``(S_local, ...)`` per sequence -> ``(T_chunks, ...)`` per routed token."""
        tables = self._checked_sequences(x)
        return conditioning.rows_per_token(x, tables, self.group, self._gather_journal())

    def _checked_sequences(self, x: torch.Tensor) -> conditioning.SequenceTables:
        tables = self._sequence_tables()
        problem = conditioning.count_problem(x, tables)
        with self._watch.collective(GATHER_SEQUENCES):
            check_same_sequences(GATHER_SEQUENCES, x, problem, self.groups.host, self.group_ranks)
        return tables

    def _gather_journal(self) -> Callable[[], AbstractContextManager]:
        return partial(self._watch.collective, GATHER_SEQUENCES)


#: The defaults of the constructor's option keywords (a `BalancerConfig` comes alone).
_KEYWORD_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(SequenceBalancer.__init__).parameters.items()
    if name not in ("self", "topology", "process_group", "recorder")
}


def _run_folder(recorder: Any) -> Path | None:
    """The folder of the recorder's plans, where a failure's incident and the journals go."""
    path = getattr(recorder, "path", None)
    return None if path is None else Path(path).parent


def _group_names(groups: BalanceGroups) -> list[dict[str, Any]]:
    """The process groups of the balancer as a journal dump lists them: what each is for,
    its ranks and its name (the flight recorder's ``process_group`` names it so)."""
    out = []

    def add(role: str, group: Group, ranks: list[int]) -> None:
        pg = dist.group.WORLD if group is None else group
        out.append({"role": role, "ranks": list(ranks), "name": str(pg.group_name)})

    add("balance", groups.group, groups.group_ranks)
    if groups.host is not None and groups.host is not groups.group:
        add("host", groups.host, groups.group_ranks)
    for bag in (b for b in groups.layout.bags if groups.rank in b):
        if len(bag) > 1 and not groups.layout.reuses(bag):  # a reused one is "balance"
            add(f"bag {bag}", groups.bag_group(bag), bag)
            host = groups.host_bag_group(bag)
            if host is not groups.bag_group(bag):
                add(f"host bag {bag}", host, bag)
    if groups.side is not None:
        add("plan_ahead", groups.side, groups.group_ranks)
    return out


def _inputs(
    x: torch.Tensor, name: str, features: Features, rows: int, what: str
) -> tuple[list[torch.Tensor], Exception | None]:
    """``x`` and the flattened ``features`` for one exchange, and why they cannot go (one
    does not have the ``rows`` rows that ``what`` holds; None when they can): raised only
    once every rank has heard of it."""
    try:
        check_rows(name, x, rows, what)
        flat = flatten_features(features)
        keys = list(features) if isinstance(features, dict) else range(len(flat))
        for key, f in zip(keys, flat, strict=True):
            check_rows(f"feature {key!r}", f, rows, what)
    except (KnapformerError, TypeError) as err:
        return [], err
    return [x, *flat], None
