"""The all-gathers that open a step: what every rank of a balance group sends, and what
every rank decides alike from what it received.

A step's first all-gather carries each rank's `GatherHead` (which call it is in, whether
its own argument checks failed, how many sequences it holds, its ``token_dim``) followed
by its measurement row of an earlier step (`knapformer.runtime.timing`); the second, every rank's
lengths, padded to the longest. Every mistake is decided from what all ranks received
(`StepGather`), so every rank raises in the same call (a rank whose own check failed
with its own error, the others naming it) rather than some waiting in a collective for a
peer that already left. `StepRequest` holds one rank's arguments after its local checks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.limits import MAX_RANK_TOKENS, MAX_SEQUENCES, MAX_TOKEN_DIM
from knapformer.errors import KnapformerError
from knapformer.runtime.marks import wait
from knapformer.runtime.router import Group, check_rows, name_ranks
from knapformer.runtime.timing import GatheredStep

#: The checks each rank runs on its own arguments before the gather; a failure travels in
#: the head (`GatherHead.problem`) so that every rank raises, not only this one.
LOCAL_CHECKS = ("local_seq_lens", "token_dim", "packed_seqs")
#: The calls that gather a head (`GatherHead.call`): ranks in different ones all raise.
#: ``plan_routing_check``: planning ahead, `plan_routing` checking on the side group that
#: every rank was given the lengths it prefetched.
GATHERING_CALLS = ("plan_routing", "finish", "plan_routing_check")
_CALL_SAYS = {
    "plan_routing": "plan_routing()",
    "finish": "finish()",
    "plan_routing_check": "plan_routing() taking a prefetched plan",
}


@dataclass(frozen=True)
class GatherHead:
    """What every rank sends in the first all-gather of a step, as float64 (integers are
    exact below 2**53), followed by the measurement row of step ``measured_step`` (one
    float per phase of `SequenceBalancer.phases`). The one definition of the head's
    layout: a new per-rank field joins by being declared here."""

    call: int  # index in GATHERING_CALLS
    problem: int  # 0: none; else 1 + index in LOCAL_CHECKS of the check that failed
    count: int  # sequences of this rank (0 when its lengths are invalid)
    token_dim: int  # as passed (0 when not a valid integer)
    measured_step: int  # the step whose measurements follow (-1: none)

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))

    @classmethod
    def from_values(cls, values: Sequence[float]) -> GatherHead:
        return cls(*(int(v) for v in values[: cls.size()]))


@dataclass(frozen=True)
class StepRequest:
    """One rank's arguments of a step, checked locally (``problem``: the failed check of
    `LOCAL_CHECKS` and its error, raised only once every rank has heard of it)."""

    lengths: np.ndarray
    token_dim: int
    problem: tuple[str, KnapformerError] | None

    @classmethod
    def of(cls, local_seq_lens: Any, token_dim: Any, packed_seqs: Any) -> StepRequest:
        """Check ``plan_routing``'s arguments (nothing raised here)."""
        return cls(*_check_arguments(local_seq_lens, token_dim, packed_seqs))

    def differs_from_prefetched(
        self, given: StepRequest, rank: int
    ) -> tuple[str, KnapformerError] | None:
        """Whether ``given`` arguments differ from these, prefetched ones (the name in
        `LOCAL_CHECKS` of the first that does, with an error saying how): routing by a
        plan made for other lengths would be wrong."""
        wanted = self
        if given.problem is not None and (
            wanted.problem is None or wanted.problem[0] != given.problem[0]
        ):
            return given.problem  # e.g. packed_seqs given here only, with the wrong rows
        if given.token_dim != wanted.token_dim:
            return "token_dim", KnapformerError(
                f"plan_routing on rank {rank} got token_dim {given.token_dim}, but "
                f"{wanted.token_dim} was prefetched for this step"
            )
        if not np.array_equal(given.lengths, wanted.lengths):
            return "local_seq_lens", KnapformerError(
                f"plan_routing on rank {rank} got local_seq_lens {_first(given.lengths.tolist())} "
                f"({len(given.lengths)} sequences), but {_first(wanted.lengths.tolist())} "
                f"({len(wanted.lengths)}) were prefetched for this step"
            )
        return None

    def same_as(self, other: StepRequest) -> bool:
        return (
            self.token_dim == other.token_dim
            and np.array_equal(self.lengths, other.lengths)
            and (self.problem is None) == (other.problem is None)
        )


