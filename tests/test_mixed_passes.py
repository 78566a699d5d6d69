"""The fast paths of a mixed partition's passes over every sequence give the plain
formulation's results bit for bit: the bisections' classes and sums kept between targets
(`Kept`, in `_Demand` and `partition_floor`), the group counts in Python numbers
(`_Demand`), the largest least cost over the dearest sequences only (`per_gpu_costs`),
the short sequences' sums cut by masks (`_filling_sums`), and the prices at home by runs
of one kind of home bag (`Prices.at_home`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from knapformer.planning.bags import bag_shape
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.group_demand import (
    TIE,
    _Demand,
    _filling_sums,
    fitting_costs,
    least_fitting,
    per_gpu_costs,
)
from knapformer.planning.partitions import effective_workloads, partition_floor
from knapformer.planning.pricing import Prices, _home_runs
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
SIZES = (1, 2, 4, 8)


def _demand(mix: str, factor: int, seed: int):
    """(the step's `_Demand` above the mean, its bracket (lo, hi), eff, lengths)."""
    comm = CommModel.cluster("nvlink")
    lengths = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(seed))
    num_gpus, length = len(lengths), np.concatenate(lengths)
    per_token = {g: comm.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in SIZES}
    eff = effective_workloads(MODEL.workload(length), length, SIZES, per_token)
    size = np.asarray(SIZES, dtype=np.float64)
    smallest, cheapest = per_gpu_costs(eff, length, size)
    lo = max(float(eff[0].sum()) / num_gpus, cheapest)
    hi = min(max(float(eff[j].sum()) / num_gpus, float(eff[j].max()) / g)
             for j, g in enumerate(SIZES))  # fmt: skip
    big = np.flatnonzero(smallest > lo)
    return _Demand(eff, size, length, num_gpus, SIZES[0], big), (lo, hi), eff, length


def _plain_at(need: _Demand, target: float):
    """`_Demand.at` as one numpy pass over every big sequence at each target."""
    ok = need.big_per_gpu <= target
    if not ok.any(axis=0).all():
        return None
    cls = ok.argmax(axis=0)
    cells = (cls, np.arange(len(need.big)))
    load = np.bincount(cls, weights=need.big_eff[cells], minlength=len(need.size))
    alone = need.big_per_gpu[cells] > 0.5 * target
    size = need.size
    groups = np.maximum(np.ceil(load / (size * target) - TIE),
                        np.bincount(cls[alone], minlength=len(size))).astype(np.int64)  # fmt: skip
    load[0] += need.x0_small
    groups[0] = 0
    slack = groups * size * target - load
    fill = np.minimum(slack / need.inflation, need.fill_base)[1:].sum()
    groups[0] = int(np.ceil(max(0.0, load[0] - fill) / (size[0] * target) - TIE))
    return int((groups * size).sum()), groups, cls


@pytest.mark.parametrize(("mix", "factor"), [("joint", 4), ("mixres", 4), ("video", 1)])
def test_the_bisection_gives_the_plain_counts_at_every_target(mix, factor):
    # The targets a bisection visits (each close to the last: classes kept), then jumps
    # across the whole bracket and below it (classes renewed, or no fit at all).
    need, (lo, hi), _, _ = _demand(mix, factor, 11)
    assert len(need.big) > 0
    targets, a, b = [], lo, hi
    for _ in range(40):
        mid = 0.5 * (a + b)
        targets.append(mid)
        a, b = (a, mid) if need.fits(mid) else (mid, b)
    targets += [hi, lo, 0.5 * lo, hi * 1.5, *np.linspace(lo, hi, 9).tolist()]
    renewed = set()
    for target in targets:
        before = need.classes.last
        got, plain = need.at(target), _plain_at(need, target)
        if need.classes.last is not before:
            renewed.add(target)
        if plain is None:
            assert got is None
            continue
        assert got[0] == plain[0]
        assert np.array_equal(got[1], plain[1]) and got[1].dtype == plain[1].dtype
        assert np.array_equal(got[2], plain[2])
    assert 0 < len(renewed) < len(targets)  # both paths ran


