"""What a candidate placement of ``topology="auto"`` costs: its modelled makespan (the
slowest GPU's compute + Ulysses + route, as `plan_cost` prices the plan it becomes) and
the bag-level prices the placement and exchange passes score moves by (`Prices`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.planning.bags import (
    BagLayout,
    Step,
)
from knapformer.planning.communication import CommModel, communication_loads
from knapformer.planning.tuning import HOME_RUN_ROWS
from knapformer.planning.workload import WorkloadModel


def modelled_makespan(step: Step, model: WorkloadModel, comm: CommModel, speed) -> float:
    """The largest per-GPU load of ``step`` (its chunk table made), communication included:
    what `plan_cost` gives the plan it becomes, computed before the plan exists."""
    layout = step.layout
    seq, pos, _, length = step.chunks
    compute, tokens = compute_per_gpu(step, model, speed)
    ulysses, route = communication_loads(
        comm, model.token_dim, float(model.scale), layout.size[layout.shape.bag_of_pos], tokens,
        step.src_pos[seq], pos, length,
    )  # fmt: skip
    return float((compute + ulysses + route).max(initial=0.0))


def compute_per_gpu(step: Step, model: WorkloadModel, speed) -> tuple[np.ndarray, np.ndarray]:
    """(compute, tokens), each (num_gpus,), of ``step``'s chunk table: each GPU's linear part
    of its own tokens plus 1/g of the attention of every sequence of its bag, over its
    speed."""
    layout, lengths, workload = step.layout, step.lengths, step.workload
    seq, pos, _, length = step.chunks
    n = len(layout.shape.bag_of_pos)
    share = np.where(lengths > 0, model.linear_share(lengths), 0.0)
    per_token = np.divide(workload * share, lengths, out=np.zeros(len(lengths)),
                          where=lengths > 0)  # fmt: skip
    linear = np.bincount(pos, weights=per_token[seq] * length, minlength=n)
    attention = np.bincount(step.bag, weights=workload * (1.0 - share), minlength=len(layout.size))
    compute = linear + (attention / layout.size)[layout.shape.bag_of_pos]
    if speed is not None:
        compute = compute / speed
    return compute, np.bincount(pos, weights=length, minlength=n)


def route_per_token(comm: CommModel, model: WorkloadModel) -> tuple[float, float]:
    """Workload units (per layer) a GPU pays per token it sends or returns over the node's
    link and over the network."""
    return tuple(
        float(comm.work_of(model.token_dim * comm.dtype_bytes / (gbs * 1e9), model.scale))
        / comm.layers
        for gbs in (comm.intra_gbs, comm.inter_gbs)
    )


@dataclass(frozen=True)
class Prices:
    """What a sequence costs in each bag of a mixed partition, per layer, in workload
    units: ``kappa`` (num_bags,) Ulysses per token; ``link`` (n, ...) via `route`: the route
    per moved token (both ends alike) between its source GPU and a bag, over the node link
    when the bag is in the source's node, else over the network."""

    kappa: np.ndarray
    bag_node: np.ndarray  # (num_bags,) node of each bag; -1: spans nodes
    src_node: np.ndarray  # (n,)
    intra: float
    inter: float

    @classmethod
    def of(cls, shape, src_pos, per_token, comm, model):
        node = int(comm.node_size)
        per_token_route = route_per_token(comm, model)
        bag_node = np.where(shape.size > node, -1, shape.start // node)
        per_class = np.array([per_token[int(g)] for g in shape.class_size])
        src_node = src_pos // node
        if src_pos.min(initial=0) < 0:  # sources outside the partition: no node
            src_node[src_pos < 0] = -2
        return cls(per_class[shape.class_of_bag_array], bag_node, src_node,
                   *per_token_route)  # fmt: skip

    def route(self, seqs, bags, home, size, lengths, there=None):
        """Per (sequence, bag) pair (broadcast): tokens that leave the source times the
        route per token: all of them away from home, (g-1)/g at home (``there``: whether
        each bag is its sequence's home, where the caller has it)."""
        per = np.where(self.bag_node[bags] == self.src_node[seqs], self.intra, self.inter)
        moved = np.where(bags == home if there is None else there, ((size - 1) / size)[bags], 1.0)
        moved *= lengths
        moved *= per  # (per * moved: the same bits)
        return moved

    def at_home(self, workload, seqs, home, size, lengths):
        """The price of sequences ``seqs`` in their home bags ``home`` (``lengths`` of each;
        ``workload``: the step's): `_priced`'s, the same bits, by a short form of the route
        (a home bag holds its sequence's source GPU, so it is in the source's node unless
        it spans nodes, and (g-1)/g of the tokens leave), summed in two buffers where the
        plain form makes ten step-sized temporaries. Where the homes come in a few runs of
        one kind of bag (`_home_runs`), each run is priced by its kind's numbers, and a
        sequence at home in a one-GPU bag costs its workload alone (no Ulysses, no route:
        ``W + 0*L + 0`` is ``W``)."""
        runs = _home_runs(self, home, size)
        if runs is None:
            return self._at_home_gathered(workload, seqs, home, size, lengths)
        price = np.take(workload, seqs)
        for lo, hi, kappa, share, link in runs:
            if kappa == 0.0 and share == 0.0:
                continue
            part = kappa * lengths[lo:hi]  # k_g*L + W, then the route, as below
            part += price[lo:hi]
            route = share * lengths[lo:hi]
            route *= link
            route *= 2
            part += route
            price[lo:hi] = part
        return price

    def _at_home_gathered(self, workload, seqs, home, size, lengths):
        """`at_home` with each sequence's numbers looked up by its home bag."""
        price = np.take(self.kappa, home)
        price *= lengths  # k_g*L (+ W below: the same sum either way round)
        buffer = np.take(workload, seqs)
        price += buffer
        route = np.take((size - 1) / size, home)
        route *= lengths
        route *= np.take(self.home_link, home, out=buffer)
        route *= 2  # its home bag sends it and receives it
        price += route
        return price

    @property
    def home_link(self) -> np.ndarray:
        """(num_bags,) route per token at home: the node's link unless the bag spans nodes."""
        return np.where(self.bag_node >= 0, self.intra, self.inter)

    def cost(self, step: Step, lengths: np.ndarray, seq, bag):
        """(price, sent) of sequences ``seq`` in bags ``bag`` (broadcast): ``W + k_g*L`` plus
        the route its receivers pay (twice at home, where the bag also sends), and what its
        home bag pays to send it (0 at home). ``lengths``: the step's, as floats."""
        home = step.home_bag[seq]
        r = self.route(seq, bag, home, step.layout.size, lengths[seq])
        there = bag == home
        return (step.workload[seq] + self.kappa[bag] * lengths[seq] + np.where(there, 2 * r, r),
                np.where(there | (home < 0), 0.0, r))  # fmt: skip


def priced_loads(step: Step, prices: Prices,
                 known=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """(price (n,) of each sequence in its bag (0 while unplaced), priced load (num_bags,),
    sent (n,): what each sequence placed away from its home bag costs that bag to send):
    ``W + k_g*L`` plus the route its receivers pay (twice at home, where the bag also sends),
    and each home bag the sending of its sequences placed away. ``known``: (price, sent,
    seqs) of an earlier call on this step, stale only for sequences ``seqs`` (ids) whose bag
    changed since: only those are priced again (a sequence's price is its own: the same
    values), in place (the caller gives them up), the loads summed anew."""
    if known is None:
        price, sent = _priced(step, prices, slice(None))
    else:
        price, sent, seqs = known
        price[seqs], sent[seqs] = _priced(step, prices, seqs)
    num_bags = len(step.layout.size)
    bag = step.bag if step.bag.min(initial=0) >= 0 else np.maximum(step.bag, 0)  # (price 0)
    load = np.bincount(bag, weights=price, minlength=num_bags)
    # Only the sequences placed away send (a sum of the others' zeros is the same bits).
    away = np.flatnonzero(sent != 0)  # (nonzero of floats: several times slower than of a mask)
    load += np.bincount(step.home_bag[away], weights=sent[away], minlength=num_bags)
    return price, load, sent


def _priced(step: Step, prices: Prices, seqs) -> tuple[np.ndarray, np.ndarray]:
    """(price, sent) of sequences ``seqs`` (ids or a slice) as `priced_loads` gives them."""
    home, lengths = step.home_bag[seqs], step.lengths[seqs].astype(np.float64)
    bag = step.bag[seqs]
    placed = bag >= 0
    bag = np.maximum(bag, 0)  # (unplaced: priced in bag 0, then 0)
    there = bag == home  # its home bag sends it and receives it: the route twice
    route = prices.route(seqs, bag, home, step.layout.size, lengths, there)
    away = ~there & (home >= 0) & placed
    sent = np.where(away, route, 0.0)
    price = prices.kappa[bag] * lengths
    price += step.workload[seqs]  # (W + k_g*L: the same bits either way round)
    np.multiply(route, 2.0, out=route, where=there)
    price += route
    price[~placed] = 0.0
    return price, sent


def _home_runs(prices: Prices, home: np.ndarray, size: np.ndarray) -> list[tuple] | None:
    """(first, end, Ulysses per token, share of tokens that leave, route per token) of each
    run of ``home`` over bags of one kind, as positions in ``home``; None unless the homes
    ascend (a step flattened GPU by GPU, bags in position order) in runs of at least
    ``HOME_RUN_ROWS`` each on average."""
    n = len(home)
    if n == 0 or home[0] < 0 or (home[1:] < home[:-1]).any():
        return None
    kappa, share, link = prices.kappa, (size - 1) / size, prices.home_link
    new = (kappa[1:] != kappa[:-1]) | (share[1:] != share[:-1]) | (link[1:] != link[:-1])
    first = [0, *(np.flatnonzero(new) + 1).tolist()]  # each run's first bag
    if len(first) * HOME_RUN_ROWS > n:
        return None
    bounds = [*np.searchsorted(home, first).tolist(), n]
    spans = zip(first, bounds[:-1], bounds[1:], strict=True)
    return [(lo, hi, float(kappa[b]), float(share[b]), float(link[b]))
            for b, lo, hi in spans if hi > lo]  # fmt: skip


def bag_makespan(step: Step, prices: Prices) -> float:
    """The largest priced per-GPU time of any bag, its sending GPU counted."""
    return float(priced_per_gpu(step, prices)[2].max(initial=0.0))


def priced_per_gpu(step: Step, prices: Prices, known=None):
    """(each sequence's price, each bag's priced load, each bag's per-GPU time, what each
    sequence's home bag pays to send it): the load spread over the bag's GPUs plus what its
    slowest GPU pays to send (`sender_extra`). ``known``: as `priced_loads` takes it."""
    price, load, sent = priced_loads(step, prices, known)
    return price, load, load / step.layout.weight + sender_extra(step, sent), sent


def sender_extra(step: Step, sent: np.ndarray) -> np.ndarray:
    """(num_bags,) how far each bag's slowest GPU sits above the bag's spread load, given
    ``sent`` (n,) (`priced_loads`): one GPU sends each of its sequences placed away, not
    the whole bag (per GPU, workload units)."""
    return uneven_sends(step.layout, *sends(step, sent))


def sends(step: Step, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each GPU (num_gpus,) and each home bag (num_bags,) pays to send its sequences
    placed away (``sent`` (n,), `priced_loads`)."""
    layout = step.layout
    num_gpus = len(layout.shape.bag_of_pos)
    # Only what is sent: adding the zeros of the sequences at home changes no bit.
    away = np.flatnonzero(sent != 0)
    src, home, paid = step.src_pos[away], step.home_bag[away], sent[away]
    gpu_sends = np.bincount(np.maximum(src, 0), weights=paid, minlength=num_gpus)
    bag_sends = np.bincount(np.maximum(home, 0), weights=paid, minlength=len(layout.size))
    return gpu_sends, bag_sends


def uneven_sends(layout: BagLayout, gpu_sends: np.ndarray, bag_sends: np.ndarray) -> np.ndarray:
    """(num_bags,) each bag's most sending GPU less the bag's sends spread over its GPUs."""
    return np.maximum.reduceat(gpu_sends, layout.start) - bag_sends / layout.weight


def moved_estimate(step: Step) -> float:
    """Tokens that leave their GPU: all of a sequence placed away from home, (g-1)/g of one
    at home in a g-GPU bag."""
    g = step.layout.size[step.bag].astype(np.float64)
    home = step.bag == step.home_bag
    return float(np.sum(step.lengths * np.where(home, (g - 1) / g, 1.0)))
