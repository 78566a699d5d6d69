"""Bounds on what a candidate placement of ``topology="auto"`` costs, cheaper than its
exact price (`pricing.modelled_makespan`): floors that no placement of its bags can beat
(`makespan_floor`, `routed_floor`) and a ceiling the placement cannot exceed
(`makespan_ceiling`). Auto settles most comparisons of its candidates with them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.planning.bags import Step
from knapformer.planning.communication import CommModel
from knapformer.planning.pricing import route_per_token
from knapformer.planning.workload import WorkloadModel


def makespan_floor(step: Step, per_token: dict[int, float]) -> float:
    """A lower bound on `modelled_makespan` of ``step`` at nominal speeds, from its bags'
    sums alone (no chunk table): the largest mean over a bag's GPUs of compute + Ulysses
    (``per_token``: Ulysses per token by group size). A bag's GPUs share its workload and
    tokens, its slowest GPU is at least their mean, and the route only adds."""
    layout = step.layout
    num_bags = len(layout.size)
    per_class = np.array([per_token[int(g)] for g in layout.class_size])
    kappa = per_class[layout.shape.class_of_bag_array]
    load = np.bincount(step.bag, weights=step.workload, minlength=num_bags)
    tokens = np.bincount(step.bag, weights=step.lengths, minlength=num_bags)
    return float(((load + kappa * tokens) / layout.size).max(initial=0.0))


def routed_floor(step: Step, model: WorkloadModel, comm: CommModel,
                 per_token: dict[int, float]) -> float:  # fmt: skip
    """A lower bound on `modelled_makespan` of ``step`` at nominal speeds without its chunk
    table, above `makespan_floor` where sequences travel: each GPU of a g-GPU bag holds at
    least ``L // g`` tokens of every sequence of its bag (`chunk_table`), and a GPU's route
    is at least what it sends and receives over the network alone, or over its node's link
    alone (the route takes the slower link's time). Whole-family layouts, solved
    compute-only, often lose on the route of the GPUs their sequences leave."""
    layout, lengths, workload, bag = step.layout, step.lengths, step.workload, step.bag
    of_pos = layout.shape.bag_of_pos
    num_bags = len(layout.size)
    size = layout.size[bag]
    length = lengths.astype(np.float64)
    least = (lengths // size).astype(np.float64)  # tokens of a sequence on each of its GPUs
    share = np.where(lengths > 0, model.linear_share(lengths), 0.0)
    per_len = np.divide(workload * share, length, out=np.zeros(len(length)), where=lengths > 0)
    per_class = np.array([per_token[int(c)] for c in layout.class_size])
    kappa = per_class[layout.shape.class_of_bag_array][bag]
    held = workload * (1.0 - share) / size + (per_len + kappa) * least
    compute = np.bincount(bag, weights=held, minlength=num_bags)[of_pos]
    sides = _RouteSides.of(step, comm)
    # Sent: all of a sequence placed in another bag, g - 1 chunks of one kept at home.
    # Received: a chunk of each sequence of the bag that comes from elsewhere. A bag that
    # spans nodes is left out of both links (its chunks take either).
    least, length = least[sides.seqs], length[sides.seqs]
    sent = np.where(sides.home, (sides.size - 1) * least, length)
    route = sides.route(model, comm, *sides.tokens(sent, least, either=False))
    return float((compute + route).max(initial=0.0))


@dataclass(frozen=True)
class _RouteSides:
    """The sequences whose chunks may travel, for the route bounds (``seqs``: all but those
    at home in a one-GPU bag, which move nothing) and which link each can take: ``size``
    its bag's GPUs, ``known`` its source is one of the bags' GPUs (``src``: its position, 0
    where not), ``home`` it lies in its source's bag, ``spans`` its bag spans nodes,
    ``near`` its bag is in its source's node (each of ``seqs``')."""

    step: Step
    seqs: np.ndarray | slice  # every sequence: a slice (no copies)
    size: np.ndarray
    src: np.ndarray
    known: np.ndarray
    home: np.ndarray
    spans: np.ndarray
    near: np.ndarray

    @classmethod
    def of(cls, step: Step, comm: CommModel) -> _RouteSides:
        layout = step.layout
        home = step.bag == step.home_bag
        moving = ~home | (layout.size > 1)[step.bag]
        seqs = slice(None) if moving.all() else np.flatnonzero(moving)
        bag, src = step.bag[seqs], step.src_pos[seqs]
        known = src >= 0
        src = np.maximum(src, 0)
        node = int(comm.node_size)
        node_of = np.arange(len(layout.shape.bag_of_pos)) // node  # each GPU position's
        in_node = np.where(layout.size > node, -1, node_of[layout.start])[bag]  # -1: spans
        return cls(step, seqs, layout.size[bag], src, known, home[seqs], in_node < 0,
                   in_node == node_of[src])  # fmt: skip

    def tokens(self, sent: np.ndarray, received: np.ndarray, either: bool):
        """(near, far), each (num_gpus,): the tokens over the node's link and over the
        network that each of ``seqs`` is ``sent`` by its source and ``received`` by each GPU
        of its bag but the source. A bag that spans nodes or a source outside the bags
        leaves the link open: counted on both (``either``) or on neither."""
        step, layout = self.step, self.step.layout
        of_pos = layout.shape.bag_of_pos
        num_gpus, num_bags = len(of_pos), len(layout.size)
        odd = self.spans | ~self.known
        link = np.where(self.near & ~odd, 0, 1)
        bag = step.bag[self.seqs]
        # Integral token counts: their sums are exact in any order.
        out = np.where(self.known, sent, 0.0) - np.where(self.home, received, 0.0)
        if not either:
            out, received = np.where(odd, 0.0, out), np.where(odd, 0.0, received)
        by_gpu = np.bincount(self.src + num_gpus * link, weights=out, minlength=2 * num_gpus)
        by_bag = np.bincount(bag + num_bags * link, weights=received, minlength=2 * num_bags)
        near = by_gpu[:num_gpus] + by_bag[:num_bags][of_pos]
        far = by_gpu[num_gpus:] + by_bag[num_bags:][of_pos]
        if either and odd.any():
            o = np.flatnonzero(odd)
            near += _per_gpu_sum(self.src[o], out[o], num_gpus)
            near += _per_bag_gpu(bag[o], received[o], num_bags, of_pos)
        return near, far

    @staticmethod
    def route(model, comm, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """The route of ``near`` and ``far`` tokens per GPU: the slower link's time."""
        intra, inter = route_per_token(comm, model)
        return np.maximum(intra * near, inter * far)


