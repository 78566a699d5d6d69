"""Moves and swaps between the most loaded bag of a mixed partition and the least loaded
ones, each sequence re-priced at its new bag (`exchange_across`), and the member samples
the exchange passes score."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from knapformer.planning.bags import (
    Step,
    least,
)
from knapformer.planning.moves import move
from knapformer.planning.pricing import Prices, priced_loads, sends, uneven_sends
from knapformer.planning.token_cap import within_token_cap
from knapformer.planning.tuning import (
    EXCHANGE_MEMBERS,
    EXCHANGE_MOVES,
    EXCHANGE_MOVES_LARGE,
    EXCHANGE_PARTNERS,
    FLOOR_STOP,
    SMALL_GPUS,
    SMALL_SEQUENCES,
    TIE,
)

_NONE = np.array([-1])  # an exchange's empty slot: a move, not a swap


def exchange_across(step: Step, prices: Prices, floor: float, max_tokens, known=None) -> None:
    """Exchanges between bags of any sizes, each sequence re-priced at its new bag
    (`Prices`): the most loaded bag moves one sequence to, or swaps one with, whichever of
    the least loaded bags (every bag in a step of at most ``SMALL_GPUS`` bags and
    ``SMALL_SEQUENCES`` sequences, else ``EXCHANGE_PARTNERS``)
    evens the two out best, while that lowers the larger of the two and leaves the
    sequences' home bags (which pay the sending) below it (at most ``EXCHANGE_MOVES``
    exchanges; stops within ``FLOOR_STOP`` of ``floor``). All pairs of a move are scored
    in one vectorised pass (`_best_exchange`); a move is charged by `PricedLedger`.
    ``known``: the step's prices as far as they are known (`priced_loads`)."""
    num_bags = len(step.layout.size)
    if num_bags < 2:
        return
    small = num_bags <= SMALL_GPUS and len(step.lengths) <= SMALL_SEQUENCES
    ledger = PricedLedger(step, prices, known, table=small)
    stop = floor * (1 + FLOOR_STOP)
    placed = np.flatnonzero(step.lengths > 0)
    every = len(placed) == len(step.lengths)  # (no empty sequence: no gather)
    # A stable sort of small ints is a radix sort (the same order, much faster).
    bag_key = (step.bag if every else step.bag[placed]).astype(
        np.int16 if num_bags < 2**15 else np.int64
    )
    by_bag = np.argsort(bag_key, kind="stable")
    if not every:
        by_bag = placed[by_bag]
    cuts = np.searchsorted(step.bag[by_bag], np.arange(num_bags + 1)).tolist()
    members = LazyMembers(by_bag, cuts)  # each bag's list, made when first asked for
    partners = num_bags - 1 if small else min(EXCHANGE_PARTNERS, num_bags - 1)
    samples: dict[int, np.ndarray] = {}  # each bag's `spread_sample`, until it changes

    def sample(bag: int) -> np.ndarray:
        if bag not in samples:
            samples[bag] = spread_sample(members[bag], step.workload, EXCHANGE_MEMBERS)
        return samples[bag]

    per = ledger.per
    for _ in range(EXCHANGE_MOVES if small else EXCHANGE_MOVES_LARGE):
        a = int(np.argmax(per))
        if per[a] <= stop or not members[a]:
            break
        lightest = least(per, partners + 1)
        lightest = lightest[lightest != a][:partners]
        cols = [sample(b) for b in lightest.tolist()]
        found = _best_exchange(ledger, a, sample(a), lightest, cols, max_tokens)
        if found is None:
            break
        moves = [m[:3] for m in found if m[0] >= 0]
        ledger.quotes = {m[0]: m[3] for m in found if m[0] >= 0}  # priced as scored
        seqs, _, tos = (list(x) for x in zip(*moves, strict=True))
        if not move(step.bag, ledger, seqs, tos, per[a]):  # a home bag rose to the top
            break
        for seq, src, to in moves:
            members[src].remove(seq)
            members[to].append(seq)
            samples.pop(src, None)
            samples.pop(to, None)
    if max_tokens is not None:
        step.layout.bag_tokens[:] = ledger.tokens.astype(np.int64)


