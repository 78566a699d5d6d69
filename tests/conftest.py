"""Shared fixtures: paths of the committed sample plans, and an auto plan made here; and
the order in which `make test`'s workers take the test files (tests/suite_order.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_plans"


def pytest_addoption(parser):
    parser.addoption(
        "--record-scope-seconds",
        action="store_true",
        help="write the seconds each unit of work took to tests/scope_seconds.json "
        "(the order in which `make test` starts them)",
    )


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        from suite_order import SuiteOrder  # tests/ is on the path of its conftest

        config.pluginmanager.register(SuiteOrder(config), "knapformer-suite-order")


@pytest.fixture
def sample_dir() -> Path:
    return SAMPLES


@pytest.fixture
def plan8_path() -> Path:
    """The 8-GPU g1n2+g2n1+g4n1 sample plan (one JSON plan)."""
    return SAMPLES / "mixed8_g1n2+g2n1+g4n1.json"


@pytest.fixture
def steps50_path() -> Path:
    """50 consecutive steps of the joint mix on 32 GPUs (JSONL)."""
    return SAMPLES / "joint32_50steps.jsonl"


@pytest.fixture
def legacy_path() -> Path:
    return SAMPLES / "legacy_mixed8.json"


def auto_plan_record() -> dict:
    """A plan whose bags the planner chose (``policy: "auto"``: group sizes, cluster
    figures, aligned bags of two sizes), as JSON, with a fixed time so that what is made
    from it is reproducible. No sample holds one."""
    from knapformer.planning.planner import plan_routing
    from knapformer.planning.workload import WorkloadModel

    lengths = [[6000, 2000], [2000], [1700, 5], [1200], [900, 800], [600], [400], [300, 200]]
    plan = plan_routing(lengths, "auto", WorkloadModel(3072), step=7, run="auto")
    return json.loads(plan.model_copy(update={"time": 1.7e9}).model_dump_json())
