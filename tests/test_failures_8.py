"""When a rank fails, every rank says which, where and when: the fault matrix of
``tests/fault_suite.py`` on 8 gloo ranks (topology g1n2+g2n1+g4n1), in one world."""

from __future__ import annotations

import pytest
from fault_suite import *  # noqa: F403 (the tests, collected here)
from fault_suite import run

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def world() -> int:
    return 8


@pytest.fixture(scope="module")
def fault_world(world, tmp_path_factory):
    return run(world, tmp_path_factory.mktemp("faults8"))
