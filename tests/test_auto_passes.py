"""A large auto step's bulk passes give what their plain form gives: the stay-home pass of a
mixed partition (which orders only the bags that cannot keep everything) and the size
classes' offers of a coarse step (which sort the candidates once, not every round)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from knapformer.planning import mixed, size_classes
from knapformer.planning.bags import BagLayout, Step, bag_shape, prefix_within_groups
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.mixed import _size_heaps, _stay_home_priced, solve_mixed
from knapformer.planning.partitions import effective_workloads, mixed_partitions, partition_floor
from knapformer.planning.pricing import Prices, priced_loads, route_per_token
from knapformer.planning.tuning import EVEN_TRIES
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
COMM = CommModel.cluster("nvlink")
SIZES = (1, 2, 4, 8)
PER_TOKEN = {g: COMM.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in SIZES}
INTER = route_per_token(COMM, MODEL)[1]  # a size class's candidates are priced as from afar


def _fresh_step(mix: str, factor: int, seed: int, max_tokens=None):
    """A mixed partition's step of one sampled step of ``mix``, nothing placed, its prices
    and partition floor (as `solve_mixed` starts)."""
    per_gpu = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(seed))
    n = len(per_gpu)
    lengths = np.concatenate(per_gpu).astype(np.int64)
    src = np.repeat(np.arange(n), [len(x) for x in per_gpu])
    workload = MODEL.workload(lengths)
    eff = effective_workloads(workload, lengths, SIZES, PER_TOKEN)
    floor = partition_floor(eff, lengths, SIZES, n)
    bag_sizes = mixed_partitions(workload, lengths, src, n, SIZES, PER_TOKEN, 8)[0].bag_sizes
    shape = bag_shape(bag_sizes)
    layout = BagLayout(shape, floor, max_tokens, None, even=True)
    step = Step.start(shape, lengths, workload, src, layout)
    return step, Prices.of(shape, src, PER_TOKEN, COMM, MODEL), floor


def _stay_home_by_sorting_all(seqs, step, load, prices, level):
    """The stay-home pass in its plain form: every sequence ordered by home bag, heaviest
    first, the running priced cost (and tokens) within each bag's room."""
    layout, lengths, home = step.layout, step.lengths, step.home_bag
    seqs = seqs[(home[seqs] >= 0) & (layout.size[np.maximum(home[seqs], 0)] <= lengths[seqs])]
    order = seqs[np.lexsort((-step.workload[seqs], home[seqs]))]
    hb = home[order]
    cost = (step.workload[order] + prices.kappa[hb] * lengths[order]
            + 2 * prices.route(order, hb, hb, layout.size, lengths[order]))  # fmt: skip
    stays = prefix_within_groups(cost, hb, (level * layout.weight - load)[hb])
    if layout.max_tokens is not None:
        room = layout.max_tokens * layout.size[hb] - layout.bag_tokens[hb]
        stays &= prefix_within_groups(lengths[order].astype(np.float64), hb, room)
    bag = np.full(len(lengths), -1)
    bag[order[stays]] = hb[stays]
    return bag, load + np.bincount(hb[stays], weights=cost[stays], minlength=len(load))


# Token caps that keep some of the sequences home that the priced room alone would keep.
CASES = [("video", None), ("joint", None), ("video", 22_000), ("seqheavy", 8_000)]


@pytest.mark.parametrize(("mix", "max_tokens"), CASES)
def test_stay_home_keeps_what_ordering_every_sequence_keeps(mix, max_tokens):
    """Bags with room for all their sequences keep them all unordered, the others keep the
    heaviest that fit: the same sequences home as the plain pass, the same loads (to
    rounding: the sums run in another order), with some bags of each kind."""
    step, prices, floor = _fresh_step(mix, 4, 21, max_tokens)
    seqs = np.flatnonzero(step.lengths > 0)
    load = np.random.default_rng(1).uniform(0.0, 0.3 * floor, len(step.layout.size))
    level = 1.0 * floor
    bag, expected = _stay_home_by_sorting_all(seqs, step, load, prices, level)
    got, known = _stay_home_priced(seqs, step, load, prices, level)
    assert np.array_equal(step.bag, bag)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # The prices it knows (those kept home) are the ones priced from scratch, bit for bit.
    assert len(known[2]) < len(step.lengths)
    fresh = priced_loads(step, prices)
    for a, b in zip(priced_loads(step, prices, known), fresh, strict=True):
        assert np.array_equal(a, b)
    home = step.home_bag[seqs]
    kept_all = np.bincount(home, weights=step.bag[seqs] == home, minlength=len(load))
    held = np.bincount(home, minlength=len(load))
    assert (kept_all == held)[held > 0].any() and (kept_all < held).any()


