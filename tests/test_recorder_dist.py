"""PlanRecorder under a SequenceBalancer in a real gloo process group (4 processes, 2
balance groups of 2 ranks): every rank's times reach each group's writer with the right
step, `every` honoured, one file per group, non-writing ranks do no I/O. The training
loop adds phases with exactly known values."""

from __future__ import annotations

import os

import pytest

from knapformer.contract.plan_io import read_plans
from knapformer.contract.run_store import read_table, store_folder
from knapformer.local.launcher import launch


def worker(rank: int, world: int, out: str, tensorboard: str) -> dict:
    """One rank: 5 steps of a balancer (two replicas of g1n2) with known timings, every=2."""
    import logging

    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    for name in ("knapformer.runtime.recorder", "knapformer.runtime.timing"):
        logging.getLogger(name).addHandler(handler)
    rec = PlanRecorder(os.path.join(out, "plans.jsonl"), every=2, tensorboard_dir=tensorboard)
    bal = SequenceBalancer("g1n2", recorder=rec, phases=["custom", "marker", "partial"])
    for step in range(5):
        bal.plan_routing([100 * (rank + 1) + step, 7], token_dim=64)
        bal.add_timing("marker", 1000.0 * rank + step)
        bal.add_timing("custom", 0.5 * rank)
        bal.add_timing("unlisted", 1.0)
        if rank == 3:  # a phase only some ranks measured
            bal.add_timing("partial", 2.0)
    bal.finish()
    bal.close()
    return {
        "rank": rank,
        "thread": rec._lines.started,
        "written": rec.written,
        "file": None if rec.file_path is None else str(rec.file_path),
        "warnings": warnings,
        "tensorboard": rec.tensorboard_written,
        "kept": 0 if rec.store is None else rec.store.kept,  # in full beyond every
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    tensorboard = tmp_path_factory.mktemp("logs") / "tb"
    # Raises, naming the rank, unless all four workers returned.
    results = launch(worker, 4, (str(out), str(tensorboard)), deadline_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    return out, dict(enumerate(results)), tensorboard


def test_each_group_writer_writes_its_own_file(run):
    out, reports, _ = run
    names = ["plans.group1.jsonl", "plans.jsonl", "store", "store.group1"]  # and a store each
    assert sorted(f.name for f in out.iterdir()) == names
    assert reports[0]["file"] == str(out / "plans.jsonl")
    assert reports[2]["file"] == str(out / "plans.group1.jsonl")
    # every=2 gives steps 0, 2, 4; a step a reader must open in full is kept too (here,
    # the crafted times make a rank's rate >= 1.3x: knapformer.runtime.store_rows)
    assert [reports[r]["written"] - reports[r]["kept"] for r in (0, 2)] == [3, 3]


def test_non_writing_ranks_start_no_thread_and_open_no_file(run):
    _, reports, _ = run
    for rank in (1, 3):
        assert reports[rank]["thread"] is False
        assert reports[rank]["written"] == 0 and reports[rank]["file"] is None
        assert reports[rank]["tensorboard"] == 0
    assert reports[0]["thread"] and reports[2]["thread"]


def test_each_group_writer_logs_its_own_tensorboard_run(run):
    _, reports, tensorboard = run
    assert [reports[r]["tensorboard"] for r in (0, 2)] == [reports[r]["written"] for r in (0, 2)]
    logs = tensorboard.parent
    assert sorted(p.name for p in logs.iterdir()) == ["tb", "tb.group1"]
    for folder in logs.iterdir():
        assert any(f.name.startswith("events.out.tfevents") for f in folder.iterdir()), folder


def test_every_k_and_per_rank_times_of_the_right_step(run):
    out, _, _ = run
    for name, gpus in (("plans.jsonl", [0, 1]), ("plans.group1.jsonl", [2, 3])):
        plans = read_plans(out / name, on_error="raise").plans
        assert [p.step for p in plans if p.step % 2 == 0] == [0, 2, 4]
        # the others were kept in full, as the store says (every step is in the store)
        steps = read_table(store_folder(out / name), "steps").to_pydict()
        assert steps["step"] == [0, 1, 2, 3, 4]
        full = [s for s, f in zip(steps["step"], steps["full_plan"], strict=True) if f]
        assert sorted(p.step for p in plans) == full
        for plan in plans:
            assert plan.gpus == gpus
            ms = plan.measurements.per_rank_ms
            # Times of the plan's own step, one value per GPU in the order of plan.gpus.
            assert ms["marker"] == [1000.0 * g + plan.step for g in gpus]
            assert ms["custom"] == [0.5 * g for g in gpus]
            assert "unlisted" not in ms
            # The last step ends at finish(): every step has its whole-step time.
            assert len(ms["step"]) == 2 and min(ms["step"]) > 0
            # compute: the step without the time inside collectives (the gather only) and
            # without host work (planning beyond its gather, recording); on the CPU the
            # part of that the thread did not run is `descheduled`
            host = [
                max(p - g, 0.0) + r
                for p, g, r in zip(
                    ms["plan"], ms["gather"], ms.get("record", [0.0] * 2), strict=True
                )
            ]
            wall = [s - g - h for s, g, h in zip(ms["step"], ms["gather"], host, strict=True)]
            both = [c + d for c, d in zip(ms["compute"], ms["descheduled"], strict=True)]
            assert both == pytest.approx(wall)
            assert all(0 <= c <= w + 1e-9 for c, w in zip(ms["compute"], wall, strict=True))
            assert plan.measurements.plan_ms is not None
        if gpus == [2, 3]:
            assert all(p.measurements.per_rank_ms["partial"] == [0.0, 2.0] for p in plans)
        else:
            assert all("partial" not in p.measurements.per_rank_ms for p in plans)


def test_unlisted_phase_is_warned_about_once_per_rank(run):
    _, reports, _ = run
    for report in reports.values():
        assert len(report["warnings"]) == 1 and "unlisted" in report["warnings"][0]
