"""Whose link is slow: each rank's bandwidth in the link probe, relative to the group's.

The link probe (`knapformer.contract.probe`) times pairs of ranks that exchange alone, so
a slow link slows exactly the pairs of its own rank. Per probed step and per kind of
link (inside a node, across nodes), a rank's **best link** is the fastest of its pairs
of that kind, and its **relative bandwidth** is that over the median of every rank's
best link of the kind (the least over the kinds it has pairs of): 1 = as fast as the
group's links, 0.1 = a tenth of it.

Why the best link: a healthy rank has at least one healthy partner in a probe of three or
more ranks, so its best link is a healthy one, while every pair of the slow rank is slow
and so is its best. Noise only ever slows a pair (a descheduled end), which the best
link of a healthy rank shrugs off. With two ranks both have the same single pair: the
probe cannot say which end is slow, both come out 1, and no rank is named.

Pure numpy over `knapformer.diagnosis.measured.RankFigures`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knapformer.diagnosis.measured import RankFigures


def relative_bandwidth(figures: Sequence[RankFigures], ranks: np.ndarray) -> np.ndarray:
    """(r, s) each rank's relative bandwidth (the module doc) in each step of ``figures``
    for ``ranks`` (sorted); NaN where the step ran no probe or the rank had no pair."""
    out = np.full((len(ranks), len(figures)), np.nan)
    for s, f in enumerate(figures):
        p = f.probed
        if p is None or not len(p.a):
            continue
        gbps = p.gbps
        for kind in (False, True):
            take = (p.cross_node == kind) & np.isfinite(gbps)
            if not take.any():
                continue
            best = np.full(len(ranks), -np.inf)
            for end in (p.a[take], p.b[take]):
                at = np.searchsorted(ranks, end).clip(max=len(ranks) - 1)
                known = ranks[at] == end  # a rank outside ``ranks`` is not this analysis's
                np.maximum.at(best, at[known], gbps[take][known])
            has = np.isfinite(best)
            reference = float(np.median(best[has]))
            if reference <= 0:
                continue
            relative = np.where(has, best / reference, np.nan)
            out[:, s] = np.fmin(out[:, s], relative)  # the worse kind; NaN: the other's
    return out
