"""What the dashboard server knows: summaries per step, plans on demand, notices, runs."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from knapformer.dashboard.store import PlanStore, Runs

from knapformer.contract.plan_io import parse_plan_line


@pytest.fixture
def lines50(steps50_path):
    return steps50_path.read_text().splitlines()


def _store(path):
    store = PlanStore(path)
    while store.poll():
        pass
    return store


def test_summaries_and_plans_on_demand(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:5]) + "\n")
    store = _store(path)
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0, 1, 2, 3, 4]
    assert [s.line for s in snap.summaries] == [1, 2, 3, 4, 5]
    assert snap.notices == [] and snap.problem_count == 0
    plan = store.plan(3)
    assert plan.model_dump_json() == json.dumps(json.loads(lines50[3]), separators=(",", ":"))
    assert store.plan(3) is plan  # cached
    with open(path, "a") as f:
        f.write(lines50[5] + "\n")
    store.poll()
    assert len(store.snapshot().summaries) == 6
    with pytest.raises(LookupError):
        store.plan(99)


def test_bad_records_become_problems_with_line_numbers(tmp_path, lines50):
    other_version = json.loads(lines50[1])
    other_version["schema_version"] = 3
    broken = json.loads(lines50[2])
    broken["chunks"]["dst_gpu"][0] = 999
    path = tmp_path / "plans.jsonl"
    path.write_text(
        "\n".join([lines50[0], "{not json", json.dumps(other_version), json.dumps(broken)])
        + "\n"
        + lines50[3][:100]  # a partial last line: not a problem, just not there yet
    )
    store = _store(path)
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0]
    assert snap.problem_count == 3
    by_line = {p.line: p.message for p in snap.problems}
    assert set(by_line) == {2, 3, 4}
    assert "not valid JSON" in by_line[2]
    assert "schema_version 3" in by_line[3]
    assert "chunk(s) 0" in by_line[4]
    assert str(snap.problems[0]).startswith("plans.jsonl:2: ")


def test_truncation_drops_old_steps_and_says_so(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:4]) + "\n")
    store = _store(path)
    reset = store.snapshot().reset
    path.write_text(lines50[10] + "\n")
    store.poll()
    snap = store.snapshot()
    step = parse_plan_line(lines50[10]).step
    assert [s.step for s in snap.summaries] == [step]
    assert snap.reset != reset
    assert any("truncated" in n for n in snap.notices)
    with pytest.raises(LookupError):
        store.plan(0, reset)  # a client still showing the old file gets told
    assert store.plan(0, snap.reset).step == step


def test_rotation_keeps_old_steps_readable(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:3]) + "\n")
    store = _store(path)
    os.rename(path, tmp_path / "plans.1.jsonl")
    path.write_text(lines50[3] + "\n")
    store.poll()
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0, 1, 2, 3]
    assert any("plans.1.jsonl" in n for n in snap.notices)
    assert store.plan(1).step == 1 and store.plan(3).step == 3


def test_missing_empty_and_removed_files_are_notices(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    store = _store(path)
    assert "does not exist" in store.snapshot().notices[0]
    path.write_text("")
    store.poll()
    assert "holds no plans yet" in store.snapshot().notices[0]
    path.write_text(lines50[0] + "\n")
    store.poll()
    assert store.snapshot().notices == []
    path.unlink()
    store.poll()
    snap = store.snapshot()
    assert "was removed" in snap.notices[0]
    assert len(snap.summaries) == 1 and store.plan(0).step == 0


def test_json_and_legacy_files(plan8_path, legacy_path, tmp_path):
    store = _store(plan8_path)
    assert len(store.snapshot().summaries) == 1
    assert store.plan(0).topology == "g1n2+g2n1+g4n1"
    legacy = _store(legacy_path)
    assert len(legacy.snapshot().summaries) == 1
    assert legacy.plan(0).num_gpus == 8
    bad = tmp_path / "bad.json"
    bad.write_text('{"topology": 3}')
    snap = _store(bad).snapshot()
    assert snap.summaries == [] and snap.problem_count == 1


def test_folder_of_runs(tmp_path, steps50_path, plan8_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(steps50_path, tmp_path / "a" / "plans.jsonl")
    shutil.copy(steps50_path, tmp_path / "b" / "plans.jsonl")
    shutil.copy(steps50_path, tmp_path / "b" / "plans.1.jsonl")  # rotated: not a run
    shutil.copy(plan8_path, tmp_path / "single.json")
    os.utime(tmp_path / "b" / "plans.jsonl", (2e9, 2e9))
    runs = Runs(tmp_path)
    try:
        assert sorted(runs.files()) == ["a", "b", "single.json"]
        assert runs.default() == "b"
        assert runs.store("nope") is None
        store = runs.store("single.json")
        assert store is runs.store("single.json")
    finally:
        runs.close()


def test_a_bad_line_costs_exactly_that_line(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    hostile = [
        "[" * 100_000,  # nested past the JSON parser's recursion limit
        '{"step": ' + "7" * 5000 + "}",  # an integer too long for int()
        "\x00\xff{",
    ]
    # One write: a good plan, the hostile lines, then 16 good plans.
    path.write_text("\n".join([lines50[0], *hostile, *lines50[1:17]]) + "\n")
    store = _store(path)
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == list(range(17))
    assert [p.line for p in snap.problems] == [2, 3, 4]
    assert snap.problem_count == 3
    assert store.plan(16).step == 16
    with open(path, "a") as f:  # and the file is still followed
        f.write(lines50[17] + "\n")
    store.poll()
    assert len(store.snapshot().summaries) == 18


def test_a_line_too_long_to_read_is_a_problem(tmp_path, lines50, monkeypatch):
    import knapformer.dashboard.tail as tail_module

    monkeypatch.setattr(tail_module, "MAX_LINE_BYTES", 4 << 20)
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join([lines50[0], " " * (5 << 20) + lines50[1], lines50[2]]) + "\n")
    snap = _store(path).snapshot()
    assert [s.step for s in snap.summaries] == [0, 2]
    assert [p.line for p in snap.problems] == [2]
    assert "longer than" in snap.problems[0].message


def _followers() -> int:
    import threading

    return sum(t.name.startswith("follow ") for t in threading.enumerate())


def _open_files_under(folder) -> int:
    fds = os.listdir("/proc/self/fd")
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum(t.startswith(str(folder)) for t in targets)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_viewing_many_runs_keeps_threads_and_open_files_bounded(tmp_path, lines50):
    import time

    from knapformer.dashboard.store import KEEP_STORES

    names = [f"run{i:03d}" for i in range(3 * KEEP_STORES)]
    for i, name in enumerate(names):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plans.jsonl").write_text(lines50[i % 50] + "\n")
    before = _followers()
    runs = Runs(tmp_path)
    try:
        for name in names:  # a user clicking through the run picker
            store = runs.store(name)
            deadline = time.monotonic() + 10
            while not store.snapshot().summaries and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store.snapshot().summaries, name
        deadline = time.monotonic() + 10  # stopped followers finish their last poll
        while _followers() - before > KEEP_STORES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _followers() - before <= KEEP_STORES
        assert _open_files_under(tmp_path) <= KEEP_STORES
        # The runs viewed last are still followed; an earlier one starts again when asked.
        assert runs.store(names[-1]) is store
        again = runs.store(names[0])
        deadline = time.monotonic() + 10
        while not again.snapshot().summaries and time.monotonic() < deadline:
            time.sleep(0.01)
        assert again.snapshot().summaries[0].step == parse_plan_line(lines50[0]).step
    finally:
        runs.close()
    assert _followers() == before and _open_files_under(tmp_path) == 0


def test_measured_steps_keep_their_per_rank_figures(tmp_path, lines50):
    from knapformer.contract.plan_io import write_jsonl
    from knapformer.testing.measured_plans import measured_run

    path = tmp_path / "plans.jsonl"
    plans = measured_run(6, slow_rank=3, slow_factor=2.0)
    write_jsonl(path, plans[:2])
    with open(path, "a") as f:  # an unmeasured step between measured ones
        f.write(lines50[0] + "\n")
    write_jsonl(path, plans[2:], append=True)
    store = _store(path)
    snap = store.snapshot()
    assert len(snap.summaries) == 7 and snap.measured_steps == 6
    window = store.measured(6, 4)
    assert [f.step for f in window] == [2, 3, 4, 5]
    assert [f.step for f in store.measured(3, 10)] == [0, 1, 2]  # the unmeasured one skipped
    np.testing.assert_allclose(
        window[-1].compute_ms, plans[-1].measurements.per_rank_ms["compute"], rtol=1e-6
    )
    assert store.measured(6, 4, reset=snap.reset + 1) == []  # the file was reset since
    assert _store(tmp_path / "none.jsonl").snapshot().measured_steps == 0


def test_a_rerun_moved_aside_like_a_rotation_is_a_new_run(tmp_path, lines50):
    """A recorder that restarts its steps moves the old recording aside exactly as a
    rotation by size does (``plans.1.jsonl``): the first plan of the new file tells them
    apart. Before, the old steps stayed and the re-run was appended to them (issue 31)."""
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:6]) + "\n")
    store = _store(path)
    reset = store.snapshot().reset
    os.rename(path, tmp_path / "plans.1.jsonl")
    path.write_text("\n".join(lines50[:2]) + "\n")  # the re-run: steps 0, 1 again
    store.poll()
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0, 1]
    assert snap.reset != reset
    assert any("holds a new run (it starts at step 0, not after step 5)" in n for n in snap.notices)
    assert store.plan(1, snap.reset).step == 1


def test_a_file_removed_and_written_again_is_a_new_run(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:6]) + "\n")
    store = _store(path)
    path.unlink()
    store.poll()
    assert len(store.snapshot().summaries) == 6  # shown until something replaces them
    path.write_text("\n".join(lines50[20:23]) + "\n")  # later steps, but a new file
    store.poll()
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [20, 21, 22]
    assert snap.notices == ["plans.jsonl is a new file; reading it from its start"]


def test_a_link_to_a_device_in_the_files_place_is_a_notice_until_a_file_is_back(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:3]) + "\n")
    store = _store(path)
    os.symlink("/dev/zero", tmp_path / "link")
    os.replace(tmp_path / "link", path)
    assert store.poll() is False  # nothing to read: no busy loop on /dev/zero
    notice = store.snapshot().notices[0]
    assert notice.startswith(f"{path} is a symbolic link (to /dev/zero): the dashboard reads")
    path.unlink()
    path.write_text("\n".join(lines50[:2]) + "\n")
    store.poll()
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0, 1]
    assert not any("symbolic link" in n for n in snap.notices)


def test_following_a_run_keeps_a_few_kilobytes_per_step(tmp_path):
    """The bound docs/reliability.md states: ~1 KB per step, 2.5 KB more and 60 bytes per
    GPU for a measured step (3.4 KB at 8 GPUs), never the plans themselves."""
    import tracemalloc

    from conftest import SAMPLES

    lines = (SAMPLES / "demo.jsonl").read_text().splitlines()  # 8 GPUs, measured
    path = tmp_path / "plans.jsonl"
    steps = 600
    with path.open("w") as f:
        for step in range(steps):
            record = json.loads(lines[step % len(lines)])
            record["step"] = step
            f.write(json.dumps(record) + "\n")
    tracemalloc.start()
    try:
        store = _store(path)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(store.snapshot().summaries) == steps
    assert held / steps < 6 * 1024, held / steps  # measured: 3.4 KB; a plan is 4.4 KB here


# ------------------------------------------------------------------ the run's store
def _recorded(folder, plans, every, segment):
    """``plans`` recorded through the real recorder into ``folder`` with its store."""
    from knapformer.runtime.recorder import PlanRecorder

    with PlanRecorder(folder / "plans.jsonl", every=every, store_segment_steps=segment) as rec:
        for plan in plans:
            rec.record(plan)
    return folder / "plans.jsonl"


def test_a_run_with_a_store_holds_every_step_and_the_plans_kept(tmp_path):
    from knapformer.dashboard.store_steps import mean_speedup, step_columns

    from knapformer.testing.measured_plans import measured_run

    plans = measured_run(40, seed=2)
    store = _store(_recorded(tmp_path, plans, every=10, segment=16))
    snap = store.snapshot()
    assert [s.step for s in snap.summaries] == [0, 10, 20, 30]  # full plans: every 10th
    assert snap.store.count == 40 and len(snap.store.segments) == 3
    columns = step_columns(snap.store, snap.summaries)
    assert columns["step"].tolist() == list(range(40))
    for plan in plans:  # every step's figures, from the store (float32 there)
        st = plan.stats
        row = plan.step
        assert columns["imbalance_before"][row] == pytest.approx(st.imbalance_before, rel=1e-6)
        assert columns["imbalance_after"][row] == pytest.approx(st.imbalance_after, rel=1e-6)
        moved = columns["moved_tokens"][row] / columns["total_tokens"][row]
        assert moved == pytest.approx(st.moved_fraction)
        assert columns["plan_ms"][row] == pytest.approx(plan.measurements.plan_ms, abs=1 / 128)
    speedups = [p.stats.speedup for p in plans]
    assert mean_speedup(columns) == pytest.approx(np.mean(speedups), rel=1e-6)
    assert snap.mean_speedup == pytest.approx(np.mean(speedups[::10]))  # the plans' mean


def test_the_store_is_followed_as_its_segments_close_and_newer_plans_fill_in(tmp_path):
    from knapformer.dashboard.store_steps import step_columns

    from knapformer.runtime.recorder import PlanRecorder
    from knapformer.testing.measured_plans import measured_run
    from knapformer.testing.polling import wait_until

    plans = measured_run(20, seed=4)
    path = tmp_path / "plans.jsonl"
    store = PlanStore(path)
    with PlanRecorder(path, every=4, store_segment_steps=8) as rec:
        for plan in plans[:17]:
            rec.record(plan)

        def two_segments_and_step_16():
            """the store closed steps 0-15 and the plans reached step 16"""
            while store.poll():
                pass
            snap = store.snapshot()
            return snap.store and snap.store.count == 16 and snap.summaries[-1].step == 16

        wait_until(two_segments_and_step_16, timeout=60)
        snap = store.snapshot()
        # the store's 16 steps, then the newest full plan (its segment is still open)
        columns = step_columns(snap.store, snap.summaries)
        assert columns["step"].tolist() == [*range(16), 16]
        assert columns["imbalance_after"][16] == snap.summaries[-1].imbalance_after
        for plan in plans[17:]:
            rec.record(plan)
    while store.poll():
        pass
    snap = store.snapshot()
    assert snap.store.count == 20 and len(snap.store.segments) == 3
    # step 16 now comes from the store, once
    assert step_columns(snap.store, snap.summaries)["step"].tolist() == list(range(20))


def test_a_store_that_cannot_be_read_is_a_notice_and_the_plans_stand_in(tmp_path):
    from knapformer.testing.measured_plans import measured_run

    path = _recorded(tmp_path, measured_run(8, seed=1), every=2, segment=4)
    (tmp_path / "store" / "steps-0-3.parquet").write_bytes(b"PAR1 not really")
    snap = _store(path).snapshot()
    assert snap.store is None and [s.step for s in snap.summaries] == [0, 2, 4, 6]
    assert any(
        n.startswith("the run store cannot be read: ")
        and "steps-0-3.parquet" in n
        and n.endswith("; the figures come from the plans")
        for n in snap.notices
    ), snap.notices


def test_a_run_without_a_store_has_none(tmp_path, lines50):
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(lines50[:3]) + "\n")
    snap = _store(path).snapshot()
    assert snap.store is None and snap.notices == []


def test_the_partition_of_every_step_comes_from_the_store_in_runs(tmp_path):
    from knapformer.dashboard.store_steps import partition_spans

    from knapformer.contract.stats import summarize
    from knapformer.planning.datamix import parse_mix, sample_lengths
    from knapformer.planning.planner import plan_routing
    from knapformer.planning.workload import WorkloadModel

    rng = np.random.default_rng(4)
    mix = parse_mix("g2b4i256f1s0,g2b5i512f1s0,g2b1i1024f1s0,g2b2i256f4s0")
    topologies = ["g1n4+g2n2"] * 5 + ["g2n2+g4n1"] * 5
    plans = [
        plan_routing(sample_lengths(mix, rng), topology, WorkloadModel(3072, 0.4), step=s)
        for s, topology in enumerate(topologies)
    ]
    # segments of 3 steps: the runs cross their borders and are joined
    snap = _store(_recorded(tmp_path, plans, every=4, segment=3)).snapshot()
    assert [s.step for s in snap.summaries] == [0, 4, 8]
    assert len(snap.store.segments) == 4
    first, last = summarize(plans[0]).bags, summarize(plans[9]).bags
    assert partition_spans(snap.store, snap.summaries) == [
        ("g1n4+g2n2", first, 0, 4),
        ("g2n2+g4n1", last, 5, 9),
    ]


def _late_plans(folder):
    """31 measured steps, rank 5 slow, recorded every 10 steps with a store, the plans
    file then holding steps 0, 10, 20, 30 before 1, 11, 21 (the plans a verdict names,
    which the store's writer appends late): (the plans, the plans file)."""
    from knapformer.testing.measured_plans import measured_run

    plans = measured_run(31, slow_rank=5, slow_factor=2.0, seed=3)
    path = _recorded(folder, plans, every=10, segment=16)
    lines = path.read_text().splitlines()
    lines.sort(key=lambda line: (json.loads(line)["step"] % 10 != 0, json.loads(line)["step"]))
    path.write_text("\n".join(lines) + "\n")
    return plans, path


def test_the_newest_step_is_followed_though_earlier_plans_come_after_it(tmp_path):
    plans, path = _late_plans(tmp_path)
    snap = _store(path).snapshot()
    steps = [s.step for s in snap.summaries]
    assert steps == [0, 10, 20, 30, 1, 11, 21]
    assert steps[snap.newest] == 30
    path = tmp_path / "plain.jsonl"
    path.write_text("\n".join(p.model_dump_json() for p in plans[:3]) + "\n")
    assert _store(path).snapshot().newest == 2  # in order: the last line


def test_measured_windows_walk_the_steps_in_order_whatever_the_files_order(tmp_path):
    _, path = _late_plans(tmp_path)
    (tmp_path / "store").rename(tmp_path / "aside")  # the plans' path
    store = _store(path)
    snap = store.snapshot()
    steps = [s.step for s in snap.summaries]
    assert steps == [0, 10, 20, 30, 1, 11, 21]
    assert [steps[i] for i in snap.by_step] == [0, 1, 10, 11, 20, 21, 30]
    at = steps.index  # the index of a step's plan

    def window(step, count):
        return [f.step for f in store.measured(at(step), count, snap.reset)]

    assert window(11, 3) == [1, 10, 11]  # in file order: 30, 1, 11
    assert window(30, 4) == [11, 20, 21, 30]  # in file order: 0, 10, 20, 30
    assert window(20, 10) == [0, 1, 10, 11, 20]
    assert window(0, 3) == [0]
    assert [steps[i] for i in store.measured_plans(at(21), 2, snap.reset)] == [20, 21]
    assert store.measured(at(21), 2, snap.reset + 1) == []  # reset since
