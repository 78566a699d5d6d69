"""What a sample's blocks take, sorted by how it reaches the rank that computes them:
token streams and per-token tensors travel with the tokens, per-sample tensors are
gathered for the samples held, masks leave padded rows out, the rest must agree.

`sort_inputs` turns one sample's captured block arguments (`capture`) into a
`SampleInputs` (its joint token rows, per-token features and per-sample values) and a
`Signature` (how to rebuild the arguments from them, with shapes and dtypes, the same
for every sample of a step: a rank without samples builds its empty inputs from a
peer's). `block_arguments` rebuilds a block list's arguments on the packed rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.declarations import JOINT, ModelSpec, Tok
from knapformer.integrations.diffusers.layouts import StepLayouts
from knapformer.integrations.diffusers.per_sample import PerSample


@dataclass(frozen=True)
class Leaf:
    """How one value of a block argument is carried: ``kind`` is ``stream`` (``what``:
    its stream or `JOINT`), ``token`` (``what``: feature number, `Tok`), ``sample``
    (``what``: value number), ``mask`` (left out: None) or ``const`` (``what``: value)."""

    kind: str
    what: Any = None


@dataclass(frozen=True)
class Signature:
    """The block arguments of every list of a step, and the shapes of what travels."""

    arguments: tuple[tuple[tuple[str, Any, tuple[Leaf, ...]], ...], ...]  # per list
    width: int  # D of the token streams
    dtype: torch.dtype  # of the token streams
    # per-token features: row shape, dtype, complex, requires grad
    features: tuple[tuple[tuple[int, ...], torch.dtype, bool, bool], ...]
    values: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]  # shape, dtype, requires grad
    grad: bool  # whether the token rows require grad

    def comparable(self, ignored: tuple[str, ...]) -> Signature:
        """This signature with the values of ``ignored`` arguments blanked."""
        arguments = tuple(
            tuple((name, spec, tuple(Leaf("const") for _ in leaves) if name in ignored
                   else leaves) for name, spec, leaves in per_list)
            for per_list in self.arguments
        )  # fmt: skip
        return Signature(arguments, self.width, self.dtype, self.features, self.values,
                         self.grad)  # fmt: skip


@dataclass
class SampleInputs:
    """One sample: ``joint (L, D)`` token rows (streams joined, padded rows left out),
    ``features`` one ``(L, ...)`` tensor per per-token feature, ``values`` its per-sample
    tensors ``(1, ...)``, ``lengths`` its rows per stream."""

    joint: torch.Tensor
    features: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: tuple[int, ...]


def sort_inputs(spec: ModelSpec, captured: list[dict[str, Any]]) -> tuple[SampleInputs, Signature]:
    """One sample's captured block arguments (one dict per block list)."""
    streams = _streams(spec, captured[0])
    keep = _kept_rows(spec, captured[0], streams)
    kept = {s: streams[s][keep[s]] for s in spec.streams}
    lengths = tuple(int(kept[s].shape[0]) for s in spec.streams)
    sorter = _Sorter(spec, streams, keep, lengths)
    arguments = tuple(
        tuple(sorter.argument(b.streams, name, value) for name, value in values.items())
        for b, values in zip(spec.blocks, captured, strict=True)
    )
    first = kept[spec.streams[0]]
    signature = Signature(
        arguments, int(first.shape[-1]), first.dtype,
        tuple((tuple(f.shape[1:]), f.dtype, c, f.requires_grad)
              for f, c in zip(sorter.features, sorter.complex, strict=True)),
        tuple((tuple(v.shape), v.dtype, v.requires_grad) for v in sorter.values),
        first.requires_grad,
    )  # fmt: skip
    joint = torch.cat([kept[s] for s in spec.streams])
    return SampleInputs(joint, sorter.features, sorter.values, lengths), signature


