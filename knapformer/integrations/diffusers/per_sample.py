"""`PerSample`: one value per held sample, which a diffusers block sees as the value of a
batch of one (a timestep embedding, its AdaLN modulation, a prompt for cross-attention).

Inside a packed forward the token streams are ``(1, T, D)``: the tokens of every sample
held here, back to back, a "batch of one" to the model's code. What the model computes
per sample is a `PerSample`: ``data`` stacks the samples' values on its first axis
(``(S * lead, ...)``, sample-major) while ``shape`` says ``(lead, ...)``, so that the
block's own code (``emb.chunk(6, dim=1)``, ``scale[:, None]``, ``temb.reshape(batch, ...)``
with ``batch = hidden_states.shape[0] = 1``) runs unchanged on it. Operations follow the
torch-function protocol (``__torch_function__``):

- on `PerSample` values alone (or with parameters), each sample's value is computed as
  the model would compute it for that sample alone: directly on ``data`` when the
  operation keeps samples apart (element-wise, ``F.linear``, norms, ``chunk`` along a
  later axis, ...), otherwise sample by sample;
- when a `PerSample` of shape ``(1, 1, ...)`` meets a token stream ``(1, T, ...)`` (the
  broadcast ``norm(x) * (1 + scale[:, None])``), it becomes ``(1, T, ...)``, each token
  taking its own sample's row through `rows_to_tokens` (gradients summed in fp32).

Which token belongs to which sample is told by the layouts of the current step
(`knapformer.integrations.diffusers.layouts.active`): a token stream is recognised by
its number of rows, which the layouts keep distinct.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.layouts import active
from knapformer.runtime.conditioning import rows_to_tokens

T = torch.Tensor

# The dtype or device of the other tensor is read, nothing is broadcast against it.
_NO_BROADCAST = {T.to, T.type_as, T.type, T.new_zeros, T.new_ones, T.new_empty, T.new_full,
                 T.new_tensor}  # fmt: skip
# Samples stay apart: element-wise, or acting on the trailing axes of each row.
_ROWWISE = {
    T.__add__, T.__radd__, T.__iadd__, T.__sub__, T.__rsub__, T.__mul__, T.__rmul__,
    T.__truediv__, T.__rtruediv__, T.__pow__, T.__rpow__, T.__neg__, T.__eq__, T.__ne__,
    T.__lt__, T.__le__, T.__gt__, T.__ge__, T.__and__, T.__or__, T.__invert__,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.where, torch.maximum,
    torch.minimum, torch.lerp, torch.addcmul, torch.exp, torch.sin, torch.cos, torch.tanh,
    torch.sigmoid, torch.rsqrt, torch.sqrt, torch.clamp, torch.clip, torch.abs,
    T.add, T.sub, T.mul, T.div, T.pow, T.clamp, T.clip, T.exp, T.log, T.sin, T.cos,
    T.tanh, T.sigmoid, T.sqrt, T.rsqrt, T.abs, T.neg, T.square, T.reciprocal, T.float,
    T.half, T.bfloat16, T.double, T.to, T.type, T.type_as, T.contiguous, T.clone,
    T.masked_fill, T.bool, T.int, T.long,
    F.silu, F.gelu, F.relu, F.mish, F.softplus, F.dropout, F.linear, F.layer_norm,
    F.rms_norm, F.group_norm,
}  # fmt: skip
# (function, position of its axis argument, default): fine unless that axis is 0.
_AXIS = {
    T.chunk: (2, 0), torch.chunk: (2, 0), T.split: (2, 0), torch.split: (2, 0),
    T.unbind: (1, 0), torch.unbind: (1, 0), T.unflatten: (1, None), T.narrow: (1, None),
    T.select: (1, None), T.softmax: (1, None), F.softmax: (1, None), T.mean: (1, None),
    T.sum: (1, None), T.amax: (1, None), T.cumsum: (1, None), T.squeeze: (1, None),
    T.flatten: (1, 0), torch.flatten: (1, 0),
}  # fmt: skip


class PerSample:
    """``data (S * lead, ...)``: sample ``s``'s value is ``data[s * lead:(s + 1) * lead]``;
    to the model it is one tensor of shape ``(lead, ...)``."""

    __slots__ = ("count", "data", "lead")

    def __init__(self, data: torch.Tensor, count: int, lead: int = 1):
        if data.shape[0] != count * lead:
            raise ValueError(f"{count} samples of {lead} rows do not make {data.shape[0]} rows")
        self.data, self.count, self.lead = data, count, lead

    @classmethod
    def of(cls, rows: torch.Tensor) -> PerSample:
        """``rows (S, ...)``, one per sample -> each sample's value ``(1, ...)``."""
        return cls(rows, rows.shape[0], 1)

    # --------------------------------------------------------------- the model's view
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.lead, *self.data.shape[1:]))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.data.dim()

    ndim = property(dim)

    def numel(self) -> int:
        return math.prod(self.shape)

    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: self.data.device)
    requires_grad = property(lambda self: self.data.requires_grad)
    is_cuda = property(lambda self: self.data.is_cuda)

    def __len__(self) -> int:
        return self.lead

    def __repr__(self) -> str:
        return f"PerSample({self.count} samples of {tuple(self.shape)}, {self.dtype})"

    def __getattr__(self, name: str) -> Any:
        method = getattr(torch.Tensor, name, None)
        if not callable(method):
            raise AttributeError(f"PerSample has no attribute {name!r}")
        return lambda *args, **kwargs: _dispatch(method, (self, *args), kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def samples(self) -> tuple[torch.Tensor, ...]:
        """Each sample's value ``(lead, ...)``."""
        return self.data.reshape(self.count, self.lead, *self.data.shape[1:]).unbind(0)


def _operator(name: str) -> Callable:
    method = getattr(torch.Tensor, name)
    return lambda self, *args: _dispatch(method, (self, *args), {})


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "pow",
              "rpow", "neg", "getitem", "setitem", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
              "invert"):  # fmt: skip
    setattr(PerSample, f"__{_name}__", _operator(f"__{_name}__"))
