"""The ``topology="auto"`` solver: each step's GPU groups and sequence places, by modelled
time with communication.

Each step it chooses a partition of the balance group into aligned GPU groups and the
sequences' places in it, minimising the modelled step time with communication
(docs/concepts.md, "Communication and the layout floor").

`solve_auto` prices candidate partitions (`knapformer.planning.partitions`) by the
slowest GPU's compute + Ulysses + route (`knapformer.planning.communication`) and keeps
the best, beside the whole-family layouts gXnY that the planner's fixed solver places (so
a step is never slower than under the best fixed layout of the family). The planner
(`plan_routing`) is the entry point; the solve state it shares with this module is in
`knapformer.planning.bags`. The passes, one module each (docs/planning.md): prices and
the modelled makespan (`pricing`), a mixed partition's placement (`mixed`), exchanges
(`exchanges`), a coarse step's last passes (`coarse`), the small step's GPU-exact
refinement (`refine`); every tuning constant is in `tuning`.
"""

from __future__ import annotations

import numpy as np

from knapformer.errors import KnapformerError
from knapformer.planning.bags import (
    Step,
    bag_shape,
)
from knapformer.planning.chunks import chunk_table
from knapformer.planning.group_demand import per_gpu_costs
from knapformer.planning.mixed import solve_mixed
from knapformer.planning.partitions import (
    effective_workloads,
    family_floors,
    mixed_partitions,
    partition_floor,
)
from knapformer.planning.pricing import (
    makespan_ceiling,
    makespan_floor,
    modelled_makespan,
    moved_estimate,
    routed_floor,
)
from knapformer.planning.refine import refine
from knapformer.planning.tuning import FLOOR_MARGIN, SLOW, SMALL_GPUS, SMALL_SEQUENCES, TIE


