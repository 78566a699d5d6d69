"""Routing tables and the token exchanges that carry out a `RoutingPlan`.

`RoutingTables.build(plan, rank, device, bag_groups)` turns one plan into what this rank needs
(split sizes and permutation indices, held as tensors), so the exchanges below do no
per-chunk Python work. Every exchange is **one** ``torch.distributed.all_to_all_single``
and is autograd-aware: its backward is the reverse all-to-all.

Token layouts on a rank (T = tokens, d = hidden size, H = heads, D = head dim):

- *packed*: this rank's own sequences, concatenated in the order their lengths were
  given to ``plan_routing`` — ``(T_local, ...)``;
- *chunks*: after ``route``, the chunks the plan sends to this rank, in chunk-id order
  (= by sequence, then chunk index) — ``(T_chunks, ...)``;
- *bag sequences*: after ``pre_attn`` in a bag of g GPUs, the bag's whole sequences in
  sequence order, with H/g of the heads — ``(T_bag, H/g, D)``.

Tensors of any dtype travel as raw bytes, so integer features arrive bit-exact and
several tensors share one exchange. Raw bytes trust every rank to send rows of the
layout its peers expect: the balancer makes sure of it, collectively, before each
exchange (`knapformer.runtime.layouts`), so that a rank with another width, dtype or
head layout is named on every rank instead of its peers receiving garbage rows (or gloo
aborting on a size mismatch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.chunk_rows import ChunkRows, token_ranges
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions
from knapformer.errors import KnapformerError
from knapformer.runtime.marks import wait

Group = dist.ProcessGroup | None
#: Makes a context manager that times one all-to-all (the balancer's, per phase).
Timer = Callable[[], AbstractContextManager]


# --------------------------------------------------------------------------- tables
@dataclass
class BagTables:
    """Ulysses tables of this rank's bag (only for bags of more than one GPU)."""

    group: Group
    size: int  # g
    tokens_per_gpu: list[int]  # chunk tokens held by each GPU of the bag, bag order
    to_sequences: torch.Tensor  # permutation: received head shards -> sequence order
    from_sequences: torch.Tensor  # its inverse
    seq_lens: list[int]  # whole sequences of the bag, sequence order (no zero lengths)


@dataclass
class RoutingTables:
    """What one rank needs to route tokens for one plan."""

    local_lens: list[int]  # this rank's sequence lengths, as given (zeros kept)
    chunk_lens: list[int]  # lengths of the chunks this rank receives, chunk-id order
    send_splits: list[int]  # tokens sent to each rank of the balance group
    recv_splits: list[int]  # tokens received from each rank of the balance group
    send_index: torch.Tensor | None  # packed rows in send order (None = identity)
    restore_index: torch.Tensor | None  # inverse of send_index
    bag: BagTables | None  # None for a single-GPU bag

    @property
    def num_local(self) -> int:
        return sum(self.local_lens)

    @property
    def num_chunk_tokens(self) -> int:
        return sum(self.chunk_lens)

    @classmethod
    def build(
        cls,
        plan: RoutingPlan,
        rank: int,
        device: torch.device,
        bag_groups: Callable[[list[int]], Group] | None = None,
    ) -> RoutingTables:
        """Tables of global ``rank`` for ``plan``; ``bag_groups(ranks)`` gives the sub-group
        of the plan's bag over ``ranks`` (made in advance: the plan picks, not creates).
        Reads only this rank's rows of the chunk table (`RoutingPlan.chunks_from`,
        `chunks_into_bag`): a derived table is not made whole."""
        n = len(plan.gpus)
        pos = gpu_positions(np.asarray(plan.gpus, dtype=np.int64))
        bag_id = plan.bag_of(rank)
        into_bag = plan.chunks_into_bag(bag_id)

        # Send side: my chunks grouped by destination (stable: chunk-id order inside).
        mine_seq = np.flatnonzero(np.asarray(plan.sequences.src_gpu) == rank)
        sent = plan.chunks.rows_of(mine_seq)  # = plan.chunks_from(rank)
        local_lens = np.asarray(plan.sequences.length, dtype=np.int64)[mine_seq]
        seq_start = np.cumsum(local_lens) - local_lens  # in the packed rows, by my sequence
        order = np.argsort(pos[sent.dst_gpu], kind="stable")
        out = sent.where(order)
        send_splits = np.bincount(pos[out.dst_gpu], weights=out.length, minlength=n)
        out_start = seq_start[np.searchsorted(mine_seq, out.seq)] + out.offset
        send_index = token_ranges(out_start, out.length)

        # Receive side: chunk ids are ordered by sequence and sequence ids by source GPU,
        # so chunks for me in id order already arrive grouped by source: no permutation.
        received = into_bag.where(into_bag.dst_gpu == rank)
        recv_splits = np.bincount(pos[received.src_gpu], weights=received.length, minlength=n)

        identity = bool(np.array_equal(send_index, np.arange(len(send_index))))
        to_tensor = _index_tensor(device)
        bag = None
        my_bag = [int(r) for r in plan.bags[bag_id]]
        if len(my_bag) > 1:
            group = None if bag_groups is None else bag_groups(my_bag)
            bag = _bag_tables(my_bag, into_bag, group, to_tensor)
        return cls(
            local_lens=local_lens.tolist(),
            chunk_lens=received.length.tolist(),
            send_splits=send_splits.astype(np.int64).tolist(),
            recv_splits=recv_splits.astype(np.int64).tolist(),
            send_index=None if identity else to_tensor(send_index),
            restore_index=None if identity else to_tensor(inverse_permutation(send_index)),
            bag=bag,
        )


