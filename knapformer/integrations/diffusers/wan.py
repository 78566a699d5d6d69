"""Balanced training forward for diffusers' ``WanTransformer3DModel`` (text-to-video).

Each sample is one sequence of video patches. Shapes (S = this rank's samples):

- `WanBatch`: ``latents``, a list of ``(C, F, H, W)`` video latents (sizes may differ),
  ``timestep (S,)``, ``text (S, L, text_dim)`` prompt embeddings padded to one length L
  (the Wan pipeline pads to 512 with zeros: the unmodified model sees the same).
- `BalancedWan(model)(batch, balancer)` -> ``(T, C_out * pt * ph * pw)``: every sample's
  output patches back to back (one tensor, so a rank without samples still has a loss in
  the graph); ``BalancedWan.patchify(videos)`` packs targets the same way and
  ``BalancedWan.unpatchify(out, batch)`` gives the ``(C_out, F, H, W)`` that
  ``model(...)`` gives for each sample alone.

Patch embedding, the timestep/text embedding and the output head run at home; the video
tokens are routed with their (frame, row, column) grid positions, from which RoPE is
taken where they land. Self-attention runs on whole sequences through the Ulysses
exchanges; cross-attention needs each token's own prompt, so the projected prompts of
the sequences held here arrive with `gather_sequences` (gradients go home), as does the
per-sample timestep projection of the AdaLN modulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.internals import _unwrapped, check_wan
from knapformer.integrations.diffusers.packed import (
    Tokens,
    call,
    install,
    modulate,
    sample_of_token,
)
from knapformer.runtime.router import host_to_device

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


@dataclass
class WanBatch:
    """This rank's samples (shapes in the module docstring)."""

    latents: list[torch.Tensor]
    timestep: torch.Tensor
    text: torch.Tensor

    def seq_lens(self, patch_size: tuple[int, int, int]) -> list[int]:
        """Video tokens of each sample: what ``plan_routing`` takes."""
        return [_grid(lat, patch_size).numel() // 3 for lat in self.latents]

    def check(self) -> None:
        s = len(self.latents)
        for name, rows in (("timestep", self.timestep.shape[0]), ("text", self.text.shape[0])):
            if rows != s:
                raise KnapformerError(f"WanBatch.{name} has {rows} rows, expected {s} samples")
        if self.text.dim() != 3:
            raise KnapformerError(f"WanBatch.text must be (S, L, text_dim), got {self.text.shape}")


def _grid(latent: torch.Tensor, patch_size) -> torch.Tensor:
    """``(tokens, 3)`` int64 (frame, row, column) of each patch, in Wan's flatten order."""
    f, h, w = (n // p for n, p in zip(latent.shape[1:], patch_size, strict=True))
    axes = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    return host_to_device(torch.stack(axes, dim=-1).reshape(-1, 3), latent.device)


class BalancedWan(nn.Module):
    """``BalancedWan(model)(batch, balancer=None)``: the packed forward of a diffusers
    ``WanTransformer3DModel`` (its own modules and weights), balanced when given a
    balancer on which ``plan_routing(batch.seq_lens(patch_size), inner_dim)`` was called
    for this step. Activation checkpointing follows ``model.enable_gradient_checkpointing()``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        check_wan(model)
        self.model = model
        self.patch_size = tuple(model.config.patch_size)
        self.inner_dim = model.config.num_attention_heads * model.config.attention_head_dim
        for block in (model, *model.blocks):
            install(_unwrapped(block))

    def patchify(self, videos: list[torch.Tensor]) -> torch.Tensor:
        """Per-sample ``(C_out, F, H, W)`` (e.g. the targets) -> ``(T, C_out * pt * ph * pw)``,
        rows as `forward` returns them."""
        width = self.model.proj_out.out_features
        parts = [_patchify(v, self.patch_size) for v in videos]
        return torch.cat(parts) if parts else self.model.proj_out.weight.new_zeros((0, width))

    def unpatchify(self, out: torch.Tensor, batch: WanBatch) -> list[torch.Tensor]:
        """`forward`'s ``(T, C_out * pt * ph * pw)`` -> per-sample ``(C_out, F, H, W)``."""
        p = self.patch_size
        shapes = [[n // q for n, q in zip(lat.shape[1:], p, strict=True)] for lat in batch.latents]
        parts = out.split([math.prod(s) for s in shapes])
        return [_unpatchify(x, s, p) for x, s in zip(parts, shapes, strict=True)]

    def forward(self, batch: WanBatch, balancer: SequenceBalancer | None = None):
        """-> ``(T, C_out * pt * ph * pw)``: every sample's output patches back to back."""
        batch.check()
        return call(self.model, _model_forward, batch, balancer, self.patch_size)


def _model_forward(model, batch: WanBatch, balancer, patch_size):
    embed = model.patch_embedding
    toks, grids = [], []
    for lat in batch.latents:
        h = embed(lat[None])  # (1, D, f, h, w)
        toks.append(h.flatten(2).transpose(1, 2)[0])
        grids.append(_grid(lat, patch_size))
    if not batch.latents:  # still run every module (zero rows): every rank's graph alike
        empty = embed.weight.new_zeros((0, embed.in_channels, *patch_size))
        toks.append(embed(empty).flatten(2).transpose(1, 2).reshape(0, embed.out_channels))
        grids.append(torch.zeros(0, 3, dtype=torch.int64, device=embed.weight.device))
    x, pos = torch.cat(toks), torch.cat(grids)
    temb, tproj, text, _ = model.condition_embedder(batch.timestep, batch.text)
    tproj = tproj.unflatten(1, (6, -1))  # (S, 6, D)

    tokens = Tokens(balancer, [t.shape[0] for t in toks] if batch.latents else [])
    x, pos = tokens.route(x, pos)
    rope = _rope_tables(model.rope, pos)
    tproj, text = tokens.per_sequence(tproj), tokens.per_sequence(text)
    ckpt = bool(model.gradient_checkpointing)
    for block in model.blocks:
        x = call(block, _block, x, tproj, text, rope, tokens, checkpointed=ckpt)
    x = tokens.reverse(x)

    shift, scale = (model.scale_shift_table + temb[:, None]).chunk(2, dim=1)  # (S, 1, D)
    lens = [t.shape[0] for t in toks] if batch.latents else []
    sample = sample_of_token(lens, x.device)
    x = (model.norm_out(x.float()) * (1 + scale[sample, 0]) + shift[sample, 0]).type_as(x)
    return model.proj_out(x)


def _patchify(video: torch.Tensor, patch_size) -> torch.Tensor:
    """``(C, F, H, W)`` -> ``(f*h*w, pt*ph*pw*C)``, the inverse of `_unpatchify`."""
    (pt, ph, pw), c = patch_size, video.shape[0]
    f, h, w = (n // p for n, p in zip(video.shape[1:], patch_size, strict=True))
    x = video.reshape(c, f, pt, h, ph, w, pw).permute(1, 3, 5, 2, 4, 6, 0)
    return x.reshape(f * h * w, -1)


def _unpatchify(x: torch.Tensor, shape, patch_size) -> torch.Tensor:
    """``(f*h*w, C*pt*ph*pw)`` -> ``(C, F, H, W)`` as Wan's forward does."""
    (f, h, w), (pt, ph, pw) = shape, patch_size
    x = x.reshape(f, h, w, pt, ph, pw, -1).permute(6, 0, 3, 1, 4, 2, 5)
    return x.reshape(x.shape[0], f * pt, h * ph, w * pw)


def _rope_tables(rope: nn.Module, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``cos, sin (T, head_dim)`` from grid positions, as ``WanRotaryPosEmbed``
    builds them for a whole video."""
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        parts = table.split(sizes, dim=1)
        out.append(torch.cat([parts[a][pos[:, a]] for a in range(3)], dim=-1))
    return out[0], out[1]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved RoPE on ``(T, H, D)`` with per-token ``(T, D)`` tables."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, 0::2], sin[:, None, 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def _cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]):
    """Each held sequence's rows of ``q (T, H, D)`` attend to its prompt ``k, v
    (S_held, L, H, D)``; rows of one sequence are contiguous."""
    pieces = []
    for s, part in enumerate(q.split(lens)):
        o = F.scaled_dot_product_attention(
            part.transpose(0, 1)[None], k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None]
        )
        pieces.append(o[0].transpose(0, 1))
    if not pieces:  # no tokens here: stay in the graph (zero gradients, like every rank)
        return q * 0 + (k.sum() + v.sum()) * 0
    return torch.cat(pieces)


def _block(block, x, tproj, text, rope, tokens: Tokens):
    """``WanTransformerBlock`` on routed rows ``x (T, D)``; ``tproj (S_held, 6, D)`` and
    ``text (S_held, L, D)`` of the sequences held here."""
    mod = (block.scale_shift_table + tproj.float()).index_select(0, tokens.index)
    shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(1)  # (T, D) each
    a1 = block.attn1
    n = modulate(block.norm1(x.float()), scale, shift).type_as(x)
    q = a1.norm_q(a1.to_q(n)).unflatten(1, (a1.heads, -1))
    k = a1.norm_k(a1.to_k(n)).unflatten(1, (a1.heads, -1))
    v = a1.to_v(n).unflatten(1, (a1.heads, -1))
    q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
    o = tokens.attend(q, k, v).flatten(1).type_as(q)
    x = (x.float() + a1.to_out[1](a1.to_out[0](o)) * gate).type_as(x)

    a2 = block.attn2
    n = block.norm2(x.float()).type_as(x)
    q = a2.norm_q(a2.to_q(n)).unflatten(1, (a2.heads, -1))
    k = a2.norm_k(a2.to_k(text)).unflatten(2, (a2.heads, -1))
    v = a2.to_v(text).unflatten(2, (a2.heads, -1))
    o = _cross_attention(q, k, v, tokens.held_lens()).flatten(1).type_as(q)
    x = x + a2.to_out[1](a2.to_out[0](o))

    n = modulate(block.norm3(x.float()), c_scale, c_shift).type_as(x)
    return (x.float() + block.ffn(n).float() * c_gate).type_as(x)
