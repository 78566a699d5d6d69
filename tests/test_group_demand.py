"""The group counts a step asks for (knapformer.planning.group_demand): the mixed
partition of the bisection and its variants tile the GPUs, give every sequence a group it
fits, and the bisection's target is the least whose groups fit."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.group_demand import (
    _absorb,
    _Demand,
    least_fitting,
    mixed_counts,
    per_gpu_costs,
)
from knapformer.planning.partitions import effective_workloads
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
SIZES = (1, 2, 4, 8)


def _step(mix: str, factor: int, seed: int):
    """(eff, lengths, num_gpus, whole) of a sampled step on an NVLink cluster."""
    comm = CommModel.cluster("nvlink")
    lengths = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(seed))
    num_gpus = len(lengths)
    length = np.concatenate(lengths)
    per_token = {g: comm.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in SIZES}
    eff = effective_workloads(MODEL.workload(length), length, SIZES, per_token)
    whole = [max(float(eff[j].sum()) / num_gpus, float(eff[j].max()) / g)
             for j, g in enumerate(SIZES)]  # fmt: skip
    return eff, length, num_gpus, whole


@pytest.mark.parametrize("factor", [1, 4])
def test_every_variant_tiles_the_gpus_and_fits_each_sequence_to_its_group(factor):
    eff, length, num_gpus, whole = _step("joint", factor, 0)
    found = mixed_counts(eff, np.asarray(SIZES, float), length, num_gpus, SIZES, whole)
    assert found is not None and len(found) >= 2
    for counts, seq_class in found:
        assert int((counts * np.asarray(SIZES)).sum()) == num_gpus
        assert (counts >= 0).all() and (counts[1:] > 0).any()  # a mixed partition
        big = seq_class > 0
        assert (length[big] >= np.asarray(SIZES)[seq_class[big]]).all()
    assert len({tuple(c.tolist()) for c, _ in found}) == len(found)  # no repeats
    again = mixed_counts(eff, np.asarray(SIZES, float), length, num_gpus, SIZES, whole)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(found, again, strict=True))  # fmt: skip


def test_one_variant_merges_the_largest_groups_in_pairs():
    eff, length, num_gpus, whole = _step("joint", 4, 1)
    found = [c for c, _ in mixed_counts(eff, np.asarray(SIZES, float), length, num_gpus,
                                        SIZES, whole)]  # fmt: skip

    def merged(v, w) -> bool:
        top = int(np.flatnonzero(v)[-1])
        return (top + 1 < len(SIZES) and v[top] > 1 and w[top + 1] == v[top] // 2
                and w[top] == v[top] % 2 and np.array_equal(w[:top], v[:top]))  # fmt: skip

    assert any(merged(v, w) for v in found for w in found)


def test_the_bisection_finds_the_least_target_whose_groups_fit():
    eff, length, num_gpus, whole = _step("joint", 4, 2)
    size = np.asarray(SIZES, float)
    smallest, cheapest = per_gpu_costs(eff, length, size)
    lo = max(float(eff[0].sum()) / num_gpus, cheapest)
    need = _Demand(eff, size, length, num_gpus, 1, np.flatnonzero(smallest > lo))
    target = need.least_target(lo, min(whole))
    assert target is not None and lo < target <= min(whole)
    used, _, cls = need.at(target)
    assert used <= num_gpus and need.fits(target)
    # every big sequence is under the target per GPU in its class's group
    assert (need.big_per_gpu[cls, np.arange(len(need.big))] <= target).all()
    assert not need.fits(target * (1 - 1e-6))  # least: a hair below it does not fit
    assert need.least_target(lo, lo * (1 + 1e-9)) is None  # no fit in a bracket too low


def test_the_bisection_closes_on_the_threshold_from_above():
    found = least_fitting(lambda t: t >= np.pi, 0.0, 10.0)
    assert np.pi <= found <= np.pi + 10.0 / 2**39  # fits, and within the last halving


def _absorb_one_group_at_a_time(cls, top, merged, big_eff, size, target):
    """`_absorb` as its doc reads, every group scored for every sequence (the oracle)."""
    bins = np.repeat([top + 1, top], [merged[top + 1], merged[top]])
    cap, held, out = size[bins] * target * (1 + 1e-9), np.zeros(len(bins)), cls.copy()
    tops = np.flatnonzero(cls == top)
    for x in tops[np.argsort(-big_eff[top + 1, tops], kind="stable")]:
        fit = np.flatnonzero(held + big_eff[bins, x] <= cap)
        if fit.size == 0:
            return None
        b = fit[np.argmin(held[fit] / size[bins[fit]])]  # least per GPU, first on a tie
        held[b] += big_eff[bins[b], x]
        out[x] = bins[b]
    lower = np.flatnonzero((cls > 0) & (cls < top))
    for x in lower[np.argsort(-big_eff[0, lower], kind="stable")]:
        fit = np.flatnonzero(held + big_eff[bins, x] <= cap)
        if fit.size:
            b = fit[np.argmax(held[fit] / cap[fit])]  # the fullest, first on a tie
            held[b] += big_eff[bins[b], x]
            out[x] = bins[b]
    return None if np.array_equal(out, cls) else out


def test_absorb_chooses_the_groups_scoring_every_group_would():
    # Few distinct costs: ties between groups (and between kinds) are the usual case.
    rng = np.random.default_rng(7)
    size = np.asarray(SIZES, float)
    outcomes, odd_groups = set(), set()
    for _ in range(400):
        n, top = int(rng.integers(1, 40)), int(rng.integers(1, 3))
        cls = rng.integers(0, top + 1, n)
        merged = np.zeros(len(SIZES), dtype=np.int64)
        merged[top + 1], merged[top] = rng.integers(1, 6), rng.integers(0, 2)
        big_eff = rng.integers(1, 6, (len(SIZES), n)) * float(rng.choice([1.0, 0.1, 1 / 3]))
        target = float(rng.choice([0.7, 1.0, 2.5]))
        got = _absorb(cls, top, merged, big_eff, size, target)
        want = _absorb_one_group_at_a_time(cls, top, merged, big_eff, size, target)
        assert (got is None) == (want is None)
        assert got is None or np.array_equal(got, want)
        outcomes.add(None if got is None else "moved")
        odd_groups.add(int(merged[top]))
    assert outcomes == {None, "moved"}  # both outcomes exercised
    assert odd_groups == {0, 1}  # the merged groups alone (one heap) and beside an odd one