def solve_auto(lengths, workload, src_pos, speed, max_tokens, solve_fixed, model, comm, sizes,
               node_size, num_gpus) -> Step:  # fmt: skip
    """Choose the step's partition into aligned groups and place the sequences in it,
    minimising the modelled step time: the slowest GPU's compute + Ulysses + route
    (`modelled_makespan`).

    Candidates: the mixed partitions of `mixed_partitions` (every one in a small step, the
    cheapest in a large one), each solved as one problem over all its bags (`solve_mixed`;
    in a small step the best is then refined GPU by GPU, `refine`), and the whole-family
    layouts gXnY, solved by ``solve_fixed(shape)`` exactly as a fixed topology is (the
    chosen solver, compute-only; the planner's, handed in): the step is then never
    slower than under the best fixed layout of the family. A fixed layout whose floor
    with Ulysses (max(total / N, largest sequence / g), a lower bound on its modelled
    time) cannot beat the best found is not solved. Ties (within 1e-9) go to the fewer
    moved tokens; a candidate that breaks the token cap is skipped. The returned step's
    layout is the chosen partition's (bags in position order).
    """
    scale = float(model.scale)
    per_token = {g: comm.ulysses_per_token(model.token_dim, g, scale) for g in sizes}
    eff = effective_workloads(workload, lengths, sizes, per_token)
    # Derived once, read by the floor, the partitions and the layouts' bounds.
    size = np.asarray(sizes, dtype=np.float64)
    costs = per_gpu_costs(eff, lengths, size) if len(lengths) else None
    floors = family_floors(eff, sizes, num_gpus)
    floor = partition_floor(eff, lengths, sizes, num_gpus, costs)
    best = _Best(model, comm, per_token, speed)
    mixed = mixed_partitions(workload, lengths, src_pos, num_gpus, sizes, per_token, node_size,
                             eff, floors, costs)  # fmt: skip
    small = len(lengths) <= SMALL_SEQUENCES and num_gpus <= SMALL_GPUS
    for bag_sizes in _mixed_layouts(mixed, small, speed):
        best.consider(lambda b=bag_sizes: solve_mixed(
            b, lengths, workload, src_pos, speed, max_tokens, per_token, floor,
            comm, model))  # fmt: skip
    if small:  # the best mixed partition, GPU-exact
        best.refine(max_tokens)
    for bound, g in sorted((bound, g) for g, bound in floors.items()):  # lowest first
        if not best.beats(bound):
            shape = bag_shape((g,) * (num_gpus // g))
            best.consider(lambda s=shape: solve_fixed(s))
    return best.step()


class _Best:
    """The best candidate of `solve_auto` so far, by (modelled makespan, moved tokens): a
    makespan within ``TIE`` of the best's is a tie, won by fewer moved tokens; and the
    first failure met (a candidate that breaks the token cap), raised when none is found."""

    def __init__(self, model, comm, per_token, speed):
        self.model, self.comm, self.per_token, self.speed = model, comm, per_token, speed
        self.held: _Candidate | None = None
        self.failure: KnapformerError | None = None

    def priced(self, step: Step) -> _Candidate:
        model, comm = self.model, self.comm
        return _Candidate(step, lambda: makespan_ceiling(step, model, comm, self.per_token),
                          lambda: _exact_key(step, model, comm, self.speed))  # fmt: skip

    def consider(self, solve) -> None:
        """Solve a candidate (``solve()``) and keep it when it beats the best."""
        try:
            step = solve()
        except KnapformerError as err:
            self.failure = self.failure or err
            return
        held = self.held
        if held is None:  # the first is the best so far whatever its price
            self.held = self.priced(step)
            return
        # A candidate whose bags alone, or with the least route its sequences take, model
        # slower than the best is neither cut into chunks nor priced (the bounds are true
        # floors: the choice is the same).
        if self.speed is None and self._beaten(step):
            return
        key, held_key = (new := self.priced(step)).key(), held.key()
        if (key[0] < held_key[0] * (1 - TIE)
                or (key[0] <= held_key[0] * (1 + TIE) and key[1] < held_key[1])):  # fmt: skip
            self.held = new

    def _beaten(self, step: Step) -> bool:
        """Whether the best so far models faster than ``step`` can, by `makespan_floor`
        (bag sums) or else by `routed_floor` (the least route as well)."""
        held, margin = self.held, 1 - FLOOR_MARGIN
        if held.slower_than(makespan_floor(step, self.per_token) * margin):
            return True
        return held.slower_than(routed_floor(step, self.model, self.comm, self.per_token) * margin)

    def refine(self, max_tokens) -> None:
        """The best so far refined GPU by GPU (`refine`)."""
        if self.held is None:
            return
        self.held.key()  # refine reads the chunk table
        refined = refine(self.held.step, self.model, self.comm, self.speed, max_tokens)
        if refined is not self.held.step:
            self.held = self.priced(refined)

    def beats(self, bound: float) -> bool:
        """Whether the best models faster than any layout no faster than ``bound`` (asked
        at nominal speeds only: speeds change what a layout can reach)."""
        return self.speed is None and self.held is not None and self.held.slower_than(bound)

    def step(self) -> Step:
        """The best candidate's step (a `KnapformerError` when none was found)."""
        if self.held is None:
            raise self.failure or KnapformerError("topology 'auto' found no partition for the step")
        return self.held.step


def _exact_key(step: Step, model, comm, speed) -> tuple[float, float]:
    """(modelled makespan, moved tokens) of ``step``, its chunk table made (and kept)."""
    step.chunks = step.chunks or chunk_table(step)
    return modelled_makespan(step, model, comm, speed), moved_estimate(step)


class _Candidate:
    """A solved candidate and its price, made only when a comparison needs it: at nominal
    speeds a cheap ceiling (`makespan_ceiling`) often settles whether another layout could
    beat it, and then it is neither cut into chunks nor priced before it is chosen."""

    def __init__(self, step: Step, price_ceiling, price_exact):
        self.step = step
        self._price_ceiling, self._price_exact = price_ceiling, price_exact
        self._ceiling: float | None = None
        self._key: tuple[float, float] | None = None

    def key(self) -> tuple[float, float]:
        """(modelled makespan, moved tokens), exact."""
        if self._key is None:
            self._key = self._price_exact()
        return self._key

    def slower_than(self, bound: float) -> bool:
        """Whether a layout no faster than ``bound`` models slower than this one beyond
        ``TIE`` (asked at nominal speeds only): first against the ceiling, with a margin
        for rounding, then exactly."""
        if self._key is None:
            if self._ceiling is None:
                self._ceiling = self._price_ceiling() * (1 + FLOOR_MARGIN)
            if bound > self._ceiling * (1 + TIE):
                return True
        return bound > self.key()[0] * (1 + TIE)


def _mixed_layouts(mixed, small: bool, speed) -> list[tuple[int, ...]]:
    """The bag sizes of the mixed partitions to solve: every one in a small step (variants
    only pay off where sequences are coarse), the cheapest in a large one. A slow GPU holds
    its whole group back: the same partition with it split off (`_isolate_slow`) comes
    beside (a small step) or instead of (a large one) the original."""
    layouts = [c.bag_sizes for c in mixed[: None if small else 1]]
    isolated = [_isolate_slow(b, speed) for b in layouts]
    if small:
        return layouts + [b for b in isolated if b]
    return [i or b for i, b in zip(isolated, layouts, strict=True)]


def _isolate_slow(bag_sizes: tuple[int, ...], speed) -> tuple[int, ...] | None:
    """``bag_sizes`` with every bag that holds a slow GPU (below ``SLOW`` of its bag's
    fastest) halved, again and again, until that GPU is alone: the halves stay aligned,
    and the others no longer wait for it in Ulysses. None when no bag changes."""
    if speed is None:
        return None
    out, start, changed = [], 0, False
    for g in bag_sizes:
        parts = [(start, g)]
        while parts:
            s, n = parts.pop(0)
            part = speed[s : s + n]
            if n > 1 and part.min() < SLOW * part.max():
                parts[:0] = [(s, n // 2), (s + n // 2, n // 2)]
                changed = True
            else:
                out.append(n)
        start += g
    return tuple(out) if changed else None
