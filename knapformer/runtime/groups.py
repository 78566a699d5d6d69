"""The process groups a `SequenceBalancer` balances over: which ranks form each balance
group (replica) and each compute bag, the sub-groups made for them, and their teardown.

`BalanceLayout` is the plain arithmetic (no torch.distributed): it validates itself when
it is made, so a layout that cannot exist cannot be constructed, and every derived value
(replicas, this rank's balance group and bag) is a property, not an expression repeated
at call sites. `BalanceGroups` creates the sub-groups of a layout once, at construction
(``torch.distributed.new_group`` is collective over the default group: every rank
creates every group, in one order), with the parent group's timeout, and destroys them
in the reverse order.

Bag groups are held in a map keyed by the bag's ranks (`BalanceGroups.bag_group`): every
bag group a step may use is created here, up front, and a step looks its bags up, so
nothing is created on the hot path. A fixed topology has one partition, its bags;
``topology="auto"`` (`knapformer.planning.partitions`) lets each step choose a partition
into aligned groups of the allowed sizes, so every aligned group of every allowed size is
created (about twice the balance group's GPU count; a rank belongs to one group of each
size, `BalanceLayout.communicators` counts them).

What a group costs: on NCCL each communicator holds its own buffers on the GPU. A bag
whose ranks are the balance group's uses the balance group itself (no new group), and
``KNAPFORMER_SHARE_COMMUNICATORS=1`` makes NCCL groups with the option that lets a split
communicator share its parent's resources (`share_options`), which torch uses when it
splits groups from the default group (it does when the default group is bound to a
device: ``init_process_group(..., device_id=...)``). It is off by default: communicators
that share resources share NCCL's internal buffers, which has not been run on GPUs
beside other groups' concurrent collectives (FSDP's), and NCCL's process-wide fallback
switch would reach the user's own groups too.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.partitions import aligned_groups
from knapformer.runtime.router import Group

#: Timeout of a group whose backend does not say (torch's own default for new groups).
_FALLBACK_TIMEOUT = datetime.timedelta(minutes=30)
#: ``1`` turns on resource sharing between the balancer's NCCL communicators (off by default).
SHARE_ENV = "KNAPFORMER_SHARE_COMMUNICATORS"
#: NCCL's own switch, read when a communicator is split: the fallback where torch does
#: not expose the per-communicator ``split_share`` option.
_NCCL_SHARE_ENV = "NCCL_COMM_SPLIT_SHARE_RESOURCES"


@dataclass(frozen=True)
class Communicators:
    """The device communicators (NCCL, on GPUs) a rank holds for a balancer beyond its
    parent group: ``balance`` its balance group's own (1 when the parent holds several
    replicas), ``bags`` its bag groups of more than one GPU, ``reused`` the bags whose
    ranks are the balance group's, which use that group instead of a new one."""

    balance: int
    bags: int
    reused: int

    @property
    def total(self) -> int:
        return self.balance + self.bags

    @property
    def without_reuse(self) -> int:
        """What the rank would hold if every bag had a group of its own."""
        return self.total + self.reused

    @property
    def host_twins(self) -> int:
        """Gloo groups (host memory only) beside them on a parent group without gloo: the
        balance group's twin and one per bag group, for the layout checks."""
        return 1 + self.bags


