"""`BalancedWan` and `WanBatch`: diffusers' ``WanTransformer3DModel`` on a list of videos,
the first API of this integration, now a thin layer over `balance`.

Shapes (S = this rank's samples):

- `WanBatch`: ``latents``, a list of ``(C, F, H, W)`` video latents (sizes may differ),
  ``timestep (S,)`` in [0, 1000) (Wan's own scale), ``text (S, L, text_dim)`` prompt
  embeddings padded to one length L (the Wan pipeline pads to 512 with zeros);
  ``image (S, L_img, image_dim)`` for image-to-video.
- `BalancedWan(model)(batch, balancer)` -> ``(T, C_out * pt * ph * pw)``: every sample's
  output patches back to back (one tensor, so a rank without samples still has a loss in
  the graph); ``patchify(videos)`` packs targets the same way and ``unpatchify(out,
  batch)`` gives the ``(C_out, F, H, W)`` that ``model(...)`` gives for each sample alone.
  The balancer's ``plan_routing(batch.seq_lens(patch_size), inner_dim)`` must have been
  called for the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.balanced import BalancedModel
from knapformer.integrations.diffusers.declarations import class_name
from knapformer.integrations.diffusers.models import WAN

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


@dataclass
class WanBatch:
    """This rank's samples (shapes in the module docstring)."""

    latents: list[torch.Tensor]
    timestep: torch.Tensor
    text: torch.Tensor
    image: torch.Tensor | None = None

    def seq_lens(self, patch_size: tuple[int, int, int]) -> list[int]:
        """Video tokens of each sample: what ``plan_routing`` takes."""
        return [math.prod(_grid(lat, patch_size)) for lat in self.latents]

    def check(self) -> None:
        s = len(self.latents)
        rows = {"timestep": self.timestep.shape[0], "text": self.text.shape[0]}
        if self.image is not None:
            rows["image"] = self.image.shape[0]
        for name, n in rows.items():
            if n != s:
                raise KnapformerError(f"WanBatch.{name} has {n} rows, expected {s} samples")
        if s and self.text.dim() != 3:
            raise KnapformerError(f"WanBatch.text must be (S, L, text_dim), got {self.text.shape}")

    def samples(self) -> list[dict[str, torch.Tensor]]:
        """Each sample as ``WanTransformer3DModel``'s keyword arguments, a batch of one."""
        self.check()
        out = []
        for i, lat in enumerate(self.latents):
            sample = dict(hidden_states=lat[None], timestep=self.timestep[i : i + 1],
                          encoder_hidden_states=self.text[i : i + 1])  # fmt: skip
            if self.image is not None:
                sample["encoder_hidden_states_image"] = self.image[i : i + 1]
            out.append(sample)
        return out


def _grid(latent: torch.Tensor, patch_size) -> tuple[int, int, int]:
    return tuple(n // p for n, p in zip(latent.shape[1:], patch_size, strict=True))


class BalancedWan(nn.Module):
    """``BalancedWan(model)(batch, balancer=None)``: `balance` for a
    ``WanTransformer3DModel`` (exactly that class: VACE is not supported) on a
    `WanBatch`, with the plan the caller made."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if class_name(model) != "WanTransformer3DModel":
            raise KnapformerError(
                f"BalancedWan takes a WanTransformer3DModel, not a {class_name(model)}: "
                "knapformer.integrations.diffusers.balance(model) lists the supported classes"
            )
        self.balanced = BalancedModel(model, WAN)
        self.model = model
        self.patch_size = tuple(model.config.patch_size)
        self.inner_dim = model.config.num_attention_heads * model.config.attention_head_dim

    def patchify(self, videos: list[torch.Tensor]) -> torch.Tensor:
        """Per-sample ``(C_out, F, H, W)`` (e.g. the targets) -> ``(T, C_out * pt * ph * pw)``,
        rows as `forward` returns them."""
        width = self.model.proj_out.out_features
        parts = [_patchify(v, self.patch_size) for v in videos]
        return torch.cat(parts) if parts else self.model.proj_out.weight.new_zeros((0, width))

    def unpatchify(self, out: torch.Tensor, batch: WanBatch) -> list[torch.Tensor]:
        """`forward`'s ``(T, C_out * pt * ph * pw)`` -> per-sample ``(C_out, F, H, W)``."""
        shapes = [_grid(lat, self.patch_size) for lat in batch.latents]
        parts = out.split([math.prod(s) for s in shapes])
        return [_unpatchify(x, s, self.patch_size) for x, s in zip(parts, shapes, strict=True)]

    def forward(self, batch: WanBatch, balancer: SequenceBalancer | None = None) -> torch.Tensor:
        """-> ``(T, C_out * pt * ph * pw)``: every sample's output patches back to back."""
        outs = self.balanced(batch.samples(), balancer, plan=False)
        return self.patchify([o[0] for o in outs]) + outs.anchor


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
