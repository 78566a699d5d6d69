"""The run store's writer: segments, compaction, resume, the recorder's hook, and the
demo writing it (for real: gloo worker processes, one of them killed with SIGKILL)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans
from knapformer.contract.run_store import list_segments, read_table, run_id, store_folder
from knapformer.contract.store_schema import RANKS, STEPS
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.step_loss import step_losses
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime import store_files
from knapformer.runtime.recorder import PlanRecorder
from knapformer.runtime.store_writer import StoreWriter
from knapformer.testing.measured_plans import measured_run, with_measurements
from knapformer.testing.polling import wait_until
from knapformer.testing.processes import running

ALL = (None, None)


@pytest.fixture(scope="module")
def plans():
    """24 measured plans of 8 GPUs; rank 3 computes 1.6x slower in every step."""
    return measured_run(24, slow_rank=3, slow_factor=1.6)


@pytest.fixture(scope="module")
def even_plans():
    """12 measured plans with no slow rank and no noise: nothing to keep in full."""
    return measured_run(12, noise=0.0, seed=1)


def write(folder, plans, **options):
    with StoreWriter(folder, **options) as writer:
        for plan in plans:
            assert writer.put(plan)
    return writer


def test_every_rank_step_is_one_row_with_the_plans_figures(tmp_path, plans):
    writer = write(tmp_path / "store", plans, segment_steps=10)
    assert (writer.written, writer.segments, writer.failed) == (24, 3, 0)
    names = [(s.first, s.last) for s in list_segments(tmp_path / "store", "ranks")]
    assert names == [(0, 9), (10, 19), (20, 23)]  # every 10 steps, the last at close
    ranks = read_table(tmp_path, "ranks")
    assert ranks.schema.equals(RANKS) and ranks.num_rows == 24 * 8
    pairs = set(zip(ranks["step"].to_pylist(), ranks["rank"].to_pylist(), strict=True))
    assert len(pairs) == 24 * 8  # each (step, rank) once
    # the figures are the ones the readers compute from the full plan
    plan = plans[17]
    row = read_table(tmp_path, "ranks", (17, 17)).to_pydict()
    m = measure(plan)
    np.testing.assert_allclose(row["rate"], m.compute_ratio, rtol=1e-6)
    np.testing.assert_allclose(row["compute_ms"], plan.measurements.per_rank_ms["compute"],
                               atol=1 / 256)  # fmt: skip
    assert row["tokens_in"] == plan.stats.tokens_before.tolist()
    steps = read_table(tmp_path, "steps")
    assert steps.schema.equals(STEPS) and steps["step"].to_pylist() == list(range(24))
    assert set(steps["slowest_rank"].to_pylist()) == {3} == set(steps["straggler"].to_pylist())
    assert all(v > 0.5 * p for v, p in zip(steps["lost_slow_ranks_ms"].to_pylist(),
               steps["lost_ms"].to_pylist(), strict=True))  # fmt: skip
    # rank_windows: one row per rank per segment, rank 3 slow in every step
    windows = read_table(tmp_path, "rank_windows").to_pandas()
    assert len(windows) == 3 * 8
    slow = windows[windows["rank"] == 3]
    assert slow["slow_steps"].tolist() == [10, 10, 4] == slow["steps"].tolist()
    assert (windows[windows["rank"] != 3]["slow_steps"] == 0).all()
    assert slow["rate_median"].min() > 1.4


def test_a_group_of_any_size_gets_what_each_step_lost(tmp_path):
    # 96 GPUs (above the 64 the loss columns once stopped at; the window's fit is the
    # compute model's grid search there), rank 70 at 1.6x: each segment's steps carry
    # the loss the diagnosis computes over the same window, and the slow rank's part.
    codes = "g24b4i256f1s0,g24b5i512f1s0,g24b1i1024f1s0,g24b2i256f4s0"
    big = measured_run(12, "g1n32+g2n16+g4n8", codes, slow_rank=70, slow_factor=1.6)
    write(tmp_path / "store", big, segment_steps=6)
    steps = read_table(tmp_path, "steps").to_pydict()
    assert steps["gpus"] == [96] * 12
    for first in (0, 6):
        expected = step_losses([measure(p).figures() for p in big[first : first + 6]])
        rows = slice(first, first + 6)
        np.testing.assert_allclose(steps["lost_ms"][rows], [x.lost_ms for x in expected],
                                   atol=0.01)  # fmt: skip
        slow_part = [x.part_ms["slow_ranks"] for x in expected]
        np.testing.assert_allclose(steps["lost_slow_ranks_ms"][rows], slow_part, atol=0.01)
    assert all(s > 0.5 * lost for s, lost in zip(steps["lost_slow_ranks_ms"], steps["lost_ms"],
                                                  strict=True))  # fmt: skip


def test_a_window_reads_only_its_steps_and_columns(tmp_path, plans):
    write(tmp_path / "store", plans, segment_steps=5)
    window = read_table(tmp_path / "store", "ranks", (7, 12), ["rank", "rate"])
    assert window.column_names == ["rank", "rate"] and window.num_rows == 6 * 8
    assert read_table(tmp_path, "steps", (20, None), ["step"])["step"].to_pylist() == [
        20, 21, 22, 23,
    ]  # fmt: skip


def test_a_segment_closes_after_its_seconds_without_more_steps(tmp_path, plans):
    writer = StoreWriter(tmp_path / "store", segment_steps=1000, segment_seconds=0.2)
    writer.put(plans[0])
    wait_until(lambda: list_segments(tmp_path / "store", "ranks"), 30, "a segment closed")
    assert read_table(tmp_path, "ranks").num_rows == 8  # readable while the run goes on
    writer.close()


def test_compaction_merges_old_segments_and_readers_see_each_row_once(tmp_path, plans):
    write(tmp_path / "store", plans, segment_steps=2, compact=4)
    segments = list_segments(tmp_path / "store", "ranks")
    assert len(segments) < 12 and any(s.last - s.first + 1 == 8 for s in segments)
    files = [p.name for p in (tmp_path / "store").iterdir()]
    assert not [n for n in files if n.endswith(".tmp")]
    assert read_table(tmp_path, "ranks")["step"].to_pylist() == np.repeat(range(24), 8).tolist()
    assert read_table(tmp_path, "rank_windows").num_rows == 12 * 8  # a row per segment kept


def test_a_resumed_run_appends_and_a_restarted_one_moves_the_store_aside(tmp_path, plans, caplog):
    folder = tmp_path / "store"
    write(folder, plans[:10])
    first = run_id(folder)
    write(folder, plans[10:])  # resumed from a checkpoint: steps go on
    assert run_id(folder) == first and read_table(tmp_path, "steps").num_rows == 24
    write(folder, plans[:4])  # the job again from step 0
    assert read_table(tmp_path, "steps")["step"].to_pylist() == [0, 1, 2, 3]
    assert run_id(folder) != first and run_id(tmp_path / "store.1") == first
    assert any("moved to" in r.getMessage() for r in caplog.records)
    second = run_id(folder)
    write(folder, plans[:2])  # and again: the first one moved aside is kept
    assert run_id(tmp_path / "store.1") == first and run_id(tmp_path / "store.2") == second


def _replayed(plans, steps):
    """``plans`` as the steps ``steps`` of a run resumed from a checkpoint."""
    return [p.model_copy(update={"step": s}) for p, s in zip(plans, steps, strict=False)]


@pytest.mark.parametrize("segment_steps, compact", [(10, 0), (3, 2)])
def test_a_run_that_replays_steps_trims_them_and_appends(
    tmp_path, plans, caplog, segment_steps, compact
):
    # Steps 0..23, then the job resumes from a checkpoint at step 15: the store keeps its
    # run and steps 0..14, the segment that straddles step 15 (one of 10 steps, or one
    # merged by compaction) is rewritten, and the replayed steps are the new ones. (The
    # writer's folder may have any name; the readers below find it as the run's store.)
    folder = tmp_path / "rows"
    write(folder, plans, segment_steps=segment_steps, compact=compact)
    first = run_id(folder)
    assert any(s.first < 15 <= s.last for s in list_segments(folder, "ranks"))
    resumed = plans[::-1]
    write(folder, _replayed(resumed, range(15, 27)), segment_steps=segment_steps)
    assert run_id(folder) == first and not (tmp_path / "rows.1").exists()
    folder = folder.rename(tmp_path / "store")
    assert any("resumes at step 15" in r.getMessage() for r in caplog.records)
    assert read_table(tmp_path, "steps")["step"].to_pylist() == list(range(27))  # each once
    ranks = read_table(tmp_path, "ranks")
    assert ranks["step"].to_pylist() == np.repeat(range(27), 8).tolist()
    replayed = read_table(tmp_path, "ranks", (20, 20)).to_pydict()
    np.testing.assert_allclose(replayed["compute_ms"], resumed[5].measurements
                               .per_rank_ms["compute"], atol=1 / 256)  # fmt: skip
    for table in ("ranks", "steps", "rank_windows"):
        assert all(s.last <= 14 or s.first >= 15 for s in list_segments(folder, table))
    # rank windows end before the replay or start at it, each counting its own steps
    windows = read_table(tmp_path, "rank_windows").to_pandas()
    span = windows["last_step"] - windows["first_step"] + 1
    assert ((windows["last_step"] <= 14) | (windows["first_step"] >= 15)).all()
    assert (windows["steps"] == span).all() and len(windows) == 8 * len(set(windows["first_step"]))
    if segment_steps == 10:  # the window of steps 10..19 was cut to 10..14
        assert (windows[windows["first_step"] == 10]["last_step"] == 14).all()


class _Killed(Exception):
    pass


def test_a_trim_killed_midway_leaves_every_step_once_and_is_done_again(
    tmp_path, plans, monkeypatch
):
    folder = tmp_path / "store"
    write(folder, plans, segment_steps=10)
    rewrite = store_files._rewrite_before

    def killed(*args):  # the shorter copy renamed into place, then the process dies
        rewrite(*args)
        raise _Killed

    monkeypatch.setattr(store_files, "_rewrite_before", killed)
    with pytest.raises(_Killed):
        store_files.trim(folder, 15)
    monkeypatch.undo()
    assert len(list(folder.glob("rank_windows-10-*.parquet"))) == 2  # both copies there
    windows = read_table(tmp_path, "rank_windows")  # the shorter, inside, is skipped
    assert sorted(set(windows["first_step"].to_pylist())) == [0, 10, 20]
    assert read_table(tmp_path, "steps")["step"].to_pylist() == list(range(24))
    write(folder, _replayed(plans, range(15, 20)), segment_steps=10)  # the job resumes
    assert read_table(tmp_path, "steps")["step"].to_pylist() == list(range(20))
    windows = read_table(tmp_path, "rank_windows").to_pandas()
    assert sorted(set(zip(windows["first_step"], windows["last_step"], strict=True))) == [
        (0, 9), (10, 14), (15, 19)
    ]  # fmt: skip


def test_a_run_that_restarts_before_the_stores_first_step_moves_it_aside(tmp_path, plans):
    write(tmp_path / "store", _replayed(plans, range(5, 29)))
    first = run_id(tmp_path / "store")
    write(tmp_path / "store", plans[:3])  # steps 0..2: another run, not a replay
    assert run_id(tmp_path / "store.1") == first
    assert read_table(tmp_path, "steps")["step"].to_pylist() == [0, 1, 2]


def test_a_step_out_of_order_is_left_out_and_counted(tmp_path, plans):
    writer = write(tmp_path / "store", [plans[5], plans[3], plans[6]])
    assert (writer.written, writer.failed) == (2, 1)
    assert read_table(tmp_path, "steps")["step"].to_pylist() == [5, 6]


def test_the_recorder_stores_every_step_and_keeps_full_plans_by_every(tmp_path, even_plans):
    with PlanRecorder(tmp_path / "plans.jsonl", every=5) as rec:
        queued = [rec.record(p) for p in even_plans]
    assert queued == [p.step % 5 == 0 for p in even_plans]  # True: in the JSONL
    assert [p.step for p in read_plans(tmp_path / "plans.jsonl").plans] == [0, 5, 10]
    steps = read_table(tmp_path, "steps")
    assert steps["step"].to_pylist() == list(range(12))
    assert steps["full_plan"].to_pylist() == [s % 5 == 0 for s in range(12)]


def test_the_recorder_keeps_in_full_the_steps_a_verdict_could_name(tmp_path, plans):
    with PlanRecorder(tmp_path / "plans.jsonl", every=10) as rec:
        for plan in plans:
            rec.record(plan)
    # rank 3 at 1.6x in every step: beyond every=10, the first such step of each window
    # of 10 is kept in full (a straggler that lasts does not make every plan full)
    written = sorted(p.step for p in read_plans(tmp_path / "plans.jsonl").plans)
    assert written == [0, 1, 10, 11, 20, 21] and rec.store.kept == 3
    steps = read_table(tmp_path, "steps").to_pydict()
    assert [s for s, f in zip(steps["step"], steps["full_plan"], strict=True) if f] == written


class _FakeDist:
    """``torch.distributed`` as the recorder looks it up: an initialised group, this rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.rank


