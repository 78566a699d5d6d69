import copy
import json

import numpy as np
import pytest
from pydantic import ValidationError

from knapformer.contract.plan import RoutingPlan
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel


def small_plan_dict() -> dict:
    """4 GPUs, bags [0] [1] [2,3]; one sequence split over the 2-GPU bag."""
    return {
        "schema_version": 1,
        "step": 7,
        "time": 1.5,
        "run": "unit",
        "topology": "g1n2+g2n1",
        "gpus": [0, 1, 2, 3],
        "bags": [[0], [1], [2, 3]],
        "token_dim": 64,
        "gamma": 0.4,
        "solver": "hand",
        "sequences": {
            "src_gpu": [0, 1, 2, 3],
            "length": [10, 6, 5, 0],
            "workload": [1.0, 0.5, 0.25, 0.0],
            "bag": [0, 2, 1, 2],
        },
        "chunks": {
            "seq": [0, 1, 1, 2],
            "src_gpu": [0, 1, 1, 2],
            "dst_gpu": [0, 2, 3, 1],
            "offset": [0, 0, 3, 0],
            "length": [10, 3, 3, 5],
        },
        "measurements": {"plan_ms": 0.5, "per_rank_ms": {"step": [1.0, 2.0, 3.0, 4.0]}},
    }


def test_valid_plan_and_exact_json_round_trip():
    plan = RoutingPlan.model_validate(small_plan_dict())
    text = plan.model_dump_json()
    again = RoutingPlan.model_validate_json(text)
    assert again == plan
    assert again.model_dump_json() == text
    defaults = {"planner_version": None, "scale": None, "workload_unit": "model", "gpu_speed": None}
    assert json.loads(text) == {**small_plan_dict(), **defaults, "solver_options": {}}
    # policy is written only when set (a plan of fixed bags reads as before it existed)
    auto = RoutingPlan.model_validate({**small_plan_dict(), "schema_version": 2, "policy": "auto"})
    assert json.loads(auto.model_dump_json())["policy"] == "auto"
    assert RoutingPlan.model_validate_json(auto.model_dump_json()).policy == "auto"


def test_round_trip_of_planner_output_keeps_floats_bit_exact():
    rng = np.random.default_rng(5)
    lengths = [rng.integers(1, 5000, size=6) for _ in range(8)]
    plan = plan_routing(lengths, "g1n2+g2n1+g4n1", WorkloadModel(3072, 0.4), step=3)
    again = RoutingPlan.model_validate_json(plan.model_dump_json())
    assert np.array_equal(again.sequences.workload, plan.sequences.workload)
    assert again.sequences.workload.dtype == np.float64
    assert again == plan


def _break(path, value):
    def mutate(d):
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return mutate


BROKEN = [
    ("gpus listed twice", _break(["gpus"], [0, 1, 2, 2]), ["GPU(s) 2", "more than once"]),
    ("GPU in two bags", _break(["bags"], [[0], [1, 2], [2, 3]]), ["GPU(s) 2", "more than one bag"]),
    ("GPU in no bag", _break(["bags"], [[0], [1], [2]]), ["GPU(s) 3", "no bag"]),
    ("bag outside gpus", _break(["bags"], [[0], [1], [2, 3, 9]]), ["GPU(s) 9"]),
    ("negative rank in a bag", _break(["bags"], [[0], [1], [2, 3, -4]]), ["GPU(s) -4"]),
    ("empty bag", _break(["bags"], [[0], [1], [2, 3], []]), ["bag(s) 3", "no GPUs"]),
    (
        "chunk to a GPU outside gpus",
        _break(["chunks", "dst_gpu"], [0, 2, 3, 12]),
        ["chunk(s) 3", "outside gpus"],
    ),
    (
        "chunk outside its bag",
        _break(["chunks", "dst_gpu"], [0, 2, 0, 1]),
        ["chunk(s) 2", "sequence(s) 1"],
    ),
    ("gap between chunks", _break(["chunks", "offset"], [0, 0, 4, 0]), ["sequence(s) 1"]),
    (
        "chunks do not sum to the length",
        _break(["sequences", "length"], [10, 7, 5, 0]),
        ["sequence(s) 1", "not covered"],
    ),
    (
        "two chunks to one GPU",
        _break(["chunks", "dst_gpu"], [0, 2, 2, 1]),
        ["sequence(s) 1", "more than one chunk"],
    ),
    ("negative length", _break(["sequences", "length"], [10, 6, 5, -1]), ["sequence(s) 3"]),
    (
        "workload not finite",
        _break(["sequences", "workload"], [1.0, float("nan"), 0.25, 0.0]),
        ["sequence(s) 1", "workload"],
    ),
    (
        "negative workload",
        _break(["sequences", "workload"], [1.0, 0.5, -0.25, 0.0]),
        ["sequence(s) 2"],
    ),
    ("source outside group", _break(["sequences", "src_gpu"], [0, 1, 2, 7]), ["sequence(s) 3"]),
    ("bag id out of range", _break(["sequences", "bag"], [0, 2, 1, 5]), ["sequence(s) 3"]),
    ("chunk names no sequence", _break(["chunks", "seq"], [0, 1, 1, 9]), ["chunk(s) 3"]),
    (
        "chunk source differs from its sequence",
        _break(["chunks", "src_gpu"], [0, 1, 0, 2]),
        ["chunk(s) 2"],
    ),
    ("negative chunk length", _break(["chunks", "length"], [10, 3, 3, -5]), ["chunk(s) 3"]),
    ("columns differ in length", _break(["chunks", "offset"], [0, 0, 3]), ["columns differ"]),
    ("float lengths", _break(["sequences", "length"], [10.5, 6, 5, 0]), ["sequences.length"]),
    (
        "per-rank times of the wrong size",
        _break(["measurements", "per_rank_ms", "step"], [1.0]),
        ["per_rank_ms['step']"],
    ),
    (
        "a time that is not finite",
        _break(["measurements", "per_rank_ms", "step"], [1.0, float("inf"), 1.0, 1.0]),
        ["per_rank_ms['step'] of GPU(s) 1 is not finite"],
    ),
    ("unknown field", _break(["extra"], 1), ["extra"]),
]


