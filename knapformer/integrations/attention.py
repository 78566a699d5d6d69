"""Attention within each packed sequence, the kernel every integration here runs between
``pre_attn`` and ``post_attn`` (and without a balancer, on this rank's own sequences)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from knapformer.runtime.router import host_to_device


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
    scale: float | None = None,
):  # fmt: skip
    """Attention within each sequence. ``q, k, v``: ``(T, H, D)`` -> ``(T, H, D)``;
    ``scale``: the softmax scale (default ``D ** -0.5``).

    Sequences of equal length share one ``scaled_dot_product_attention`` call.
    """
    if q.shape[0] == 0:
        # Stay in the graph, so a rank the balancer left without tokens still gets
        # (zero) gradients for every parameter, like every other rank.
        return q * 0 + (k.sum() + v.sum()) * 0
    out = torch.empty_like(q)
    starts, total = [], 0
    for n in seq_lens:
        starts.append(total)
        total += n
    by_len: dict[int, list[int]] = {}
    for start, n in zip(starts, seq_lens, strict=True):
        if n:
            by_len.setdefault(n, []).append(start)
    pieces, index = [], []
    for n, group in by_len.items():
        starts_t = host_to_device(torch.tensor(group), q.device)  # no host wait on a GPU
        idx = starts_t[:, None] + torch.arange(n, device=q.device)
        idx = idx.reshape(-1)
        # (B, n, H, D) -> (B, H, n, D) as SDPA expects
        qs, ks, vs = (
            t.index_select(0, idx).reshape(len(group), n, *t.shape[1:]).transpose(1, 2)
            for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        pieces.append(o.transpose(1, 2).reshape(len(group) * n, *q.shape[1:]))
        index.append(idx)
    return out.index_copy(0, torch.cat(index), torch.cat(pieces))
