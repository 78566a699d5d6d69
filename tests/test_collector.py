"""`collector_paused`: the planner pauses Python's cyclic collector while it plans, and
gives it back as it found it, however calls nest or overlap across threads."""

from __future__ import annotations

import gc
import threading

import pytest

from knapformer.planning.collector import collector_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_resume_only_when_the_outermost_ends(collector_on):
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer call is still planning
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_process_stays_off(collector_on):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_calls_on_two_threads_resume_after_the_last(collector_on):
    """Plan-ahead plans on its own thread while another caller may plan too: the collector
    comes back on when the later of the two ends, not when the first does."""
    inside, leave, seen = threading.Event(), threading.Event(), []

    def plan_ahead():
        with collector_paused():
            inside.set()
            leave.wait(timeout=30)
        seen.append(gc.isenabled())

    worker = threading.Thread(target=plan_ahead)
    with collector_paused():
        worker.start()
        assert inside.wait(timeout=30)
    assert not gc.isenabled()  # the worker is still inside
    leave.set()
    worker.join(timeout=30)
    assert seen == [True] and gc.isenabled()


def test_decorated_function_resumes_after_an_error(collector_on):
    @collector_paused()
    def fails():
        assert not gc.isenabled()
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        fails()
    assert gc.isenabled()