def _offers_by_lexsort(step, band, g, per_token):
    """`size_classes._even_offers` in its plain form: the pool sorted by (cost, donor's load) with
    a lexsort in every call, the first of each run of equal costs offered."""
    size, bag, per, price = step.layout.size, step.bag, band.per, band.price
    takers = np.flatnonzero((size == g) & band.outside)
    pool = np.flatnonzero(band.in_pool)
    cand = pool[step.lengths[pool] >= g]
    if not takers.size or not cand.size:
        return None
    key = step.workload[cand] + per_token * step.lengths[cand].astype(np.float64)
    order = np.lexsort((per[bag[cand]], key))
    cand, key = cand[order], key[order]
    run = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    mine = np.flatnonzero(band.live & np.isin(band.bag_of, takers))
    j = np.concatenate([mine, np.full(len(takers), -1)])
    b = np.concatenate([bag[mine], takers])
    out_j = np.where(j >= 0, price[np.maximum(j, 0)], 0.0)
    weight = step.layout.weight[b]
    lo = out_j + (band.target - band.band - per[b]) * weight
    hi = out_j + (band.target - per[b]) * weight
    u = (np.searchsorted(key[run], hi, "right") - 1)[:, None] - np.arange(EVEN_TRIES)
    first = run[np.maximum(u, 0)]
    ok = (u >= 0) & (key[first] >= lo[:, None]) & (bag[cand[first]] != b[:, None])
    rows, cols = np.nonzero(ok)
    return (j[rows], b[rows], cand[first[rows, cols]]) if rows.size else None


def test_size_class_offers_are_the_first_of_each_run_of_a_lexsort(monkeypatch):
    """Every round of the size classes' pass on a coarse joint step of 1,024 GPUs offers the
    same exchanges as the plain lexsort form (costs repeat: ties go to the least loaded
    donor, then the lowest id)."""
    calls = []
    offers = size_classes._even_offers

    def checked(step, band, g, by_cost):
        got = offers(step, band, g, by_cost)
        plain = _offers_by_lexsort(step, band, g, PER_TOKEN[g] + INTER)
        calls.append(got is not None)
        assert (got is None) == (plain is None)
        if got is not None:
            assert all(np.array_equal(x, y) for x, y in zip(got, plain, strict=True))
        return got

    monkeypatch.setattr(size_classes, "_even_offers", checked)
    step, _, floor = _fresh_step("joint", 32, 3)
    solve_mixed(tuple(step.layout.size.tolist()), step.lengths, step.workload, step.src_pos,
                None, None, PER_TOKEN, floor, COMM, MODEL)  # fmt: skip
    assert sum(calls) >= 4


BAND, SCORES = size_classes._Band, size_classes._even_scores  # as found, not as patched


def _priced_by_round(monkeypatch, budget):
    """The offers the size classes' pass prices in each of its rounds on a coarse joint step
    of 1,024 GPUs, with ``budget`` offers (``EVEN_OFFERS``) at most before a round."""
    rounds, band, scores = [], BAND, SCORES

    def counted_band(*args):
        rounds.append(0)
        return band(*args)

    def counted_scores(step, prices, band, offers, max_tokens):
        rounds[-1] += len(offers[0])
        return scores(step, prices, band, offers, max_tokens)

    monkeypatch.setattr(size_classes, "_Band", counted_band)
    monkeypatch.setattr(size_classes, "_even_scores", counted_scores)
    monkeypatch.setattr(size_classes, "EVEN_OFFERS", budget)
    step, _, floor = _fresh_step("joint", 32, 3)
    solve_mixed(tuple(step.layout.size.tolist()), step.lengths, step.workload, step.src_pos,
                None, None, PER_TOKEN, floor, COMM, MODEL)  # fmt: skip
    return rounds