def _best_exchange(ledger, a: int, ma, lightest, cols, max_tokens):
    """The exchange of bag ``a`` (its members ``ma``) with one of the ``lightest`` bags
    (members ``cols``, or nothing back: a move) that ends with the lowest larger per-GPU
    time of the two: [(sequence, from, to, (its price, its sending) there)] x 2 (-1:
    nothing comes back), or None when none lowers ``a``."""
    weight, per, price = ledger.weight, ledger.per, ledger.price
    mb = np.concatenate([x for c in cols for x in (c, _NONE)])  # -1: a move, no swap
    lens = [len(c) + 1 for c in cols]
    col = np.repeat(np.arange(len(cols)), lens)  # partner of each
    b = lightest[col]
    (into_a, sent_a), (in_b, sent_b) = ledger.exchange_prices(mb, a, ma, lightest)
    out_b = price[mb]
    out_b[np.cumsum(lens) - 1] = 0.0  # nothing comes back
    # The per-GPU times after each exchange (m, len(ma)): a row per partner's member, so
    # that each partner's numbers are one per row (the sums as written out: a's is
    # per[a] + (into_a - out of a) / weight[a]).
    value = np.subtract.outer(into_a, price[ma])
    value /= weight[a]
    value += per[a]
    into_b = np.take(in_b, col, axis=0)
    into_b -= out_b[:, None]
    into_b /= weight[b][:, None]
    into_b += per[b][:, None]
    np.maximum(value, into_b, out=value)  # the larger of the two
    if max_tokens is not None:
        # Token counts are whole numbers: the shift's grouping changes no bit of the test.
        lengths = ledger.lengths
        lj = np.where(mb >= 0, lengths[mb], 0.0)
        shift = lengths[ma][None, :] - lj[:, None]
        ok = within_token_cap(ledger.tokens, ledger.size, a, b[:, None], shift, max_tokens)
        value[~ok] = np.inf
    # The first least one by a's member, then the partner's (as scored a's member by row).
    i, j = divmod(int(np.ascontiguousarray(value.T).argmin()), len(mb))
    if not value[j, i] < per[a] * (1 - TIE):
        return None
    dst = int(b[j])
    quote_i = (float(in_b[col[j], i]), float(sent_b[col[j], i]))
    quote_j = (float(into_a[j]), float(sent_a[j]))
    return [(int(ma[i]), a, dst, quote_i), (int(mb[j]), dst, a, quote_j)]


class PricedLedger:
    """What the bags of a mixed partition are charged while sequences move between them
    (the priced passes' `Ledger`): each sequence's price in its bag and what its home bag
    pays to send it, each bag's priced load, tokens and per-GPU time, and what each GPU and
    home bag sends. One GPU sends a sequence placed away from it, not its bag: a bag's
    slowest GPU is its spread load plus the most any of its GPUs sends, less that GPU's
    share. ``quotes``: sequence -> (price, sending) where the next move takes it, as its
    scoring priced them (the same bits: a price is its own), taken by the next `charge`.
    ``table``: every sequence priced in every bag at once (a small step's few hundred by a
    few dozen; elementwise, the same bits), then looked up."""

    def __init__(self, step: Step, prices: Prices, known=None, table: bool = False):
        layout = step.layout
        self.step, self.prices = step, prices
        self.size, self.weight, self.start = layout.size, layout.weight, layout.start
        self.lengths = step.lengths.astype(np.float64)
        self.price, self.load, self.sent = priced_loads(step, prices, known)
        # Under a token cap only (else never read)
        self.tokens = (np.bincount(step.bag, weights=self.lengths, minlength=len(self.size))
                       if layout.max_tokens is not None else np.zeros(len(self.size)))  # fmt: skip
        self.gpu_sends, self.bag_sends = sends(step, self.sent)
        self.extra = uneven_sends(layout, self.gpu_sends, self.bag_sends)
        self.per = self.load / self.weight + self.extra
        self.quotes: dict[int, tuple[float, float]] = {}
        self._ends = (layout.start + layout.size).tolist()  # each bag's GPUs: start..end
        self._table = None
        if table:  # its last row is sequence -1's (nothing moves)
            every = np.append(np.arange(len(self.lengths)), -1)[:, None]
            self._table = self._fitting(every, np.arange(len(self.size))[None, :])

    def priced(self, seq, bag):
        """(price in ``bag``, what its home bag pays for sending) of sequences ``seq``."""
        return self.prices.cost(self.step, self.lengths, seq, bag)

    def _fitting(self, seq, bag):
        """`priced`, the price inf where a sequence is shorter than its bag's group (it may
        not go there), and (0, 0) for sequence -1 (nothing moves)."""
        real = seq >= 0
        seq = np.maximum(seq, 0)
        price, sent = self.priced(seq, bag)
        price = np.where(self.lengths[seq] >= self.size[bag], price, np.inf)
        return np.where(real, price, 0.0), np.where(real, sent, 0.0)

    def exchange_prices(self, mb, a: int, ma, lightest):
        """(price, sending) of every ``mb`` (-1: none) in bag ``a``, and of every ``ma`` in
        each of ``lightest`` (len(lightest), len(ma)), as `_fitting` gives them: looked up
        in a small step's table, else priced in one call."""
        if self._table is not None:
            price, sent = self._table
            rows, cols = ma[None, :], lightest[:, None]
            return (price[mb, a], sent[mb, a]), (price[rows, cols], sent[rows, cols])
        m, k = len(mb), len(lightest)
        seqs = np.concatenate([mb, np.tile(ma, k)])
        both = self._fitting(seqs, np.concatenate([np.full(m, a), np.repeat(lightest, len(ma))]))
        (in_a, in_b), (sent_a, sent_b) = ((x[:m], x[m:].reshape(k, len(ma))) for x in both)
        return (in_a, sent_a), (in_b, sent_b)

    def charge(self, seqs, src, dst) -> float:
        """`Ledger.charge`: each sequence re-priced where it goes, its home bag's and
        source GPU's sending changed with it. Scalars: a move touches a few bags."""
        home, src_gpu = self.step.home_bag, self.step.src_pos
        quotes = [self.quotes.pop(seq, None) for seq in seqs]
        if None in quotes:
            there, sent_there = self.priced(np.array(seqs), np.array(dst))
            quotes = list(zip(there.tolist(), sent_there.tolist(), strict=True))
        load, price, sent, tokens = self.load, self.price, self.sent, self.tokens
        # The per-bag and per-GPU state is copied whole, a sequence's only where it moves.
        self._undo = ([x.copy() for x in (load, tokens, self.gpu_sends, self.bag_sends,
                                          self.extra, self.per)],
                      [(seq, price[seq], sent[seq]) for seq in seqs])  # fmt: skip
        touched = {src[0], dst[0]}
        for seq, s, to, (new_price, new_sent) in zip(seqs, src, dst, quotes, strict=True):
            load[s] -= price[seq]
            load[to] += new_price
            price[seq] = new_price
            tokens[s] -= self.lengths[seq]
            tokens[to] += self.lengths[seq]
            h = int(home[seq])
            if h >= 0:
                change = new_sent - sent[seq]
                load[h] += change
                self.gpu_sends[src_gpu[seq]] += change
                self.bag_sends[h] += change
                touched.add(h)
            sent[seq] = new_sent
        top = -np.inf
        for b in touched:
            most = self.gpu_sends[self.start[b] : self._ends[b]].max()
            self.extra[b] = most - self.bag_sends[b] / self.weight[b]
            self.per[b] = load[b] / self.weight[b] + self.extra[b]
            top = max(top, self.per[b])
        return float(top)

    def undo(self, seqs, src, dst) -> None:
        arrays, entries = self._undo
        self.load, self.tokens, self.gpu_sends, self.bag_sends, self.extra, per = arrays
        self.per[:] = per  # (the exchange pass reads this array between moves)
        for seq, price, sent in entries:
            self.price[seq], self.sent[seq] = price, sent


