"""`SequenceBalancer`: plan every step, then move tokens to where the plan says.

Typical step (see ``knapformer/local/models.py`` for a model that does this)::

    plan = balancer.plan_routing(local_seq_lens, d, packed_seqs=packed)  # 2 all-gathers
    chunk_lens, x, feats = balancer.route(packed, {"pos": positions})   # 1 all-to-all
    ...  # per layer: q, k, v of the chunks (tokens, heads, head_dim)
    seq_lens, q, k, v = balancer.pre_attn(q, k, v)   # Ulysses inside the bag
    out = attention(q, k, v, seq_lens)                # whole sequences, heads/g heads
    chunk_lens, out = balancer.post_attn(out)
    ...
    seq_lens, y, _ = balancer.reverse_route(x)        # 1 all-to-all; rows as `packed`

Works on the backend of the process group: NCCL with CUDA tensors, gloo with CPU
tensors. ``plan_routing`` checks its arguments collectively: a mistake on one rank (or
ranks disagreeing on ``token_dim``) makes every rank raise in that call, never some wait
in a collective for a peer that already left. Balance groups are consecutive ranks; a
world of k x (topology GPUs) ranks holds k replicas, each balanced on its own.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import astuple, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.errors import KnapformerError
from knapformer.plan import RoutingPlan
from knapformer.planner import SOLVERS, plan_routing
from knapformer.router import (
    Features,
    Group,
    RoutingTables,
    check_rows,
    exchange,
    flatten_features,
    unflatten_features,
)
from knapformer.topology import Topology, as_topology
from knapformer.workload import WorkloadModel

#: Most tokens one rank may hold before routing (its ``local_seq_lens`` summed): 2**24 is
#: ~100 GB of bf16 activations at d = 3072 for the input alone, beyond any GPU. Bigger
#: figures are mistakes, and would fail some ranks (allocating routing tables) and not
#: others; checked on the gathered lengths, so every rank refuses them alike.
GPU_TOKEN_LIMIT = 2**24
#: Most sequences one rank may pass in one step (every rank allocates the gathered table).
GPU_SEQUENCE_LIMIT = 2**20
#: Largest ``token_dim`` accepted (far beyond any model's hidden size; exact in the head).
TOKEN_DIM_LIMIT = 2**24

#: The checks each rank runs on its own arguments before the gather; a failure travels in
#: the head (`GatherHead.problem`) so that every rank raises, not only this one.
LOCAL_CHECKS = ("local_seq_lens", "token_dim", "packed_seqs")


@dataclass(frozen=True)
class GatherHead:
    """What every rank sends in the first all-gather of a step, as float64 (integers are
    exact below 2**53), followed by the recorder's timing row. The one definition of the
    head's layout: a new per-rank field joins by being declared here."""

    problem: int  # 0: none; else 1 + index in LOCAL_CHECKS of the check that failed
    count: int  # sequences of this rank (0 when its lengths are invalid)
    token_dim: int  # as passed (0 when not a valid integer)

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))

    @classmethod
    def from_values(cls, values: list[float]) -> GatherHead:
        return cls(*(int(v) for v in values[: cls.size()]))