def _bag_tables(bag_ranks, into_bag: ChunkRows, group, to_tensor) -> BagTables:
    """After route each GPU of the bag holds its chunk of every bag sequence; Ulysses
    sends head shard j of all of them to bag GPU j, which receives them grouped by source
    GPU and reorders them into whole sequences (chunk k of a sequence sits on GPU k).
    ``into_bag``: the chunks of the bag's sequences (chunk-id order = sequence order,
    chunk k after k-1)."""
    c_len = into_bag.length
    member = np.searchsorted(np.asarray(bag_ranks), into_bag.dst_gpu)
    buffer_order = np.argsort(member, kind="stable")  # how the shards arrive
    lengths_in_buffer = c_len[buffer_order]
    start_in_buffer = np.empty(len(c_len), dtype=np.int64)
    start_in_buffer[buffer_order] = np.cumsum(lengths_in_buffer) - lengths_in_buffer
    to_sequences = token_ranges(start_in_buffer, c_len)
    tokens_per_gpu = np.bincount(member, weights=c_len, minlength=len(bag_ranks))
    first = np.flatnonzero(np.diff(into_bag.seq, prepend=-1))  # each sequence's chunk 0
    seq_lens = np.add.reduceat(c_len, first) if len(c_len) else np.zeros(0, np.int64)
    return BagTables(
        group=group,
        size=len(bag_ranks),
        tokens_per_gpu=tokens_per_gpu.astype(np.int64).tolist(),
        to_sequences=to_tensor(to_sequences),
        from_sequences=to_tensor(inverse_permutation(to_sequences)),
        seq_lens=seq_lens.astype(np.int64).tolist(),
    )


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """The inverse of a permutation of ``0..len(perm)-1`` (``np.argsort(perm)``), in one
    scatter instead of a sort."""
    inverse = np.empty(len(perm), dtype=np.int64)
    inverse[perm] = np.arange(len(perm))
    return inverse


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (built on the host) on ``device``. To a GPU it goes through pinned memory, so
    that the copy is queued like a kernel: from pageable memory the host would wait for it
    and for everything queued before it."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _index_tensor(device: torch.device):
    def convert(a: np.ndarray) -> torch.Tensor:
        return host_to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)

    return convert