def test_a_group_whose_first_step_is_kept_in_full_writes_its_own_file(tmp_path, monkeypatch):
    # Group 1 (ranks 8..15) resumes at step 5 with every=4: step 5 is not due, but rank
    # 11 is slow, so the store's thread hands it back to keep in full before any line was
    # queued. That line, and every later one, belong in group 1's file.
    rng = np.random.default_rng(2)
    mix = parse_mix("g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0")
    model = WorkloadModel(3072, 0.4)
    plans = [
        with_measurements(
            plan_routing(
                sample_lengths(mix, rng), "g1n2+g2n1+g4n1", model, gpus=range(8, 16), step=s
            ),
            rng,
            slow_rank=11,
            slow_factor=1.6,
        )
        for s in range(5, 13)
    ]
    monkeypatch.setitem(sys.modules, "torch.distributed", _FakeDist(rank=8))
    with PlanRecorder(tmp_path / "plans.jsonl", every=4) as rec:
        rec.record(plans[0])
        rec.store.drain()  # the store's thread has handed step 5 back
        assert rec.store.kept == 1
        for plan in plans[1:]:
            rec.record(plan)
    assert not (tmp_path / "plans.jsonl").exists()
    assert sorted(p.step for p in read_plans(tmp_path / "plans.group1.jsonl").plans) == [
        5,
        8,
        9,
        12,
    ]
    steps = read_table(tmp_path / "store.group1", "steps").to_pydict()
    assert steps["step"] == list(range(5, 13))