@pytest.mark.parametrize(("name", "mutate", "fragments"), BROKEN, ids=[b[0] for b in BROKEN])
def test_each_broken_invariant_is_rejected_naming_the_ids(name, mutate, fragments):
    d = copy.deepcopy(small_plan_dict())
    mutate(d)
    with pytest.raises(ValidationError) as err:
        RoutingPlan.model_validate(d)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"


def test_stats_match_hand_computation():
    st = RoutingPlan.model_validate(small_plan_dict()).stats
    np.testing.assert_allclose(st.load_before, [1.0, 0.5, 0.25, 0.0])
    # seq0 -> GPU0; seq2 -> GPU1; seq1 (0.5) and seq3 (0) split over GPUs 2,3
    np.testing.assert_allclose(st.load_after, [1.0, 0.25, 0.25, 0.25])
    np.testing.assert_array_equal(st.tokens_before, [10, 6, 5, 0])
    np.testing.assert_array_equal(st.tokens_after, [10, 5, 3, 3])
    np.testing.assert_allclose(st.bag_load_before, [1.0, 0.5, 0.25])
    np.testing.assert_allclose(st.bag_load_after, [1.0, 0.25, 0.5])
    assert st.moved_tokens == 11
    assert st.total_tokens == 21
    assert st.traffic[1, 2] == 3 and st.traffic[1, 3] == 3 and st.traffic[2, 1] == 5
    assert st.traffic[0, 0] == 10 and st.traffic.sum() == 21
    assert st.lower_bound == pytest.approx(max(1.75 / 4, 1.0 / 2))
    assert st.imbalance_before == pytest.approx(1.0 / (1.75 / 4))
    assert st.max_min_before == float("inf")
    assert st.max_min_after == pytest.approx(4.0)
    assert st.speedup == pytest.approx(1.0)


def test_build_skips_validation_but_validated_checks():
    d = small_plan_dict()
    d["chunks"]["dst_gpu"] = [0, 0, 0, 0]
    plan = RoutingPlan.build(**{k: v for k, v in d.items() if k != "measurements"})
    with pytest.raises(ValidationError, match="outside their sequence's bag"):
        plan.validated()


def test_other_schema_version_is_rejected():
    d = small_plan_dict()
    d["schema_version"] = 3
    with pytest.raises(ValidationError, match="schema_version"):
        RoutingPlan.model_validate(d)


def test_json_schema_describes_columns_as_arrays():
    schema = RoutingPlan.model_json_schema()
    seq = schema["$defs"]["Sequences"]["properties"]
    assert seq["length"]["type"] == "array"
    assert seq["workload"]["items"]["type"] == "number"


def test_negative_ranks_and_out_of_order_rows_are_rejected():
    d = small_plan_dict()
    d["gpus"] = [0, 1, 2, -3]
    with pytest.raises(ValidationError, match="negative rank"):
        RoutingPlan.model_validate(d)
    d = small_plan_dict()  # chunks 1 and 2 of sequence 1 swapped: a valid tiling, wrong order
    for name in ("dst_gpu", "offset", "length"):
        col = d["chunks"][name]
        col[1], col[2] = col[2], col[1]
    with pytest.raises(ValidationError, match=r"chunk\(s\) 2 are out of order"):
        RoutingPlan.model_validate(d)
    d = small_plan_dict()  # sequences not grouped by source GPU
    d["sequences"]["src_gpu"] = [0, 1, 3, 2]
    d["chunks"]["src_gpu"] = [0, 1, 1, 3]
    with pytest.raises(ValidationError, match=r"sequence\(s\) 3 are out of order"):
        RoutingPlan.model_validate(d)