@pytest.mark.parametrize("mix", ["video", "seqheavy"])
def test_filling_sums_by_masks_are_the_sums_by_ids(mix):
    _, _, eff, lengths = _demand(mix, 1, 3)
    small = lengths < np.quantile(lengths, 0.9)
    small[::7] = True  # some longer ones too: a set cut per size
    seqs, alone, there = np.flatnonzero(small), [], []
    for j, g in enumerate(SIZES):
        if j:
            seqs = seqs[lengths[seqs] >= g]
        alone.append(float(eff[0, seqs].sum()))
        there.append(float(eff[j, seqs].sum()))
    assert _filling_sums(eff, lengths, np.asarray(SIZES, dtype=np.float64), small) == (
        alone,
        there,
    )


@pytest.mark.parametrize("node_size", [8, 4])
def test_prices_at_home_by_runs_are_the_looked_up_prices(node_size):
    # 2,048 GPUs in runs of 8-GPU and one-GPU bags (on nodes of 4, the 8-GPU bags span
    # two), about 30 sequences each, sources in order: the runs path; shuffled: the plain.
    comm = replace(CommModel.cluster("nvlink"), node_size=node_size)
    per_token = {g: comm.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in SIZES}
    shape = bag_shape((8,) * 64 + (1,) * 1024 + (8,) * 64 + (2,) * 256)
    num_gpus = int(shape.size.sum())
    rng = np.random.default_rng(5)
    src = np.sort(rng.integers(0, num_gpus, 30 * num_gpus))
    lengths = rng.integers(1, 20_000, len(src))
    workload = MODEL.workload(lengths)
    prices = Prices.of(shape, src, per_token, comm, MODEL)
    home = shape.bag_of_pos[src]
    seqs = np.arange(len(src))
    runs = _home_runs(prices, home, shape.size)
    assert runs is not None and len(runs) == 4
    assert any(r[3] == 0.0 for r in runs) and any(r[3] > 0 for r in runs)  # one-GPU bags too
    plain = prices._at_home_gathered(workload, seqs, home, shape.size, lengths)
    got = prices.at_home(workload, seqs, home, shape.size, lengths)
    assert np.array_equal(got, plain)
    route = prices.route(seqs, home, home, shape.size, lengths.astype(np.float64))
    assert np.array_equal(got, workload + prices.kappa[home] * lengths + 2 * route)
    mixed = rng.permutation(len(src))  # homes out of order: looked up one by one
    assert _home_runs(prices, home[mixed], shape.size) is None
    assert np.array_equal(
        prices.at_home(workload, mixed, home[mixed], shape.size, lengths[mixed]), plain[mixed]
    )


@pytest.mark.parametrize(("mix", "factor"), [("video", 4), ("joint", 4), ("lowres", 1)])
def test_the_largest_least_cost_is_the_plain_one(mix, factor):
    # Sampled steps, then every sequence as dear (all looked at), and short ones that
    # fit the smallest group alone.
    _, _, eff, lengths = _demand(mix, factor, 7)
    size = np.asarray(SIZES, dtype=np.float64)
    flat = np.tile(eff[:, :1], (1, 50))
    short = lengths.copy()
    short[::3] = 3
    for costs, length in ((eff, lengths), (flat, lengths[:50]), (eff, short)):
        plain = costs[0] / size[0]
        for j in range(1, len(size)):
            plain = np.minimum(plain, np.where(length >= size[j], costs[j] / size[j], np.inf))
        smallest, largest = per_gpu_costs(costs, length, size)
        assert np.array_equal(smallest, costs[0] / size[0])
        assert largest == float(plain.max())


@pytest.mark.parametrize(("mix", "factor"), [("video", 4), ("joint", 4), ("seqheavy", 1)])
def test_the_partition_floor_is_the_plain_bisection(mix, factor):
    need, _, eff, lengths = _demand(mix, factor, 9)
    size = np.asarray(SIZES, dtype=np.float64)
    smallest, cheapest = per_gpu_costs(eff, lengths, size)
    lo = max(float(eff.min(axis=0).sum()) / need.num_gpus, cheapest)
    big = np.flatnonzero(smallest > lo)
    assert big.size > 0
    rest = float(np.delete(eff[0], big).sum())
    fits, per_gpu = fitting_costs(eff, lengths, size, big)
    big_eff = np.where(fits, eff[:, big], np.inf)

    def fits_at(target: float) -> bool:  # every comparison made anew at each target
        cost = np.where(per_gpu <= target, big_eff, np.inf).min(axis=0)
        return float(cost.sum()) + rest <= need.num_gpus * target

    hi = lo
    while not fits_at(hi):
        hi *= 2.0
    assert partition_floor(eff, lengths, SIZES, need.num_gpus) == least_fitting(fits_at, lo, hi)