def _in_file(path) -> set[int]:
    return {p.step for p in read_plans(path).plans}


def test_full_plan_is_false_for_a_line_the_full_queue_dropped(tmp_path, even_plans, monkeypatch):
    # A JSONL queue of one and its writer held up until every step is recorded: all
    # but the first line or two are dropped, and the store's rows say which are in.
    held = threading.Event()
    serialize = PlanRecorder._serialize
    monkeypatch.setattr(PlanRecorder, "_serialize",
                        lambda self, plan: held.wait(30) and serialize(self, plan))  # fmt: skip
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path, every=2, queue_size=1) as rec:
        queued = {p.step for p in even_plans if rec.record(p)}
        held.set()
    assert rec.dropped >= 4 and queued == _in_file(path) and queued <= {0, 2}
    steps = read_table(tmp_path, "steps").to_pydict()
    assert steps["step"] == list(range(12))  # the store has every step all the same
    in_full = {s for s, f in zip(steps["step"], steps["full_plan"], strict=True) if f}
    assert in_full == queued


def test_full_plan_is_false_for_a_line_the_jsonl_writer_refused(tmp_path, even_plans):
    # Step 1's plan has a NaN workload: its rows are stored, its line is refused (no
    # reader would accept it), and the JSONL writer's word reaches the store before the
    # last segment closes.
    plan = even_plans[1]
    workload = np.where(np.arange(len(plan.sequences)) == 0, np.nan, 1.0)
    broken = plan.model_copy(
        update={"sequences": plan.sequences.model_copy(update={"workload": workload})}
    )
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path) as rec:
        assert all(rec.record(p) for p in (even_plans[0], broken, *even_plans[2:5]))
    assert rec.refused == 1 and _in_file(path) == {0, 2, 3, 4}
    steps = read_table(tmp_path, "steps").to_pydict()
    assert steps["step"] == [0, 1, 2, 3, 4]
    assert steps["full_plan"] == [True, False, True, True, True]


