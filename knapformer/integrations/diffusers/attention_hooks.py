"""Attention inside a packed step: the attention calls of a model's blocks, redirected
while a step runs to attention within whole samples.

diffusers' attention processors call ``dispatch_attention_fn`` (``(B, N, H, D)``), older
ones ``F.scaled_dot_product_attention`` (``(B, H, N, D)``). `install` wraps both names in
the modules of the model's processors; outside a packed step the wrappers call the
originals unchanged. Inside one (`knapformer.integrations.diffusers.layouts.active`):

- self-attention over a layout of ``N`` rows (a stream, or the joint sequence in the
  processor's order): the rows go to routed order, through the bag's Ulysses exchange
  (``pre_attn``), attention within each whole sequence over the rows of the streams the
  layout covers, and back (``post_attn``); spares get zeros;
- cross-attention, keys and values `PerSample` (each sample's own prompt): each sample's
  rows attend to its own keys, with its own mask.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from knapformer.errors import KnapformerError
from knapformer.integrations.attention import attention
from knapformer.integrations.diffusers.layouts import SPARE, Layout, StepLayouts, active
from knapformer.integrations.diffusers.per_sample import PerSample
from knapformer.runtime.router import host_to_device

_WRAPPED = "_knapformer_wrapped"


def install(model: torch.nn.Module) -> None:
    """Wrap the attention entry points of every processor module of ``model`` (once per
    module: the wrappers stay, and do nothing outside a packed step)."""
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        namespace = sys.modules[type(processor).__module__]
        dispatch = getattr(namespace, "dispatch_attention_fn", None)
        if dispatch is not None and not getattr(dispatch, _WRAPPED, False):
            namespace.dispatch_attention_fn = _wrap_dispatch(dispatch)
        functional = getattr(namespace, "F", None)
        if functional is F:
            namespace.F = _Functional()


def _wrap_dispatch(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def dispatch_attention_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        step = active()
        if step is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return _attend(step, a["query"], a["key"], a["value"], a["attn_mask"], a["scale"],
                       a["dropout_p"], a["is_causal"])  # fmt: skip

    setattr(dispatch_attention_fn, _WRAPPED, True)
    return dispatch_attention_fn


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          **kwargs):  # fmt: skip
    """``F.scaled_dot_product_attention`` for the processors that call it directly."""
    step = active()
    if step is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, **kwargs)  # fmt: skip
    swap = lambda x: x.transpose(1, 2) if x is not None else None  # noqa: E731
    out = _attend(step, swap(query), swap(key), swap(value), attn_mask, scale, dropout_p,
                  is_causal)  # fmt: skip
    return out.transpose(1, 2)


class _Functional:
    """``torch.nn.functional`` with `_sdpa` for ``scaled_dot_product_attention``."""

    scaled_dot_product_attention = staticmethod(_sdpa)

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


def _attend(step: StepLayouts, q, k, v, mask, scale, dropout_p, is_causal) -> torch.Tensor:
    """``q (1, N, H, D)`` over a layout of the step; ``k, v`` the same rows
    (self-attention) or `PerSample` ``(1, L, H, D)`` (each sample's own context)."""
    if is_causal or dropout_p:
        raise KnapformerError("causal attention and attention dropout are not supported")
    if isinstance(q, PerSample) or q.shape[0] != 1:
        raise KnapformerError(f"attention queries of shape {tuple(q.shape)}: expected (1, N, H, D)")
    layout = step.layout(q.shape[1])
    if isinstance(k, PerSample):
        return _cross(layout, q[0], k, v, mask, scale)[None]
    if mask is not None:
        raise KnapformerError(
            "an attention mask over the token streams: declare the mask among the model's "
            "masks (its padded rows are then left out) instead"
        )
    if k.shape[1] != q.shape[1]:  # one context for every sample (a batch of one's)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        ).transpose(1, 2)
    return _self(step, layout, q[0], k[0], v[0], scale)[None]


def _self(step: StepLayouts, layout: Layout, q, k, v, scale) -> torch.Tensor:
    """Self-attention of the layout's rows ``(N, H, D)`` within whole sequences."""
    real = np.flatnonzero(layout.rows != SPARE)
    to_dev = lambda a: host_to_device(torch.from_numpy(a.astype(np.int64)), q.device)  # noqa: E731
    at, rows = to_dev(real), to_dev(layout.rows[real])
    routed = [x.new_zeros((step.total, *x.shape[1:])).index_copy(0, rows, x.index_select(0, at))
              for x in (q, k, v)]  # fmt: skip
    bal = step.balancer
    if bal is not None:
        seq_lens, *qkv = bal.pre_attn(*routed)
    else:
        seq_lens, qkv = [sum(s) for s in step.sequences], routed
    keep = _covered(step, layout.streams)
    if keep is None:
        out = attention(*qkv, seq_lens, scale=scale)
    else:
        positions, lens = keep
        sel = to_dev(positions)
        part = attention(*(x.index_select(0, sel) for x in qkv), lens, scale=scale)
        out = torch.zeros_like(qkv[0]).index_copy(0, sel, part)
    if bal is not None:
        out = bal.post_attn(out)[1]
    return q.new_zeros(q.shape).index_copy(0, at, out.index_select(0, rows))


def _covered(step: StepLayouts, streams: tuple[str, ...]):
    """Rows of the sequences (in ``pre_attn``'s order) that belong to ``streams``, and
    their count per sequence; None when that is every row."""
    if set(streams) == set(step.order):
        return None
    mine = np.asarray([s in streams for s in step.order])
    positions, lens, start = [], [], 0
    for seq in step.sequences:
        begins = start + np.cumsum([0, *seq[:-1]])
        parts = [np.arange(b, b + n) for b, n, m in zip(begins, seq, mine, strict=True) if m]
        lens.append(int(sum(len(p) for p in parts)))
        positions.extend(parts)
        start += sum(seq)
    flat = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    return flat, lens


def _cross(layout: Layout, q, k: PerSample, v: PerSample, mask, scale) -> torch.Tensor:
    """Rows ``q (N, H, D)`` attend each to its own sample's ``k, v (1, L, H, D)``."""
    sample = layout.sample
    out = torch.zeros_like(q)
    keys, values = k.samples(), v.samples()
    masks = mask.samples() if isinstance(mask, PerSample) else [mask] * k.count
    for s in np.unique(sample):
        at = np.flatnonzero(sample == s)
        idx = host_to_device(torch.from_numpy(at), q.device)
        rows = q.index_select(0, idx).transpose(0, 1)[None]  # (1, H, n, D)
        m = masks[int(s)]
        if m is not None and m.dim() >= 2 and m.shape[-2] not in (1,):
            raise KnapformerError(
                f"a cross-attention mask of shape {tuple(m.shape)} differs per query row; "
                "only masks over the keys are supported"
            )
        o = F.scaled_dot_product_attention(
            rows, keys[int(s)].transpose(1, 2), values[int(s)].transpose(1, 2),
            attn_mask=m, scale=scale,
        )  # fmt: skip
        out = out.index_copy(0, idx, o[0].transpose(0, 1))
    return out