def _per_gpu_sum(pos: np.ndarray, weights: np.ndarray, num_gpus: int) -> np.ndarray:
    return np.bincount(pos, weights=weights, minlength=num_gpus)


def _per_bag_gpu(bag, weights, num_bags: int, of_pos) -> np.ndarray:
    """(num_gpus,) the sum of ``weights`` over each GPU's bag (what every GPU of it gets)."""
    return np.bincount(bag, weights=weights, minlength=num_bags)[of_pos]


def makespan_ceiling(step: Step, model: WorkloadModel, comm: CommModel,
                     per_token: dict[int, float], routed: bool = False) -> float:  # fmt: skip
    """An upper bound on `modelled_makespan` of ``step`` at nominal speeds, from per-bag and
    per-source sums (no chunk table): a GPU holds L // g tokens of each sequence of its
    g-GPU bag and at most ceil(R / g) of the bag's R remainder tokens, one per sequence
    (even spread: the remainders run one cycle through the bag; all of a sequence's on
    one chunk under round-robin), and sends or receives at most every token of its
    sources and its own, over the slower link; ``routed``: at most its chunks' over the
    link each can take (`routed_floor`'s counts, from above), a few passes more. Where it
    already settles a comparison, the exact price is not needed."""
    return float(ceiling_per_gpu(step, model, comm, per_token, routed).max(initial=0.0))


def ceiling_per_gpu(step: Step, model: WorkloadModel, comm: CommModel,
                    per_token: dict[int, float], routed: bool = False) -> np.ndarray:  # fmt: skip
    """(num_gpus,) each GPU's upper bound of `makespan_ceiling`."""
    layout, lengths = step.layout, step.lengths
    per_bag, held = _bag_ceiling(step, model, per_token)
    of_pos = layout.shape.bag_of_pos
    # Every token a GPU sends or holds, over the slower link.
    sent = np.bincount(np.maximum(step.src_pos, 0), weights=lengths, minlength=len(of_pos))
    route = max(route_per_token(comm, model)) * (sent + held[of_pos])
    if not routed:
        return per_bag[of_pos] + route
    # Sent: all of a sequence placed in another bag, all but one chunk of at least L // g
    # of one kept at home. Received: a chunk of at most L // g + 1 (L // g + L % g under
    # round-robin) by every GPU of its bag but the source. A bag that spans nodes counts
    # on both links; a source outside the bags (-1) sends nothing, its chunks both.
    sides = _RouteSides.of(step, comm)
    length = lengths[sides.seqs]
    quot, rem = np.divmod(length, sides.size)
    most = (quot + (rem > 0 if layout.even else rem)).astype(np.float64)
    sent = np.where(sides.home, length - quot, length).astype(np.float64)
    routed_route = sides.route(model, comm, *sides.tokens(sent, most, either=True))
    return per_bag[of_pos] + np.minimum(route, routed_route)


def _bag_ceiling(step: Step, model: WorkloadModel, per_token) -> tuple[np.ndarray, np.ndarray]:
    """(per bag: the most compute + Ulysses any of its GPUs pays, the most tokens any holds)
    of `makespan_ceiling`."""
    layout, lengths, workload, bag = step.layout, step.lengths, step.workload, step.bag
    num_bags = len(layout.size)
    g = layout.size.astype(np.float64)
    multi = np.flatnonzero((layout.size > 1)[bag])  # the rest lie whole in their bags
    length = lengths[multi]
    rem = length % layout.size[bag[multi]]
    some = np.flatnonzero(rem != 0)  # the work of the others spreads evenly
    seqs, rem = multi[some], rem[some]
    per_len = workload[seqs] * model.linear_share(length[some]) / length[some]
    base = workload.copy()  # less the remainder tokens' linear work
    base[seqs] -= per_len * rem
    tokens = np.bincount(bag, weights=lengths, minlength=num_bags)
    rems = np.bincount(bag[seqs], weights=rem, minlength=num_bags)
    if layout.even:
        every = np.bincount(bag[seqs], weights=per_len, minlength=num_bags)
        spill = np.minimum(every, np.ceil(rems / g) * float(per_len.max(initial=0.0)))
        held = (tokens - rems) / g + np.ceil(rems / g)
    else:
        spill = np.bincount(bag[seqs], weights=per_len * rem, minlength=num_bags)
        held = (tokens - rems) / g + rems
    kappa = np.array([per_token[int(c)] for c in layout.class_size])
    work = np.bincount(bag, weights=base, minlength=num_bags) / g + spill
    return work + kappa[layout.shape.class_of_bag_array] * held, held
