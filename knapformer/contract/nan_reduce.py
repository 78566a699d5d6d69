"""numpy's NaN-skipping reductions, NaN for a slice with no value, without a warning.

``np.nanmedian`` and its kin warn on an all-NaN slice. A rank absent from every step of
a window, or a step nobody measured, is such a slice on purpose, and silencing the warning
with ``warnings.catch_warnings`` is not thread-safe: the dashboard analyses plans in its
server's threads, where one thread's filter is lost or leaks into another's.
`nan_reduce` never reaches numpy with an all-NaN slice. `nan_to_zero` is
``np.nan_to_num`` in fewer passes over a large array.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def nan_reduce(
    reduce: Callable[..., np.ndarray], values: np.ndarray, axis: int | None = None
) -> np.ndarray | float:
    """``reduce`` (``np.nanmedian``, ``np.nanmean``, ``np.nanmax``, ``np.nanmin``) of
    ``values`` along ``axis``, NaN where a slice holds no value (not NaN); a float for
    ``axis=None``."""
    x = np.asarray(values, dtype=np.float64)
    missing = np.isnan(x)
    if axis is None:
        return float(reduce(x[~missing])) if not missing.all() else float("nan")
    if x.size and not missing.any():  # the usual window: no figure to mask
        if reduce is np.nanmedian:
            return _nanmedian(x, axis, x.shape[axis], x is not values)
        return reduce(x, axis=axis)
    count = x.shape[axis] - missing.sum(axis=axis)
    some = count > 0
    if not some.any():
        return np.full(some.shape, np.nan)
    # Slices without a value are filled with zeros, which reduce quietly, then masked.
    filled = x if some.all() else np.where(np.expand_dims(~some, axis), 0.0, x)
    if reduce is np.nanmedian:
        middle = _nanmedian(filled, axis, np.expand_dims(count, -1), filled is not values)
        return np.where(some, middle, np.nan)
    return np.where(some, reduce(filled, axis=axis), np.nan)


def _nanmedian(x: np.ndarray, axis: int, count: int | np.ndarray, own: bool) -> np.ndarray:
    """``np.nanmedian(x, axis)`` of slices that hold ``count`` values each (an int, or
    one per slice: the other axes in order, then 1), by one sort: numpy's goes slice by
    slice in Python (0.4 s for a 1,024 x 1,000 window, a few ms here). The same values:
    the middle one, or the mean of the middle two. ``own``: ``x`` may be sorted in place."""
    ordered = np.moveaxis(x, axis, -1)
    if not (own and ordered.flags.c_contiguous):
        # a copy with each slice contiguous: sorting along a strided axis took 1.6x longer
        ordered = np.array(ordered, order="C")
    ordered.sort(axis=-1)  # NaN sorts last
    if isinstance(count, int):
        low, high = ordered[..., (count - 1) // 2], ordered[..., count // 2]
    else:
        count = np.maximum(count, 1)  # a slice without a value: any (the caller masks it)
        low = np.take_along_axis(ordered, (count - 1) // 2, axis=-1)[..., 0]
        high = np.take_along_axis(ordered, count // 2, axis=-1)[..., 0]
    return (low + high) / 2


_LARGEST = float(np.finfo(np.float64).max)


def nan_to_zero(values, copy: bool = True, nan: float = 0.0) -> np.ndarray:
    """``np.nan_to_num(values, nan=nan)`` as float64 (NaN as ``nan``, 0 by default; +-inf
    as the largest finite floats), the same values: numpy looks for each of NaN, +inf and
    -inf in a pass of its own (a million rows a phase in a store window), this once for
    NaN and once for any inf. ``copy=False`` changes a float64 ``values`` in place."""
    out = np.array(values, dtype=np.float64, copy=copy or None)
    np.copyto(out, nan, where=np.isnan(out))
    infinite = np.isinf(out)
    if infinite.any():
        np.copyto(out, np.where(out > 0, _LARGEST, -_LARGEST), where=infinite)
    return out