def test_size_classes_start_no_round_once_their_offers_are_priced(monkeypatch):
    """A round of the size classes' pass starts only while fewer than ``EVEN_OFFERS`` offers
    have been priced: the rounds a budget allows are the rounds whose offers before them
    stay under it (every round's, under the default, on this step of 1,024 GPUs)."""
    free = _priced_by_round(monkeypatch, 1 << 30)
    assert len(free) > 2 and all(free)
    assert _priced_by_round(monkeypatch, size_classes.EVEN_OFFERS) == free
    assert _priced_by_round(monkeypatch, 1) == free[:1]
    assert _priced_by_round(monkeypatch, free[0] + free[1]) == free[:2]


@pytest.mark.parametrize("node_size", [8, 4])
def test_the_route_at_home_is_the_route_of_sequences_placed_home(node_size):
    """The stay-home pass prices sequences in their home bags by the short form of the
    route (a home bag is in its source's node unless it spans nodes): the same bits as the
    general route, with bags inside a node and, on nodes of 4, 8-GPU bags across two."""
    step, _, _ = _fresh_step("video", 4, 21)
    comm = replace(COMM, node_size=node_size)
    prices = Prices.of(step.layout.shape, step.src_pos, PER_TOKEN, comm, MODEL)
    seqs = np.flatnonzero(step.home_bag >= 0)
    home = step.home_bag[seqs]
    lengths = step.lengths[seqs].astype(np.float64)
    size = step.layout.size
    workload = step.workload[seqs]
    route = prices.route(seqs, home, home, size, lengths)
    expected = workload + prices.kappa[home] * lengths + 2 * route
    got = prices.at_home(step.workload, seqs, home, size, step.lengths[seqs])
    assert np.array_equal(got, expected)
    assert (prices.bag_node[home] < 0).any() == (node_size == 4)


def test_size_heaps_hold_each_key_s_bags_as_heaps():
    """The placement's heaps, made sorted at once: each (size class, node) key's heap holds
    exactly its bags' (per-GPU time, bag) entries, in heap order (ties in time included);
    a bag alone in its node (home to every sequence from there) or spanning nodes is in
    its overall heap only."""
    rng = np.random.default_rng(4)
    n = 300
    per = rng.choice([0.5, 1.0, 1.5, 2.0], n) + rng.integers(0, 2, n) * rng.random(n)
    class_of_bag = rng.integers(0, 3, n)
    bag_node = np.where(class_of_bag == 2, -1, rng.integers(0, 20, n))
    bag_node[[5, 9]] = [20, 21]  # each alone in its node
    heaps = _size_heaps(per, class_of_bag, bag_node)
    expected: dict = {}
    for b in range(n):
        keys = [(int(class_of_bag[b]), -2)]
        if bag_node[b] >= 0 and (bag_node == bag_node[b]).sum() > 1:
            keys.append((int(class_of_bag[b]), int(bag_node[b])))
        for key in keys:
            expected.setdefault(key, []).append((float(per[b]), b))
    assert all(node not in (-1, 20, 21) for _, node in heaps)
    alone = _size_heaps(per[:3], class_of_bag[:3], np.array([-1, 3, 4]))  # no node heap
    assert alone.keys() == {(int(c), -2) for c in class_of_bag[:3]}
    assert heaps.keys() == expected.keys()
    for key, heap in heaps.items():
        assert sorted(heap) == sorted(expected[key])
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap)))


@pytest.mark.parametrize("mix", ["joint", "mixres"])
def test_placement_heaps_top_is_the_least_loaded_bag(monkeypatch, mix):
    """Loads only grow while sequences are placed one by one, so a bag's heap entry is
    renewed only when it surfaces stale: after each sequence placed, every heap whose top
    is live (each one a search has just read) still has the least (per-GPU time, bag) of
    its bags at the top, as a scan of them finds."""
    place = mixed._PricedBags.place
    checked = []

    def row_by_row(self, rows, layout, limit):
        chosen = []
        for row in rows:
            chosen += place(self, [row], layout, limit)
            for heap in self.heaps.values():
                if heap[0][0] == self.per[heap[0][1]]:
                    assert heap[0] == min((self.per[b], b) for _, b in heap)
                    checked.append(len(heap))
        return chosen

    monkeypatch.setattr(mixed._PricedBags, "place", row_by_row)
    step, _, floor = _fresh_step(mix, 8, 3)
    solve_mixed(tuple(step.layout.size.tolist()), step.lengths, step.workload, step.src_pos,
                None, None, PER_TOKEN, floor, COMM, MODEL)  # fmt: skip
    assert len(checked) > 100 and max(checked) > 10
