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
the modelled makespan (`pricing`), cheaper bounds on it (`bounds`), a mixed partition's
placement (`mixed`), the moves every local search makes (`moves`), exchanges
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
from knapformer.planning.bounds import makespan_ceiling, makespan_floor, routed_floor
from knapformer.planning.chunks import chunk_table
from knapformer.planning.group_demand import per_gpu_costs
from knapformer.planning.mixed import solve_mixed
from knapformer.planning.partitions import (
    effective_workloads,
    family_floors,
    mixed_partitions,
    partition_floor,
)
from knapformer.planning.pricing import modelled_makespan, moved_estimate
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
        model, comm, per_token = self.model, self.comm, self.per_token
        bounds = {
            "ceiling": lambda: makespan_ceiling(step, model, comm, per_token),
            "routed_ceiling": lambda: makespan_ceiling(step, model, comm, per_token, True),
            "bags": lambda: makespan_floor(step, per_token),
            "routed": lambda: routed_floor(step, model, comm, per_token),
        }
        return _Candidate(step, bounds, lambda: _exact_key(step, model, comm, self.speed))

    def consider(self, solve) -> None:
        """Solve a candidate (``solve()``) and keep it when it beats the best."""
        try:
            step = solve()
        except KnapformerError as err:
            self.failure = self.failure or err
            return
        new, held = self.priced(step), self.held
        if held is None:  # the first is the best so far whatever its price
            self.held = new
            return
        if self.speed is None and self._settled(new):
            return
        key, held_key = new.key(), held.key()
        if (key[0] < held_key[0] * (1 - TIE)
                or (key[0] <= held_key[0] * (1 + TIE) and key[1] < held_key[1])):  # fmt: skip
            self.held = new

    def _settled(self, new: _Candidate) -> bool:
        """Whether bounds settle ``new`` against the best (at nominal speeds), the cheap ones
        first: dropped when its bag floor (`makespan_floor`) lies above the best's price;
        the best from then on, unpriced, when its ceiling lies below the best's floor;
        dropped when its routed floor (`routed_floor`) lies above the best's price; the
        best when its routed ceiling does. The best's price is its ceilings, its floors or,
        where they do not settle it, its exact price. The bounds are true: the choice is
        the same."""
        held = self.held
        if held.slower_than(new.bound("bags")):
            return True
        if self._replaces(new, "ceiling"):
            return True
        if held.slower_than(new.bound("routed")):
            return True
        return self._replaces(new, "routed_ceiling")

    def _replaces(self, new: _Candidate, ceiling: str) -> bool:
        """Whether ``new``'s ``ceiling`` (and bag floor) lie below the best's floor: then
        it is the best, unpriced."""
        lower = self.held.lower()
        if new.bound("bags") < lower and new.bound(ceiling) < lower * (1 - TIE):
            self.held = new
            return True
        return False

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
    speeds its cheap bounds (``bounds``: the ceilings, `makespan_ceiling` plain and
    routed, and the floors, `makespan_floor` and `routed_floor`) often settle whether
    another layout could beat it, and then it is neither cut into chunks nor priced before
    it is chosen."""

    def __init__(self, step: Step, bounds, price_exact):
        self.step = step
        self._bounds, self._price_exact = bounds, price_exact
        self._known: dict[str, float] = {}
        self._key: tuple[float, float] | None = None

    def key(self) -> tuple[float, float]:
        """(modelled makespan, moved tokens), exact."""
        if self._key is None:
            self._key = self._price_exact()
        return self._key

    def bound(self, name: str) -> float:
        """A ceiling (``"ceiling"``, ``"routed_ceiling"``; a margin for rounding above) or
        a floor (``"bags"``, ``"routed"``; the margin below) of the modelled makespan, made
        once."""
        if name not in self._known:
            margin = FLOOR_MARGIN if name.endswith("ceiling") else -FLOOR_MARGIN
            self._known[name] = self._bounds[name]() * (1 + margin)
        return self._known[name]

    def lower(self) -> float:
        """The exact modelled makespan where it is known, else the routed floor."""
        return self.bound("routed") if self._key is None else self._key[0]

    def slower_than(self, bound: float) -> bool:
        """Whether a layout no faster than ``bound`` models slower than this one beyond
        ``TIE`` (asked at nominal speeds only): against the ceiling and the floors first
        (cheap), then the routed ceiling, then exactly."""
        if self._key is None:
            if bound > self.bound("ceiling") * (1 + TIE):
                return True
            if bound <= self.bound("bags") * (1 + TIE) or bound <= self.bound("routed") * (1 + TIE):
                return False
            if bound > self.bound("routed_ceiling") * (1 + TIE):
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
