"""The phases of a training step: the one vocabulary of phase names that the balancer's
timer, the plan's measurements (``Measurements.per_rank_ms`` keys), the diagnosis, the
trace and every view share.

A step runs from one ``plan_routing`` call to the next. Its phases, by who times them:

- the balancer's own: ``plan`` (gather and solve; ``gather`` is its all-gather),
  ``route``, ``pre_attn`` / ``post_attn`` (Ulysses, per layer), ``reverse_route``,
  ``record`` (handing the plan to the recorder), ``probe`` (the link probe, every few
  steps) and ``allreduce`` (the gradient all-reduce, when the loop runs it through the
  balancer);
- the training loop's (``balancer.timed(phase)`` / ``add_timing``): ``data`` (waiting
  for the next batch), ``forward_backward``, ``optimizer``, ``host`` (other host work);
- the timer's: ``gc`` (Python's garbage collector outside every other phase), and when
  the step ends, ``step`` (its wall time), ``compute`` (the step less the collectives,
  the data wait, host work, the optimizer and ``untimed``), on the CPU ``descheduled``
  (the thread ready to compute but waiting for a core) and ``untimed`` (the step's wall
  time inside no timed phase: Python between the loop's phases; derived when the loop
  times its ``forward_backward`` as a block, which then holds the compute);
- the step journal's (`knapformer.runtime.journal`, `JOURNAL_PHASES`): every collective
  of the balancer by the phase it serves, plus ``plan_ahead`` (the plan-ahead thread's
  gathers), ``gather_sequences`` (per-sequence rows), ``finish`` and ``close``.

docs/concepts.md ("Measured times") explains how they add up to a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from knapformer.contract.nan_reduce import nan_to_zero

# ------------------------------------------------------------------------- the names
PLAN = "plan"
GATHER = "gather"
RECORD = "record"
ROUTE = "route"
PRE_ATTN = "pre_attn"
POST_ATTN = "post_attn"
REVERSE_ROUTE = "reverse_route"
ALLREDUCE = "allreduce"
PROBE = "probe"
DATA = "data"
FORWARD_BACKWARD = "forward_backward"
OPTIMIZER = "optimizer"
HOST = "host"
GC = "gc"
STEP = "step"
COMPUTE = "compute"
DESCHEDULED = "descheduled"
UNTIMED = "untimed"
PLAN_AHEAD = "plan_ahead"
GATHER_SEQUENCES = "gather_sequences"
FINISH = "finish"
CLOSE = "close"

# ------------------------------------------------------------------------ the groups
#: What `SequenceBalancer` times itself, in the order a step runs them.
BALANCER_PHASES = (PLAN, ROUTE, PRE_ATTN, POST_ATTN, REVERSE_ROUTE)
#: Collectives timed on every rank (ms inside each, summed over the step's calls). Time
#: inside a collective is waiting for the last rank to arrive plus the transfer itself;
#: the rank that arrived last waited least, so its wait is taken as t_i - min_j t_j and
#: the last arrival is argmin_j t_j (no clocks are compared across ranks).
COLLECTIVE_PHASES = (GATHER, ROUTE, PRE_ATTN, POST_ATTN, REVERSE_ROUTE, ALLREDUCE, PROBE)
#: The collectives that run among the GPUs of one bag (the Ulysses exchanges); the others
#: span the whole balance group. A rank of a 1-GPU bag exchanges with nobody, so it waits
#: for nobody there either.
BAG_COLLECTIVES = (PRE_ATTN, POST_ATTN)
#: The group-wide exchanges that move tokens (the routing all-to-alls).
GROUP_EXCHANGES = (ROUTE, REVERSE_ROUTE)
#: Every collective that moves tokens: what a slow link of one rank shows in.
EXCHANGES = (ROUTE, PRE_ATTN, POST_ATTN, REVERSE_ROUTE)
#: Host work: ``plan`` (less the ``gather`` it holds), recording, the loop's ``host``
#: phase and garbage collection (`host_ms`). Neither it nor ``data`` is the GPU's compute.
HOST_WORK_PHASES = (PLAN, RECORD, HOST, GC)
#: Phases a step timer derives when a step ends (never added by hand).
DERIVED_PHASES = (STEP, COMPUTE, DESCHEDULED, UNTIMED)
#: What is not the device's compute: the collectives, the wait for data, host work, the
#: optimizer step (the same on every rank whatever the plan gave it) and the time between
#: the loop's phases.
NOT_COMPUTE = (*COLLECTIVE_PHASES, DATA, *HOST_WORK_PHASES, OPTIMIZER, UNTIMED)
#: The step's fixed costs, which no plan changes: the length gather, the gradient
#: all-reduce, the optimizer step and the time between the loop's phases (what a step's
#: loss names besides the plan's, the data's and the host's).
FIXED_PHASES = (GATHER, ALLREDUCE, OPTIMIZER, UNTIMED)
#: Phases of the training loop whose work runs on the device: ``balancer.timed`` times
#: them with CUDA events on a GPU (the others by the host's clocks).
DEVICE_PHASES = (FORWARD_BACKWARD, OPTIMIZER)
#: What `SequenceBalancer` gathers from every rank by default, in row order.
RECORDED_PHASES = (
    PLAN, RECORD, ROUTE, PRE_ATTN, POST_ATTN, REVERSE_ROUTE, GATHER, ALLREDUCE, PROBE,
    FORWARD_BACKWARD, OPTIMIZER, DATA, HOST, GC, *DERIVED_PHASES,
)  # fmt: skip
#: Which measured phase stands for a GPU's compute, best first: a true compute time, then
#: the parts of a step that are mostly compute, and the whole step (routing and waiting
#: included) only when nothing better was measured.
COMPUTE_PHASES = (COMPUTE, FORWARD_BACKWARD, "forward", "attn", STEP)

#: What the step journal names each balancer collective by, in the order a step runs
#: them (`knapformer.runtime.journal`; an incident names one of them). ``gather``: the
#: step's all-gathers on the training thread; ``plan_ahead``: the same on the plan-ahead
#: thread; ``close``: the wait for every rank at `SequenceBalancer.close`.
JOURNAL_PHASES = (
    GATHER, PLAN_AHEAD, PROBE, ROUTE, GATHER_SEQUENCES, PRE_ATTN, POST_ATTN, REVERSE_ROUTE,
    ALLREDUCE, FINISH, CLOSE,
)  # fmt: skip

# ----------------------------------------------------------------- how a step nests
#: Phases that hold others when those fit inside them (a trace draws them nested).
NESTED_PHASES = {
    PLAN: (GATHER,),
    FORWARD_BACKWARD: (ROUTE, PRE_ATTN, POST_ATTN, REVERSE_ROUTE),
}
#: The order phases run in a step, outermost phases only.
STEP_ORDER = (PLAN, RECORD, FORWARD_BACKWARD, ALLREDUCE, OPTIMIZER)
#: Not slices of a step: ``step`` is its length, ``compute``, ``descheduled`` and
#: ``untimed`` are derived from it, and ``gc`` is spread over it.
SPAN_PHASES = (STEP, COMPUTE, DESCHEDULED, UNTIMED, GC)


def compute_phase(phases: Iterable[str]) -> str | None:
    """The first of `COMPUTE_PHASES` among ``phases`` (None when none of them is)."""
    present = set(phases)
    return next((name for name in COMPUTE_PHASES if name in present), None)


def phase_ms(per_rank: Mapping[str, Sequence[float]], name: str, n: int) -> np.ndarray:
    """(n,) every rank's ms in phase ``name``; 0 where it was not measured."""
    values = per_rank.get(name)
    return np.zeros(n) if values is None else nan_to_zero(values)


def outside_compute_ms(values: Mapping[str, float]) -> float:
    """Ms of one rank's step (``values``: phase -> ms) in `NOT_COMPUTE`: waiting in
    collectives, the host's own work, the wait for data, the optimizer and the time
    between phases, none of which may read as a slow GPU."""
    host = float(host_ms({p: [v] for p, v in values.items()}, 1)[0])
    others = (p for p in NOT_COMPUTE if p not in HOST_WORK_PHASES)
    return host + sum(values.get(p, 0.0) for p in others)


def host_ms(per_rank: Mapping[str, Sequence[float]], n: int) -> np.ndarray:
    """(n,) each rank's host work that is not the model's: ``plan`` without the gather it
    includes, ``record``, the loop's ``host`` phase and garbage collection (``gc``) (0 for
    what was not measured)."""
    planning = np.maximum(phase_ms(per_rank, PLAN, n) - phase_ms(per_rank, GATHER, n), 0.0)
    others = (phase_ms(per_rank, p, n) for p in HOST_WORK_PHASES if p != PLAN)
    return planning + sum(others, np.zeros(n))
