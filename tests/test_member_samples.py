"""The spread samples of a bag's members the exchange passes score
(knapformer.planning.exchanges): one bag at a time (`spread_sample`) and many at once
(`member_samples`) take the same sample, light to heavy, ends included."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.planning.exchanges import member_samples, spread_sample


def _bags(seed: int, num_bags: int = 6):
    """(workload, bag of each sequence, sequences sorted by bag then lightest first, cuts)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 90, num_bags)
    bag = np.repeat(np.arange(num_bags), counts)
    rng.shuffle(bag)
    workload = rng.random(len(bag)).round(2)  # rounded: ties, broken by position
    by_weight = np.argsort(workload, kind="stable")
    order = by_weight[np.argsort(bag[by_weight], kind="stable")]
    cuts = np.searchsorted(bag[order], np.arange(num_bags + 1))
    return workload, bag, order, cuts


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("most", [1, 2, 7, 32])
def test_one_bag_and_many_bags_take_the_same_sample(seed, most):
    workload, bag, order, cuts = _bags(seed)
    rows = member_samples(order, cuts, np.arange(len(cuts) - 1), most)
    for b, row in enumerate(rows):
        members = np.flatnonzero(bag == b)
        one = spread_sample(members.tolist(), workload, most)
        if len(members) > most:
            assert one.tolist() == row.tolist()
        else:  # all of them, as given; the many-bag rows sorted light to heavy, -1 padded
            assert sorted(one.tolist()) == sorted(members.tolist())
            assert row[len(members) :].tolist() == [-1] * (most - len(members))
            assert sorted(row[: len(members)].tolist()) == sorted(members.tolist())


@pytest.mark.parametrize("count, most", [(100, 32), (33, 32), (1000, 12), (5, 2)])
def test_a_sample_spans_light_to_heavy_without_repeats(count, most):
    workload = np.random.default_rng(count).random(count)
    members = list(range(count))
    sample = spread_sample(members, workload, most)
    assert len(sample) == most == len(set(sample.tolist()))
    weights = workload[sample]
    assert (np.diff(weights) >= 0).all()
    assert weights[0] == workload.min() and weights[-1] == workload.max()