# ----------------------------------------------------------------------- the demo
# small and quick steps: what is tested is the recording, not the training
DEMO = ["demo", "--no-dashboard", "--world-size", "8", "--link-probe-every", "0",
        "--n-layers", "1", "--length-scale", "0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def demo40(tmp_path_factory):
    """The done-when run: 40 steps on 8 gloo workers, --every 10 (one run, shared)."""
    out = tmp_path_factory.mktemp("demo40")
    args = [*DEMO, "--steps", "40", "--every", "10", "--segment-steps", "16", "--out", str(out)]
    assert main(args) == 0
    return out


@pytest.mark.slow
def test_the_demo_stores_every_rank_step_and_thins_full_plans(demo40):
    ranks = read_table(demo40, "ranks", columns=["step", "rank", "compute_ms", "route_ms"])
    assert ranks.num_rows == 320
    assert sorted(zip(ranks["step"].to_pylist(), ranks["rank"].to_pylist(), strict=True)) == [
        (s, r) for s in range(40) for r in range(8)
    ]
    assert ranks["compute_ms"].null_count == 0 and ranks["route_ms"].null_count == 0
    steps = read_table(demo40, "steps")
    full = [s for s, f in zip(steps["step"].to_pylist(), steps["full_plan"].to_pylist(),
                              strict=True) if f]  # fmt: skip
    # every 10th step, plus those a reader must open in full (a rank at 1.3x on a busy
    # host, an imbalanced step): the JSONL holds exactly the steps marked full_plan
    assert {0, 10, 20, 30} <= set(full)
    assert sorted(p.step for p in read_plans(demo40 / "plans.jsonl").plans) == full
    segments = [(s.first, s.last) for s in list_segments(store_folder(demo40), "ranks")]
    assert segments == [(0, 15), (16, 31), (32, 39)]


@pytest.mark.slow
def test_the_demos_readers_and_query_work_on_its_folder(demo40, capsys):
    assert main(["query", str(demo40), "SELECT count(*) AS n FROM ranks"]) == 0
    assert main(["stragglers", str(demo40)]) == 0
    assert main(["validate", str(demo40 / "plans.jsonl")]) == 0
    assert "320" in capsys.readouterr().out


@pytest.mark.slow
def test_a_demo_killed_with_sigkill_leaves_a_store_every_reader_accepts(tmp_path):
    out = tmp_path / "demo"
    args = [*DEMO, "--world-size", "4", "--steps", "0", "--segment-steps", "1"]
    command = [sys.executable, "-c", "from knapformer.cli import main; main()", *args]
    with running([*command, "--out", str(out)]) as proc:
        store = out / "store"
        wait_until(lambda: len(list_segments(store, "ranks")) >= 3, 240, "segments closed")
        family = [proc, *psutil.Process(proc.pid).children(recursive=True)]
        for p in family:  # the whole job at once, the writing rank mid-segment
            p.send_signal(signal.SIGKILL)
        proc.wait(30)
        time.sleep(0.1)
    segments = list_segments(store, "ranks")
    last = segments[-1].last
    for table in ("ranks", "steps", "rank_windows"):
        read_table(out, table)  # every segment checked: no error
    steps = read_table(out, "steps")["step"].to_pylist()
    assert steps[: last + 1] == list(range(last + 1))  # all but the open segment
    assert json.loads((store / "run.json").read_text())["run_id"]
    assert main(["query", str(out), "SELECT max(step) FROM steps"]) == 0