class LazyMembers(dict):
    """Bag -> its sequence ids (a list), cut from ``by_bag`` (ids sorted by bag; bag b's
    run is ``cuts[b]:cuts[b + 1]``) when first asked for: an exchange pass reads few bags."""

    def __init__(self, by_bag: np.ndarray, cuts: list[int]):
        super().__init__()
        self.by_bag, self.cuts = by_bag, cuts

    def __missing__(self, bag: int) -> list[int]:
        self[bag] = part = self.by_bag[self.cuts[bag] : self.cuts[bag + 1]].tolist()
        return part


def spread_sample(members: list[int], workload: np.ndarray, most: int) -> np.ndarray:
    """``members`` as an array, or ``most`` of them spread evenly over their workloads
    (a large bag's exchanges are then scored on a sample from light to heavy): one bag's
    `member_samples`."""
    m = np.asarray(members, dtype=np.int64)
    if len(m) <= most:
        return m
    return m[np.argsort(workload[m], kind="stable")][_spread(len(m), most)]


def member_samples(order: np.ndarray, cuts: np.ndarray, bags: np.ndarray, most: int):
    """(len(bags), most) sequence ids of each of ``bags`` (-1 pads): all of a bag's members
    when it has at most ``most``, else ``most`` spread evenly from its lightest to its
    heaviest. ``order``: placed sequences sorted by bag, lightest first; bag b's run is
    ``cuts[b]:cuts[b + 1]``."""
    first, count = cuts[bags], cuts[bags + 1] - cuts[bags]
    q = np.arange(most)
    offset = np.where(count[:, None] > most, _spread_offsets(count, most), q[None, :])
    valid = q[None, :] < count[:, None]
    return np.where(valid, order[np.minimum(first[:, None] + offset, len(order) - 1)], -1)


@lru_cache(maxsize=1024)
def _spread(count: int, most: int) -> np.ndarray:
    """``most`` indices spread evenly over 0..count-1 (`_spread_offsets` of one run,
    cached: a bag's exchanges sample runs of few distinct lengths)."""
    spread = _spread_offsets(np.array([count]), most)[0]
    spread.flags.writeable = False  # shared by every caller
    return spread


def _spread_offsets(count: np.ndarray, most: int) -> np.ndarray:
    """(len(count), most): ``most`` offsets spread evenly over 0..count-1 of each run (the
    ends included, rounded half to even)."""
    q = np.arange(most)
    return np.round(q[None, :] * ((count[:, None] - 1) / max(most - 1, 1))).astype(np.int64)
