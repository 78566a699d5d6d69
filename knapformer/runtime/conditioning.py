"""Per-sequence data after `route`: which sequence each routed token belongs to, and the
rows of per-sequence tensors brought to the tokens that need them.

After ``route`` a rank holds chunks of other ranks' sequences, but a DiT's conditioning
is per sequence (timestep embedding, pooled text, class label: one row per sample).
Two things bring it to the tokens:

- `sequence_index`: ``(T_chunks,)`` int64, the plan's sequence id of every routed token
  row (the row of ``plan.sequences``), read from the plan and this rank's tables; no
  collective.
- `gather_sequences`: this rank's ``(S_local, ...)`` rows (one per sequence it passed to
  ``plan_routing``, in that order) become the balance group's ``(S, ...)`` rows in plan
  sequence order: one all-gather forward; backward, the gradients of every rank are
  summed and each rank keeps those of its own rows (the gradient goes home).

``per_token(x) = gather_sequences(x)[sequence_index()]`` is the usual combination: an
AdaLN block indexes its per-sequence modulation with it.

The work is done by functions of a plan's `SequenceTables` (`sequence_tables`, which the
balancer builds once per plan): `gather_rows` and `rows_per_token`; the balancer calls
them, and checks before the gather, collectively, that every rank gives as many rows as
it has sequences and rows of one layout (`knapformer.runtime.layouts.check_same_sequences`).
`sequence_index(balancer)` and `gather_sequences(balancer, x)` are the balancer's own
methods of those names, for code that passes the balancer around (the integrations).

`rows_to_tokens` is that indexing, and what every per-token use of per-sequence rows
goes through: its backward sums each row's token gradients in fp32 and rounds once. A
bf16 ``index_select`` sums them in bf16, one token at a time, so the error of a sample's
row grows with its tokens (0.2 relative at 20,000 tokens, against ~5e-3 for the
broadcast the unbalanced model's backward reduces).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.errors import KnapformerError
from knapformer.runtime.router import Group, host_to_device

#: Makes the context manager each of the gather's collectives runs in (the balancer's
#: journal entry), forward and backward.
Collective = Callable[[], AbstractContextManager]


@dataclass
class SequenceTables:
    """What this rank needs to place per-sequence rows, for one plan."""

    index: torch.Tensor  # (T_chunks,) plan sequence id of each routed token row
    counts: list[int]  # sequences passed to plan_routing by each GPU, group order
    position: int  # this rank's place in the group
    order: torch.Tensor | None  # gathered row -> plan sequence order (None: identity)


def sequence_tables(plan: RoutingPlan, rank: int, device: torch.device) -> SequenceTables:
    """The `SequenceTables` of global ``rank`` for ``plan`` (tensors on ``device``)."""
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    pos = gpu_positions(gpus)
    src_pos = pos[np.asarray(plan.sequences.src_gpu, dtype=np.int64)]
    mine = plan.chunks_to(rank)  # chunk-id order = route's row order
    index = np.repeat(mine.seq, mine.length)
    # All-gathered rows arrive grouped by GPU, each GPU's in its own order; plan sequence
    # ids are ordered that way too, but do not rely on it.
    gathered = np.argsort(src_pos, kind="stable")  # plan seq id of each gathered row
    identity = bool(np.array_equal(gathered, np.arange(len(gathered))))
    return SequenceTables(
        index=host_to_device(torch.from_numpy(index), device),
        counts=np.bincount(src_pos, minlength=len(gpus)).astype(np.int64).tolist(),
        position=int(pos[np.asarray([rank])][0]),
        order=None if identity else host_to_device(torch.from_numpy(np.argsort(gathered)), device),
    )


class _GatherSequences(torch.autograd.Function):
    """All-gather rows of unequal counts; backward: sum over ranks, keep own rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], position: int, group: Group, collective):
        ctx.counts, ctx.position, ctx.group, ctx.collective = counts, position, group, collective
        width = max(counts) if counts else 0
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        with collective():
            dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank's use of every row, summed in fp32 (rounded once, as `rows_to_tokens`).
        total = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous().clone()
        with ctx.collective():
            dist.all_reduce(total, group=ctx.group)
        start = sum(ctx.counts[: ctx.position])
        mine = total[start : start + ctx.counts[ctx.position]].to(grad.dtype)
        return mine, None, None, None, None


def count_problem(x: object, tables: SequenceTables) -> KnapformerError | None:
    """Why ``x`` cannot be this rank's per-sequence rows (None: it can): it must be a
    tensor whose first dimension is the sequences this rank gave ``plan_routing``."""
    mine = tables.counts[tables.position]
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == mine:
        return None
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    return KnapformerError(
        f"per-sequence tensor has shape {shape} but this rank gave plan_routing {mine} "
        "sequences; its first dimension must be the sequences"
    )


def gather_rows(
    x: torch.Tensor, tables: SequenceTables, group: Group, collective: Collective = nullcontext
) -> torch.Tensor:
    """This rank's per-sequence rows ``x (S_local, ...)`` (one per length given to
    ``plan_routing``, in that order, `count_problem` checked) -> the group's ``(S, ...)``
    in plan sequence order.

    Collective over ``group``, the balance group (every rank calls it, also one without
    sequences); autograd-aware: each rank's rows get the gradient summed over the ranks
    that used them. ``collective`` wraps each of its collectives, forward and backward.
    """
    out = _GatherSequences.apply(x, tables.counts, tables.position, group, collective)
    return out if tables.order is None else out.index_select(0, tables.order)


class _RowsToTokens(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward accumulates in fp32 (see module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)
        total = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=wide)
        return total.index_add_(0, index, grad.to(wide)).to(grad.dtype), None


def rows_to_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x (S, ...)`` per-sequence rows -> ``(T, ...)``, row ``index[t]`` for token ``t``;
    the gradient of each row is summed in fp32 and rounded once."""
    if not x.requires_grad:
        return x.index_select(0, index)
    return _RowsToTokens.apply(x, index)


def rows_per_token(
    x: torch.Tensor, tables: SequenceTables, group: Group, collective: Collective = nullcontext
) -> torch.Tensor:
    """``x (S_local, ...)`` per sequence -> ``(T_chunks, ...)``: each routed token's row of
    its sequence (`gather_rows` indexed by ``tables.index``,
    through `rows_to_tokens`)."""
    return rows_to_tokens(gather_rows(x, tables, group, collective), tables.index)


class Balanced(Protocol):
    """What `sequence_index` and `gather_sequences` ask of a balancer (its public methods)."""

    def sequence_index(self) -> torch.Tensor: ...
    def gather_sequences(self, x: torch.Tensor) -> torch.Tensor: ...


def sequence_index(balancer: Balanced) -> torch.Tensor:
    """``(T_chunks,)`` int64: the plan sequence id of every row the balancer's `route`
    returned (its ``sequence_index()``)."""
    return balancer.sequence_index()


def gather_sequences(balancer: Balanced, x: torch.Tensor) -> torch.Tensor:
    """The balancer's ``gather_sequences(x)``: this rank's per-sequence rows -> the group's."""
    return balancer.gather_sequences(x)
