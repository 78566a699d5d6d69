"""How loads are shown to people: one unit and one number format for every view.

A plan whose workloads are calibrated milliseconds (``workload_unit == "ms"``: the model
carried the time scale ``knapformer calibrate`` fits) shows loads in ms. Any other plan
shows them relative to its mean GPU (the ideal per-GPU load = 1.00): raw model units
(``8.227e-05``) mean nothing to a reader. Numbers have 3 significant figures and
thousands separators. `show`, the dashboard, the animation and the report all use this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from knapformer.contract.plan import RoutingPlan


@dataclass(frozen=True)
class LoadUnit:
    """Multiply a load by ``factor`` to show it in this unit."""

    factor: float
    suffix: str  # after a number: " ms" or "" (relative)
    axis_title: str  # e.g. "load (ms)"
    relative: bool

    @classmethod
    def of(cls, plan: RoutingPlan) -> LoadUnit:
        if plan.workload_unit == "ms":
            return cls(1.0, " ms", "load (ms)", relative=False)
        mean = plan.stats.mean_load
        return cls(1.0 / mean if mean > 0 else 1.0, "", "load (mean GPU = 1.00)", relative=True)

    def format(self, value: float) -> str:
        """``value`` (in plan units) shown in this unit: ``"1,230 ms"``, ``"0.998"``."""
        return significant(value * self.factor) + self.suffix

    @property
    def name(self) -> str:
        """What a column of these numbers is called: ``"ms"`` or ``"× mean"``."""
        return "× mean" if self.relative else "ms"


def round_significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant figures (for tables that sort numbers)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def round_significant_array(values: np.ndarray, digits: int = 3) -> np.ndarray:
    """`round_significant` of every element (zeros and non-finite values unchanged)."""
    values = np.asarray(values, dtype=np.float64)
    fine = np.isfinite(values) & (values != 0)
    out = values.copy()
    decimals = digits - 1 - np.floor(np.log10(np.abs(values[fine])))
    scale = 10.0**decimals
    out[fine] = np.round(values[fine] * scale) / scale
    return out


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant figures and thousands separators:
    ``12345.6 -> "12,300"``, ``1.23456 -> "1.23"``, ``0.00123456 -> "0.00123"``."""
    rounded = round_significant(value, digits)
    if rounded == 0 or not math.isfinite(rounded):
        return str(rounded) if rounded else "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:,.{decimals}f}"
