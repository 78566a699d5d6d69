"""Where each GPU rank sits in a plan's list of GPUs: the lookup the validator, the
statistics, the router and the views share."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

# GpuPositions keeps a dense table (one gather per lookup) of ranks below _DENSE_RANKS
# (512 KB) or spanning at most _DENSE_SPAN_FACTOR times their count; else binary search.
_DENSE_RANKS = 2**16
_DENSE_SPAN_FACTOR = 4


class GpuPositions:
    """Where each GPU rank sits in a plan's ``gpus``: ``positions[ranks]`` is an int64 array
    of ``ranks``' shape holding each rank's index in ``gpus``, -1 for a rank not in it.

    Memory and time grow with the number of GPUs, never with the ranks' values (a plan
    naming rank 10⁹ must not allocate 8 GB). The router looks up every chunk of every
    step here, so the usual case is one gather into a dense table indexed by rank: ranks
    below 2¹⁶ or 4× the GPU count (every balance group of a job of that size). Ranks
    that span little more than their count (one group of a larger world) use a table
    offset by the smallest rank; sparse ranks are binary-searched.
    """

    def __init__(self, gpus: ArrayLike):
        gpus = np.asarray(gpus, dtype=np.int64).reshape(-1)
        self.num_gpus = n = len(gpus)
        low, high = (int(gpus.min()), int(gpus.max())) if n else (0, -1)
        self._table: np.ndarray | None = None
        if low >= 0 and high < max(_DENSE_SPAN_FACTOR * n, _DENSE_RANKS):
            self._low = 0
        elif high - low < _DENSE_SPAN_FACTOR * n:
            self._low = low
        else:
            order = np.argsort(gpus, kind="stable")
            self._order, self._sorted = order, gpus[order]
            return
        self._table = np.full(high - self._low + 1, -1, dtype=np.int64)
        self._table[gpus - self._low] = np.arange(n)

    def __getitem__(self, ranks: ArrayLike) -> np.ndarray:
        ranks = np.asarray(ranks, dtype=np.int64)
        table = self._table
        if table is None:
            if not self.num_gpus:
                return np.full(ranks.shape, -1, dtype=np.int64)
            at = np.minimum(np.searchsorted(self._sorted, ranks), self.num_gpus - 1)
            return np.where(self._sorted[at] == ranks, self._order[at], -1)
        # Hot path: bounds by two reductions, then one gather (no temporary arrays: at
        # router sizes, fresh temporaries cost more in page faults than the gather).
        if ranks.size == 0 or (ranks.min() >= self._low and ranks.max() < self._low + len(table)):
            return table[ranks - self._low] if self._low else table[ranks]
        index = ranks - self._low
        inside = (index >= 0) & (index < len(table))
        out = np.full(ranks.shape, -1, dtype=np.int64)
        out[inside] = table[index[inside]]
        return out

    def contains(self, ranks: ArrayLike) -> np.ndarray:
        """Boolean mask of ``ranks``' shape: which of them are GPUs of the plan."""
        return self[ranks] >= 0


def gpu_positions(gpus: ArrayLike) -> GpuPositions:
    """`GpuPositions` of ``gpus`` (distinct ranks; ``positions[ranks]``, -1 for strangers)."""
    return GpuPositions(gpus)
