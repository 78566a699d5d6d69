"""A small packed-sequence DiT block stack: the reference integration of the balancer.

Sequences are packed along the token dimension: ``packed`` is ``(T, d)`` holding the
sequences back to back, ``seq_lens`` their lengths. Everything except attention works
token by token, so with a balancer the model only needs to

1. ``route`` the tokens (and per-token features such as RoPE positions) to their GPUs,
2. wrap attention in ``pre_attn`` / ``post_attn`` (Ulysses inside multi-GPU bags),
3. ``reverse_route`` the result so every row is back where the caller put it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.attention import attention  # re-exported: tests import it here

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


def positions_in_sequences(seq_lens: list[int], device: torch.device | None = None):
    """Index of every token within its sequence: ``(T,)`` int64."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
    starts = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, lens)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x (T, H, D)`` (D even) at positions ``pos (T,)``."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angle = pos.to(torch.float64)[:, None] * freq[None, :]  # (T, D/2)
    # cos/sin before the cast: an angle rounded to bf16 is off by up to 128 rad at 32k
    cos, sin = (f(angle).to(x.dtype)[:, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DiTBlock(nn.Module):
    """Pre-norm transformer block: attention (per-head RMSNorm on q/k, optional RoPE)
    then an MLP, both residual."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, rope: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise KnapformerError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.head_dim, self.rope = n_heads, d_model // n_heads, rope
        if rope and self.head_dim % 2:
            raise KnapformerError(f"RoPE needs an even head dim, got {self.head_dim}")
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * d_model, d_model),
        )

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        seq_lens: list[int],
        balancer: SequenceBalancer | None = None,
    ) -> torch.Tensor:
        """``x (T, d)``, ``pos (T,)``; with a balancer, ``x`` holds routed chunks and
        ``seq_lens`` their chunk lengths."""
        tokens = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(tokens, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:  # per token, so it may run on chunks before the Ulysses exchange
            q, k = apply_rope(q, pos), apply_rope(k, pos)
        if balancer is not None:
            seq_lens, q, k, v = balancer.pre_attn(q, k, v)
        out = attention(q, k, v, seq_lens)
        if balancer is not None:
            _, out = balancer.post_attn(out)
        x = x + self.proj(out.reshape(tokens, self.n_heads * self.head_dim))
        return x + self.mlp(self.norm2(x))


class ToyDiT(nn.Module):
    """A stack of `DiTBlock` with an output norm and projection: ``(T, d) -> (T, d)``."""

    def __init__(
        self, d_model: int, n_heads: int, n_layers: int, mlp_ratio: int = 4, rope: bool = True
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            DiTBlock(d_model, n_heads, mlp_ratio, rope) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(
        self,
        packed: torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        balancer: SequenceBalancer | None = None,
    ) -> torch.Tensor:
        """``packed (T, d)``: sequences back to back, lengths ``seq_lens`` (sum = T).

        With a balancer (``plan_routing`` already called with these ``seq_lens``) the
        tokens are routed, processed where the plan puts them and routed back, so the
        output rows match ``packed`` either way.
        """
        lens = [int(n) for n in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
        if packed.dim() != 2 or packed.shape[0] != sum(lens):
            raise KnapformerError(
                f"packed has shape {tuple(packed.shape)} but seq_lens sum to {sum(lens)}; "
                "expected (sum(seq_lens), d_model)"
            )
        pos = positions_in_sequences(lens, packed.device)
        x = packed
        if balancer is not None:
            # Positions travel with the tokens: a chunk's RoPE angles are those of its
            # place in the whole sequence, not in the chunk.
            lens, x, pos = balancer.route(packed, pos)
        for block in self.blocks:
            x = block(x, pos, lens, balancer)
        x = self.out(self.norm(x))
        if balancer is not None:
            _, x, _ = balancer.reverse_route(x)
        return x
