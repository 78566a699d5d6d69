"""Names of the balancer's phases in a ``torch.profiler`` trace, and `mark`, which labels a
block with one of them only while a profiler runs.

A trace of a balanced step then reads ``knapformer.plan`` (gather and solve),
``knapformer.route``, ``knapformer.pre_attn`` / ``knapformer.post_attn`` (Ulysses, per
layer), ``knapformer.reverse_route``, ``knapformer.probe`` (the link probe, when it
runs), and inside them ``knapformer.wait.<collective>``:
the time spent waiting in one collective (``all_gather``, ``all_to_all``, ``barrier``,
``plan_ahead``: the training thread waiting for the plan-ahead thread).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.autograd.profiler as _profiler
from torch.profiler import record_function

from knapformer.contract import phases

PREFIX = "knapformer."  # + the phase's name (`knapformer.contract.phases`)
PLAN = PREFIX + phases.PLAN
ROUTE = PREFIX + phases.ROUTE
PRE_ATTN = PREFIX + phases.PRE_ATTN
POST_ATTN = PREFIX + phases.POST_ATTN
REVERSE_ROUTE = PREFIX + phases.REVERSE_ROUTE
PROBE = PREFIX + phases.PROBE
WAIT = PREFIX + "wait."  # + the collective's name


def mark(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a profiler runs; nothing otherwise (a record
    costs microseconds, and some of these blocks run per layer)."""
    if _profiler._is_profiler_enabled:
        return record_function(name)
    return nullcontext()


def wait(collective: str) -> AbstractContextManager:
    """`mark` for the time spent inside one ``collective``."""
    return mark(WAIT + collective)
