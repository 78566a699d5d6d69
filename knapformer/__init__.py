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
    "Topology": "knapformer.contract.topology",
    "WorkloadModel": "knapformer.planning.workload",
    "RoutingPlan": "knapformer.contract.plan",
    "PlanStats": "knapformer.contract.stats",
    "plan_routing": "knapformer.planning.planner",
    "plan_from_legacy": "knapformer.contract.legacy",
    "read_plans": "knapformer.contract.plan_io",
    "write_jsonl": "knapformer.contract.plan_io",
    "SequenceBalancer": "knapformer.runtime.balancer",
    "BalancerConfig": "knapformer.runtime.balancer_config",
    "PlanRecorder": "knapformer.runtime.recorder",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'knapformer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