@dataclass(frozen=True)
class BalanceLayout:
    """Which ranks balance together: ``parent_ranks`` (the process group's ranks, in
    order) cut into replicas of ``topology``; ``rank``: this process's global rank.

    ``topology=None`` is ``topology="auto"``: one balance group of every parent rank, whose
    steps may use any aligned group of ``group_sizes`` (the allowed sizes, as
    `knapformer.planning.partitions.allowed_sizes` gives them)."""

    topology: Topology | None
    parent_ranks: tuple[int, ...]
    rank: int
    group_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self._validate()

    @property
    def auto(self) -> bool:
        return self.topology is None

    def _validate(self) -> None:
        world = len(self.parent_ranks)
        if len(set(self.parent_ranks)) != world:
            raise KnapformerError(f"process group ranks {list(self.parent_ranks)} repeat a rank")
        if self.auto:
            sizes = self.group_sizes
            if world == 0 or not sizes or any(world % g for g in sizes if g <= world):
                raise KnapformerError(
                    f"topology 'auto' on {world} ranks: group sizes {list(sizes)} must be "
                    "given and divide the rank count"
                )
            n = world
        else:
            n = self.topology.num_gpus
        if world == 0 or world % n:
            replicas = world // n
            raise KnapformerError(
                f"world size {world} does not fit topology {self.topology}: it needs a "
                f"multiple of {n} ranks (replicas({replicas}) * topology gpus({n}) = "
                f"{replicas * n} != world_size({world}))"
            )
        if self.rank not in self.parent_ranks:
            raise KnapformerError(
                f"rank {self.rank} is not in the process group's ranks {list(self.parent_ranks)}"
            )

    @property
    def gpus_per_replica(self) -> int:
        return len(self.parent_ranks) if self.topology is None else self.topology.num_gpus

    @property
    def num_replicas(self) -> int:
        return len(self.parent_ranks) // self.gpus_per_replica

    @property
    def replicated(self) -> bool:
        """Whether the parent group holds several balance groups (each gets a sub-group)."""
        return self.num_replicas > 1

    @cached_property
    def replicas(self) -> list[list[int]]:
        """Ranks of every balance group: consecutive ranks of the parent group."""
        n = self.gpus_per_replica
        return [list(self.parent_ranks[i * n : (i + 1) * n]) for i in range(self.num_replicas)]

    @cached_property
    def group_ranks(self) -> list[int]:
        """Ranks of this rank's balance group."""
        return self.replica_of(self.rank)

    @cached_property
    def bags(self) -> list[list[int]]:
        """Every bag a step of any replica may use: a fixed topology's bags, or under
        ``auto`` every aligned group of every allowed size (smallest sizes first)."""
        if self.topology is not None:
            return [bag for ranks in self.replicas for bag in self.topology.bags(ranks)]
        return [
            [ranks[p] for p in group]
            for ranks in self.replicas
            for group in aligned_groups(len(ranks), self.group_sizes)
        ]

    @cached_property
    def bag_sizes(self) -> tuple[int, ...]:
        """The sizes a bag of a step may have, ascending (what heads must divide)."""
        if self.topology is None:
            return tuple(sorted(self.group_sizes))
        return tuple(sorted(set(self.topology.bag_sizes)))

    @cached_property
    def _bags_of(self) -> dict[int, list[list[int]]]:
        """The bags each rank belongs to (auto: one of each allowed size)."""
        out: dict[int, list[list[int]]] = {}
        for bag in self.bags:
            for rank in bag:
                out.setdefault(rank, []).append(bag)
        return out

    @cached_property
    def _replica_of(self) -> dict[int, int]:
        return {rank: i for i, ranks in enumerate(self.replicas) for rank in ranks}

    def replica_of(self, rank: int) -> list[int]:
        """Ranks of the balance group ``rank`` belongs to."""
        return self.replicas[self._replica_of[rank]]

    def reuses(self, bag: list[int]) -> bool:
        """Whether ``bag`` spans its whole balance group, so that it uses that group."""
        return len(bag) > 1 and bag == self.replica_of(bag[0])

    def communicators(self, rank: int | None = None) -> Communicators:
        """The device communicators ``rank`` (default: this rank) holds (see
        `Communicators`); every bag a step may use counts, as they are all made up front."""
        rank = self.rank if rank is None else rank
        mine = [b for b in self._bags_of.get(rank, []) if len(b) > 1]
        reused = sum(self.reuses(b) for b in mine)
        return Communicators(int(self.replicated), len(mine) - reused, reused)

    @cached_property
    def my_bag(self) -> list[int]:
        """This rank's bag under a fixed topology (under ``auto`` each step's plan says)."""
        if self.topology is None:
            raise KnapformerError(
                "topology 'auto' chooses every rank's bag each step; read it from the plan"
            )
        return next(b for b in self.bags if self.rank in b)


