"""The order and the units in which `make test`'s workers take the suite
(tests/suite_order.py): longest unit first, the docs' console blocks in one unit per
page, and the tests that share a docs block's run in that page's unit, so that the run
is made once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import suite_order
from suite_order import WITH_A_DOCS_PAGE, longest_first, page_unit, unit_of

TESTS = Path(__file__).resolve().parent


@dataclass
class FakeItem:
    nodeid: str


def test_a_test_is_in_its_files_unit_unless_it_is_a_docs_blocks():
    assert unit_of("tests/test_planner.py::test_x[a::b]") == "tests/test_planner.py"
    assert unit_of("tests/test_planner.py::test_x[docs/x.md:3]") == "tests/test_planner.py"
    readme = "tests/test_docs.py[README.md]"
    assert unit_of("tests/test_docs.py::test_console_block[README.md:52]") == readme
    debugging = page_unit("docs/debugging.md")
    assert debugging == "tests/test_docs.py[docs/debugging.md]"
    assert unit_of("tests/test_docs.py::test_console_block[docs/debugging.md:26]") == debugging
    assert unit_of("tests/test_docs.py::test_relative_links_resolve") == "tests/test_docs.py"
    assert unit_of("tests/test_stragglers_run.py::test_the_slow_rank") == debugging
    shared = "tests/test_demo.py::test_demo_headless_records_measured_plans"
    assert unit_of(shared) == readme
    assert unit_of("tests/test_demo.py::test_six_workers") == "tests/test_demo.py"


def test_every_test_that_takes_a_docs_run_is_in_its_pages_unit():
    """A test calling run_block_of outside the unit of the block's page would run the
    block a second time, on another worker: the list must name each such test with the
    page it names, and only real ones."""
    takers = {}
    for path in TESTS.glob("test_*.py"):
        if path.name in ("test_docs.py", Path(__file__).name):
            continue
        source = path.read_text(encoding="utf-8")
        for function in re.split(r"\n(?=(?:@|def |class ))", source):
            for page in re.findall(r"run_block_of\(\s*\"([^\"]+)\"", function):
                name = re.search(r"def (\w+)", function).group(1)
                takers[f"tests/{path.name}::{name}"] = page
    assert takers, "no test takes a docs block's run: the list is not needed any more"
    for taker, page in takers.items():
        assert unit_of(taker) == page_unit(page), taker
    for prefix, page in WITH_A_DOCS_PAGE.items():
        file, _, name = prefix.partition("::")
        assert (TESTS.parent / file).is_file() and (TESTS.parent / page).is_file(), prefix
        assert not name or f"def {name}(" in (TESTS.parent / file).read_text(), prefix


def test_units_start_longest_first_and_keep_their_tests_together(monkeypatch, tmp_path):
    table = tmp_path / "scope_seconds.json"
    seconds = {"tests/test_b.py": 5.0, page_unit("docs/debugging.md"): 90.0}
    seconds |= {"tests/test_c.py": 30, page_unit("README.md"): 20.0}
    table.write_text(json.dumps(seconds))
    monkeypatch.setattr(suite_order, "SECONDS_FILE", table)
    ids = [
        "tests/test_a.py::one",  # not in the table: short, after the known units
        "tests/test_b.py::one",
        "tests/test_c.py::one",
        "tests/test_docs.py::block[README.md:1]",
        "tests/test_b.py::two",
        "tests/test_stragglers_run.py::named",  # joins debugging.md's unit
        "tests/test_docs.py::block[docs/debugging.md:9]",
        "tests/test_docs.py::block[README.md:40]",
        "tests/test_z.py::one",
    ]
    ordered = [item.nodeid for item in longest_first([FakeItem(i) for i in ids])]
    assert ordered == [
        "tests/test_stragglers_run.py::named",
        "tests/test_docs.py::block[docs/debugging.md:9]",
        "tests/test_c.py::one",
        "tests/test_docs.py::block[README.md:1]",
        "tests/test_docs.py::block[README.md:40]",
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


def test_recording_refreshes_the_units_that_ran_and_drops_the_gone(monkeypatch, tmp_path):
    table = tmp_path / "scope_seconds.json"
    old = {"tests/test_docs.py": 640.0, "tests/test_planner.py": 9.0, "tests/test_gone.py": 3.0}
    table.write_text(json.dumps(old | {page_unit("docs/gone.md"): 5.0}))
    monkeypatch.setattr(suite_order, "SECONDS_FILE", table)
    suite_order.record_seconds({"tests/test_docs.py": 4.04, page_unit("README.md"): 12.34})
    assert json.loads(table.read_text()) == {
        "tests/test_docs.py": 4.0,
        "tests/test_docs.py[README.md]": 12.3,
        "tests/test_planner.py": 9.0,
    }


def test_the_committed_table_names_existing_units():
    table = suite_order.unit_seconds()
    pages = {unit for unit in table if unit.startswith("tests/test_docs.py[")}
    assert page_unit("docs/debugging.md") in pages, "the docs' units are the pages"
    for unit in table:
        assert suite_order.unit_exists(unit), unit