def _streams(spec: ModelSpec, first_call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each stream's ``(L, D)`` rows, from the first block list's stream arguments."""
    out = {}
    for arg, stream in spec.blocks[0].streams.items():
        x = first_call.get(arg)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise KnapformerError(
                f"{spec.blocks[0].name}'s {arg} ({stream} tokens) is {shape}, expected "
                "(1, L, D): give the model one sample at a time (a batch of one)"
            )
        out[stream] = x[0]
    missing = [s for s in spec.streams if s not in out]
    if missing:
        raise KnapformerError(f"no argument of {spec.blocks[0].name} carries {missing[0]}")
    return out


def _kept_rows(spec, first_call, streams) -> dict[str, torch.Tensor]:
    """Per stream, the rows no declared mask leaves out (bool, on the host)."""
    keep = {s: torch.ones(x.shape[0], dtype=torch.bool) for s, x in streams.items()}
    for arg, tok in spec.masks.items():
        mask = first_call.get(arg)
        if mask is None:
            continue
        rows = mask.movedim(tok.axis, 0).reshape(mask.shape[tok.axis], -1)
        if rows.shape[1] != 1:
            raise KnapformerError(f"mask {arg} of shape {tuple(mask.shape)}: expected one per row")
        rows = rows[:, 0].cpu().bool()
        parts = _split_joint(spec, rows, tok.stream, {s: len(k) for s, k in keep.items()}, arg)
        for s, part in parts.items():
            keep[s] &= part
    return keep


def _split_joint(spec, rows, stream, counts, arg) -> dict[str, torch.Tensor]:
    """Rows along a stream (or `JOINT`) -> per stream."""
    names = spec.streams if stream == JOINT else (stream,)
    sizes = [counts[s] for s in names]
    if rows.shape[0] != sum(sizes):
        raise KnapformerError(
            f"{arg} has {rows.shape[0]} rows, but {'+'.join(names)} has {sum(sizes)} tokens"
        )
    return dict(zip(names, rows.split(sizes), strict=True))


class _Sorter:
    """Sorts one sample's argument values into leaves, features and per-sample values
    (a tensor used by several arguments travels once)."""

    def __init__(self, spec, streams, keep, lengths):
        self.spec, self.streams, self.keep, self.lengths = spec, streams, keep, lengths
        self.features: list[torch.Tensor] = []
        self.complex: list[bool] = []
        self.values: list[torch.Tensor] = []
        self._seen: dict[int, Leaf] = {}

    def argument(self, stream_args: dict[str, str], name: str, value: Any):
        if name in stream_args:
            return name, None, (Leaf("stream", stream_args[name]),)
        if name in self.spec.masks:
            return name, None, (Leaf("mask"),)
        leaves, treespec = tree_flatten(value)
        toks = self.spec.tokens.get(name)
        if toks is not None and not isinstance(toks, tuple):
            toks = (toks,) * len(leaves)
        sorted_leaves = tuple(self._leaf(name, x, None if toks is None else toks[i])
                              for i, x in enumerate(leaves))  # fmt: skip
        return name, treespec_dumps(treespec), sorted_leaves

    def _leaf(self, name: str, x: Any, tok: Tok | None) -> Leaf:
        if not isinstance(x, torch.Tensor):
            return Leaf("const", x)
        if id(x) in self._seen:
            return self._seen[id(x)]
        leaf = self._token(name, x, tok) if tok is not None else self._value(name, x)
        self._seen[id(x)] = leaf
        return leaf

    def _token(self, name: str, x: torch.Tensor, tok: Tok) -> Leaf:
        rows = x.movedim(tok.axis, 0)
        names = self.spec.streams if tok.stream == JOINT else (tok.stream,)
        counts = {s: self.streams[s].shape[0] for s in self.spec.streams}
        if rows.shape[0] != sum(counts[s] for s in names):
            raise KnapformerError(f"{name} has {rows.shape[0]} rows along axis {tok.axis}, "
                                  f"but {'+'.join(names)} has {sum(counts[s] for s in names)} "
                                  "tokens")  # fmt: skip
        parts = dict(zip(names, rows.split([counts[s] for s in names]), strict=True))
        is_complex = rows.is_complex()
        joined = []
        for s, n in zip(self.spec.streams, self.lengths, strict=True):
            part = parts.get(s)
            part = part[self.keep[s].to(part.device)] if part is not None else None
            if part is None:
                part = rows.new_zeros((n, *rows.shape[1:]))
            joined.append(torch.view_as_real(part) if is_complex else part)
        self.features.append(torch.cat(joined))
        self.complex.append(is_complex)
        return Leaf("token", (len(self.features) - 1, tok))

    def _value(self, name: str, x: torch.Tensor) -> Leaf:
        if x.dim() == 0 or x.shape[0] != 1:
            raise KnapformerError(
                f"block argument {name} of shape {tuple(x.shape)} is neither declared per "
                "token nor one sample's (a batch of one)"
            )
        self.values.append(x)
        return Leaf("sample", len(self.values) - 1)


def block_arguments(
    arguments: tuple, streams: dict[str, Any], features: list[torch.Tensor],
    values: list[PerSample], layouts: StepLayouts, signature: Signature,
) -> dict[str, Any]:  # fmt: skip
    """One block list's arguments on the packed rows: ``streams`` the current stream
    tensors ``(1, n, D)`` (and `JOINT`), ``features`` the routed per-token features,
    ``values`` the held samples' per-sample values."""
    out = {}
    for name, treespec, leaves in arguments:
        built = [_built(leaf, streams, features, values, layouts, signature) for leaf in leaves]
        out[name] = built[0] if treespec is None else tree_unflatten(built, _structure(treespec))
    return out


@functools.lru_cache(maxsize=256)
def _structure(dumped: str):
    """A block argument's structure, kept as text in the `Signature` (it travels)."""
    return treespec_loads(dumped)


def _built(leaf: Leaf, streams, features, values, layouts, signature) -> Any:
    if leaf.kind == "stream":
        return streams.get(leaf.what)
    if leaf.kind == "mask":
        return None
    if leaf.kind == "sample":
        return values[leaf.what]
    if leaf.kind == "const":
        return leaf.what
    number, tok = leaf.what
    parts = layouts.split(features[number])
    names = layouts.order if tok.stream == JOINT else (tok.stream,)
    rows = torch.cat([parts[s] for s in names])
    if signature.features[number][2]:
        rows = torch.view_as_complex(rows)
    return rows.movedim(0, tok.axis)
