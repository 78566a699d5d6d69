import json

import numpy as np
import pytest

from knapformer.contract.plan_io import (
    PlanFormatError,
    parse_step_range,
    plans_in_range,
    read_plans,
    select_step,
    write_json,
    write_jsonl,
)
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

_MODEL = WorkloadModel(3072, 0.4)


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
    record["schema_version"] = 3
    path.write_text(json.dumps(record) + "\n")
    assert "schema_version 3 is not supported" in read_plans(path).problems[0].message


def test_plans_name_their_planner_and_schema_1_files_still_read(tmp_path):
    import knapformer

    plan = _plans(1)[0]
    assert plan.schema_version == 2
    assert plan.planner_version == knapformer.__version__
    record = json.loads(plan.model_dump_json())
    record["schema_version"] = 1
    del record["planner_version"]  # what a schema-1 recorder wrote
    path = tmp_path / "v1.jsonl"
    path.write_text(json.dumps(record) + "\n")
    old = read_plans(path, on_error="raise").plans[0]
    assert old.schema_version == 1
    assert old.planner_version is None
    assert old.sequences == plan.sequences


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


def test_step_ranges_select_like_select_step(tmp_path):
    assert parse_step_range("3:7") == (3, 7)
    assert parse_step_range(":7") == (None, 7) and parse_step_range("3:") == (3, None)
    with pytest.raises(ValueError, match="must look like A:B"):
        parse_step_range("5")
    with pytest.raises(ValueError, match="integer steps"):
        parse_step_range("a:b")
    with pytest.raises(ValueError, match="the last step is before the first"):
        parse_step_range("4:2")
    plans = _plans(5)
    for i, plan in enumerate(plans):
        plan.step = 10 + i
    path = tmp_path / "plans.jsonl"
    write_jsonl(path, plans)
    result = read_plans(path)
    assert [p.step for p in plans_in_range(result, "11:12")] == [11, 12]
    assert [p.step for p in plans_in_range(result, "13:")] == [13, 14]
    gap = r"no plan with a step in '0:9' \(the file holds steps 10..14\)"
    with pytest.raises(ValueError, match=gap):
        plans_in_range(result, "0:9")
    # Without step numbers, the index in the file is the step (as for select_step).
    for plan in plans:
        plan.step = None
    write_jsonl(path, plans)
    result = read_plans(path)
    assert plans_in_range(result, "1:2") == [result.plans[1], result.plans[2]]
    assert select_step(result, 1).plan == result.plans[1]


@pytest.mark.parametrize(
    "measurements",
    [
        None,
        {},
        {"plan_ms": 2.5, "per_rank_ms": {"route": [0.1, 1e-7, 3.0, 4.0], 'odd "phase"': [1] * 4}},
        {"plan_ms": float("nan"), "per_rank_ms": {"step": [float("inf"), 1.0, 2.0, 3.0]}},
        {"per_rank_ms": {}, "note": "extra fields travel too"},
    ],
)
def test_json_line_pieces_parse_to_what_model_dump_json_writes(measurements, monkeypatch):
    from knapformer.contract import plan_io
    from knapformer.contract.plan import Measurements
    from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix

    rng = np.random.default_rng(3)
    codes = scale_mix(parse_mix("joint"), 8)  # ~700 sequences on 256 GPUs
    plan = plan_routing(sample_lengths(codes, rng), "g1n128+g2n32+g4n16", _MODEL, step=4)
    plan.sequences.workload[5] = float("inf")  # non-finite floats are written null
    if measurements is not None:
        gpus = len(plan.gpus)
        for values in measurements.get("per_rank_ms", {}).values():
            values.extend(values[-1:] * (gpus - len(values)))
        measurements = Measurements(**measurements)
    plan.measurements = measurements
    monkeypatch.setattr(plan_io, "PIECE_NUMBERS", 100)  # columns of ~700 split in pieces
    pieces = list(plan_io.json_line_pieces(plan))
    assert json.loads(b"".join(pieces)) == json.loads(plan.model_dump_json())
    # The work is split: no piece holds more than PIECE_NUMBERS numbers of a column.
    assert len(plan.chunks) > 700 and len(pieces) > 7 * 9
    assert max(piece.count(b",") for piece in pieces[1:]) <= 100  # [0]: the scalar fields
