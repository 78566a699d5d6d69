"""`knapformer tensorboard` and `knapformer.contract.scalars`: per-step scalars written with the
tensorboard package and read back from the event files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.contract.scalars import TAG_PREFIX, open_writer, step_figures, write_step
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Tag -> [(step, value, wall time)] of the event files in ``logdir``."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_demo_run_scalars_read_back_as_recorded(sample_dir, tmp_path, capsys):
    plans = read_plans(sample_dir / "demo.jsonl", on_error="raise").plans
    assert main(["tensorboard", str(sample_dir / "demo.jsonl"), "--logdir", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert f"{len(plans)} steps in 1 run" in said and f"tensorboard --logdir {tmp_path}" in said
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert run.name == plans[0].run == "demo"
    got = _scalars(run)
    expected_tags = {
        "imbalance_before",
        "imbalance_after",
        "moved_fraction",
        "modelled_speedup",
        "plan_ms",
        "compute_max_ms",
        "compute_mean_ms",
        "compute_max_over_mean",
    }
    assert set(got) == {TAG_PREFIX + name for name in expected_tags}
    for name in expected_tags:
        series = got[TAG_PREFIX + name]
        assert [s for s, _, _ in series] == [p.step for p in plans]
        # Event files hold float32: compare at that precision.
        np.testing.assert_allclose(
            [v for _, v, _ in series], [step_figures(p)[name] for p in plans], rtol=1e-6
        )
        np.testing.assert_allclose([t for _, _, t in series], [p.time for p in plans])
    # The measured figure is what it says: max over mean of the compute phase's times.
    plan = plans[-1]
    phase = plan.measurements.compute_phase()
    times = np.asarray(plan.measurements.per_rank_ms[phase])
    assert got[TAG_PREFIX + "compute_max_over_mean"][-1][1] == pytest.approx(
        times.max() / times.mean(), rel=1e-6
    )


def test_a_folder_of_runs_gives_one_tensorboard_run_each(tmp_path):
    model = WorkloadModel(256)
    for run, topology in (("g1n4", "g1n4"), ("mixed", "g1n2+g2n1")):
        (tmp_path / "runs" / run).mkdir(parents=True)
        lengths = [[300, 20], [900], [50], [40]]
        plans = [plan_routing(lengths, topology, model, step=s) for s in (4, 5)]
        write_jsonl(tmp_path / "runs" / run / "plans.jsonl", plans)
    logdir = tmp_path / "tb"
    assert main(["tensorboard", str(tmp_path / "runs"), "--logdir", str(logdir)]) == 0
    assert sorted(p.name for p in logdir.iterdir()) == ["g1n4", "mixed"]
    one_gpu_bags = _scalars(logdir / "g1n4")
    # Planned offline: modelled figures and the planning time, no measured compute.
    assert set(one_gpu_bags) == {
        TAG_PREFIX + n
        for n in (
            "imbalance_before", "imbalance_after", "moved_fraction", "modelled_speedup", "plan_ms",
        )
    }  # fmt: skip
    assert [s for s, _, _ in one_gpu_bags[TAG_PREFIX + "imbalance_after"]] == [4, 5]
    mixed = _scalars(logdir / "mixed")
    # A 900-token sequence split over a 2-GPU bag balances better than 1-GPU bags can.
    assert (
        mixed[TAG_PREFIX + "imbalance_after"][0][1]
        < one_gpu_bags[TAG_PREFIX + "imbalance_after"][0][1]
    )


def test_write_step_takes_the_plans_step_or_the_given_index(tmp_path):
    plan = plan_routing([[100], [700]], "g1n2", WorkloadModel(64))
    assert plan.step is None
    writer = open_writer(tmp_path)
    try:
        assert write_step(writer, plan, 17) == len(step_figures(plan)) == 5
    finally:
        writer.close()
    got = _scalars(tmp_path)
    assert got[TAG_PREFIX + "moved_fraction"][0][0] == 17
    assert got[TAG_PREFIX + "imbalance_before"][0][1] == pytest.approx(
        plan.stats.imbalance_before, rel=1e-6
    )
