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
AdaLN block indexes its per-sequence modulation with it. Both are cached per plan.

`rows_to_tokens` is that indexing, and what every per-token use of per-sequence rows
goes through: its backward sums each row's token gradients in fp32 and rounds once. A
bf16 ``index_select`` sums them in bf16, one token at a time, so the error of a sample's
row grows with its tokens (0.2 relative at 20,000 tokens, against ~5e-3 for the
broadcast the unbalanced model's backward reduces).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.positions import gpu_positions
from knapformer.errors import KnapformerError
from knapformer.runtime.router import Group, host_to_device

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


@dataclass
class SequenceTables:
    """What this rank needs to place per-sequence rows, for one plan."""

    index: torch.Tensor  # (T_chunks,) plan sequence id of each routed token row
    counts: list[int]  # sequences passed to plan_routing by each GPU, group order
    position: int  # this rank's place in the group
    order: torch.Tensor | None  # gathered row -> plan sequence order (None: identity)


# Per balancer, the tables of its current plan (a new plan makes new routing tables).
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sequence_tables(balancer: SequenceBalancer) -> SequenceTables:
    """The `SequenceTables` of the balancer's current plan (built once per plan)."""
    tables = balancer._require_tables()
    cached = _CACHE.get(balancer)
    if cached is not None and cached[0] is tables:
        return cached[1]
    plan = balancer.last_plan
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    pos = gpu_positions(gpus)
    src_pos = pos[np.asarray(plan.sequences.src_gpu, dtype=np.int64)]
    c_dst = np.asarray(plan.chunks.dst_gpu, dtype=np.int64)
    mine = np.flatnonzero(c_dst == balancer.rank)  # chunk-id order = route's row order
    seq = np.asarray(plan.chunks.seq, dtype=np.int64)[mine]
    lengths = np.asarray(plan.chunks.length, dtype=np.int64)[mine]
    index = np.repeat(seq, lengths)
    # All-gathered rows arrive grouped by GPU, each GPU's in its own order; plan sequence
    # ids are ordered that way too, but do not rely on it.
    gathered = np.argsort(src_pos, kind="stable")  # plan seq id of each gathered row
    identity = bool(np.array_equal(gathered, np.arange(len(gathered))))
    device = balancer.device
    built = SequenceTables(
        index=host_to_device(torch.from_numpy(index), device),
        counts=np.bincount(src_pos, minlength=len(gpus)).astype(np.int64).tolist(),
        position=int(pos[np.asarray([balancer.rank])][0]),
        order=None if identity else host_to_device(torch.from_numpy(np.argsort(gathered)), device),
    )
    _CACHE[balancer] = (tables, built)
    return built


def sequence_index(balancer: SequenceBalancer) -> torch.Tensor:
    """``(T_chunks,)`` int64: the plan sequence id of every token row `route` returned."""
    return sequence_tables(balancer).index


class _GatherSequences(torch.autograd.Function):
    """All-gather rows of unequal counts; backward: sum over ranks, keep own rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], position: int, group: Group):
        ctx.counts, ctx.position, ctx.group = counts, position, group
        width = max(counts) if counts else 0
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank's use of every row, summed in fp32 (rounded once, as `rows_to_tokens`).
        total = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        start = sum(ctx.counts[: ctx.position])
        return total[start : start + ctx.counts[ctx.position]].to(grad.dtype), None, None, None


def gather_sequences(balancer: SequenceBalancer, x: torch.Tensor) -> torch.Tensor:
    """This rank's per-sequence rows ``x (S_local, ...)`` (one per length given to
    ``plan_routing``, in that order) -> the group's ``(S, ...)`` in plan sequence order.

    Collective over the balance group (every rank calls it, also one without
    sequences); autograd-aware: each rank's rows get the gradient summed over the ranks
    that used them.
    """
    t = sequence_tables(balancer)
    mine = t.counts[t.position]
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != mine:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise KnapformerError(
            f"per-sequence tensor has shape {shape} but this rank gave plan_routing {mine} "
            "sequences; its first dimension must be the sequences"
        )
    out = _GatherSequences.apply(x, t.counts, t.position, balancer.group)
    return out if t.order is None else out.index_select(0, t.order)


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


def per_token(balancer: SequenceBalancer, x: torch.Tensor) -> torch.Tensor:
    """``x (S_local, ...)`` per sequence -> ``(T_chunks, ...)``: each routed token's row of
    its sequence (`gather_sequences` indexed by `sequence_index`, through `rows_to_tokens`)."""
    return rows_to_tokens(gather_sequences(balancer, x), sequence_index(balancer))
