"""PlanRecorder guarantees, single process: background writing, whole lines, drops,
rotation, I/O errors, flushing at close and at exit, tailing and SIGKILL safety."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from knapformer.contract.plan_io import parse_plan_line, read_plans
from knapformer.errors import KnapformerError
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.recorder import PlanRecorder
from knapformer.runtime.writing_rank import group_path

ROOT = Path(__file__).resolve().parent.parent
MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
TOPO8 = "g1n2+g2n1+g4n1"


@pytest.fixture(scope="module")
def plans() -> list:
    codes = parse_mix("g2b4i256f1s0,g2b2i512f1s0,g4b1i1024f1s0")
    rng = np.random.default_rng(7)
    return [plan_routing(sample_lengths(codes, rng), TOPO8, MODEL, step=i) for i in range(12)]


def steps_in(path: Path) -> list[int]:
    result = read_plans(path, on_error="raise")
    return [p.step for p in result.plans]


def recorder_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "knapformer.runtime.recorder"]


# --------------------------------------------------------------------------- basics
def test_records_every_kth_step_as_valid_jsonl(tmp_path, plans):
    path = tmp_path / "sub" / "plans.jsonl"  # the directory is created
    with PlanRecorder(path, every=3) as rec:
        queued = [rec.record(p) for p in plans]
    assert queued == [p.step % 3 == 0 for p in plans]
    assert steps_in(path) == [0, 3, 6, 9]
    back = read_plans(path).plans
    assert back[1] == plans[3]  # the same plan, field for field
    assert rec.written == 4 and rec.dropped == 0
    assert not rec.active and rec.record(plans[0]) is False  # closed: a no-op


def test_plans_without_step_numbers_count_calls(tmp_path, plans):
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path, every=2) as rec:
        for i, p in enumerate(plans[:5]):
            p2 = p.model_copy()
            p2.step = None
            p2.run = f"call{i}"
            rec.record(p2)
    assert [p.run for p in read_plans(path).plans] == ["call0", "call2", "call4"]


def test_serialises_on_the_writer_thread_not_the_caller(tmp_path, plans):
    threads: list[str] = []

    class Spy(PlanRecorder):
        def _serialize(self, plan):
            threads.append(threading.current_thread().name)
            return super()._serialize(plan)

    with Spy(tmp_path / "plans.jsonl") as rec:
        for p in plans[:3]:
            rec.record(p)
    assert threads == ["knapformer-plan-recorder"] * 3
    assert threading.current_thread().name not in threads


def test_disabled_recorder_does_nothing(tmp_path, plans):
    rec = PlanRecorder(tmp_path / "plans.jsonl", enabled=False)
    assert rec.record(plans[0]) is False
    rec.close()
    assert not (tmp_path / "plans.jsonl").exists()
    assert not rec._lines.started


@pytest.mark.parametrize(
    "kwargs",
    [{"every": 0}, {"queue_size": 0}, {"max_bytes": 0}, {"backups": -1}, {"writer": -1}],
)
def test_bad_arguments_name_the_value(tmp_path, kwargs):
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=rf"{name}.*{value}"):
        PlanRecorder(tmp_path / "p.jsonl", **kwargs)


# ------------------------------------------------------------------ queue overflow
def test_full_queue_drops_and_counts_without_blocking(tmp_path, plans, caplog):
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    class Stuck(PlanRecorder):
        def _serialize(self, plan):
            entered.set()
            release.wait(10)
            left.set()
            return super()._serialize(plan)

    rec = Stuck(tmp_path / "plans.jsonl", queue_size=2)
    rec.record(plans[0])
    assert entered.wait(5)  # the writer holds plan 0; the queue is empty
    queued = [rec.record(p) for p in plans[1:10]]
    assert queued == [True, True] + [False] * 7
    assert rec.dropped == 7
    # The 9 calls returned while the writer was still stuck: none waited for it (one that
    # had would have returned only after the writer gave up waiting and left).
    assert not left.is_set()
    release.set()
    with caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"):
        rec.close()
    assert steps_in(tmp_path / "plans.jsonl") == [0, 1, 2]
    assert any("dropped 7 plan" in m for m in recorder_warnings(caplog))


def test_close_writes_everything_queued(tmp_path, plans):
    release = threading.Event()

    class Slow(PlanRecorder):
        def _serialize(self, plan):
            release.wait(10)
            return super()._serialize(plan)

    rec = Slow(tmp_path / "plans.jsonl", queue_size=64)
    for p in plans:
        rec.record(p)
    assert rec.written == 0
    threading.Timer(0.2, release.set).start()
    rec.close()
    assert steps_in(tmp_path / "plans.jsonl") == list(range(12))


# ------------------------------------------------------------------------ rotation
def test_rotation_keeps_the_newest_files_up_to_retention(tmp_path, plans):
    line = len(plans[0].model_dump_json()) + 1
    path = tmp_path / "plans.jsonl"
    max_bytes = int(2.5 * line)  # ~2 plans per file
    with PlanRecorder(path, max_bytes=max_bytes, backups=2) as rec:
        for p in plans:
            rec.record(p)
    names = sorted(f.name for f in tmp_path.iterdir() if f.is_file())  # not the store
    assert names == ["plans.1.jsonl", "plans.2.jsonl", "plans.jsonl"]
    newest = steps_in(path)
    older = steps_in(tmp_path / "plans.1.jsonl")
    oldest = steps_in(tmp_path / "plans.2.jsonl")
    # Files hold consecutive steps, oldest file first, ending with the last plan.
    assert oldest + older + newest == list(range(oldest[0], 12))
    assert newest[-1] == 11 and oldest[0] > 0  # the oldest plans were deleted
    for name in names:
        assert (tmp_path / name).stat().st_size <= max_bytes


def test_rotation_without_backups_starts_over(tmp_path, plans):
    path = tmp_path / "plans.jsonl"
    line = len(plans[0].model_dump_json()) + 1
    with PlanRecorder(path, max_bytes=int(1.5 * line), backups=0) as rec:
        for p in plans[:4]:
            rec.record(p)
    assert [f.name for f in tmp_path.iterdir() if f.is_file()] == ["plans.jsonl"]
    assert steps_in(path) == [3]


def test_appends_to_an_existing_file(tmp_path, plans):
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path) as rec:
        rec.record(plans[0])
    with PlanRecorder(path) as rec:
        rec.record(plans[1])
    assert steps_in(path) == [0, 1]


# ----------------------------------------------------------------------- I/O errors
def test_disk_full_disables_with_one_warning_and_training_goes_on(plans, caplog):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"):
        rec = PlanRecorder("/dev/full")
        rec.record(plans[0])
        deadline = time.monotonic() + 5
        while rec.disabled_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        later = [rec.record(p) for p in plans[1:]]  # the "training loop" keeps going
        rec.close()
    assert "No space left" in rec.disabled_reason
    assert later == [False] * (len(plans) - 1)
    warnings = recorder_warnings(caplog)
    assert len(warnings) == 1 and "disabled" in warnings[0] and "/dev/full" in warnings[0]
    assert rec.written == 0


def test_directory_removed_mid_run_disables_with_one_warning(tmp_path, plans, caplog):
    out = tmp_path / "run"
    line = len(plans[0].model_dump_json()) + 1
    with caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"):
        rec = PlanRecorder(out / "plans.jsonl", max_bytes=int(1.5 * line), backups=1)
        rec.record(plans[0])
        deadline = time.monotonic() + 5
        # the line written and the store made (its first plan makes its folder, the run's)
        while (rec.written < 1 or rec.store.written < 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.rmtree(out)
        for p in plans[1:]:  # the next write must rotate, which needs the directory
            rec.record(p)
        rec.close()
    assert rec.disabled_reason is not None and "plans.jsonl" in rec.disabled_reason
    assert len(recorder_warnings(caplog)) == 1
    assert not out.exists()  # nothing was recreated behind the user's back


def test_unwritable_location_disables(tmp_path, plans, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with (
        caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"),
        PlanRecorder(blocker / "plans.jsonl") as rec,
    ):
        for p in plans[:3]:
            rec.record(p)
    assert rec.disabled_reason is not None
    assert len(recorder_warnings(caplog)) == 1


# ------------------------------------------------------------- separate processes
WRITER = """
import sys, time
from knapformer.testing.mix_plans import make_plans
from knapformer.runtime.recorder import PlanRecorder
from knapformer.testing.mix_plans import make_plans
class SlowWriter(PlanRecorder):
    def _serialize(self, plan):
        time.sleep({write_delay})  # a slow disk: the writer lags behind the "training"
        return super()._serialize(plan)
