"""Balanced training forward for diffusers' ``FluxTransformer2DModel``.

Each sample is one joint sequence, its text tokens then its image tokens (Flux's own
order). Shapes (S = this rank's samples, T = tokens):

- `FluxBatch`: ``image (T_img, in_channels)`` packed latents (Flux's 2x2-patched
  tokens), ``text (T_txt, joint_attention_dim)``, ``pooled (S, pooled_dim)``,
  ``timestep (S,)`` in [0, 1], ``image_ids (T_img, 3)``, ``text_ids (T_txt, 3)``,
  optional ``guidance (S,)``; ``image_lens`` / ``text_lens`` per sample.
- `BalancedFlux(model)(batch, balancer)` -> ``(T_img, out_channels)``, rows as
  ``batch.image``: what ``model(...)`` gives for each sample alone.

What it does: both input projections and the timestep/text embedding run at home; the
joint tokens are routed with their RoPE ids and a stream tag; every block runs where the
plan put the tokens, with per-token AdaLN modulation from each token's sample
(``balancer.per_token`` machinery) and the text and image rows of a chunk through their
own projections; the result is routed home for the output norm and projection. Model
weights are the model's own (no copy); blocks run through their own ``__call__``
(`knapformer.integrations.diffusers.packed`), so FSDP2 and checkpointing hooks fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.internals import _unwrapped, check_flux
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
class FluxBatch:
    """This rank's samples, packed (shapes in the module docstring)."""

    image: torch.Tensor
    image_lens: list[int]
    text: torch.Tensor
    text_lens: list[int]
    pooled: torch.Tensor
    timestep: torch.Tensor
    image_ids: torch.Tensor
    text_ids: torch.Tensor
    guidance: torch.Tensor | None = None

    @classmethod
    def pack(cls, images, texts, pooled, timestep, image_ids, text_ids, guidance=None):
        """From per-sample lists: ``images[i] (L_img_i, C)``, ``texts[i] (L_txt_i, J)``,
        ``image_ids[i] (L_img_i, 3)``, ``text_ids[i] (L_txt_i, 3)``; ``pooled (S, P)`` and
        ``timestep (S,)`` (tensors or lists of rows)."""

        def rows(xs):
            return xs if isinstance(xs, torch.Tensor) else torch.stack(list(xs))

        return cls(
            image=torch.cat(list(images)),
            image_lens=[int(x.shape[0]) for x in images],
            text=torch.cat(list(texts)),
            text_lens=[int(x.shape[0]) for x in texts],
            pooled=rows(pooled),
            timestep=rows(timestep),
            image_ids=torch.cat(list(image_ids)),
            text_ids=torch.cat(list(text_ids)),
            guidance=None if guidance is None else rows(guidance),
        )

    @property
    def seq_lens(self) -> list[int]:
        """Tokens of each joint sequence (text + image): what ``plan_routing`` takes."""
        return [t + i for t, i in zip(self.text_lens, self.image_lens, strict=True)]

    def check(self) -> None:
        """A `KnapformerError` naming the field whose rows do not fit the lengths."""
        s = len(self.image_lens)
        expect = {
            "text_lens": (len(self.text_lens), s),
            "image": (self.image.shape[0], sum(self.image_lens)),
            "text": (self.text.shape[0], sum(self.text_lens)),
            "image_ids": (self.image_ids.shape[0], sum(self.image_lens)),
            "text_ids": (self.text_ids.shape[0], sum(self.text_lens)),
            "pooled": (self.pooled.shape[0], s),
            "timestep": (self.timestep.shape[0], s),
        }
        if self.guidance is not None:
            expect["guidance"] = (self.guidance.shape[0], s)
        for name, (got, want) in expect.items():
            if got != want:
                raise KnapformerError(f"FluxBatch.{name} has {got} rows, expected {want}")


