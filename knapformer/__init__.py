"""KnapFormer: an online load balancer for Diffusion-Transformer training on
heterogeneous data, and the toolkit to record, show, animate and debug its plans.

Importing this package needs neither CUDA, Dash nor manim; the distributed pieces are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"  # the one home of the version (pyproject reads it)

_EXPORTS = {
    "Topology": "knapformer.topology",
    "WorkloadModel": "knapformer.workload",
    "RoutingPlan": "knapformer.plan",
    "PlanStats": "knapformer.stats",
    "plan_routing": "knapformer.planner",
    "read_plans": "knapformer.plan_io",
    "write_jsonl": "knapformer.plan_io",
    "SequenceBalancer": "knapformer.balancer",
    "PlanRecorder": "knapformer.recorder",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'knapformer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
