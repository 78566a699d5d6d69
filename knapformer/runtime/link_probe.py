"""`LinkProber`: every few steps, time a short exchange between pairs of ranks, one pair
at a time per rank, so that the diagnosis can say whose link is slow
(`knapformer.contract.probe` describes the schedule and what a plan stores).

A probe runs up to ``rounds`` rounds of the round-robin schedule, continuing where the
previous probe stopped, so that a large group covers every pair over a few probes. Each
round starts with a barrier (a one-element all-reduce) that is not timed: a rank that
arrives late (a slow GPU, a busy host) delays nobody's timed exchange. Inside a round a
rank sends ``bytes`` to its partner and receives as many from it
(`torch.distributed.batch_isend_irecv`, which NCCL runs as one group: no deadlock). It
times that `REPEATS` times back to back and keeps the least: a rank descheduled for a
moment (a busy host) slows one of them, a slow link every one. On CUDA the stream is
synchronised around each (a probe is rare, so exact times are worth their cost).

The first time a round runs, its exchange is made once untimed first: a backend connects
a pair at its first exchange (gloo, NCCL's p2p channels), which would read as a slow
link. Every rank's times are then all-gathered, so every rank attaches the same
`LinkProbe` to its plan.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from knapformer.contract.limits import MAX_PROBE_BYTES, MAX_PROBE_ROUNDS
from knapformer.contract.probe import LinkProbe, probe_partners, probe_round_count
from knapformer.errors import KnapformerError
from knapformer.runtime.router import Group

#: Bytes each way per exchange by default: large enough to be bandwidth- rather than
#: latency-bound on a PCIe or InfiniBand link, small next to a DiT's activations.
DEFAULT_PROBE_BYTES = 8 * 2**20
#: Rounds per probe by default: every pair of an 8-GPU node in one probe.
DEFAULT_PROBE_ROUNDS = 7
#: Timed exchanges per round; the least is kept (the module doc).
REPEATS = 3


def check_probe_options(every: int, nbytes: int, rounds: int) -> None:
    """A `KnapformerError` naming the first bad option of the link probe."""
    for name, value, low, high in (
        ("link_probe_every", every, 0, None),
        ("link_probe_bytes", nbytes, 1, MAX_PROBE_BYTES),
        ("link_probe_rounds", rounds, 1, MAX_PROBE_ROUNDS),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KnapformerError(f"{name} must be a whole number >= {low}, got {value!r}")
        if high is not None and value > high:
            raise KnapformerError(f"{name} must be at most {high:,}, got {value:,}")


class LinkProber:
    """The probe of one balance group (``ranks``, this rank at ``position``); collective:
    every rank of the group constructs it and calls `probe` at the same steps."""

    def __init__(
        self,
        group: Group,
        ranks: list[int],
        device: torch.device,
        every: int,
        nbytes: int = DEFAULT_PROBE_BYTES,
        rounds: int = DEFAULT_PROBE_ROUNDS,
    ) -> None:
        check_probe_options(every, nbytes, rounds)
        self.group, self.ranks, self.device = group, list(ranks), device
        self.position = self.ranks.index(dist.get_rank())
        self.every = every
        self.total_rounds = probe_round_count(len(self.ranks))
        self.rounds_per_probe = min(rounds, self.total_rounds)
        self._next_round = 0
        self._warm: set[int] = set()  # rounds whose pairs have exchanged once
        self.node = _host_indices(group, len(self.ranks)) if self.enabled else []
        # float32 so that NCCL, gloo and every device move it; its size is what counts.
        count = max(nbytes // 4, 1)
        self._send = torch.ones(count, dtype=torch.float32, device=device) if self.enabled else None
        self._recv = torch.empty_like(self._send) if self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.total_rounds > 0

    def due(self, step: int) -> bool:
        """Whether the plan of ``step`` carries a probe."""
        return self.enabled and step % self.every == 0

    def probe(self) -> LinkProbe:
        """Run this probe's rounds (collective over the group) and return every rank's
        times, the same on every rank."""
        rounds = [(self._next_round + k) % self.total_rounds for k in range(self.rounds_per_probe)]
        self._next_round = (rounds[-1] + 1) % self.total_rounds
        mine = torch.tensor([self._round(r) for r in rounds], dtype=torch.float64)
        # float64 on the group's device: NCCL gathers CUDA tensors only
        mine = mine.to(self.device)
        on_device = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(on_device, mine, group=self.group)
        table = torch.stack([g.cpu() for g in on_device], dim=1)  # (rounds, gpus)
        return LinkProbe(
            bytes=self._send.numel() * 4,
            rounds=rounds,
            ms=table.tolist(),
            node=self.node,
        )

    def _round(self, round_index: int) -> float:
        """Exchange with this round's partner; ms it took (0.0 when idle). Every rank of
        the group calls it, partner or not, for the barrier."""
        _barrier(self.group, self.device)
        partner = int(probe_partners(len(self.ranks), round_index)[self.position])
        peer = self.ranks[partner] if partner >= 0 else None
        if round_index not in self._warm:  # every rank, idle or not: the barrier is collective
            if peer is not None:
                self._exchange(peer)
            _barrier(self.group, self.device)
            self._warm.add(round_index)
        if peer is None:
            return 0.0
        least = float("inf")
        for _ in range(REPEATS):
            self._sync()
            began = time.perf_counter()
            self._exchange(peer)
            self._sync()
            least = min(least, (time.perf_counter() - began) * 1e3)
        return least

    def _exchange(self, peer: int) -> None:
        ops = [
            dist.P2POp(dist.isend, self._send, peer, self.group),
            dist.P2POp(dist.irecv, self._recv, peer, self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _barrier(group: Group, device: torch.device) -> None:
    """Every rank of ``group`` is here: a one-element all-reduce (NCCL's barrier would
    need to be told the device)."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def _host_indices(group: Group, size: int) -> list[int]:
    """(size,) per position of the group: the index of its host among the group's hosts,
    in order of first appearance (ranks on one host share one)."""
    names: list[str | None] = [None] * size
    dist.all_gather_object(names, socket.gethostname(), group=group)
    first: dict[str, int] = {}
    return [first.setdefault(str(name), len(first)) for name in names]