def _joint_positions(text_lens: list[int], image_lens: list[int], device: torch.device):
    """Rows of the text and image tokens in the joint packing ``[text_0; image_0; ...]``."""
    pairs = [n for pair in zip(text_lens, image_lens, strict=True) for n in pair]
    lens = torch.tensor(pairs, dtype=torch.int64)
    stream = torch.repeat_interleave(torch.arange(len(lens)) % 2, lens)
    rows = torch.arange(len(stream))
    return host_to_device(rows[stream == 0], device), host_to_device(rows[stream == 1], device)


class BalancedFlux(nn.Module):
    """``BalancedFlux(model)(batch, balancer=None)``: the packed forward of a diffusers
    ``FluxTransformer2DModel`` (its own modules and weights), balanced when given a
    balancer on which ``plan_routing(batch.seq_lens, model.inner_dim)`` was called for
    this step; without one it runs this rank's samples where they are. Activation
    checkpointing follows ``model.enable_gradient_checkpointing()``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        check_flux(model)
        self.model = model
        for block in (model, *model.transformer_blocks, *model.single_transformer_blocks):
            install(_unwrapped(block))

    def forward(self, batch: FluxBatch, balancer: SequenceBalancer | None = None):
        """-> ``(T_img, out_channels)``, rows as ``batch.image``."""
        batch.check()
        return call(self.model, _model_forward, batch, balancer)


def _model_forward(model, batch: FluxBatch, balancer):
    """The model's forward on packed samples (runs inside ``model.__call__``)."""
    dtype = model.x_embedder.weight.dtype
    img = model.x_embedder(batch.image)
    txt = model.context_embedder(batch.text)
    timestep = batch.timestep.to(img.dtype) * 1000
    if batch.guidance is None:
        temb = model.time_text_embed(timestep, batch.pooled)
    else:
        temb = model.time_text_embed(timestep, batch.guidance.to(img.dtype) * 1000, batch.pooled)
    txt_rows, img_rows = _joint_positions(batch.text_lens, batch.image_lens, img.device)
    total = img.shape[0] + txt.shape[0]
    joint = img.new_zeros((total, img.shape[1])).index_copy(0, txt_rows, txt)
    joint = joint.index_copy(0, img_rows, img)
    ids = torch.zeros(total, batch.image_ids.shape[1], dtype=batch.image_ids.dtype,
                      device=img.device)  # fmt: skip
    ids = ids.index_copy(0, txt_rows, batch.text_ids).index_copy(0, img_rows, batch.image_ids)
    is_image = torch.zeros(total, dtype=torch.bool, device=img.device)
    is_image[img_rows] = True

    tokens = Tokens(balancer, batch.seq_lens)
    x, (ids, is_image) = tokens.route(joint, [ids, is_image])
    rope = model.pos_embed(ids)  # per token: its RoPE angles travel as its ids
    streams = _Streams(is_image)
    temb_held = tokens.per_sequence(temb)  # (S_held, D), gradients go home
    ckpt = bool(model.gradient_checkpointing)
    for block in model.transformer_blocks:
        x = call(block, _double_block, x, temb_held, rope, tokens, streams, checkpointed=ckpt)
    for block in model.single_transformer_blocks:
        x = call(block, _single_block, x, temb_held, rope, tokens, checkpointed=ckpt)
    x = tokens.reverse(x).index_select(0, img_rows).to(dtype)

    # Output norm at home: each image token's own sample's embedding.
    norm_out = model.norm_out
    emb = norm_out.linear(norm_out.silu(temb).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    sample = sample_of_token(batch.image_lens, x.device)
    x = modulate(norm_out.norm(x), scale[sample], shift[sample])
    return model.proj_out(x)


class _Streams:
    """Which routed rows are text and which image (a chunk may hold either or both)."""

    def __init__(self, is_image: torch.Tensor):
        self.image = torch.nonzero(is_image).reshape(-1)
        self.text = torch.nonzero(~is_image).reshape(-1)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.index_select(0, self.text), x.index_select(0, self.image)

    def merge(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        out = image.new_empty((text.shape[0] + image.shape[0], *image.shape[1:]))
        return out.index_copy(0, self.text, text).index_copy(0, self.image, image)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Flux's RoPE on ``(T, H, D)`` with per-token ``cos, sin (T, D)``."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x[None], rope, sequence_dim=1)[0]


def _per_token_chunks(linear_emb: torch.Tensor, tokens: Tokens, rows, n: int):
    """``(S_held, n*D)`` modulation -> n tensors ``(len(rows), D)`` for those token rows."""
    index = tokens.index if rows is None else tokens.index.index_select(0, rows)
    return linear_emb.index_select(0, index).chunk(n, dim=1)


def _double_block(block, x, temb, rope, tokens: Tokens, streams: _Streams):
    """``FluxTransformerBlock`` on routed rows ``x (T, D)``: text rows through the
    ``*_context`` / ``add_*`` modules, image rows through the others, one attention."""
    attn, hd = block.attn, block.attn.head_dim
    xt, xi = streams.split(x)
    mi = block.norm1.linear(block.norm1.silu(temb))  # (S_held, 6D)
    mt = block.norm1_context.linear(block.norm1_context.silu(temb))
    shift_i, scale_i, gate_i, shift_mlp_i, scale_mlp_i, gate_mlp_i = _per_token_chunks(
        mi, tokens, streams.image, 6
    )
    shift_t, scale_t, gate_t, shift_mlp_t, scale_mlp_t, gate_mlp_t = _per_token_chunks(
        mt, tokens, streams.text, 6
    )
    ni = modulate(block.norm1.norm(xi), scale_i, shift_i)
    nt = modulate(block.norm1_context.norm(xt), scale_t, shift_t)
    qi = attn.norm_q(_heads(attn.to_q(ni), hd))
    ki = attn.norm_k(_heads(attn.to_k(ni), hd))
    vi = _heads(attn.to_v(ni), hd)
    qt = attn.norm_added_q(_heads(attn.add_q_proj(nt), hd))
    kt = attn.norm_added_k(_heads(attn.add_k_proj(nt), hd))
    vt = _heads(attn.add_v_proj(nt), hd)
    q, k, v = (streams.merge(a, b) for a, b in ((qt, qi), (kt, ki), (vt, vi)))
    q, k = _rope(q, rope), _rope(k, rope)
    out = tokens.attend(q, k, v).flatten(1).to(q.dtype)
    ot, oi = streams.split(out)
    oi = attn.to_out[1](attn.to_out[0](oi))
    ot = attn.to_add_out(ot)

    xi = xi + gate_i * oi
    ff = block.ff(modulate(block.norm2(xi), scale_mlp_i, shift_mlp_i))
    xi = xi + gate_mlp_i * ff
    xt = xt + gate_t * ot
    ff = block.ff_context(modulate(block.norm2_context(xt), scale_mlp_t, shift_mlp_t))
    xt = xt + gate_mlp_t * ff
    return streams.merge(xt, xi)


def _single_block(block, x, temb, rope, tokens: Tokens):
    """``FluxSingleTransformerBlock`` on routed rows ``x (T, D)`` (both streams alike)."""
    attn, hd = block.attn, block.attn.head_dim
    m = block.norm.linear(block.norm.silu(temb))
    shift, scale, gate = _per_token_chunks(m, tokens, None, 3)
    n = modulate(block.norm.norm(x), scale, shift)
    mlp = block.act_mlp(block.proj_mlp(n))
    q = _rope(attn.norm_q(_heads(attn.to_q(n), hd)), rope)
    k = _rope(attn.norm_k(_heads(attn.to_k(n), hd)), rope)
    v = _heads(attn.to_v(n), hd)
    out = tokens.attend(q, k, v).flatten(1).to(q.dtype)
    return x + gate * block.proj_out(torch.cat([out, mlp], dim=1))
