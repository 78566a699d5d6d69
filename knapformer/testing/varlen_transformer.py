"""A transformer block as the research code's users write one, for the compat tests.

It has what the research code's own test feeds its block: packed sequences ``(T, d)``,
their lengths (anything `torch.as_tensor` takes: the list, tuple or tensor a balancer
returns), a per-token RoPE table, and an optional balancer whose ``pre_attn`` /
``post_attn`` wrap attention. Attention is varlen from ``cu_seqlens``, the int32 offsets
flash-attention's varlen kernels take, so the lengths the balancer returns are used as
such a kernel uses them.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def rope_cossin(seq_lens: Any, d_head: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE table of packed sequences: ``(T, 2 * d_head)`` float32, ``[cos | sin]`` of
    each token's angle at its position within its own sequence."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
    freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angle = pos.to(torch.float64)[:, None] * freq[None, :]  # (T, d_head / 2)
    angle = torch.cat([angle, angle], dim=-1)  # (T, d_head): one angle per rotated pair
    return torch.cat([angle.cos(), angle.sin()], dim=-1).to(torch.float32)


def apply_rope(x: torch.Tensor, cossin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, H, D)`` by ``cossin (T, 2D)``: pairs are (i, i + D/2)."""
    cos, sin = cossin.to(x.dtype)[:, None, :].chunk(2, dim=-1)  # (T, 1, D) each
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def cu_seqlens(seq_lens: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """(``cu_seqlens`` (n + 1,) int32 starting at 0, longest length) of ``seq_lens``."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int32, device=device)
    offsets = F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return offsets, int(lens.max()) if lens.numel() else 0


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """Attention within each sequence ``offsets[i]:offsets[i+1]`` (as a varlen kernel is
    called); ``q, k, v``: ``(T, H, D)`` -> ``(T, H, D)``."""
    assert offsets.dtype == torch.int32 and int(offsets[-1]) == q.shape[0], (offsets, q.shape)
    lens = offsets[1:] - offsets[:-1]
    assert lens.numel() == 0 or max_seqlen == int(lens.max()), (max_seqlen, lens)
    pieces = [q[:0]]
    for start, end in pairwise(offsets.tolist()):
        if end > start:  # (n, H, D) -> (H, n, D) as SDPA expects
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
    return torch.cat(pieces) if q.shape[0] else q * 0 + (k.sum() + v.sum()) * 0


class TransformerBlock(nn.Module):
    """Pre-norm block: attention (q/k RMSNorm, RoPE, varlen) then a SwiGLU MLP."""

    def __init__(self, d_model: int, d_head: int):
        super().__init__()
        self.d_head = d_head
        self.attn_norm = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.q_norm, self.k_norm = nn.RMSNorm(d_head), nn.RMSNorm(d_head)
        self.attn_out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.RMSNorm(d_model)
        self.gate_up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(2 * d_model, d_model)

    def forward(
        self, x: torch.Tensor, seq_lens: Any, cossin: torch.Tensor, balancer: Any = None
    ) -> torch.Tensor:
        """``x (T, d)``, ``cossin (T, 2 * d_head)``; with a balancer, ``x`` holds routed
        chunks and ``seq_lens`` their lengths (pre_attn supplies the sequences')."""
        tokens = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).view(tokens, 3, -1, self.d_head).unbind(dim=1)
        q, k = apply_rope(self.q_norm(q), cossin), apply_rope(self.k_norm(k), cossin)
        if balancer is not None:
            seq_lens, q, k, v = balancer.pre_attn(q, k, v)
        offsets, longest = cu_seqlens(seq_lens, q.device)
        out = varlen_attention(q, k, v, offsets, longest)
        if balancer is not None:
            _, out = balancer.post_attn(out)
        x = x + self.attn_out(out.reshape(tokens, -1))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)