plans = make_plans(8, seed=3, mix="joint", factor={factor})
rec = SlowWriter({path!r}, queue_size=1024, max_bytes=None)
print("ready", flush=True)
step = 0
while step < {count}:
    p = plans[step % len(plans)].model_copy()
    p.step = step
    if rec.record(p):
        step += 1
        time.sleep({pause})
{tail}
"""


def start_writer(
    path: Path,
    count: int,
    factor: int,
    tail: str = "rec.close()",
    pause: float = 0.0,
    write_delay: float = 0.0,
):
    code = WRITER.format(
        path=str(path),
        count=count,
        factor=factor,
        tail=tail,
        pause=pause,
        write_delay=write_delay,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_tailing_reader_never_parses_a_partial_record(tmp_path):
    path = tmp_path / "plans.jsonl"
    count = 150
    # 128 GPUs: lines of tens of kB, written over ~0.5 s while the reader polls.
    proc = start_writer(path, count, factor=4, pause=0.003)
    seen: list[int] = []
    buffer = b""
    progress = set()  # how many records the reader had at each poll
    try:
        while not path.exists():
            time.sleep(0.001)
        with open(path, "rb") as f:
            while True:
                chunk = f.read()
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    seen.append(parse_plan_line(line.decode()).step)  # raises if partial
                progress.add(len(seen))
                if proc.poll() is not None and not chunk:
                    break
    finally:
        proc.wait(30)
    assert proc.returncode == 0
    assert buffer == b""  # the file ends with a whole line
    assert seen == list(range(count))
    # The reader really read while the writer wrote: it saw the file at many sizes.
    assert len([n for n in progress if 0 < n < count]) >= 3


def test_sigkill_leaves_whole_lines_and_at_most_a_partial_last_one(tmp_path):
    path = tmp_path / "plans.jsonl"
    proc = start_writer(path, 10**9, factor=4, tail="")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if path.exists() and path.read_bytes().count(b"\n") >= 20:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    data = path.read_bytes()
    lines = data.split(b"\n")
    result = read_plans(path)
    whole = len(lines) - 1  # lines terminated by a newline
    assert whole >= 20
    assert [p.step for p in result.plans] == list(range(whole))
    if lines[-1]:  # killed mid-line: exactly that line is skipped and reported
        assert len(result.problems) == 1 and result.problems[0].line == whole + 1
    else:
        assert result.problems == []
    # A reader meets a cut-off final line the same way however it arises.
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: data.rindex(b"\n") - 100])
    cut_result = read_plans(cut)
    assert [p.step for p in cut_result.plans] == list(range(whole - 1))
    assert [p.line for p in cut_result.problems] == [whole]


def test_plans_are_flushed_at_interpreter_exit_without_close(tmp_path):
    path = tmp_path / "plans.jsonl"
    # The script ends right after queueing; the writer is still ~1 s behind.
    proc = start_writer(
        path, 40, factor=1, tail="print(rec.written, rec.dropped)", write_delay=0.025
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    written_before_exit, dropped = map(int, out.split())
    assert dropped == 0 and written_before_exit < 40
    assert steps_in(path) == list(range(40))


def test_record_payload_is_json_object_per_line(tmp_path, plans):
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path) as rec:
        rec.record(plans[0])
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert json.loads(raw)["step"] == 0


# ------------------------------------------------------------ hostile conditions
def _wait_written(rec: PlanRecorder, count: int) -> None:
    deadline = time.monotonic() + 10
    while rec.written < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rec.written == count


def test_directory_removed_between_rotations_is_noticed_at_the_next_write(tmp_path, plans, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"):
        rec = PlanRecorder(out / "plans.jsonl")  # rotation 256 MiB away: never reached here
        for p in plans[:5]:
            rec.record(p)
        _wait_written(rec, 5)
        shutil.rmtree(out)
        for i in range(40):  # the training loop goes on
            p = plans[i % len(plans)].model_copy()
            p.step = 5 + i
            rec.record(p)
        deadline = time.monotonic() + 10
        while rec.disabled_reason is None and time.monotonic() < deadline:
            time.sleep(0.005)
        after = rec.record(plans[0])  # once noticed, the recorder is off
        rec.close()
    # Nothing went into the deleted file: the first write after the removal saw it.
    assert rec.written == 5
    assert rec.disabled_reason is not None and "removed" in rec.disabled_reason
    warnings = recorder_warnings(caplog)
    assert len(warnings) == 1 and str(out / "plans.jsonl") in warnings[0], warnings
    assert not out.exists()  # nothing was recreated behind the user's back
    assert after is False


def test_file_replaced_under_the_recorder_starts_a_new_file_at_the_path(tmp_path, plans, caplog):
    path = tmp_path / "plans.jsonl"
    with caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"):
        rec = PlanRecorder(path)
        for p in plans[:3]:
            rec.record(p)
        _wait_written(rec, 3)
        path.unlink()  # e.g. a user clearing old plans while the job runs
        for p in plans[3:8]:
            rec.record(p)
        _wait_written(rec, 8)
        os.replace(path, tmp_path / "moved.jsonl")  # and an outside tool rotating it
        for p in plans[8:]:
            rec.record(p)
        rec.close()
    # Plans after each change go to the path the user (and the dashboard) reads.
    assert steps_in(tmp_path / "moved.jsonl") == [3, 4, 5, 6, 7]
    assert steps_in(path) == [8, 9, 10, 11]
    assert rec.active is False and rec.disabled_reason is None
    warnings = recorder_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "removed" in warnings[0] and "replaced" in warnings[1]


def test_non_finite_measured_times_are_dropped_with_one_warning(tmp_path, plans, caplog):
    from knapformer.contract.plan import Measurements

    path = tmp_path / "plans.jsonl"
    n = len(plans[0].gpus)
    bad = []
    for i, value in enumerate([math.inf, math.nan, -math.inf]):
        p = plans[i].model_copy()
        p.measurements = Measurements(
            plan_ms=value if i == 0 else 1.5,
            per_rank_ms={
                "route": [1.0] * n,
                "forward_backward": [2.0] * (n - 1) + [value],
            },
        )
        bad.append(p)
    with (
        caplog.at_level(logging.WARNING, logger="knapformer.runtime.recorder"),
        PlanRecorder(path) as rec,
    ):
        for p in bad:
            rec.record(p)
    result = read_plans(path)  # every reader goes through this parser
    assert result.problems == [] and [p.step for p in result.plans] == [0, 1, 2]
    for back in result.plans:
        assert back.measurements.per_rank_ms == {"route": [1.0] * n}  # the good figure kept
    assert result.plans[0].measurements.plan_ms is None
    assert result.plans[1].measurements.plan_ms == 1.5
    assert rec.written == 3
    warnings = recorder_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "forward_backward" in warnings[0] and "inf" in warnings[0]
    # The caller's plan object is left as it was.
    assert math.isinf(bad[0].measurements.per_rank_ms["forward_backward"][-1])


@pytest.mark.parametrize("template", ["runs/{group}-{date}/plans.jsonl", "runs/{}/plans.jsonl"])
def test_path_template_with_unknown_placeholder_is_refused_at_construction(tmp_path, template):
    with pytest.raises(KnapformerError, match=re.escape(template)):
        PlanRecorder(tmp_path / template)


def test_path_braces_other_than_placeholders_are_taken_literally(tmp_path, plans):
    template = tmp_path / "odd{" / "run{group}" / "plans}.jsonl"
    rec = PlanRecorder(template)
    assert group_path(rec.path, [4, 5, 6, 7]) == tmp_path / "odd{" / "run1" / "plans}.jsonl"
    with rec:
        rec.record(plans[0])
    assert steps_in(template) == [0]  # no process group: the path as given


def test_rotation_removes_backups_beyond_retention_left_by_earlier_runs(tmp_path, plans):
    path = tmp_path / "plans.jsonl"
    for k in range(1, 8):  # an earlier run kept 7 backups
        (tmp_path / f"plans.{k}.jsonl").write_text(plans[0].model_dump_json() + "\n")
    (tmp_path / "plans.group1.3.jsonl").write_text("another group's backup\n")
    (tmp_path / "plans.x.jsonl").write_text("not a backup\n")
    line = len(plans[0].model_dump_json()) + 1
    with PlanRecorder(path, max_bytes=int(1.5 * line), backups=2) as rec:
        for p in plans[:4]:
            rec.record(p)
    names = sorted(f.name for f in tmp_path.iterdir() if f.is_file())
    assert names == [
        "plans.1.jsonl",
        "plans.2.jsonl",
        "plans.group1.3.jsonl",
        "plans.jsonl",
        "plans.x.jsonl",
    ]
    assert steps_in(path) == [3]
    assert steps_in(tmp_path / "plans.1.jsonl") == [2]
    assert steps_in(tmp_path / "plans.2.jsonl") == [1]


# ---------------------------------------------------------------- TensorBoard, live
def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of the TensorBoard event files in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_written_live_by_the_writer_thread(tmp_path, plans, monkeypatch):
    pytest.importorskip("tensorboard")
    import knapformer.contract.scalars as scalars

    threads: list[str] = []
    write_step = scalars.write_step

    def spy(writer, plan, step=None):
        threads.append(threading.current_thread().name)
        return write_step(writer, plan, step)

    monkeypatch.setattr(scalars, "write_step", spy)
    with PlanRecorder(tmp_path / "plans.jsonl", every=2, tensorboard_dir=tmp_path / "tb") as rec:
        for plan in plans[:6]:
            rec.record(plan)
    assert threads == ["knapformer-plan-recorder"] * 3  # never the training thread
    assert rec.tensorboard_written == 3
    got = _scalars(tmp_path / "tb")
    assert got, "no scalars were written"
    for name, value in scalars.step_figures(plans[4]).items():
        series = dict(got[scalars.TAG_PREFIX + name])
        assert sorted(series) == [0, 2, 4]  # the recorded steps, and only them
        assert series[4] == pytest.approx(value, rel=1e-6)  # event files hold float32


def test_a_tensorboard_failure_stops_only_the_tensorboard_logging(tmp_path, plans, caplog):
    pytest.importorskip("tensorboard")
    (tmp_path / "tb").write_text("a file where the log folder should be")
    with PlanRecorder(tmp_path / "plans.jsonl", tensorboard_dir=tmp_path / "tb") as rec:
        for plan in plans[:3]:
            rec.record(plan)
    assert steps_in(tmp_path / "plans.jsonl") == [0, 1, 2]  # the JSONL goes on
    assert rec.tensorboard_written == 0
    warned = [w for w in recorder_warnings(caplog) if "TensorBoard" in w]
    assert len(warned) == 1 and str(tmp_path / "tb") in warned[0]


def test_tensorboard_without_its_extra_is_refused_when_the_recorder_is_made(tmp_path, monkeypatch):
    import importlib.util

    from knapformer.errors import MissingExtraError

    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "tensorboard" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingExtraError, match=r"knapformer\[tensorboard\]"):
        PlanRecorder(tmp_path / "plans.jsonl", tensorboard_dir=tmp_path / "tb")


# ------------------------------------------------- resumed files, invalid plans, races
def test_a_file_ending_in_a_partial_line_is_terminated_and_the_next_plan_kept(
    tmp_path, plans, caplog
):
    # What SIGKILL or a full disk leaves: whole lines, then part of one.
    path = tmp_path / "plans.jsonl"
    whole = plans[0].model_dump_json() + "\n"
    path.write_text(whole + plans[1].model_dump_json()[:200])
    with PlanRecorder(path) as rec:
        assert rec.record(plans[2]) and rec.record(plans[3])
    assert rec.written == 2
    result = read_plans(path)
    assert [p.step for p in result.plans] == [0, 2, 3]  # before: step 2 was glued and lost
    assert [p.line for p in result.problems] == [2]  # the partial line, reported once
    warnings = [w for w in recorder_warnings(caplog) if "partial line" in w]
    assert len(warnings) == 1 and str(path) in warnings[0]


def _measured(plan, per_rank_ms):
    from knapformer.contract.plan import Measurements

    return plan.model_copy(update={"measurements": Measurements(per_rank_ms=per_rank_ms)})


def test_plans_a_reader_would_refuse_are_counted_not_written(tmp_path, plans, caplog):
    from knapformer.contract.limits import MAX_STEP

    nan_workload = plans[1].model_copy(
        update={
            "sequences": plans[1].sequences.model_copy(
                update={"workload": np.where(np.arange(len(plans[1].sequences)) == 0, np.nan, 1.0)}
            )
        }
    )
    short = _measured(plans[2], {"forward_backward": [1.0] * (len(plans[2].gpus) - 1)})
    beyond = plans[3].model_copy(update={"step": MAX_STEP + 1})
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path) as rec:
        for plan in (plans[0], nan_workload, short, beyond, plans[4]):
            assert rec.record(plan)
    assert (rec.written, rec.refused) == (2, 3)
    assert steps_in(path) == [0, 4]  # every written line reads back (read_plans raises)
    warnings = [w for w in recorder_warnings(caplog) if "readers would refuse" in w]
    assert len(warnings) == 1
    assert "step 1" in warnings[0] and "workload" in warnings[0]
    # The caller's plans were not touched, and the valid one is as it was.
    assert read_plans(path).plans[1] == plans[4]


def test_record_racing_close_returns_true_only_for_plans_accounted_for(tmp_path, plans):
    # A record() that passed its checks when close() ran: before, it queued the plan
    # behind the writer's stop item and returned True for a plan never written.
    inside, go = threading.Event(), threading.Event()

    class Paused(PlanRecorder):
        def _writes(self, plan):
            if plan.step == 5:
                inside.set()
                go.wait(10)
            return super()._writes(plan)

    rec = Paused(tmp_path / "plans.jsonl")
    assert rec.record(plans[0])
    result: list[bool] = []
    late = threading.Thread(target=lambda: result.append(rec.record(plans[5])))
    late.start()
    assert inside.wait(10)
    rec.close()  # while that record() is between its checks and the queue
    go.set()
    late.join(10)
    assert result == [False]
    assert rec.written == 1 and steps_in(tmp_path / "plans.jsonl") == [0]
    # Many threads against close(): every True is a plan written or counted.
    for attempt in range(3):
        path = tmp_path / f"race{attempt}" / "plans.jsonl"
        rec = PlanRecorder(path, queue_size=100_000)
        accepted = [0] * 4
        started = threading.Barrier(5)

        def hammer(k: int, rec=rec, accepted=accepted, started=started) -> None:
            started.wait()
            for i in range(300):
                if rec.record(plans[i % len(plans)].model_copy(update={"step": None})):
                    accepted[k] += 1

        threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        started.wait()
        rec.close()
        for t in threads:
            t.join()
        lines = path.read_text().count("\n") if path.exists() else 0
        assert sum(accepted) == rec.written + rec.failed + rec.refused + rec.lost
        assert rec.written == lines
        assert not rec.record(plans[0])  # after close: refused, no thread started


def test_a_rerun_whose_steps_restart_starts_a_new_file(tmp_path, plans, caplog):
    path = tmp_path / "plans.jsonl"
    with PlanRecorder(path) as rec:
        for plan in plans[:3]:
            rec.record(plan)
    with PlanRecorder(path) as rec:  # the same job again: steps restart at 0
        for plan in plans[:3]:
            rec.record(plan)
    assert steps_in(path) == [0, 1, 2]
    assert steps_in(tmp_path / "plans.1.jsonl") == [0, 1, 2]
    warnings = [w for w in recorder_warnings(caplog) if "earlier recording" in w]
    assert len(warnings) == 1 and "up to step 2" in warnings[0] and "step 0" in warnings[0]
    # A run resumed from a checkpoint goes on where it stopped: it appends.
    with PlanRecorder(path) as rec:
        for plan in plans[3:5]:
            rec.record(plan)
    assert steps_in(path) == [0, 1, 2, 3, 4]
    # the run store does the same: the earlier run's moved aside, the resumed one appended
    names = ["plans.1.jsonl", "plans.jsonl", "store", "store.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
