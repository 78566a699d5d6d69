"""Every step of every shipped sample plan re-plans identically with this planner (what
`knapformer replay` checks first), and every sample names the planner that made it."""

from __future__ import annotations

from pathlib import Path

import pytest

import knapformer
from knapformer.contract.plan_io import read_plans
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.replay import first_difference, renumber, replan_skip_reason

SAMPLES = Path(__file__).resolve().parent.parent / "sample_plans"
PLAN_FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".json", ".jsonl"))


def _replanned(plan):
    """The plan this planner makes from the recorded lengths and options."""
    lengths = [plan.sequences.length[plan.sequences.src_gpu == g] for g in plan.gpus]
    model = WorkloadModel(plan.token_dim, plan.gamma, plan.scale or 1.0, plan.workload_unit)
    return plan_routing(
        lengths,
        plan.topology,
        model,
        solver=plan.solver,
        max_tokens_per_gpu=plan.solver_options.get("max_tokens_per_gpu"),
        gpus=plan.gpus,
        step=plan.step,
        gpu_speed=plan.gpu_speed,
    )


@pytest.mark.parametrize("path", PLAN_FILES, ids=[p.name for p in PLAN_FILES])
def test_every_step_of_every_sample_replans_identically(path):
    plans = read_plans(path, on_error="raise").plans
    assert plans
    for plan in plans:
        if replan_skip_reason(plan) is not None:  # a legacy plan: nothing to re-plan with
            assert plan.planner_version is None
            continue
        assert plan.planner_version == knapformer.__version__, path.name
        local = renumber(plan)
        difference = first_difference(local, renumber(_replanned(plan)), list(plan.gpus))
        assert difference is None, f"{path.name} step {plan.step}: {difference}"