PerSample.__hash__ = object.__hash__  # __eq__ is element-wise, as a tensor's


def _dispatch(func, args: tuple, kwargs: dict):
    found = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, PerSample)]
    ref = found[0]
    if any(x.count != ref.count for x in found):
        raise KnapformerError("PerSample values of different sample counts met")
    layouts = active()
    if layouts is not None and func not in _NO_BROADCAST:
        tokens = _token_rows(ref, args, kwargs, layouts.counts)
        if tokens is not None:
            index = layouts.sample_index(tokens)
            expand = lambda x: _to_tokens(x, index) if isinstance(x, PerSample) else x  # noqa: E731
            return func(*tree_map(expand, args), **tree_map(expand, kwargs))
    direct = _direct(func, args, kwargs, found, ref)
    if direct is not None:
        unwrap = lambda x: x.data if isinstance(x, PerSample) else x  # noqa: E731
        out = func(*tree_map(unwrap, direct[0]), **tree_map(unwrap, direct[1]))
        return _wrap(out, ref.count, direct[2])
    return _sample_by_sample(func, args, kwargs, ref)


def _token_rows(ref: PerSample, args, kwargs, counts) -> int | None:
    """The row count of a token stream ``(1, T, ...)`` this operation broadcasts a
    ``(1, 1, ...)`` `PerSample` against, if any."""
    if ref.lead != 1 or ref.dim() < 2 or ref.shape[1] != 1:
        return None
    for x in tree_flatten((args, kwargs))[0]:
        if (isinstance(x, torch.Tensor) and x.dim() == ref.dim() and x.shape[0] == 1
                and x.shape[1] in counts):  # fmt: skip
            return int(x.shape[1])
    return None


def _to_tokens(x: PerSample, index: torch.Tensor) -> torch.Tensor:
    """``(1, 1, ...)`` per sample -> ``(1, T, ...)``, token t taking sample ``index[t]``'s."""
    if x.lead != 1 or x.dim() < 2 or x.shape[1] != 1:
        raise KnapformerError(
            f"a per-sample value of shape {tuple(x.shape)} meets the token stream: only "
            "(1, 1, ...) values (one row broadcast over the tokens) can"
        )
    rows = rows_to_tokens(x.data, index)  # (T, 1, ...)
    return rows.reshape(1, rows.shape[0], *rows.shape[2:])


