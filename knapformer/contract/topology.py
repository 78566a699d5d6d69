"""Compute-bag topologies such as ``g1n2+g2n1+g4n1``.

A term ``gXnY`` means *Y bags of X GPUs each*. Bags take contiguous ranks, smaller
bags first, so ``g1n2+g2n1+g4n1`` on 8 GPUs gives bags ``[0] [1] [2,3] [4,5,6,7]``.
A world size that is a multiple of the topology's GPU count holds several replicas
(balance groups of consecutive ranks), each balanced on its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate

from knapformer.contract.limits import MAX_GPUS, abbreviate, check_count, parse_count
from knapformer.errors import KnapformerError

_TERM = re.compile(r"g([0-9]+)n([0-9]+)")


@dataclass(frozen=True)
class Topology:
    """Bag sizes of one balance group, smallest first (``bag_sizes[i]`` = GPUs of bag i)."""

    bag_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = self.bag_sizes
        # Checked per distinct type, then by the least size: one C-level pass each, where a
        # test per bag would cost a plan at 4,096 bags a few tenths of a ms.
        if (
            not sizes
            or not all(issubclass(t, int) for t in set(map(type, sizes)))
            or min(sizes) <= 0
        ):
            shown = abbreviate(str(list(sizes)))
            raise KnapformerError(f"bag sizes {shown} must be a non-empty list of positive ints")
        check_count(sum(sizes), MAX_GPUS, "the GPU count of a topology")

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse ``gXnY[+gXnY...]``; a bag size given twice is merged (``g1n2+g1n3`` = ``g1n5``)."""
        if not isinstance(text, str) or not text.strip():
            raise KnapformerError(
                f"topology {abbreviate(repr(text))} is empty; expected e.g. 'g1n2+g2n1+g4n1'"
            )
        return _parsed(cls, text)

    @classmethod
    def _parse(cls, text: str) -> Topology:
        shown = abbreviate(repr(text))
        counts: dict[int, int] = {}
        total = 0
        terms = text.strip().split("+")
        for term in terms:
            where = f"topology {shown}" + (
                f": term {abbreviate(repr(term))}" if len(terms) > 1 else ""
            )
            match = _TERM.fullmatch(term.strip())
            if match is None:
                raise KnapformerError(
                    f"topology {shown}: term {abbreviate(repr(term))} is not of the form gXnY "
                    "(X GPUs per bag, Y bags), e.g. 'g2n4'"
                )
            # Counted before anything is built: 'g1n99999999999' must not make a tuple.
            size = parse_count(match.group(1), MAX_GPUS, f"{where}: the bag size")
            count = parse_count(match.group(2), MAX_GPUS, f"{where}: the bag count")
            if size == 0 or count == 0:
                raise KnapformerError(
                    f"topology {shown}: term {abbreviate(repr(term))} has a zero size or count"
                )
            total = check_count(
                total + size * count, MAX_GPUS, f"the GPU count of topology {shown}"
            )
            counts[size] = counts.get(size, 0) + count
        sizes = tuple(size for size in sorted(counts) for _ in range(counts[size]))
        return cls(sizes)

    @classmethod
    def from_bag_sizes(cls, sizes: list[int] | tuple[int, ...]) -> Topology:
        return cls(tuple(sorted(int(s) for s in sizes)))

    @cached_property
    def num_gpus(self) -> int:
        """GPUs in one balance group."""
        return sum(self.bag_sizes)

    @property
    def num_bags(self) -> int:
        return len(self.bag_sizes)

    @property
    def max_bag_size(self) -> int:
        return self.bag_sizes[-1]

    def heads_for(self, at_least: int = 4) -> int:
        """The smallest head count >= ``at_least`` that every bag size divides (Ulysses
        splits the heads evenly across the GPUs of a bag)."""
        return heads_for(self.bag_sizes, at_least)

    def __str__(self) -> str:
        return self._name

    @cached_property
    def _name(self) -> str:  # made once: a plan names its topology every step
        counts: dict[int, int] = {}
        for size in self.bag_sizes:
            counts[size] = counts.get(size, 0) + 1
        return "+".join(f"g{size}n{count}" for size, count in counts.items())

    def bags(self, gpus: Sequence[int] | None = None) -> list[list[int]]:
        """GPU ranks of each bag for one balance group (default: ranks 0..num_gpus-1)."""
        if gpus is None:
            gpus = list(range(self.num_gpus))
        if len(gpus) != self.num_gpus:
            raise KnapformerError(
                f"topology {self} needs {self.num_gpus} GPUs per balance group, got {len(gpus)}"
            )
        return consecutive_bags(gpus, self.bag_sizes)

    def num_replicas(self, world_size: int) -> int:
        """How many balance groups a world of ``world_size`` ranks holds."""
        if world_size <= 0 or world_size % self.num_gpus:
            raise KnapformerError(
                f"world size {world_size} does not fit topology {self}: it needs a multiple "
                f"of {self.num_gpus} ranks"
            )
        return world_size // self.num_gpus

    def balance_groups(self, world_size: int) -> list[list[int]]:
        """Ranks of every balance group (consecutive ranks) in a world of ``world_size``."""
        n = self.num_gpus
        return [list(range(r * n, (r + 1) * n)) for r in range(self.num_replicas(world_size))]

    def group_of(self, rank: int, world_size: int) -> list[int]:
        """Ranks of the balance group that holds ``rank``."""
        groups = self.balance_groups(world_size)
        if not 0 <= rank < world_size:
            raise KnapformerError(f"rank {rank} is outside world size {world_size}")
        return groups[rank // self.num_gpus]


def as_topology(topology: Topology | str) -> Topology:
    return topology if isinstance(topology, Topology) else Topology.parse(topology)


@lru_cache(maxsize=64)
def _parsed(cls: type[Topology], text: str) -> Topology:
    """`Topology.parse`, made once per string: a plan names its topology every step, and a
    4,096-bag one takes ~0.7 ms to parse. A string that does not parse raises every time."""
    return cls._parse(text)


def consecutive_bags(gpus: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """``gpus`` cut into consecutive bags of ``sizes[i]`` GPUs (the sizes sum to len(gpus)),
    each a new list."""
    if sizes and sizes.count(sizes[0]) == len(sizes):  # one size: one C-level pass (half the time)
        return list(map(list, zip(*[iter(gpus)] * sizes[0], strict=True)))
    if not isinstance(gpus, list):
        gpus = list(gpus)  # then each slice is a new list already
    starts = accumulate(sizes, initial=0)  # one more than the sizes: zip stops at theirs
    return [gpus[s : s + g] for s, g in zip(starts, sizes, strict=False)]


def heads_for(bag_sizes: Iterable[int], at_least: int = 4) -> int:
    """The smallest head count >= ``at_least`` that every size of ``bag_sizes`` divides
    (Ulysses splits the heads evenly across the GPUs of a bag)."""
    lcm = math.lcm(*bag_sizes)
    return lcm * max(1, math.ceil(at_least / lcm))
