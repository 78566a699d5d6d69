"""One rule for which measured phase stands for a GPU's compute, used by calibration, the
straggler tools and the dashboard's predicted-vs-measured view alike."""

from __future__ import annotations

import pytest
import torch
from knapformer.visualization.straggler_figures import predicted_vs_measured_figure

from knapformer.contract.phases import COMPUTE_PHASES, RECORDED_PHASES
from knapformer.contract.plan import Measurements
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.stragglers import analyse, rank_steps
from knapformer.runtime.timing import StepTimer
from knapformer.tools.calibrate import calibrate_file


def measured_phase(plan):
    """The phase the straggler tools and their figures compare with the model."""
    return measure(plan).phase


@pytest.fixture
def plan8(plan8_path):
    return read_plans(plan8_path, on_error="raise").plans[0]


def _measured(plan, phases: list[str]):
    """``plan`` with per-GPU times (proportional to its load after) for each of ``phases``."""
    times = (plan.stats.load_after * 10 + 1).tolist()
    per_rank = {name: times for name in phases}
    return plan.model_copy(update={"measurements": Measurements(plan_ms=1.0, per_rank_ms=per_rank)})


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        (["plan", "route", "forward_backward", "optimizer", "step"], "forward_backward"),
        (["step", "compute", "forward_backward"], "compute"),
        (["step", "attn"], "attn"),
        (["step", "route"], "step"),
        (["plan", "route"], None),
    ],
)
def test_compute_phase_prefers_a_true_compute_time_and_takes_the_whole_step_last(phases, expected):
    per_rank = {name: [1.0] for name in phases}
    assert Measurements(per_rank_ms=per_rank).compute_phase() == expected


def test_compute_comes_first_and_the_whole_step_last():
    assert COMPUTE_PHASES[0] == "compute" and COMPUTE_PHASES[-1] == "step"
    # The balancer gathers by default the phases of a training loop the rule picks from
    # (its timer holds the list; SequenceBalancer(phases=...) adds to it).
    timer = StepTimer(torch.device("cpu"), phases=["forward"])
    assert timer.phases == (*RECORDED_PHASES, "forward")
    assert {"compute", "forward_backward", "step"} <= set(RECORDED_PHASES)


def test_dashboard_and_calibrate_pick_the_same_phase_of_a_recorded_demo(sample_dir):
    """The recorded demo measures plan, route, …, forward_backward, optimizer and step."""
    path = sample_dir / "demo.jsonl"
    plans = read_plans(path, on_error="raise").plans
    fitted = calibrate_file(path).phase
    shown = {measured_phase(p) for p in plans}
    assert shown == {fitted}
    window = [measure(p).figures() for p in plans]
    figure = predicted_vs_measured_figure(analyse(window), rank_steps(window))
    assert figure.layout.yaxis.title.text == f"measured {fitted} (ms)"


def test_dashboard_and_calibrate_agree_on_a_file_measuring_compute_and_step(tmp_path, plan8):
    path = tmp_path / "plans.jsonl"
    write_jsonl(path, [_measured(plan8, ["step", "compute"])] * 3)
    plan = read_plans(path, on_error="raise").plans[0]
    assert calibrate_file(path).phase == measured_phase(plan) == "compute"
