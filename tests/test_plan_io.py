import json

import pytest

from knapformer.plan_io import PlanFormatError, read_plans, select_step, write_json, write_jsonl
from knapformer.planner import plan_routing
from knapformer.workload import WorkloadModel


def _plans(n):
    model = WorkloadModel(256, 0.4)
    return [
        plan_routing([[100 + i], [50], [75], [10]], "g1n2+g2n1", model, step=i) for i in range(n)
    ]


def test_jsonl_round_trip_with_line_numbers(tmp_path):
    path = tmp_path / "plans.jsonl"
    plans = _plans(3)
    assert write_jsonl(path, plans) == 3
    result = read_plans(path, on_error="raise")
    assert [r.line for r in result.records] == [1, 2, 3]
    assert result.plans == plans


def test_malformed_lines_are_skipped_and_reported_or_raised(tmp_path):
    path = tmp_path / "plans.jsonl"
    write_jsonl(path, _plans(2))
    lines = path.read_text().splitlines()
    bad_plan = json.loads(lines[1])
    bad_plan["sequences"]["length"][0] += 1  # no longer tiled by its chunks
    text = "\n".join([lines[0], "{not json", json.dumps(bad_plan), lines[1], '{"sched'])
    path.write_text(text)
    result = read_plans(path)
    assert [r.line for r in result.records] == [1, 4]
    assert [p.line for p in result.problems] == [2, 3, 5]
    assert "not valid JSON" in result.problems[0].message
    assert "sequence(s) 0 are not covered exactly" in result.problems[1].message
    assert str(result.problems[0]).startswith(f"{path}:2: ")
    with pytest.raises(PlanFormatError, match=":2: not valid JSON"):
        read_plans(path, on_error="raise")


def test_other_schema_version_is_a_clear_problem(tmp_path):
    path = tmp_path / "v2.jsonl"
    record = json.loads(_plans(1)[0].model_dump_json())
    record["schema_version"] = 2
    path.write_text(json.dumps(record) + "\n")
    assert "schema_version 2 is not supported" in read_plans(path).problems[0].message


def test_json_document_list_and_missing_or_empty_files(tmp_path):
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    plans = _plans(2)
    write_json(one, plans[0], indent=2)
    many.write_text(json.dumps([json.loads(p.model_dump_json()) for p in plans]))
    assert read_plans(one, on_error="raise").plans == plans[:1]
    assert read_plans(many, on_error="raise").plans == plans
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty" in read_plans(empty).problems[0].message
    assert "cannot read" in read_plans(tmp_path / "nope.jsonl").problems[0].message


def test_select_step(tmp_path):
    path = tmp_path / "plans.jsonl"
    write_jsonl(path, _plans(3))
    result = read_plans(path)
    assert select_step(result, None).plan.step == 2
    assert select_step(result, 1).plan.step == 1
    with pytest.raises(PlanFormatError, match=r"step 9 is not in the file \(it holds steps 0..2\)"):
        select_step(result, 9)
