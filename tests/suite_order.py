"""How `make test` shares the suite among its pytest-xdist workers (``--dist loadfile``):
which tests form one unit of work, and which units start first.

A unit is a test file, but for the docs: tests/test_docs.py's test of a console block
is in its page's unit (``tests/test_docs.py[docs/debugging.md]``), so that the pages'
blocks, each run in a folder of its own (docs/make_docs.py), spread over the workers.
A test that shares a block's run (knapformer/testing/doc_blocks.py: a run is made once
per process) joins that page's unit, so that the run really is made once. Units start
longest first (their seconds in ``scope_seconds.json``, written by
``--record-scope-seconds``), so that no long unit starts last and holds the suite up
alone; a unit missing from the table (a new file) counts as short.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

SECONDS_FILE = Path(__file__).with_name("scope_seconds.json")
ROOT = Path(__file__).resolve().parent.parent
DOCS_TESTS = "tests/test_docs.py"
#: Tests (node id prefixes) that take a console block's run from doc_blocks.run_block_of,
#: and the page of that block.
WITH_A_DOCS_PAGE = {
    "tests/test_stragglers_run.py::": "docs/debugging.md",
    "tests/test_demo.py::test_demo_headless_records_measured_plans": "README.md",
    "tests/test_demo.py::test_torchrun_example_records_plans": "docs/recording.md",
}
#: A test of a console block: its id ends in the block's place, ``[docs/x.md:12]``.
_BLOCK_ID = re.compile(r"\[([\w./-]+\.md):\d+\]$")


def page_unit(page: str) -> str:
    """The unit of the console blocks of ``page`` (relative to the repository)."""
    return f"{DOCS_TESTS}[{page}]"


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or a docs page's unit."""
    for prefix, page in WITH_A_DOCS_PAGE.items():
        if nodeid.startswith(prefix):
            return page_unit(page)
    file = nodeid.split("::", 1)[0]
    block = _BLOCK_ID.search(nodeid)
    if file == DOCS_TESTS and block:
        return page_unit(block.group(1))
    return file


def unit_exists(unit: str) -> bool:
    """Whether ``unit`` names a test file (and a page) of the repository."""
    file, _, page = unit.partition("[")
    return (ROOT / file).is_file() and (not page or (ROOT / page.rstrip("]")).is_file())


def unit_seconds() -> dict[str, float]:
    """The seconds each unit took in the run that wrote the table (empty when none)."""
    try:
        return json.loads(SECONDS_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with each unit's tests together, the units in decreasing seconds (ties
    and unknown units in collection order); the tests of a unit keep their order."""
    seconds = unit_seconds()
    first_seen: dict[str, int] = {}
    for k, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), k)

    def key(pair: tuple[int, pytest.Item]) -> tuple[float, int, int]:
        unit = unit_of(pair[1].nodeid)
        return (-seconds.get(unit, 0.0), first_seen[unit], pair[0])

    return [item for _, item in sorted(enumerate(items), key=key)]


class UnitScheduling(LoadFileScheduling):
    """xdist's file-by-file scheduling, with `unit_of` for a file. The workers' collection
    is already in the order the units should start (`longest_first`), and xdist keeps it
    when its own reordering (by number of tests) is off."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


class SuiteOrder:
    """The plugin: registered by tests/conftest.py when pytest-xdist is installed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = defaultdict(float)

    @staticmethod
    def _loadfile(config: pytest.Config) -> bool:
        return config.getoption("dist", "no") == "loadfile"

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if not self._loadfile(config):
            return None
        config.option.loadscopereorder = False  # keep longest_first's order
        return UnitScheduling(config, log)

    def pytest_collection_modifyitems(self, config, items):
        # On xdist's workers (which do not know the --dist mode): the collection they send
        # is the order in which the scheduler hands the units out.
        if hasattr(config, "workerinput"):
            items[:] = longest_first(items)

    def pytest_runtest_logreport(self, report):
        self.seconds[unit_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session):
        if self.config.getoption("record_scope_seconds") and not hasattr(
            self.config, "workerinput"
        ):
            record_seconds(self.seconds)


def record_seconds(seconds: dict[str, float]) -> None:
    """Write ``seconds`` into the table: the units that ran get their new figure, the
    others keep theirs (a run of a few files refreshes those), and units that no longer
    exist are dropped."""
    table = {u: s for u, s in unit_seconds().items() if unit_exists(u)}
    table.update((unit, round(s, 1)) for unit, s in seconds.items())
    text = json.dumps(dict(sorted(table.items())), indent=1) + "\n"
    SECONDS_FILE.write_text(text, encoding="utf-8")
