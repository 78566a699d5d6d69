"""The run-file layout: what a recorder writes is what the demo clears and the dashboard
lists, because all of them name files through `knapformer.contract.runfiles`."""

from __future__ import annotations

import json
from pathlib import Path

from knapformer.dashboard.store import Runs

from knapformer.contract.runfiles import (
    MAX_NAME,
    find_runs,
    group_file,
    is_rotated,
    looks_like_plans,
    plans_file,
    recording_files,
    remove_recording,
    rotated_file,
    run_file,
    safe_name,
)
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.recorder import PlanRecorder


def _plans(n: int) -> list:
    lengths = [[900, 40], [3000], [10, 20, 30], [5000]]
    return [plan_routing(lengths, "g1n2+g2n1", WorkloadModel(64), step=i) for i in range(n)]


def test_group_files_follow_the_template_or_sit_next_to_the_path(tmp_path):
    path = tmp_path / "plans.jsonl"
    assert group_file(path, 0) == path
    assert group_file(path, 3) == tmp_path / "plans.group3.jsonl"
    templated = tmp_path / "g{group}" / "plans.jsonl"
    assert group_file(templated, 0) == tmp_path / "g0" / "plans.jsonl"
    assert group_file(templated, 2) == tmp_path / "g2" / "plans.jsonl"
    # Rotation keeps a group file's name recognisable as that group's.
    assert rotated_file(group_file(path, 1), 2) == tmp_path / "plans.group1.2.jsonl"
    assert is_rotated(rotated_file(path, 4)) and not is_rotated(group_file(path, 4))


def test_recorder_rotations_are_cleared_by_a_new_run_and_hidden_from_the_run_list(tmp_path):
    plans = _plans(6)
    path = plans_file(tmp_path / "run")
    line = len(plans[0].model_dump_json()) + 1
    with PlanRecorder(path, max_bytes=int(2.5 * line), backups=2) as rec:
        for plan in plans:
            rec.record(plan)
    written = sorted(p.name for p in path.parent.iterdir() if p.is_file())  # not store/
    assert written == ["plans.1.jsonl", "plans.2.jsonl", "plans.jsonl"]
    assert [p.name for p in recording_files(path)] == written
    # The dashboard offers the run once, under its folder's name, not its rotated copies.
    assert find_runs(tmp_path) == {"run": path}
    assert Runs(tmp_path).files() == {"run": path}
    (path.parent / "notes.jsonl").write_text("")
    removed = remove_recording(path)
    assert sorted(p.name for p in removed) == written
    assert sorted(p.name for p in path.parent.iterdir()) == ["notes.jsonl", "store"]


def test_a_folder_of_runs_lists_run_folders_and_loose_plan_files(tmp_path):
    for run in ("b-greedy", "a-knapformer"):
        run_file(tmp_path, run).parent.mkdir()
        run_file(tmp_path, run).write_text("")
    (tmp_path / "empty-run").mkdir()  # no plans.jsonl: not a run
    for name in ("plans.jsonl", "plans.3.jsonl", "extra.json", "notes.txt"):
        (tmp_path / name).write_text("")
    runs = find_runs(tmp_path)
    assert runs == {
        tmp_path.name: tmp_path / "plans.jsonl",
        "a-knapformer": tmp_path / "a-knapformer" / "plans.jsonl",
        "b-greedy": tmp_path / "b-greedy" / "plans.jsonl",
        "extra.json": tmp_path / "extra.json",
    }
    single = tmp_path / "extra.json"
    assert find_runs(single) == {"extra": single}
    assert find_runs(Path(tmp_path / "missing.jsonl")) == {"missing": tmp_path / "missing.jsonl"}


def test_safe_name_never_makes_a_path(tmp_path):
    for name, safe in (
        ("../../ESCAPED", "_.._ESCAPED"),
        ("/etc/passwd", "_etc_passwd"),
        ("..", "run"),
        (".hidden", "hidden"),
        ("", "run"),
        ("a\udcffb", "a_b"),
        ("g1n2+g2n1+g4n1-knapformer", "g1n2+g2n1+g4n1-knapformer"),
    ):
        assert safe_name(name) == safe
    assert len(safe_name("x" * 1000)) == MAX_NAME
    for run in ("../../x", "/abs", "..", "a/../../b"):
        assert run_file(tmp_path, run).parent.parent == tmp_path


def test_only_loose_files_that_look_like_plans_are_runs(tmp_path):
    plan = _plans(1)[0]
    (tmp_path / "plans.jsonl").write_text(plan.model_dump_json() + "\n")
    (tmp_path / "other.jsonl").write_text("\ufeff" + plan.model_dump_json() + "\n")
    indented = json.dumps(json.loads(plan.model_dump_json()), indent=2)
    (tmp_path / "indented.json").write_text(indented)
    (tmp_path / "legacy.json").write_text('{"balance_gpu_ids": [0]}')
    (tmp_path / "trace.json").write_text('{"traceEvents": [{"args": {"topology": "g1n1"}}]}')
    (tmp_path / "figure.json").write_text('{"data": [], "layout": {}}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "fresh.jsonl").write_text("")  # a recording about to start
    assert sorted(find_runs(tmp_path)) == sorted(
        [tmp_path.name, "other.jsonl", "indented.json", "legacy.json", "fresh.jsonl"]
    )
    assert not looks_like_plans(tmp_path / "missing.json")
