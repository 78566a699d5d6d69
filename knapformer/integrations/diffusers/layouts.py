"""Where each row of a packed step's token streams sits: its place among the rows this
rank computes, its sample, and which rows are spares.

A sample is one sequence of its streams (e.g. ``text`` then ``image``), cut into chunks
and routed; the rows a rank computes ("routed rows") hold chunks of several samples. A
block sees each stream as one ``(1, n, D)`` tensor (its routed rows in routed order) and
the joint sequence as the streams concatenated in the model's order. Both are
*layouts*: a list of routed rows. Per-sample values (`PerSample`) and attention find
their layout by its number of rows, so the layouts of a step keep their counts
distinct: where two streams would have as many rows, or a stream one row or none (a
count a broadcast dimension of 1 could be mistaken for, and an empty slice a model's
``x[:, :-n]`` gets wrong), zero *spare* rows are appended to it. Spares belong to no
sequence: attention leaves them out and they are dropped before the tokens go home.
They take their per-sample values from the first sample held (on a rank holding no
token, from the step's first sample), which their results never reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from knapformer.errors import KnapformerError
from knapformer.runtime.router import host_to_device

_ACTIVE: ContextVar[StepLayouts | None] = ContextVar("knapformer_diffusers_step", default=None)
SPARE = -1  # the routed row of a spare
MIN_ROWS = 2  # a stream holding tokens has at least this many rows


@dataclass(frozen=True)
class Layout:
    """Rows of a stream, or of the joint sequence, in the order a block holds them."""

    streams: tuple[str, ...]  # the streams it covers, in order
    rows: np.ndarray  # (N,) the routed row of each of its rows; SPARE for a spare
    sample: np.ndarray  # (N,) the held sample of each row (a spare: sample 0)
    index: torch.Tensor  # ``sample`` on the device


class StepLayouts:
    """The layouts of one step on this rank.

    ``row_stream[r]``: the stream (position in ``order``) of routed row r;
    ``row_sample[r]``: its sample among those held here (0 .. S_held - 1);
    ``balancer``: the step's (None: this rank's own samples, unbalanced);
    ``sequences``: the stream lengths of each sequence attention runs over, in the order
    ``pre_attn`` returns them (unbalanced: this rank's samples).
    """

    def __init__(
        self, order: tuple[str, ...], row_stream: np.ndarray, row_sample: np.ndarray,
        device: torch.device, balancer: Any, sequences: list[tuple[int, ...]],
    ):  # fmt: skip
        self.order, self.device = order, device
        self.balancer, self.sequences = balancer, sequences
        self.total = len(row_stream)
        self.stream_rows = {s: np.flatnonzero(row_stream == i) for i, s in enumerate(order)}
        sizes = _sizes([len(self.stream_rows[s]) for s in order])
        self.spares = {s: n - len(self.stream_rows[s]) for s, n in zip(order, sizes, strict=True)}
        self.row_sample = np.asarray(row_sample, dtype=np.int64)
        self.by_count: dict[int, Layout] = {}
        for streams in [(s,) for s in order] + [order]:
            rows = np.concatenate([self._with_spares(s) for s in streams])
            self.by_count.setdefault(len(rows), self._layout(streams, rows))
        self._device_rows: dict[str, torch.Tensor] = {}

    def _with_spares(self, stream: str) -> np.ndarray:
        return np.concatenate([self.stream_rows[stream],
                               np.full(self.spares[stream], SPARE, np.int64)])  # fmt: skip

    def _layout(self, streams: tuple[str, ...], rows: np.ndarray) -> Layout:
        sample = np.zeros(len(rows), np.int64)
        real = rows != SPARE
        sample[real] = self.row_sample[rows[real]]
        return Layout(streams, rows, sample, host_to_device(torch.from_numpy(sample), self.device))

    @property
    def counts(self) -> dict[int, Layout]:
        return self.by_count

    def layout(self, rows: int) -> Layout:
        if rows not in self.by_count:
            have = ", ".join(f"{n} ({'+'.join(lay.streams)})" for n, lay in self.by_count.items())
            raise KnapformerError(
                f"a block holds {rows} token rows, which is no token stream of this step "
                f"(streams: {have}): the model combines its streams in a way its "
                "declaration does not describe"
            )
        return self.by_count[rows]

    def sample_index(self, rows: int) -> torch.Tensor:
        """``(rows,)`` the held sample of each row of the layout with ``rows`` rows."""
        return self.layout(rows).index

    def rows_of(self, stream: str) -> torch.Tensor:
        """The routed rows of ``stream`` (no spares), on the device."""
        if stream not in self._device_rows:
            rows = torch.from_numpy(self.stream_rows[stream].astype(np.int64))
            self._device_rows[stream] = host_to_device(rows, self.device)
        return self._device_rows[stream]

    def split(self, routed: torch.Tensor, seq_dim: int = 0) -> dict[str, torch.Tensor]:
        """``routed`` (routed rows along ``seq_dim``) -> each stream's rows, spares (zeros)
        appended."""
        out = {}
        for s in self.order:
            part = routed.index_select(seq_dim, self.rows_of(s))
            if self.spares[s]:
                pad = list(part.shape)
                pad[seq_dim] = self.spares[s]
                part = torch.cat([part, part.new_zeros(pad)], dim=seq_dim)
            out[s] = part
        return out

    def merge(self, streams: dict[str, torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """Each stream's ``(n_s, ...)`` rows (spares dropped) back in routed order; a
        stream given as None comes back as zeros. ``like``: a tensor of the rows' width."""
        out = like.new_zeros((self.total, *like.shape[1:]))
        for s in self.order:
            x = streams.get(s)
            if x is not None:
                out = out.index_copy(0, self.rows_of(s), x[: len(self.stream_rows[s])])
        return out


def _sizes(counts: list[int]) -> list[int]:
    """Rows of each stream once spares are added: at least `MIN_ROWS` each (also on a
    rank holding no token: model code such as ``x.reshape(..., -1, 2)`` fails on empty
    tensors), all different (so the joint count, their sum, differs from each too)."""
    used: set[int] = set()
    out = []
    for n in counts:
        n = max(n, MIN_ROWS)
        while n in used:
            n += 1
        used.add(n)
        out.append(n)
    return out


def active() -> StepLayouts | None:
    """The layouts of the packed step running now, if any."""
    return _ACTIVE.get()


@contextmanager
def activated(layouts: StepLayouts) -> Iterator[StepLayouts]:
    token = _ACTIVE.set(layouts)
    try:
        yield layouts
    finally:
        _ACTIVE.reset(token)
