"""Whose link is slow: each rank's bandwidth in the link probe, relative to the group's.

The link probe (`knapformer.contract.probe`) times pairs of ranks that exchange alone, so
a slow link slows exactly the pairs of its own rank. For a rank ``r`` and a probed step,
each of its pairs is compared with the typical pair of the same kind (inside a node, or
across nodes) that ``r`` takes no part in: the median bandwidth of those pairs over the
window, so that ``r``'s own slowness never sets its reference. The rank's **relative
bandwidth** in the step is the median over its pairs of that ratio (1 = as fast as its
peers' links; 0.1 = a tenth of it).

Why this localises: a healthy rank meets the slow one in at most one pair per round, so
its median stays near 1, while every pair of the slow rank is slow. With two ranks there
is one pair and nothing to compare it with (NaN): the probe cannot say which end is
slow, and no rank is named. A GPU count of 3 or more can.

Pure numpy over `knapformer.diagnosis.measured.RankFigures`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from knapformer.diagnosis.measured import RankFigures

#: Above this many ranks, a rank's pairs are a negligible share of all pairs: the
#: reference is then the median of every pair of the kind, which is far cheaper.
_EXACT_UP_TO = 32


def relative_bandwidth(figures: Sequence[RankFigures], ranks: np.ndarray) -> np.ndarray:
    """(r, s) each rank's relative bandwidth (the module doc) in each step of
    ``figures``; NaN where the step ran no probe, the rank had no pair in it, or no pair
    without it is known."""
    out = np.full((len(ranks), len(figures)), np.nan)
    probed = [(s, f.probed) for s, f in enumerate(figures) if f.probed is not None]
    if not probed:
        return out
    step = np.concatenate([np.full(len(p.a), s) for s, p in probed])
    a = np.concatenate([p.a for _, p in probed])
    b = np.concatenate([p.b for _, p in probed])
    cross = np.concatenate([p.cross_node for _, p in probed])
    gbps = np.concatenate([p.gbps for _, p in probed])
    known = np.isfinite(gbps)
    step, a, b, cross, gbps = step[known], a[known], b[known], cross[known], gbps[known]
    exact = len(ranks) <= _EXACT_UP_TO
    overall = {kind: _median(gbps[cross == kind]) for kind in (False, True)}
    for i, rank in enumerate(ranks.tolist()):
        mine = (a == rank) | (b == rank)
        if not mine.any():
            continue
        if exact:
            reference = {kind: _median(gbps[~mine & (cross == kind)]) for kind in (False, True)}
        else:
            reference = overall
        ref = np.where(cross[mine], reference[True], reference[False])
        ratio = gbps[mine] / ref
        for s in np.unique(step[mine]):
            values = ratio[step[mine] == s]
            if np.isfinite(values).any():
                out[i, s] = np.nanmedian(values)
    return out


def _median(values: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no pair of the kind: NaN
        return float(np.median(values)) if values.size else float("nan")
