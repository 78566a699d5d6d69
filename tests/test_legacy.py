import json

import numpy as np
import pytest

from knapformer.contract.legacy import plan_from_legacy, plan_to_legacy
from knapformer.contract.plan_io import read_plans
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel


def _plan():
    rng = np.random.default_rng(2)
    lengths = [rng.integers(0, 9000, size=rng.integers(0, 5)) for _ in range(8)]
    return plan_routing(lengths, "g1n2+g2n1+g4n1", WorkloadModel(3072, 0.4), solver="greedy")


def test_legacy_summary_with_string_keys_imports_to_the_same_routing():
    plan = _plan()
    summary = json.loads(json.dumps(plan_to_legacy(plan)))  # int keys became strings
    assert all(isinstance(k, str) for k in summary["seq_id2seq_len"])
    imported = plan_from_legacy(summary)
    assert imported.topology == "g1n2+g2n1+g4n1"
    assert imported.token_dim is None and imported.gamma is None
    assert imported.solver == "unknown"
    for name in ("src_gpu", "length", "bag"):
        assert np.array_equal(getattr(imported.sequences, name), getattr(plan.sequences, name))
    np.testing.assert_allclose(imported.sequences.workload, plan.sequences.workload)
    assert imported.stats.moved_tokens == plan.stats.moved_tokens
    assert np.array_equal(imported.stats.traffic, plan.stats.traffic)


def test_legacy_chunks_tile_sequences_in_id_order():
    # Two sequences on GPU 0; the second one split over bag [1, 2] as chunks 1 and 2.
    summary = {
        "balance_gpu_ids": [0, 1, 2],
        "bag_id2gpu_ids": {"0": [0], "1": [1, 2]},
        "gpu_id2bag_id": {"0": 0, "1": 1, "2": 1},
        "seq_id2seq_len": {"0": 4, "1": 7},
        "seq_id2seq_workload": {"0": 1.0, "1": 2.0},
        "gpu_id2seq_ids": {"0": [0, 1], "1": [], "2": []},
        "gpu_id2seq_lens": {"0": [4, 7], "1": [], "2": []},
        "gpu_id2seq_workloads": {"0": [1.0, 2.0], "1": [], "2": []},
        "gpu_id2chunk_ids": {"0": [0, 1, 2], "1": [], "2": []},
        "gpu_id2chunk_lens": {"0": [4, 3, 4], "1": [], "2": []},
        "balance_chunk_id2gpu_id": {"0": 0, "1": 1, "2": 2},
        "balance_chunk_id2chunk_len": {"0": 4, "1": 3, "2": 4},
        "chunk_id2seq_id": {"0": 0, "1": 1, "2": 1},
    }
    plan = plan_from_legacy(summary)
    assert plan.chunks.offset.tolist() == [0, 0, 3]
    assert plan.sequences.bag.tolist() == [0, 1]
    assert plan.topology == "g1n1+g2n1"


def test_legacy_missing_keys_are_named():
    with pytest.raises(ValueError, match="chunk_id2seq_id"):
        plan_from_legacy({"balance_gpu_ids": [0], "bag_id2gpu_ids": {"0": [0]}})


def test_committed_legacy_sample_is_recognised(legacy_path):
    result = read_plans(legacy_path, on_error="raise")
    assert len(result.plans) == 1
    assert result.plans[0].solver == "unknown"
    assert len(result.plans[0].gpus) == 8


@pytest.mark.parametrize(
    ("key", "value"),
    [("balance_gpu_ids", 5), ("gpu_id2seq_ids", {"0": 3}), ("seq_id2seq_len", {})],
)
def test_malformed_legacy_fields_are_value_errors(key, value):
    summary = json.loads(json.dumps(plan_to_legacy(_plan())))
    summary[key] = value
    with pytest.raises(ValueError, match="legacy plan"):
        plan_from_legacy(summary)


def test_legacy_chunks_listed_out_of_order_are_put_in_canonical_order():
    summary = json.loads(json.dumps(plan_to_legacy(_plan())))
    for gpu, ids in summary["gpu_id2chunk_ids"].items():
        summary["gpu_id2chunk_ids"][gpu] = ids[::-1]
        summary["gpu_id2chunk_lens"][gpu] = summary["gpu_id2chunk_lens"][gpu][::-1]  # paired
    plan = plan_from_legacy(summary)
    assert np.array_equal(plan.chunks.seq, np.sort(plan.chunks.seq))
