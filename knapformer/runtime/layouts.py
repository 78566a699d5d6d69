"""The check, before each exchange of the balancer, that every rank sends rows of the layout
its peers expect: one tiny collective on the host, nothing sent when they disagree.

The exchanges move raw bytes (`knapformer.runtime.router`), sized by the plan's tables and
each rank's row layout. A rank whose layout differs (another width, dtype, head count or
head_dim), or whose own tensor fails its shape check, would make its peers receive
garbage rows, wait out the group's timeout, or make gloo abort the process ("Received data
size doesn't match"). So each exchange first runs `agree_on_layout` over the ranks that
take part in it: each rank sends every peer a small header (whether its own check failed,
then the numbers that must match), and every rank raises the same `KnapformerError` (the
rank whose check failed, its own) before any row moves. The header travels on a group
that carries CPU tensors (`knapformer.runtime.groups.BalanceGroups.host` and
``host_bag_group``), so the host never waits for the GPU's queue.

Three layouts are checked: the rows of ``route`` / ``reverse_route`` (`check_same_rows`),
the heads of ``pre_attn`` / ``post_attn`` (`check_same_heads`), and the per-sequence rows
of ``gather_sequences`` (`check_same_sequences`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from knapformer.errors import KnapformerError
from knapformer.runtime.marks import wait
from knapformer.runtime.router import Group, name_ranks

#: Every dtype torch defines, in a fixed order: a dtype travels in a header as its index.
DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))


def agree_on_layout(
    call: str,
    problem: KnapformerError | None,
    header: Sequence[int],
    group: Group,
    ranks: Sequence[int],
) -> dict[tuple[int, ...], list[int]]:
    """Collective over ``group`` (global ``ranks``, in group order; CPU tensors): every
    rank's ``header``, as ``{header: its ranks}``. Raises on every rank alike when a
    rank's own ``problem`` is set (that rank raises it, the others name it). One
    all-to-all of ``1 + len(header)`` int64 per peer."""
    mine = [0 if problem is None else 1, *(int(v) for v in header)]
    send = torch.tensor([mine] * len(ranks), dtype=torch.int64)
    got = torch.empty_like(send)
    with wait("all_to_all"):
        dist.all_to_all_single(got, send, group=group)
    table = [tuple(row) for row in got.tolist()]
    if problem is not None:
        raise problem
    failed = [rank for rank, row in zip(ranks, table, strict=True) if row[0]]
    if failed:
        raise KnapformerError(
            f"{call}: invalid input on {name_ranks(failed)} (its own error says why); "
            "nothing was sent"
        )
    layouts: dict[tuple[int, ...], list[int]] = {}
    for rank, row in zip(ranks, table, strict=True):
        layouts.setdefault(row[1:], []).append(rank)
    return layouts


def _refuse(call: str, what: str, said: str) -> KnapformerError:
    return KnapformerError(
        f"{call}: the ranks give {what} ({said}); every rank must give the same, nothing was sent"
    )


def _one_layout(call: str, layouts: dict, what: str, say) -> None:
    """Raise, on every rank alike, when the ranks gave more than one layout (``say``:
    a layout's header in words)."""
    if len(layouts) > 1:
        said = "; ".join(f"{say(layout)} on {name_ranks(who)}" for layout, who in layouts.items())
        raise _refuse(call, what, said)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


# ------------------------------------------------------------------------- rows
def check_same_rows(
    call: str,
    tensors: Sequence[torch.Tensor],
    problem: KnapformerError | None,
    group: Group,
    ranks: Sequence[int],
) -> None:
    """Before ``route`` / ``reverse_route`` (``call``): every rank's token tensor has the
    same values per row and dtype, and its features the same number, dtypes and shapes;
    ``problem``: this rank's own row check failed (``tensors`` may then be anything)."""
    header = (0, 0, 0, 0)
    if problem is None:
        x = tensors[0]
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        layout = ";".join(f"{t.dtype}:{tuple(t.shape[1:])}" for t in tensors[1:])
        header = (width, DTYPES.index(x.dtype), len(tensors) - 1, _digest(layout))
    layouts = agree_on_layout(call, problem, header, group, ranks)
    rows: dict[tuple[int, ...], list[int]] = {}
    feats: dict[tuple[int, ...], list[int]] = {}
    for (width, dtype, count, digest), who in layouts.items():
        rows.setdefault((width, dtype), []).extend(who)
        feats.setdefault((count, digest), []).extend(who)
    if len(rows) > 1:
        said = "; ".join(
            f"{w} {DTYPES[dtype]} values per token on {name_ranks(sorted(who))}"
            for (w, dtype), who in rows.items()
        )
        raise _refuse(call, "tensors of different widths or dtypes", said)
    if len(feats) > 1:
        said = "; ".join(
            f"{count} feature(s) of one layout on {name_ranks(sorted(who))}"
            for (count, _), who in feats.items()
        )
        raise _refuse(call, "features of different number, dtypes or shapes", said)


# ------------------------------------------------------------------------ heads
def check_same_heads(
    call: str, x: torch.Tensor, problem: KnapformerError | None, group: Group, ranks: Sequence[int]
) -> None:
    """Before ``pre_attn`` / ``post_attn`` (``call``) in a bag: every rank's (tokens,
    heads, head_dim) tensor has the same heads, head_dim and dtype."""
    header = (0, 0, 0) if problem is not None else (x.shape[1], x.shape[2], DTYPES.index(x.dtype))
    layouts = agree_on_layout(call, problem, header, group, ranks)
    _one_layout(call, layouts, "attention tensors of different layouts",
                lambda h: f"{h[0]} heads of head_dim {h[1]} in {DTYPES[h[2]]}")  # fmt: skip


# -------------------------------------------------------------------- sequences
def check_same_sequences(
    call: str, x: torch.Tensor, problem: KnapformerError | None, group: Group, ranks: Sequence[int]
) -> None:
    """Before ``gather_sequences`` (``call``): every rank's per-sequence tensor has the same
    values per row, dtype and trailing shape."""
    header = (0, 0, 0)
    if problem is None:
        width = int(np.prod(x.shape[1:], dtype=np.int64))
        header = (width, DTYPES.index(x.dtype), _digest(str(tuple(x.shape[1:]))))
    layouts = agree_on_layout(call, problem, header, group, ranks)
    _one_layout(call, layouts, "per-sequence tensors of different widths, dtypes or shapes",
                lambda h: f"{h[0]} {DTYPES[h[1]]} values per sequence")  # fmt: skip