# ------------------------------------------------------------------------ exchange
# The wire format: row i of the send buffer is the bytes of row i of every tensor, side by
# side, in the order given. Packing writes each tensor's rows straight into its columns of
# one preallocated buffer, already in send order (one pass over the bytes, not a
# concatenation and then a permutation); unpacking reads each tensor's columns straight
# into its own tensor. Rows are moved as the widest words (8, 4, 2 or 1 bytes) that every
# tensor's row bytes allow: a gather of 8-byte words runs far faster than one of bytes.
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _byte_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as ``(rows, bytes per row)`` uint8, a view where its memory allows."""
    width = int(np.prod(t.shape[1:], dtype=np.int64))
    flat = t.reshape(rows, width)
    # Viewing as bytes needs unit stride in memory. `contiguous()` is not enough: a
    # gradient such as `y.sum()`'s is expanded (stride 0), and an empty or one-element
    # expanded tensor counts as contiguous, so it would come back unchanged.
    if not flat.is_contiguous() or (flat.dim() == 2 and flat.stride(1) != 1):
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def as_words(parts: Sequence[torch.Tensor], words=_WORDS) -> list[torch.Tensor]:
    """``(rows, bytes)`` uint8 tensors viewed as the widest of ``words`` all of them allow
    (the word must divide every row's bytes and every view's offset)."""
    for word in words:
        try:
            return [p.view(word) for p in parts]
        except RuntimeError:  # a row or an offset that is not a multiple of the word
            continue
    return list(parts)  # bytes: uint8 always fits


def pack_rows(
    tensors: Sequence[torch.Tensor],
    rows: int,
    take: torch.Tensor | None = None,
    put: torch.Tensor | None = None,
) -> torch.Tensor:
    """The raw bytes of ``tensors`` (each ``(rows, ...)``) side by side, one pass:
    ``(rows, total bytes per row)`` uint8. ``take``: output row i is input row
    ``take[i]`` (a gather); ``put``: input row i becomes output row ``put[i]`` (the
    inverse, for a permutation ``put``). A lone tensor with neither is a view."""
    srcs = as_words([_byte_rows(t, rows) for t in tensors])
    if len(srcs) == 1 and take is None and put is None:
        return srcs[0].view(torch.uint8)
    out_rows = rows if take is None else len(take)
    buf = srcs[0].new_empty((out_rows, sum(s.shape[1] for s in srcs)))
    col = 0
    for src in srcs:
        dst = buf[:, col : col + src.shape[1]]
        col += src.shape[1]
        if take is not None:
            torch.index_select(src, 0, take, out=dst)  # writes into the strided columns
        elif put is not None:
            dst.index_copy_(0, put, src)
        else:
            dst.copy_(src)
    return buf.view(torch.uint8)


def unpack_rows(
    buf: torch.Tensor,
    specs: Sequence[tuple[torch.dtype, torch.Size]],
    take: torch.Tensor | None = None,
    put: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Inverse of `pack_rows`: the tensors of ``specs`` (dtype, shape of a row) out of
    ``buf`` ``(rows, bytes per row)``, each read in one pass into a tensor of its own
    (``take``/``put`` reorder the rows as in `pack_rows`). A lone tensor with neither
    is a view of ``buf``."""
    rows = buf.shape[0] if take is None else len(take)
    widths = [int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype) for dtype, shape in specs]
    cols = np.cumsum([0, *widths])
    fits = [w for w in _WORDS if not np.any(cols % _itemsize(w))]  # every column boundary
    (words,) = as_words([buf], fits)
    scale = _itemsize(words.dtype)
    out = []
    for (dtype, shape), start, end in zip(specs, cols[:-1], cols[1:], strict=True):
        part = words[:, start // scale : end // scale]
        if take is not None:
            part = part.index_select(0, take)
        elif put is not None:
            part = part.new_empty(part.shape).index_copy_(0, put, part)
        elif len(specs) > 1:  # a tensor of its own: views need aligned row strides
            part = part.clone(memory_format=torch.contiguous_format)
        out.append(part.view(torch.uint8).view(dtype).reshape(rows, *shape))
    return out


def _to_bytes(tensors: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """Row-wise raw bytes of all tensors side by side: ``(rows, total bytes per row)``."""
    return pack_rows(tensors, rows)


def _from_bytes(buf: torch.Tensor, specs: Sequence[tuple[torch.dtype, torch.Size]]):
    """Inverse of ``_to_bytes`` for ``buf`` of shape (rows, bytes per row)."""
    return unpack_rows(buf, specs)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def all_to_all_rows(
    buf: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group
) -> torch.Tensor:
    """One ``all_to_all_single`` of the rows of ``buf`` (the only collective used here)."""
    out = buf.new_empty((sum(recv_splits), *buf.shape[1:]))
    with wait("all_to_all"):
        dist.all_to_all_single(out, buf, recv_splits, send_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Permute rows, all-to-all, permute rows — for several tensors in one exchange.

    Forward: pack the rows in ``pre_index`` order, exchange, unpack them in ``post_index``
    order (each a single pass, `pack_rows` / `unpack_rows`). Backward: the mirror image
    (the same indices scatter instead of gather, reverse all-to-all), carrying only the
    gradients of the floating-point inputs that need them.
    """

    @staticmethod
    def forward(ctx, pre_index, post_index, send_splits, recv_splits, group, timer, *tensors):
        ctx.pre_index, ctx.post_index = pre_index, post_index
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.timer = timer
        ctx.specs = [(t.dtype, t.shape[1:]) for t in tensors]
        ctx.device = tensors[0].device
        rows = tensors[0].shape[0]
        buf = pack_rows(tensors, rows, take=pre_index)
        with timer():
            buf = all_to_all_rows(buf, send_splits, recv_splits, group)
        outs = unpack_rows(buf, ctx.specs, take=post_index)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        need = [i for i, flag in enumerate(ctx.needs_input_grad[6:]) if flag]
        rows = sum(ctx.recv_splits)
        grads_in = [
            grads[i]
            if grads[i] is not None
            else torch.zeros(rows, *ctx.specs[i][1], dtype=ctx.specs[i][0], device=ctx.device)
            for i in need
        ]
        buf = pack_rows(grads_in, rows, put=ctx.post_index)
        with ctx.timer():  # the backward exchange is time inside the same collective
            buf = all_to_all_rows(buf, ctx.recv_splits, ctx.send_splits, ctx.group)
        back = unpack_rows(buf, [ctx.specs[i] for i in need], put=ctx.pre_index)
        out: list[torch.Tensor | None] = [None] * len(ctx.specs)
        for i, g in zip(need, back, strict=True):
            out[i] = g
        return (None, None, None, None, None, None, *out)


def exchange(
    tensors: Sequence[torch.Tensor],
    send_splits: list[int],
    recv_splits: list[int],
    group: Group,
    pre_index: torch.Tensor | None = None,
    post_index: torch.Tensor | None = None,
    timer: Timer = nullcontext,
) -> list[torch.Tensor]:
    """Exchange the rows of several tensors (same first dim) in one all-to-all; ``timer``
    times the all-to-all itself, forward and backward."""
    args = (pre_index, post_index, send_splits, recv_splits, group, timer)
    return list(_Exchange.apply(*args, *tensors))


def name_ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 2, 3``, for a message."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ------------------------------------------------------------- features (pytrees)
Features = torch.Tensor | dict[str, torch.Tensor] | list[torch.Tensor] | tuple | None


def flatten_features(features: Features) -> list[torch.Tensor]:
    if features is None:
        return []
    if isinstance(features, torch.Tensor):
        return [features]
    if isinstance(features, dict):
        return list(features.values())
    if isinstance(features, list | tuple):
        return list(features)
    raise TypeError(
        f"features must be a tensor, a dict or list of tensors, or None; got {type(features)}"
    )


def unflatten_features(features: Features, tensors: list[torch.Tensor]) -> Features:
    if features is None:
        return None
    if isinstance(features, torch.Tensor):
        return tensors[0]
    if isinstance(features, dict):
        return dict(zip(features.keys(), tensors, strict=True))
    return type(features)(tensors)


def check_rows(name: str, tensor: torch.Tensor, rows: int, what: str) -> None:
    """A clear error when a per-token tensor does not have ``rows`` rows."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 1 or tensor.shape[0] != rows:
        raise KnapformerError(
            f"{name} has shape {tuple(tensor.shape)} but {what} hold {rows} tokens; "
            "its first dimension must be the tokens"
        )