@dataclass(eq=False)
class BalanceGroups:
    """The sub-groups of one `BalanceLayout`, made by `create` (collective over the
    default group). ``group``: the balance group to run the step's collectives on (the
    parent group itself when it holds one replica); ``side``: the plan-ahead thread's gloo
    group over the balance group's ranks, or None; ``host``: the group that checks the
    routed rows' layout (`knapformer.runtime.layouts`) with CPU tensors: ``group`` itself
    when its backend has gloo, else a gloo group over the same ranks, so that the check
    never makes the host wait for the GPU (`host_bag_group` is the same for a bag's
    Ulysses exchanges); ``timeout``: the parent group's, given to every group and wait of
    the balancer."""

    layout: BalanceLayout
    parent: Group
    timeout: datetime.timedelta
    group: Group = None
    side: Group = None
    host: Group = None
    _bag_groups: dict[tuple[int, ...], Group] = field(default_factory=dict)
    _host_bags: dict[tuple[int, ...], Group] = field(default_factory=dict)
    _owned: list[dist.ProcessGroup] = field(default_factory=list)  # creation order

    @classmethod
    def create(
        cls, layout: BalanceLayout, parent: Group = None, plan_ahead: bool = False
    ) -> BalanceGroups:
        """Create every sub-group ``layout`` needs: balance groups (when replicated), gloo
        host groups (when ``parent`` carries no CPU tensors), the bag groups of bags of
        more than one GPU, and with ``plan_ahead`` the side groups."""
        groups = cls(layout, parent, group_timeout(parent), group=parent)
        if layout.replicated:
            for ranks in layout.replicas:
                made = groups._new(ranks)
                if made is not None:
                    groups.group = made
        groups.host = groups.group
        if not carries_cpu(parent):
            # Reading an NCCL check's answer would wait for every kernel queued before it.
            for ranks in layout.replicas:
                made = groups._new(ranks, backend="gloo")
                if made is not None:
                    groups.host = made
        balance = dist.group.WORLD if groups.group is None else groups.group
        groups._bag_groups = groups._make_bags(None, balance)
        if not carries_cpu(parent):  # the bags' layout checks, on the host
            groups._host_bags = groups._make_bags("gloo", groups.host)
        if plan_ahead:
            # A gloo group on the host, never the training group, so that the plan-ahead
            # thread's collectives cannot interleave with the training thread's.
            for ranks in layout.replicas:
                made = groups._new(ranks, backend="gloo")
                if made is not None:
                    groups.side = made
        return groups

    def _make_bags(self, backend: str | None, balance: Group) -> dict[tuple[int, ...], Group]:
        """The groups of this rank's bags of more than one GPU, by their ranks: ``balance``
        (the balance group on ``backend``) for a bag that spans it, else a new group (made
        by every rank, for every bag, in one order)."""
        made: dict[tuple[int, ...], Group] = {}
        for bag in self.layout.bags:
            if len(bag) == 1 or (self.layout.reuses(bag) and self.rank not in bag):
                continue
            group = balance if self.layout.reuses(bag) else self._new(bag, backend=backend)
            if group is not None:
                made[tuple(bag)] = group
        return made

    def _new(self, ranks: list[int], backend: str | None = None) -> dist.ProcessGroup | None:
        """A sub-group over ``ranks`` (every rank must call this, in the same order);
        returned to its members only (non-members get a placeholder that owns nothing).
        On NCCL it shares its parent's resources where torch and NCCL allow it."""
        # backend None: the default group's
        options = share_options(backend or str(dist.get_backend()), self.timeout)
        made = dist.new_group(ranks, timeout=self.timeout, backend=backend, pg_options=options)
        if self.layout.rank not in ranks:
            return None
        self._owned.append(made)
        return made

    # ------------------------------------------------------------------ lookups
    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def group_ranks(self) -> list[int]:
        return self.layout.group_ranks

    @property
    def my_bag(self) -> list[int]:
        return self.layout.my_bag

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def bag_group(self, ranks: list[int] | tuple[int, ...]) -> Group:
        """The sub-group of the bag over ``ranks`` (None for a single GPU, which needs
        none); a `KnapformerError` for a bag that was not created up front."""
        key = tuple(int(r) for r in ranks)
        if len(key) == 1:
            return None
        try:
            return self._bag_groups[key]
        except KeyError:
            raise KnapformerError(
                f"no process group was created for bag {list(key)} on rank {self.rank}; "
                f"the bags of this balancer are {self.layout.bags}"
            ) from None

    def host_bag_group(self, ranks: list[int] | tuple[int, ...]) -> Group:
        """The group that checks the layout of a bag's Ulysses exchanges with CPU tensors:
        the bag's own group when it carries them, else its gloo twin."""
        key = tuple(int(r) for r in ranks)
        return self._host_bags.get(key) or self.bag_group(key)

    @property
    def my_bag_group(self) -> Group:
        return self.bag_group(self.my_bag)

    def owned(self) -> Iterator[dist.ProcessGroup]:
        """The sub-groups this rank belongs to, in creation order."""
        return iter(self._owned)

    # ----------------------------------------------------------------- teardown
    def destroy(self, keep: tuple[Group, ...] = ()) -> None:
        """Destroy the sub-groups, the latest made first (bags and the side group before
        the balance group they live in), except those in ``keep`` (a group a thread is
        still inside: destroying it under the thread could crash the process); idempotent.
        The parent group is the caller's and is left alone. Call it once no collective of
        the balancer runs anywhere (`knapformer.runtime.roll_call.RollCall.close` waits
        for every rank through the store), or after a failure, when peers are gone."""
        owned, self._owned = self._owned, []
        self._bag_groups.clear()
        self._host_bags.clear()
        for made in reversed(owned):
            # Skip what is already gone: destroying WORLD (e.g. at shutdown, before
            # close) destroys every group, and destroying one twice raises.
            if not dist.is_initialized():
                break
            if any(made is k for k in keep):
                continue
            with suppress(ValueError):
                dist.destroy_process_group(made)
        self.group, self.side, self.host = self.parent, None, None


