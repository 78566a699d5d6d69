"""`BalancedFlux` and `FluxBatch`: diffusers' ``FluxTransformer2DModel`` on packed
tensors, the first API of this integration, now a thin layer over `balance`.

Shapes (S = this rank's samples, T = tokens):

- `FluxBatch`: ``image (T_img, in_channels)`` packed latents (Flux's 2x2-patched tokens),
  ``text (T_txt, joint_attention_dim)``, ``pooled (S, pooled_dim)``, ``timestep (S,)``
  in [0, 1] (the model multiplies by 1000), ``image_ids (T_img, 3)``, ``text_ids
  (T_txt, 3)``, optional ``guidance (S,)``; ``image_lens`` / ``text_lens`` per sample.
- `BalancedFlux(model)(batch, balancer)` -> ``(T_img, out_channels)``, rows as
  ``batch.image``: what ``model(...)`` gives for each sample alone. The balancer's
  ``plan_routing(batch.seq_lens, model.inner_dim)`` must have been called for the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.balanced import BalancedModel
from knapformer.integrations.diffusers.declarations import class_name
from knapformer.integrations.diffusers.models import FLUX

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


def _rows(xs: Any, what: str) -> torch.Tensor:
    """A tensor of per-sample rows, from a tensor or a list of rows."""
    if isinstance(xs, torch.Tensor):
        return xs
    xs = list(xs)
    return torch.stack(xs) if xs else torch.zeros(0)


def _packed(xs: Any, width_of: Any = None) -> torch.Tensor:
    xs = list(xs)
    return torch.cat(xs) if xs else torch.zeros(0, 0 if width_of is None else width_of)


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
        ``image_ids[i] (L_img_i, 3)``, ``text_ids[i] (L_txt_i, 3)``; ``pooled (S, P)``,
        ``timestep (S,)`` and ``guidance (S,)`` as tensors or lists of rows. Empty lists
        make the batch of a rank without samples."""
        images, texts = list(images), list(texts)
        return cls(
            image=_packed(images),
            image_lens=[int(x.shape[0]) for x in images],
            text=_packed(texts),
            text_lens=[int(x.shape[0]) for x in texts],
            pooled=_rows(pooled, "pooled"),
            timestep=_rows(timestep, "timestep"),
            image_ids=_packed(image_ids, 3),
            text_ids=_packed(text_ids, 3),
            guidance=None if guidance is None else _rows(guidance, "guidance"),
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

    def samples(self) -> list[dict[str, torch.Tensor]]:
        """Each sample as ``FluxTransformer2DModel``'s keyword arguments, a batch of one."""
        self.check()
        images = self.image.split(self.image_lens)
        texts, tids = self.text.split(self.text_lens), self.text_ids.split(self.text_lens)
        iids = self.image_ids.split(self.image_lens)
        out = []
        for i in range(len(self.image_lens)):
            one = slice(i, i + 1)
            sample = dict(hidden_states=images[i][None], encoder_hidden_states=texts[i][None],
                          pooled_projections=self.pooled[one], timestep=self.timestep[one],
                          img_ids=iids[i], txt_ids=tids[i])  # fmt: skip
            if self.guidance is not None:
                sample["guidance"] = self.guidance[i : i + 1]
            out.append(sample)
        return out


class BalancedFlux(nn.Module):
    """``BalancedFlux(model)(batch, balancer=None)``: `balance` for a
    ``FluxTransformer2DModel`` (exactly that class) on a `FluxBatch`, with the plan the
    caller made; without a balancer it runs this rank's samples where they are."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if class_name(model) != "FluxTransformer2DModel":
            raise KnapformerError(
                f"BalancedFlux takes a FluxTransformer2DModel, not a {class_name(model)}: "
                "knapformer.integrations.diffusers.balance(model) takes every supported class"
            )
        self.balanced = BalancedModel(model, FLUX)
        self.model = model

    def forward(self, batch: FluxBatch, balancer: SequenceBalancer | None = None) -> torch.Tensor:
        """-> ``(T_img, out_channels)``, rows as ``batch.image``."""
        outs = self.balanced(batch.samples(), balancer, plan=False)
        width = self.model.proj_out.out_features
        rows = torch.cat([o[0] for o in outs]) if outs else outs.anchor.new_zeros(0, width)
        return rows + outs.anchor