def _direct(func, args, kwargs, found, ref):
    """``(args, kwargs, lead of the result)`` when ``func`` can run on the stacked data
    and give each sample what it would alone; None otherwise."""
    if any(x.lead != ref.lead for x in found):
        return None
    if func in _ROWWISE:
        plain = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if func in _NO_BROADCAST or all(_within_sample(x, ref) for x in plain):
            return args, kwargs, ref.lead
        return None
    if func in _AXIS:
        at, default = _AXIS[func]
        axis = args[at] if len(args) > at else kwargs.get("dim", default)
        if func in (T.flatten, torch.flatten):
            axis = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        if isinstance(axis, int) and axis % ref.dim() != 0:
            return args, kwargs, ref.lead
        return None
    if func is T.unsqueeze or func is torch.unsqueeze:
        axis = args[1] if len(args) > 1 else kwargs["dim"]
        return (args, kwargs, ref.lead) if axis % (ref.dim() + 1) != 0 else None
    if func in (T.transpose, torch.transpose, T.swapaxes, T.movedim):
        axes = (args[1], args[2])
        return (args, kwargs, ref.lead) if all(a % ref.dim() for a in axes) else None
    if func is T.__getitem__ or func is T.__setitem__:
        return (args, kwargs, ref.lead) if _keeps_samples(args[1], ref.dim()) else None
    if func in (T.view, T.reshape, torch.reshape, T.expand):
        return _reshaped(func, args, ref)
    if func in (torch.cat, torch.concat, torch.stack):
        return _joined(func, args, kwargs, ref)
    return None


def _within_sample(x: torch.Tensor, ref: PerSample) -> bool:
    """Whether plain ``x`` broadcasts against each sample alike (no axis 0 of its own)."""
    return x.dim() < ref.dim() or (x.dim() == ref.dim() and x.shape[0] == 1)


def _keeps_samples(index: Any, ndim: int) -> bool:
    """Whether ``value[index]`` leaves axis 0 whole (``x[:, None]``, ``x[..., :3]``)."""
    index = index if isinstance(index, tuple) else (index,)
    if not index:
        return True
    first = index[0]
    if isinstance(first, slice) and first == slice(None):
        return True
    explicit = [i for i in index if i is not None and i is not Ellipsis]
    return first is Ellipsis and len(explicit) < ndim


def _reshaped(func, args, ref: PerSample):
    """``view``/``reshape``/``expand`` to a shape: its first axis is per sample."""
    shape = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
    shape = list(shape)
    if not shape or not all(isinstance(s, int) for s in shape):
        return None  # a dtype view, or sizes given as tensors: sample by sample
    if func is T.expand:
        if shape[0] not in (-1, ref.lead):
            return None
        return (args[0], -1, *shape[1:]), {}, ref.lead
    if shape[0] == -1:
        rest = math.prod(s for s in shape[1:])
        if rest <= 0 or -1 in shape[1:]:
            return None
        shape[0] = ref.numel() // rest
    lead = int(shape[0])
    return (args[0], (ref.count * lead, *shape[1:])), {}, lead


def _joined(func, args, kwargs, ref: PerSample):
    tensors = args[0]
    axis = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    ndim = ref.dim() + (1 if func is torch.stack else 0)
    if not all(isinstance(x, PerSample) for x in tensors) or axis % ndim == 0:
        return None
    return args, kwargs, ref.lead


def _wrap(out: Any, count: int, lead: int) -> Any:
    if isinstance(out, torch.Tensor):
        return PerSample(out, count, lead)
    if isinstance(out, tuple | list):
        return type(out)(_wrap(x, count, lead) for x in out)
    return out


def _sample_by_sample(func, args, kwargs, ref: PerSample):
    """``func`` on each sample's values alone, the results stacked again."""
    if ref.count == 0:
        # Learn the result's shape on one zero sample kept in the graph (so that every
        # parameter still gets its zero gradient on a rank holding no token).
        probe = lambda x: x.data.new_zeros(x.shape) + x.data.sum() * 0  # noqa: E731
        pick = lambda x: probe(x) if isinstance(x, PerSample) else x  # noqa: E731
        one = func(*tree_map(pick, args), **tree_map(pick, kwargs))
        return _restack([one], 0)
    results = []
    for s in range(ref.count):
        pick = lambda x, s=s: x.samples()[s] if isinstance(x, PerSample) else x  # noqa: E731
        results.append(func(*tree_map(pick, args), **tree_map(pick, kwargs)))
    return _restack(results, ref.count)


def _restack(results: list, count: int) -> Any:
    first = results[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise KnapformerError(
                "a per-sample value was reduced to a scalar, which a batch of samples "
                "cannot stand for; reduce along an axis other than the first"
            )
        lead = first.shape[0]
        data = torch.cat(results) if count else first[:0]
        return PerSample(data, count, lead)
    if isinstance(first, tuple | list):
        return type(first)(_restack([r[i] for r in results], count) for i in range(len(first)))
    return first
