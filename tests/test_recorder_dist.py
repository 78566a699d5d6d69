"""PlanRecorder in a real gloo process group (4 processes, 2 balance groups of 2 ranks):
per-rank times gathered to each group's writer, `every` honoured on all ranks, one file
per group, non-writing ranks do no I/O. A stand-in balancer sets exactly known timings."""

from __future__ import annotations

import os

import pytest

from knapformer.local.launcher import launch
from knapformer.plan_io import read_plans


def worker(rank: int, world: int, out: str) -> dict:
    """One rank: 5 steps of a stand-in balancer with known timings, every=2."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    import torch.distributed as dist

    from knapformer.planner import plan_routing
    from knapformer.recorder import PlanRecorder
    from knapformer.workload import WorkloadModel

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("knapformer.recorder").addHandler(handler)
    groups = [[0, 1], [2, 3]]
    handles = [dist.new_group(g) for g in groups]  # every rank creates every group
    mine = next(i for i, g in enumerate(groups) if rank in g)
    fake = SimpleNamespace(
        rank=rank,
        group_ranks=groups[mine],
        group=handles[mine],
        step=-1,
        timings={},
        previous_timings={},
    )
    rec = PlanRecorder(os.path.join(out, "plans.jsonl"), every=2, phases=["custom"])
    model = WorkloadModel(64)
    for step in range(5):
        lengths = [np.array([100 * (g + 1) + step, 7]) for g in groups[mine]]
        plan = plan_routing(lengths, "g1n2", model, gpus=groups[mine], step=step)
        fake.step = step
        fake.previous_timings, fake.timings = (
            fake.timings,
            {
                "route": 1000.0 * rank + step,
                "custom": 0.5 * rank,
                "unlisted": 1.0,
            },
        )
        if step > 0:
            fake.previous_timings["step"] = 10.0 * step
        if rank == 3:  # a phase only some ranks measured
            fake.timings["pre_attn"] = 2.0
        rec.on_step(fake, plan)
    rec.finish(fake)
    rec.close()
    return {
        "rank": rank,
        "thread": rec._thread is not None,
        "written": rec.written,
        "file": None if rec.file_path is None else str(rec.file_path),
        "warnings": warnings,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # Raises, naming the rank, unless all four workers returned.
    results = launch(worker, 4, (str(out),), deadline_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    return out, dict(enumerate(results))


def test_each_group_writer_writes_its_own_file(run):
    out, reports = run
    assert sorted(f.name for f in out.iterdir()) == ["plans.group1.jsonl", "plans.jsonl"]
    assert reports[0]["file"] == str(out / "plans.jsonl")
    assert reports[2]["file"] == str(out / "plans.group1.jsonl")
    assert reports[0]["written"] == reports[2]["written"] == 3


def test_non_writing_ranks_start_no_thread_and_open_no_file(run):
    _, reports = run
    for rank in (1, 3):
        assert reports[rank]["thread"] is False
        assert reports[rank]["written"] == 0 and reports[rank]["file"] is None
    assert reports[0]["thread"] and reports[2]["thread"]


def test_every_k_and_per_rank_times_of_the_right_step(run):
    out, _ = run
    for name, gpus in (("plans.jsonl", [0, 1]), ("plans.group1.jsonl", [2, 3])):
        plans = read_plans(out / name, on_error="raise").plans
        assert [p.step for p in plans] == [0, 2, 4]
        for plan in plans:
            assert plan.gpus == gpus
            ms = plan.measurements.per_rank_ms
            # Times of the plan's own step, one value per GPU in the order of plan.gpus.
            assert ms["route"] == [1000.0 * g + plan.step for g in gpus]
            assert ms["custom"] == [0.5 * g for g in gpus]
            assert "unlisted" not in ms
            if plan.step < 4:
                assert ms["step"] == [10.0 * (plan.step + 1)] * 2
            else:  # the last step's times come from finish(): no whole-step time yet
                assert "step" not in ms
            assert plan.measurements.plan_ms is not None
        if gpus == [2, 3]:
            assert all(p.measurements.per_rank_ms["pre_attn"] == [0.0, 2.0] for p in plans)
        else:
            assert all("pre_attn" not in p.measurements.per_rank_ms for p in plans)


def test_unlisted_phase_is_warned_about_once_per_rank(run):
    _, reports = run
    for report in reports.values():
        assert len(report["warnings"]) == 1 and "unlisted" in report["warnings"][0]
