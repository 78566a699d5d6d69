"""The order and the units in which `make test`'s workers take the suite
(tests/suite_order.py): longest unit first, and the tests that share a docs block's run
in the docs' unit, so that the run is made once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import suite_order
from suite_order import DOCS_UNIT, WITH_THE_DOCS, longest_first, unit_of

TESTS = Path(__file__).resolve().parent


@dataclass
class FakeItem:
    nodeid: str


def test_a_test_is_in_its_files_unit_unless_it_shares_a_docs_run():
    assert unit_of("tests/test_planner.py::test_x[a::b]") == "tests/test_planner.py"
    assert unit_of("tests/test_docs.py::test_console_block[README.md:52]") == DOCS_UNIT
    assert unit_of("tests/test_stragglers_run.py::test_the_slow_rank") == DOCS_UNIT
    shared = "tests/test_demo.py::test_demo_headless_records_measured_plans"
    assert unit_of(shared) == DOCS_UNIT
    assert unit_of("tests/test_demo.py::test_six_workers") == "tests/test_demo.py"


def test_every_test_that_takes_a_docs_run_is_in_the_docs_unit():
    """A test calling run_block_of outside the docs' unit would run the block a second
    time, on another worker: the list must name each such test, and only real ones."""
    takers = set()
    for path in TESTS.glob("test_*.py"):
        if path.name in ("test_docs.py", Path(__file__).name):
            continue
        source = path.read_text(encoding="utf-8")
        for function in re.split(r"\n(?=(?:@|def |class ))", source):
            if "run_block_of(" in function:
                name = re.search(r"def (\w+)", function).group(1)
                takers.add(f"tests/{path.name}::{name}")
    assert takers, "no test takes a docs block's run: the list is not needed any more"
    for taker in takers:
        assert unit_of(taker) == DOCS_UNIT, taker
    for prefix in WITH_THE_DOCS:
        file, _, name = prefix.partition("::")
        assert (TESTS.parent / file).is_file(), prefix
        assert not name or f"def {name}(" in (TESTS.parent / file).read_text(), prefix


def test_units_start_longest_first_and_keep_their_tests_together(monkeypatch, tmp_path):
    table = tmp_path / "scope_seconds.json"
    table.write_text(json.dumps({"tests/test_b.py": 5.0, DOCS_UNIT: 90.0, "tests/test_c.py": 30}))
    monkeypatch.setattr(suite_order, "SECONDS_FILE", table)
    ids = [
        "tests/test_a.py::one",  # not in the table: short, after the known units
        "tests/test_b.py::one",
        "tests/test_c.py::one",
        "tests/test_docs.py::block[README.md:1]",
        "tests/test_b.py::two",
        "tests/test_stragglers_run.py::named",  # joins the docs' unit
        "tests/test_docs.py::block[docs/x.md:9]",
        "tests/test_z.py::one",
    ]
    ordered = [item.nodeid for item in longest_first([FakeItem(i) for i in ids])]
    assert ordered == [
        "tests/test_docs.py::block[README.md:1]",
        "tests/test_stragglers_run.py::named",
        "tests/test_docs.py::block[docs/x.md:9]",
        "tests/test_c.py::one",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        "tests/test_a.py::one",
        "tests/test_z.py::one",
    ]


def test_without_a_table_the_collection_order_is_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(suite_order, "SECONDS_FILE", tmp_path / "missing.json")
    ids = ["tests/test_b.py::one", "tests/test_a.py::one", "tests/test_b.py::two"]
    ordered = [item.nodeid for item in longest_first([FakeItem(i) for i in ids])]
    assert ordered == ["tests/test_b.py::one", "tests/test_b.py::two", "tests/test_a.py::one"]


def test_the_committed_table_names_existing_units():
    table = suite_order.unit_seconds()
    assert table[DOCS_UNIT] == max(table.values())  # the docs' blocks run one at a time
    for unit in table:
        assert (TESTS.parent / unit).is_file(), unit
