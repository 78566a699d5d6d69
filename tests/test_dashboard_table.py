"""The sequence table's server-side pages, sorting and filtering (dashboard.table)."""

from __future__ import annotations

import numpy as np
import pytest
from knapformer.dashboard.table import query
from knapformer.visualization.figures import sequence_rows

from knapformer.contract.plan_io import read_plans


@pytest.fixture
def plan(steps50_path):
    return read_plans(steps50_path, on_error="raise").plans[3]


def test_pages_hold_the_rows_in_order(plan):
    every = sequence_rows(plan)
    rows, pages, ids = query(plan, 2, 10)
    assert pages == -(-len(every) // 10)
    assert rows == every[20:30]
    assert ids.tolist() == list(range(len(every)))
    last, _, _ = query(plan, 10_000, 10)  # a page past the end shows the last one
    assert last == every[(pages - 1) * 10 :]


def test_sorting_and_filtering_use_the_tables_own_syntax(plan):
    every = sequence_rows(plan)
    rows, _, ids = query(plan, 0, 5, [{"column_id": "length", "direction": "desc"}])
    lengths = [r["length"] for r in every]
    assert [r["length"] for r in rows] == sorted(lengths, reverse=True)[:5]
    _, _, ids = query(plan, 0, 5, None, "{chunks} > 1 && {length} >= 1000")
    assert ids.tolist() == [r["id"] for r in every if r["chunks"] > 1 and r["length"] >= 1000]
    _, _, ids = query(plan, 0, 5, None, '{bag} = 14 && {destinations} contains "31"')
    assert ids.tolist() == [
        r["id"] for r in every if r["bag"] == 14 and "31" in r["destinations"].split()
    ]
    assert len(ids) > 0
    # two keys: bag ascending, then workload descending within a bag
    _, _, ids = query(
        plan,
        0,
        5,
        [{"column_id": "bag", "direction": "asc"}, {"column_id": "workload", "direction": "desc"}],
    )
    key = [(every[i]["bag"], -every[i]["workload"]) for i in ids]
    assert key == sorted(key)


def test_a_half_typed_filter_does_not_empty_the_table(plan):
    n = len(plan.sequences)
    for text in ("{length} >", "{nope} > 3", "{length} > abc", "garbage"):
        assert len(query(plan, 0, 5, None, text)[2]) == n, text
    assert np.array_equal(
        query(plan, 0, 5, None, "{length} > abc && {chunks} ge 2")[2],
        query(plan, 0, 5, None, "{chunks} >= 2")[2],
    )