def carries_cpu(group: Group) -> bool:
    """Whether ``group``'s collectives take CPU tensors (gloo, alone or beside NCCL as in
    ``"cpu:gloo,cuda:nccl"``)."""
    return "gloo" in str(dist.get_backend(group))


def group_device(group: Group) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL moves CUDA tensors only,
    everything else runs on the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout(group: Group) -> datetime.timedelta:
    """The timeout ``group`` (None: the default group) was made with."""
    pg = dist.group.WORLD if group is None else group
    backend = str(dist.get_backend(pg))
    device = torch.device("cuda" if "nccl" in backend else "cpu")
    try:
        timeout = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a backend that keeps no options
        return _FALLBACK_TIMEOUT
    return timeout if isinstance(timeout, datetime.timedelta) else _FALLBACK_TIMEOUT


def share_options(backend: str, timeout: datetime.timedelta | None = None) -> Any | None:
    """NCCL options under which a communicator split from its parent shares the parent's
    resources (``ncclConfig_t.splitShare``), or None: on a backend without NCCL, unless
    ``KNAPFORMER_SHARE_COMMUNICATORS=1``, or when this torch has no NCCL. Where torch does
    not expose the option, NCCL's ``NCCL_COMM_SPLIT_SHARE_RESOURCES=1`` is set instead,
    unless the user set it. Torch splits a new group from the default group only when the
    default group is bound to a device; otherwise each communicator is made on its own.
    ``timeout``: the group's (torch warns when the options carry another)."""
    if "nccl" not in backend or os.environ.get(SHARE_ENV, "0") != "1":
        return None
    try:
        options = dist.ProcessGroupNCCL.Options()
    except AttributeError:  # torch built without NCCL
        return None
    options.is_high_priority_stream = False  # torch's default for new groups
    if timeout is not None:
        options._timeout = timeout
    try:
        options.config.split_share = 1
    except AttributeError:
        os.environ.setdefault(_NCCL_SHARE_ENV, "1")
    return options