class SequenceBalancer:
    """Balances packed sequences across the GPUs of a balance group.

    Args:
        topology: compute bags, e.g. ``"g1n2+g2n1+g4n1"`` (or a `Topology`).
        gamma: attention weight of the workload model.
        solver: ``"knapformer"`` (default) or ``"greedy"``.
        process_group: the group to balance (default: WORLD). Sub-groups are created with
            ``torch.distributed.new_group``, so every rank of the default group must
            construct the balancer at the same point.
        max_tokens_per_gpu: optional hard cap on tokens per GPU after routing.
        recorder: optional object with ``on_step(balancer, plan)`` and ``close()``
            (e.g. ``knapformer.PlanRecorder``), called on every rank of the group. If it
            has ``timing_row(timings) -> list[float]`` (the same length on every rank),
            each rank's row of the previous step's timings is sent with the length
            all-gather and every rank's row is in ``previous_timing_rows``.
        run: run name stored in every plan.
    """

    def __init__(
        self,
        topology: Topology | str,
        gamma: float = 0.4,
        solver: str = "knapformer",
        process_group: Group = None,
        max_tokens_per_gpu: int | None = None,
        recorder: Any = None,
        run: str | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "SequenceBalancer needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first"
            )
        self.topology = as_topology(topology)
        if solver not in SOLVERS:
            raise KnapformerError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
        WorkloadModel(1, gamma)  # validates gamma now rather than at the first step
        if max_tokens_per_gpu is not None and max_tokens_per_gpu <= 0:
            raise KnapformerError(f"max_tokens_per_gpu must be positive, got {max_tokens_per_gpu}")
        self.gamma = float(gamma)
        self.solver = solver
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.recorder = recorder
        self.run = run

        self.rank: int = dist.get_rank()
        if process_group is None or process_group == dist.group.WORLD:
            parent_ranks = list(range(dist.get_world_size()))
        else:
            parent_ranks = dist.get_process_group_ranks(process_group)
        n = self.topology.num_gpus
        try:
            replicas = self.topology.num_replicas(len(parent_ranks))
        except ValueError as err:
            raise KnapformerError(f"{err} (process group of {len(parent_ranks)} ranks)") from None
        balance_groups = [parent_ranks[i * n : (i + 1) * n] for i in range(replicas)]
        self.group_ranks: list[int] = next(g for g in balance_groups if self.rank in g)
        self.num_replicas = replicas

        # torch.distributed requires every rank to create every sub-group, in one order.
        # The groups this rank belongs to that we created; close() destroys them (new_group
        # hands non-members a placeholder that owns nothing).
        self._own_groups: list[dist.ProcessGroup] = []
        self.group: Group = process_group
        if replicas > 1:
            for ranks in balance_groups:
                created = dist.new_group(ranks)
                if self.rank in ranks:
                    self.group = created
                    self._own_groups.append(created)
        self._bag_group: Group = None
        for ranks in balance_groups:
            for bag in self.topology.bags(ranks):
                if len(bag) > 1:
                    created = dist.new_group(bag)
                    if self.rank in bag:
                        self._bag_group = created
                        self._own_groups.append(created)
        self.my_bag: list[int] = next(
            b for b in self.topology.bags(self.group_ranks) if self.rank in b
        )

        backend = str(dist.get_backend(self.group))
        # NCCL moves CUDA tensors only; everything else here runs on the CPU.
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

        self.step: int = -1  # -1 until the first plan_routing
        self.last_plan: RoutingPlan | None = None
        self.tables: RoutingTables | None = None
        self.previous_timings: dict[str, float] = {}
        # Every rank's recorder row of the previous step (group order), when recording.
        self.previous_timing_rows: list[list[float]] | None = None
        self._timings: dict[str, float] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA events, resolved lazily
        self._last_start: float | None = None
        self._closed = False

    # ---------------------------------------------------------------- timings
    @property
    def timings(self) -> dict[str, float]:
        """This rank's ms per phase for the current step (summed over calls)."""
        for phase, start, end in self._pending:
            end.synchronize()
            self._timings[phase] = self._timings.get(phase, 0.0) + start.elapsed_time(end)
        self._pending.clear()
        return self._timings

    def add_timing(self, phase: str, ms: float) -> None:
        """Add a user-measured phase (e.g. ``"forward_backward"``; `knapformer.plan` names
        the phases recorded by default) to this step's timings."""
        self._timings[phase] = self._timings.get(phase, 0.0) + float(ms)

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        # On CUDA the work is asynchronous: time it with events, read them later.
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((phase, start, end))
        else:
            began = time.perf_counter()
            yield
            self.add_timing(phase, (time.perf_counter() - began) * 1e3)

    # --------------------------------------------------------------- planning
    def plan_routing(
        self, local_seq_lens: Any, token_dim: int, packed_seqs: torch.Tensor | None = None
    ) -> RoutingPlan:
        """Plan this step from every rank's sequence lengths; collective over the group.

        ``local_seq_lens``: this rank's sequence lengths (list, numpy array or tensor), in
        the order the sequences are packed. ``token_dim``: the model's hidden size, the
        same on every rank. ``packed_seqs`` (optional): the ``(T_local, ...)`` tensor this
        rank will `route`; passing it checks its rows here, where a mismatch on one rank
        makes every rank raise (in `route` the others would wait in the all-to-all).
        Returns the plan (also ``self.last_plan``); ``plan.measurements.plan_ms`` is this
        rank's time for the whole call.

        Every check is collective: bad arguments on one rank (lengths, ``token_dim``,
        ``packed_seqs``), ranks disagreeing on ``token_dim``, or lengths beyond
        `GPU_TOKEN_LIMIT` / `GPU_SEQUENCE_LIMIT` make every rank of the group raise
        `KnapformerError` in this call, and none plans the step.
        """
        self._require_open()
        started, wall = time.perf_counter(), time.time()
        # Errors are raised after the gather, so no peer is left waiting in it.
        lengths, dim, problem = _check_arguments(local_seq_lens, token_dim, packed_seqs)
        previous = dict(self.timings)
        if self._last_start is not None:
            previous["step"] = (started - self._last_start) * 1e3
        # The recorder's per-rank times of the previous step ride along with the lengths:
        # recording then adds no collective of its own.
        timing_row = getattr(self.recorder, "timing_row", None)
        row = [] if timing_row is None else timing_row(previous)
        per_gpu, rows = self._gather_lengths(lengths, dim, problem, row)
        plan = plan_routing(
            per_gpu,
            self.topology,
            WorkloadModel(dim, self.gamma),
            solver=self.solver,
            max_tokens_per_gpu=self.max_tokens_per_gpu,
            gpus=self.group_ranks,
            step=self.step + 1,
            run=self.run,
        )
        self.use_plan(plan)
        elapsed = (time.perf_counter() - started) * 1e3
        plan.time = wall
        plan.measurements.plan_ms = elapsed  # the planner's own time plus the gather

        self.previous_timings = previous
        self.previous_timing_rows = rows if row else None
        self._timings = {"plan": elapsed}
        self._last_start = started
        self.step += 1
        if self.recorder is not None:
            # Timed on the host whatever the device: the hook's cost is what training
            # pays for recording, and it is recorded with the step like any phase.
            began = time.perf_counter()
            self.recorder.on_step(self, plan)
            self.add_timing("record", (time.perf_counter() - began) * 1e3)
        return plan

    def use_plan(self, plan: RoutingPlan) -> None:
        """Route the following calls by ``plan`` (what `plan_routing` does with the plan it
        makes). Local: every rank of the group must be given the same plan, whose GPUs are
        the group's ranks. Replay uses it to execute a recorded plan."""
        self._require_open()
        self.tables = RoutingTables.build(plan, self.rank, self.device, self._bag_group)
        self.last_plan = plan

    def _gather_lengths(
        self,
        lengths: np.ndarray,
        token_dim: int,
        problem: tuple[str, KnapformerError] | None,
        row: list[float],
    ) -> tuple[list[np.ndarray], list[list[float]]]:
        """All ranks' lengths and ``row`` (the recorder's timings, the same size on every
        rank): one all-gather of the `GatherHead` with the rows, one of the padded lengths.

        Everything that can go wrong is decided from what every rank received, so every
        rank raises in the same call (a rank with a ``problem`` its own error, the others
        naming it) rather than some waiting in a collective for a peer that left.
        """
        n = len(self.group_ranks)
        code = 0 if problem is None else 1 + LOCAL_CHECKS.index(problem[0])
        head = GatherHead(code, len(lengths), token_dim)
        mine = torch.tensor([*head.values(), *row], dtype=torch.float64, device=self.device)
        received = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(received, mine, group=self.group)
        table = torch.stack(received).cpu().tolist()
        heads = [GatherHead.from_values(values) for values in table]
        rows = [values[GatherHead.size() :] for values in table]
        if problem is not None:
            raise problem[1]
        self._refuse_heads(heads)
        sizes = [h.count for h in heads]
        padded = torch.zeros(max(sizes), dtype=torch.int64, device=self.device)
        padded[: len(lengths)] = torch.from_numpy(lengths)
        gathered = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(gathered, padded, group=self.group)
        per_gpu = [g[:s].cpu().numpy() for g, s in zip(gathered, sizes, strict=True)]
        self._refuse_lengths(per_gpu)
        return per_gpu, rows

    def _refuse_heads(self, heads: list[GatherHead]) -> None:
        """Raise, on every rank alike, when a peer's own check failed, the ranks disagree
        on ``token_dim``, or one passes more sequences than `GPU_SEQUENCE_LIMIT`."""
        failed = [
            f"{LOCAL_CHECKS[h.problem - 1]} on rank {rank}"
            for rank, h in zip(self.group_ranks, heads, strict=True)
            if h.problem
        ]
        if failed:
            whose = "its own error says" if len(failed) == 1 else "their own errors say"
            raise KnapformerError(
                f"invalid {'; '.join(failed)} ({whose} why); no rank of the balance group "
                "planned this step"
            )
        dims: dict[int, list[int]] = {}
        for rank, h in zip(self.group_ranks, heads, strict=True):
            dims.setdefault(h.token_dim, []).append(rank)
        if len(dims) > 1:
            said = "; ".join(f"{dim} on {_ranks(ranks)}" for dim, ranks in dims.items())
            raise KnapformerError(
                f"token_dim differs across the balance group ({said}): every rank must "
                "pass the same token_dim; no rank planned this step"
            )
        for rank, h in zip(self.group_ranks, heads, strict=True):
            if h.count > GPU_SEQUENCE_LIMIT:
                raise KnapformerError(
                    f"rank {rank} passed {h.count} sequences, more than GPU_SEQUENCE_LIMIT "
                    f"({GPU_SEQUENCE_LIMIT}) per rank and step; no rank planned this step"
                )

    def _refuse_lengths(self, per_gpu: list[np.ndarray]) -> None:
        """Raise, on every rank alike, when a rank holds more than `GPU_TOKEN_LIMIT`
        tokens (or one sequence longer than that)."""
        for rank, lengths in zip(self.group_ranks, per_gpu, strict=True):
            longest = int(lengths.max()) if lengths.size else 0
            # Each length is checked first, so the sum cannot overflow int64.
            total = longest if longest > GPU_TOKEN_LIMIT else int(lengths.sum())
            if total > GPU_TOKEN_LIMIT:
                raise KnapformerError(
                    f"rank {rank} passed local_seq_lens of {total} tokens"
                    f"{' in one sequence' if total == longest and lengths.size > 1 else ''}, "
                    f"more than GPU_TOKEN_LIMIT ({GPU_TOKEN_LIMIT}) per rank; no rank "
                    "planned this step"
                )

    def _require_open(self) -> None:
        if self._closed:  # its sub-groups are destroyed
            raise RuntimeError("this SequenceBalancer is closed; create a new one")

    def _require_tables(self) -> RoutingTables:
        self._require_open()
        if self.tables is None:
            raise RuntimeError("call plan_routing(...) before routing tokens")
        return self.tables

    # ---------------------------------------------------------------- routing
    def route(
        self, packed_seqs: torch.Tensor, features: Features = None
    ) -> tuple[list[int], torch.Tensor, Features]:
        """Send every chunk to its GPU: one all-to-all for the tokens and all features.

        ``packed_seqs``: ``(T_local, ...)``, this rank's sequences concatenated in the
        order of ``local_seq_lens``. ``features``: a tensor or dict/list of tensors with
        first dim ``T_local`` (any dtype; integers arrive bit-exact).
        Returns ``(chunk_lens, seqs (T_chunks, ...), features)``: the chunks this rank now
        holds, ordered by sequence id then chunk index.
        """
        t = self._require_tables()
        with self._timed("route"):
            tensors = self._inputs(packed_seqs, features, t.num_local, "packed_seqs", "local")
            outs = exchange(tensors, t.send_splits, t.recv_splits, self.group, t.send_index)
        return list(t.chunk_lens), outs[0], unflatten_features(features, outs[1:])

    def reverse_route(
        self, seqs: torch.Tensor, features: Features = None
    ) -> tuple[list[int], torch.Tensor, Features]:
        """Send chunks home: the inverse of `route` (rows back in the packed order).

        ``seqs``: ``(T_chunks, ...)``. Returns ``(local_seq_lens, seqs (T_local, ...),
        features)``.
        """
        t = self._require_tables()
        with self._timed("reverse_route"):
            tensors = self._inputs(seqs, features, t.num_chunk_tokens, "seqs", "chunks")
            outs = exchange(
                tensors, t.recv_splits, t.send_splits, self.group, post_index=t.restore_index
            )
        return list(t.local_lens), outs[0], unflatten_features(features, outs[1:])

    def _inputs(self, x, features, rows: int, name: str, where: str) -> list[torch.Tensor]:
        what = (
            "the sequence lengths given to plan_routing"
            if where == "local"
            else "the chunks routed to this rank"
        )
        check_rows(name, x, rows, what)
        flat = flatten_features(features)
        for i, f in enumerate(flat):
            key = list(features)[i] if isinstance(features, dict) else i
            check_rows(f"feature {key!r}", f, rows, what)
        return [x, *flat]

    # -------------------------------------------------------------- attention
    def pre_attn(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ulysses: trade chunks of all heads for whole sequences of H/g heads.

        ``q, k, v``: ``(T_chunks, H, D)`` from the routed tokens. In a bag of g > 1 GPUs
        returns ``(seq_lens, q, k, v)`` with ``(T_bag, H/g, D)``: the bag's whole
        sequences (lengths ``seq_lens``, what a varlen attention kernel needs) and this
        GPU's share of the heads. A single-GPU bag returns its inputs unchanged.
        """
        t = self._require_tables()
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise KnapformerError(
                    f"{name} must have shape (tokens, heads, head_dim), got {shape}"
                )
            check_rows(name, x, t.num_chunk_tokens, "the chunks routed to this rank")
        if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
            raise KnapformerError(
                f"q, k, v must share shape and dtype, got {tuple(q.shape)}/{q.dtype}, "
                f"{tuple(k.shape)}/{k.dtype}, {tuple(v.shape)}/{v.dtype}"
            )
        heads = q.shape[1]
        # Checked against every bag size so that all ranks fail together, not hang.
        bad = [g for g in set(self.topology.bag_sizes) if heads % g]
        if bad:
            raise KnapformerError(
                f"{heads} attention heads cannot be split evenly across bags of "
                f"{max(bad)} GPUs (topology {self.topology}); use a head count divisible "
                f"by every bag size"
            )
        bag = t.bag
        if bag is None:
            return list(t.chunk_lens), q, k, v
        with self._timed("pre_attn"):
            rows, g, dh = q.shape[0], bag.size, q.shape[2]
            x = torch.stack([q, k, v], dim=1).reshape(rows, 3, g, heads // g, dh)
            x = x.permute(2, 0, 1, 3, 4).reshape(g * rows, 3, heads // g, dh)
            (y,) = exchange(
                [x], [rows] * g, bag.tokens_per_gpu, bag.group, post_index=bag.to_sequences
            )
            q2, k2, v2 = y.unbind(dim=1)
        return list(bag.seq_lens), q2, k2, v2

    def post_attn(self, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Inverse of `pre_attn` for the attention output.

        ``out``: ``(T_bag, H/g, D)`` in the layout `pre_attn` returned. Returns
        ``(chunk_lens, out (T_chunks, H, D))``.
        """
        t = self._require_tables()
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise KnapformerError(f"out must have shape (tokens, heads, head_dim), got {shape}")
        bag = t.bag
        if bag is None:
            check_rows("out", out, t.num_chunk_tokens, "the chunks routed to this rank")
            return list(t.chunk_lens), out
        check_rows("out", out, sum(bag.seq_lens), "the bag sequences from pre_attn")
        with self._timed("post_attn"):
            rows, g = t.num_chunk_tokens, bag.size
            (y,) = exchange(
                [out], bag.tokens_per_gpu, [rows] * g, bag.group, pre_index=bag.from_sequences
            )
            y = y.reshape(g, rows, *out.shape[1:]).permute(1, 0, 2, 3)
            y = y.reshape(rows, g * out.shape[1], out.shape[2])
        return list(t.chunk_lens), y

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the recorder, if any, then destroy the sub-groups this balancer created
        (idempotent). The balancer cannot route after this; the parent group is untouched.
        """
        if self._closed:
            return
        self._closed = True
        if self.recorder is not None:
            self.recorder.close()  # first: closing may still talk over the balance group
        groups, self._own_groups = self._own_groups, []
        for group in groups:
            # Skip what is already gone: destroying WORLD (e.g. at shutdown, before close)
            # destroys every group, and destroying one twice raises.
            if not dist.is_initialized():
                break
            with suppress(ValueError):
                dist.destroy_process_group(group)

    def __enter__(self) -> SequenceBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """``token_dim`` as an int in 1..TOKEN_DIM_LIMIT (a whole float is accepted)."""
    try:
        dim = operator.index(token_dim)
    except TypeError:
        if not (isinstance(token_dim, float) and token_dim.is_integer()):
            raise KnapformerError(
                f"token_dim must be a positive integer (the model's hidden size), got {token_dim!r}"
            ) from None
        dim = int(token_dim)
    if not 0 < dim <= TOKEN_DIM_LIMIT:
        raise KnapformerError(
            f"token_dim must be a positive integer up to {TOKEN_DIM_LIMIT}, got {dim}"
        )
    return dim


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


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