@dataclass(frozen=True)
class StepGather:
    """The gathers of one balance group: ``ranks`` in group order; ``phases``, the columns
    of the measurement rows (`SequenceBalancer.phases`). ``group`` and ``device`` are per
    call: the training group, or planning ahead the side group on the host."""

    ranks: list[int]
    phases: tuple[str, ...]

    def step(
        self,
        group: Group,
        device: torch.device,
        request: StepRequest,
        measured_step: int,
        row: list[float],
    ) -> tuple[list[np.ndarray], GatheredStep | None]:
        """`plan_routing`'s gather: all ranks' lengths, and their measurements of
        ``measured_step`` (the ``row``s): one all-gather of the `GatherHead` with the rows,
        one of the padded lengths. A rank whose ``request`` failed its own check raises its
        own error, the others one naming it."""
        lengths, problem = request.lengths, request.problem
        code = 0 if problem is None else 1 + LOCAL_CHECKS.index(problem[0])
        call = GATHERING_CALLS.index("plan_routing")
        head = GatherHead(call, code, len(lengths), request.token_dim, measured_step)
        heads, table = self._exchange_head(group, device, head, row)
        if problem is not None:
            raise problem[1]
        self._refuse_heads(heads)
        sizes = [h.count for h in heads]
        padded = torch.zeros(max(sizes), dtype=torch.int64, device=device)
        padded[: len(lengths)] = torch.from_numpy(lengths)
        gathered = [torch.empty_like(padded) for _ in sizes]
        with wait("all_gather"):
            dist.all_gather(gathered, padded, group=group)
        per_gpu = [g[:s].cpu().numpy() for g, s in zip(gathered, sizes, strict=True)]
        self._refuse_lengths(per_gpu)
        return per_gpu, self._measured(heads, table)

    def finish(
        self, group: Group, device: torch.device, measured_step: int, row: list[float] | None
    ) -> GatheredStep | None:
        """`finish`'s gather of one ended step: the head and the measurement rows only."""
        head = GatherHead(GATHERING_CALLS.index("finish"), 0, 0, 0, measured_step)
        heads, table = self._exchange_head(group, device, head, row)
        self._refuse_heads(heads)
        return self._measured(heads, table)

    def confirm(
        self,
        group: Group,
        device: torch.device,
        prefetched: StepRequest,
        given: StepRequest,
        rank: int,
    ) -> None:
        """Planning ahead, `plan_routing`'s check that every rank was given the arguments
        it prefetched: one head all-gather; every rank raises the same error naming the
        ranks whose arguments differ (those ranks with how, as a note)."""
        differs = prefetched.differs_from_prefetched(given, rank)
        code = 0 if differs is None else 1 + LOCAL_CHECKS.index(differs[0])
        call = GATHERING_CALLS.index("plan_routing_check")
        head = GatherHead(call, code, len(given.lengths), given.token_dim, -1)
        heads, _ = self._exchange_head(group, device, head, None)
        self._refuse_calls(heads)
        failed = [
            f"{LOCAL_CHECKS[h.problem - 1]} on rank {r}"
            for r, h in zip(self.ranks, heads, strict=True)
            if h.problem
        ]
        if not failed:
            return
        err = KnapformerError(
            f"plan_routing got arguments other than the prefetched ones ({'; '.join(failed)}): "
            "pass what prefetch got, in the same order, on every rank; no rank routed this "
            "step, and the prefetched plan is kept for that call"
        )
        if differs is not None:
            err.add_note(str(differs[1]))
        raise err

    def _exchange_head(
        self, group: Group, device: torch.device, head: GatherHead, row: list[float] | None
    ) -> tuple[list[GatherHead], np.ndarray]:
        """The head all-gather: every rank's head and measurement row, in group order."""
        row = [math.nan] * len(self.phases) if row is None else row
        mine = torch.tensor([*head.values(), *row], dtype=torch.float64, device=device)
        received = [torch.empty_like(mine) for _ in self.ranks]
        with wait("all_gather"):
            dist.all_gather(received, mine, group=group)
        table = torch.stack(received).cpu().numpy()
        heads = [GatherHead.from_values(values) for values in table]
        return heads, table[:, GatherHead.size() :]

    def _measured(self, heads: list[GatherHead], table: np.ndarray) -> GatheredStep | None:
        steps = {h.measured_step for h in heads}
        if len(steps) != 1 or min(steps) < 0:  # every rank sends the same step, or none
            return None
        return GatheredStep(steps.pop(), self.phases, table)

    def _refuse_calls(self, heads: list[GatherHead]) -> None:
        """Raise, on every rank alike, when ranks are in different calls."""
        calls: dict[int, list[int]] = {}
        for rank, h in zip(self.ranks, heads, strict=True):
            calls.setdefault(h.call, []).append(rank)
        if len(calls) > 1:
            said = "; ".join(
                f"{_CALL_SAYS[GATHERING_CALLS[call]]} on {name_ranks(ranks)}"
                for call, ranks in calls.items()
            )
            raise KnapformerError(
                f"the balance group's ranks are in different calls ({said}); every rank must "
                "make the same calls (plan_routing, prefetch, finish) in the same order"
            )

    def _refuse_heads(self, heads: list[GatherHead]) -> None:
        """Raise, on every rank alike, when ranks are in different calls, a peer's own
        check failed, the ranks disagree on ``token_dim``, or one passes more sequences
        than `MAX_SEQUENCES`."""
        self._refuse_calls(heads)
        failed = [
            f"{LOCAL_CHECKS[h.problem - 1]} on rank {rank}"
            for rank, h in zip(self.ranks, heads, strict=True)
            if h.problem
        ]
        if failed:
            whose = "its own error says" if len(failed) == 1 else "their own errors say"
            raise KnapformerError(
                f"invalid {'; '.join(failed)} ({whose} why); no rank of the balance group "
                "planned this step"
            )
        dims: dict[int, list[int]] = {}
        for rank, h in zip(self.ranks, heads, strict=True):
            dims.setdefault(h.token_dim, []).append(rank)
        if len(dims) > 1:
            said = "; ".join(f"{dim} on {name_ranks(ranks)}" for dim, ranks in dims.items())
            raise KnapformerError(
                f"token_dim differs across the balance group ({said}): every rank must "
                "pass the same token_dim; no rank planned this step"
            )
        for rank, h in zip(self.ranks, heads, strict=True):
            if h.count > MAX_SEQUENCES:
                raise KnapformerError(
                    f"rank {rank} passed {h.count} sequences, more than MAX_SEQUENCES "
                    f"({MAX_SEQUENCES}) per rank and step; no rank planned this step"
                )

    def _refuse_lengths(self, per_gpu: list[np.ndarray]) -> None:
        """Raise, on every rank alike, when a rank holds more than `MAX_RANK_TOKENS`
        tokens (or one sequence longer than that)."""
        for rank, lengths in zip(self.ranks, per_gpu, strict=True):
            longest = int(lengths.max()) if lengths.size else 0
            # Each length is checked first, so the sum cannot overflow int64.
            total = longest if longest > MAX_RANK_TOKENS else int(lengths.sum())
            if total > MAX_RANK_TOKENS:
                raise KnapformerError(
                    f"rank {rank} passed local_seq_lens of {total} tokens"
                    f"{' in one sequence' if total == longest and lengths.size > 1 else ''}, "
                    f"more than MAX_RANK_TOKENS ({MAX_RANK_TOKENS}) per rank; no rank "
                    "planned this step"
                )


