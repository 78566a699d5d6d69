"""The Ulysses exchanges inside a bag of g GPUs: chunks of all heads become whole sequences
of H/g heads before attention (`heads_to_sequences`) and back after it
(`sequences_to_heads`), each one all-to-all over the bag; and what each rank checks of its
own tensors first (`pre_attn_problem`, `post_attn_problem`), so that the bag can refuse a
bad one together (`knapformer.runtime.layouts.check_same_heads`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from knapformer.errors import KnapformerError
from knapformer.runtime.router import BagTables, Timer, check_rows, exchange

_CHUNK_ROWS = "the chunks routed to this rank"


def heads_layout_problem(name: str, x: Any) -> KnapformerError | None:
    """Why ``x`` is not a (tokens, heads, head_dim) tensor (None: it is)."""
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return None
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    return KnapformerError(f"{name} must have shape (tokens, heads, head_dim), got {shape}")


def pre_attn_problem(
    q: Any, k: Any, v: Any, rows: int, bag_sizes: Sequence[int], topology: object
) -> Exception | None:
    """Why ``q, k, v`` cannot go into `heads_to_sequences` on this rank: not (tokens,
    heads, head_dim) tensors of ``rows`` rows of one shape and dtype, or a head count that
    some bag size (every size a step may use, so that a count that works once works
    always) does not divide. None when they can."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        problem = heads_layout_problem(name, x)
        if problem is not None:
            return problem
        try:
            check_rows(name, x, rows, _CHUNK_ROWS)
        except KnapformerError as err:
            return err
    if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
        return KnapformerError(
            f"q, k, v must share shape and dtype, got {tuple(q.shape)}/{q.dtype}, "
            f"{tuple(k.shape)}/{k.dtype}, {tuple(v.shape)}/{v.dtype}"
        )
    heads = q.shape[1]
    bad = [g for g in bag_sizes if heads % g]
    if bad:
        return KnapformerError(
            f"{heads} attention heads cannot be split evenly across bags of "
            f"{max(bad)} GPUs (topology {topology}); use a head count divisible "
            f"by every bag size"
        )
    return None


def post_attn_problem(out: Any, rows: int, what: str) -> KnapformerError | None:
    """Why ``out`` cannot go into `sequences_to_heads`: not a (tokens, heads, head_dim)
    tensor of ``rows`` rows (``what`` holds them). None when it can."""
    problem = heads_layout_problem("out", out)
    if problem is not None:
        return problem
    try:
        check_rows("out", out, rows, what)
    except KnapformerError as err:
        return err
    return None


def heads_to_sequences(
    bag: BagTables, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timer: Timer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v (T_chunks, H, D)`` -> ``(T_bag, H/g, D)`` each, in one exchange."""
    rows, g, heads, dh = q.shape[0], bag.size, q.shape[1], q.shape[2]
    x = torch.stack([q, k, v], dim=1).reshape(rows, 3, g, heads // g, dh)
    x = x.permute(2, 0, 1, 3, 4).reshape(g * rows, 3, heads // g, dh)
    (y,) = exchange(
        [x], [rows] * g, bag.tokens_per_gpu, bag.group, post_index=bag.to_sequences, timer=timer
    )
    q2, k2, v2 = y.unbind(dim=1)
    return q2, k2, v2


def sequences_to_heads(bag: BagTables, out: torch.Tensor, rows: int, timer: Timer) -> torch.Tensor:
    """``out (T_bag, H/g, D)`` -> ``(rows = T_chunks, H, D)``, in one exchange."""
    g = bag.size
    (y,) = exchange(
        [out], bag.tokens_per_gpu, [rows] * g, bag.group, pre_index=bag.from_sequences, timer=timer
    )
    y = y.reshape(g, rows, *out.shape[1:]).permute(1, 0, 2, 3)
    return y.reshape(rows, g * out.shape[1], out.shape[2])