def _check_arguments(
    local_seq_lens: Any, token_dim: Any, packed_seqs: torch.Tensor | None
) -> tuple[np.ndarray, int, tuple[str, KnapformerError] | None]:
    """This rank's lengths, its token_dim (0 if invalid) and the first check (a name of
    `LOCAL_CHECKS`) that failed, with its error; nothing raised here."""
    try:
        lengths = _as_lengths(local_seq_lens)
    except (TypeError, ValueError, OverflowError) as err:  # numpy's own errors too
        return (
            np.zeros(0, dtype=np.int64),
            0,
            ("local_seq_lens", _as_user_error(err, "local_seq_lens")),
        )
    try:
        dim = _as_token_dim(token_dim)
    except KnapformerError as err:
        return lengths, 0, ("token_dim", err)
    if packed_seqs is not None:
        try:
            check_rows("packed_seqs", packed_seqs, int(lengths.sum()), "the local_seq_lens")
        except (TypeError, ValueError) as err:
            return lengths, dim, ("packed_seqs", _as_user_error(err, "packed_seqs"))
    return lengths, dim, None


def _as_user_error(err: Exception, name: str) -> KnapformerError:
    """``err`` as the library's user error; one from numpy or torch says what it was about."""
    if isinstance(err, KnapformerError):
        return err
    text = str(err)
    return KnapformerError(text if text.startswith(name) else f"{name}: {text}")


def _as_token_dim(token_dim: Any) -> int:
    """``token_dim`` as an int in 1..MAX_TOKEN_DIM (a whole float is accepted)."""
    try:
        dim = operator.index(token_dim)
    except TypeError:
        if not (isinstance(token_dim, float) and token_dim.is_integer()):
            raise KnapformerError(
                f"token_dim must be a positive integer (the model's hidden size), got {token_dim!r}"
            ) from None
        dim = int(token_dim)
    if not 0 < dim <= MAX_TOKEN_DIM:
        raise KnapformerError(
            f"token_dim must be a positive integer up to {MAX_TOKEN_DIM}, got {dim}"
        )
    return dim


def _as_lengths(local_seq_lens: Any) -> np.ndarray:
    """This rank's lengths as a 1-D int64 array; a clear error for anything else."""
    if isinstance(local_seq_lens, torch.Tensor):
        local_seq_lens = local_seq_lens.detach().cpu().numpy()
    arr = np.asarray(local_seq_lens)
    if arr.ndim != 1:
        raise KnapformerError(
            f"local_seq_lens must be a 1-D list of lengths, got shape {arr.shape}"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "f":
        bad = arr[~np.isfinite(arr) | (np.mod(arr, 1) != 0)]
    else:
        bad = None if arr.dtype.kind in "iu" else arr
    if bad is not None and bad.size:
        raise KnapformerError(
            f"local_seq_lens must be whole numbers of tokens, got {_first(bad.tolist())}"
        )
    if arr.dtype.kind != "i" and arr.max() >= 2**63:  # would wrap around in int64
        raise KnapformerError(f"local_seq_lens include a length {arr.max()} beyond int64")
    arr = arr.astype(np.int64)
    if arr.min() < 0:
        raise KnapformerError(f"local_seq_lens include a negative length {int(arr.min())}")
    return arr


def _first(values: list, shown: int = 8) -> str:
    """The first few of many values, for a message."""
    more = len(values) - shown
    return f"{values[:shown]}" + (f" (and {more} more)" if more > 0 else "")
