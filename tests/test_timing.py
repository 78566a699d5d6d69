"""On the CPU a step's compute is the training thread's CPU time in it, and what the wall
clock counted beyond that is ``descheduled`` (knapformer/runtime/timing.py)."""

from __future__ import annotations

import gc
import itertools
import time

import numpy as np
import pytest
import torch

from knapformer.local.slowdown import burn, collect
from knapformer.runtime.timing import StepTimer, cpu_clock_ms

BURN_MS, SLEEP_MS = 40.0, 60.0


@pytest.fixture(autouse=True)
def no_automatic_collections():
    """A collection the allocator sets off is host work (``gc``) and leaves the compute:
    the bounds below are exact only without them. The tests that collect do it by hand."""
    gc.disable()
    yield
    gc.enable()


def _step(timer: StepTimer, body) -> dict[str, float]:
    """One step of ``timer`` around ``body(timer)``; its derived values."""
    timer.open(0, time.perf_counter(), timer.boundary(), cpu_clock_ms())
    body(timer)
    return timer.close(time.perf_counter(), timer.boundary(), cpu_clock_ms()).values()


def test_a_sleep_is_not_compute_and_cpu_work_is():
    def body(_):
        burn(BURN_MS, cpu_clock_ms)
        time.sleep(SLEEP_MS / 1e3)  # ready to run nothing: the wall clock only

    values = _step(StepTimer(torch.device("cpu")), body)
    # CPU time never runs ahead of the wall clock, and the burn took at least BURN_MS of it
    assert BURN_MS <= values["compute"] < BURN_MS + SLEEP_MS
    assert values["descheduled"] >= SLEEP_MS * 0.9  # the sleep (timer granularity aside)
    assert values["compute"] + values["descheduled"] == np.float64(values["step"])


def test_phases_outside_compute_leave_it_by_their_cpu_time():
    def body(timer):
        with timer.timed("route"):  # a collective: not compute, by its own CPU time
            burn(BURN_MS, cpu_clock_ms)
        burn(BURN_MS, cpu_clock_ms)
        began = time.perf_counter()
        time.sleep(SLEEP_MS / 1e3)  # a wait for data that used no CPU
        timer.add("data", (time.perf_counter() - began) * 1e3, cpu_ms=0.0)

    values = _step(StepTimer(torch.device("cpu")), body)
    assert values["route"] >= BURN_MS
    # the second burn alone: with the route's CPU time in it, it would be 2 x BURN_MS
    assert BURN_MS <= values["compute"] < 2 * BURN_MS
    wall = values["step"] - values["route"] - values["data"]
    assert values["compute"] + values["descheduled"] == np.float64(wall)


def test_a_phase_added_without_its_cpu_time_leaves_at_its_wall_time():
    def body(timer):
        burn(BURN_MS, cpu_clock_ms)
        timer.add("data", 1000 * BURN_MS)  # far more than the step's CPU time

    values = _step(StepTimer(torch.device("cpu")), body)
    assert values["compute"] == 0.0  # never below 0


def test_without_a_cpu_clock_the_compute_is_the_wall_clocks():
    timer = StepTimer(torch.device("cpu"))
    timer.open(0, time.perf_counter(), None)  # no CPU clock given: nothing to subtract
    time.sleep(SLEEP_MS / 1e3)
    values = timer.close(time.perf_counter()).values()
    assert values["compute"] == values["step"] >= SLEEP_MS * 0.9
    assert "descheduled" not in values


def test_a_device_the_thread_waits_for_is_compute():
    def body(timer):
        burn(BURN_MS, cpu_clock_ms)
        time.sleep(SLEEP_MS / 1e3)  # an emulated device computes meanwhile
        timer.add_device(SLEEP_MS)

    values = _step(StepTimer(torch.device("cpu")), body)
    assert values["compute"] >= BURN_MS + SLEEP_MS
    assert values["compute"] + values["descheduled"] == np.float64(values["step"])


def _cycles() -> list:
    """A heap of 200,000 linked lists for the collector to traverse."""
    heap = [[] for _ in range(200_000)]
    for a, b in itertools.pairwise(heap):
        a.append(b)
    return heap


@pytest.fixture
def gc_timer():
    """A CPU step timer that times garbage collection; released after the test."""
    timer = StepTimer(torch.device("cpu"), time_gc=True)
    yield timer
    timer.release()


def test_the_collector_hook_is_installed_only_while_a_timer_asks_for_it():
    before = list(gc.callbacks)
    plain = StepTimer(torch.device("cpu"))
    assert gc.callbacks == before  # off by default: see knapformer/runtime/gc_clock.py
    a, b = (StepTimer(torch.device("cpu"), time_gc=True) for _ in range(2))
    assert len(gc.callbacks) == len(before) + 1  # one hook, however many timers
    a.release()
    a.release()  # idempotent: b still holds it
    assert len(gc.callbacks) == len(before) + 1
    b.release()
    assert gc.callbacks == before
    plain.release()
    assert gc.callbacks == before


def test_garbage_collection_is_host_work_not_compute(gc_timer):
    """A collection stops the training thread: recorded as ``gc`` (host work), out of the
    compute; one inside a timed phase stays in that phase and out of ``gc``."""
    heap = _cycles()  # built before the step: its allocations are not the step's

    def body(timer):
        burn(BURN_MS, cpu_clock_ms)
        collect(3 * BURN_MS)

    values = _step(gc_timer, body)
    assert values["gc"] >= 2.5 * BURN_MS  # the loop between collections aside
    assert BURN_MS <= values["compute"] < 2 * BURN_MS  # the burn, not the collections
    wall = values["step"] - values["gc"]
    assert values["compute"] + values["descheduled"] == np.float64(wall)

    def in_a_phase(timer):
        with timer.timed("record"):
            collect(BURN_MS)

    values = _step(gc_timer, in_a_phase)
    assert values.get("gc", 0.0) < BURN_MS / 4 and values["record"] >= BURN_MS
    assert len(heap) == 200_000


def test_a_collection_inside_a_phase_of_the_compute_leaves_the_compute(gc_timer):
    """``forward_backward`` is timed but is compute: a collection in it is still ``gc``."""
    heap = _cycles()

    def body(timer):
        with timer.timed("forward_backward"):
            burn(BURN_MS, cpu_clock_ms)
            collect(3 * BURN_MS)

    values = _step(gc_timer, body)
    assert values["gc"] >= 2.5 * BURN_MS and values["forward_backward"] >= 4 * BURN_MS
    assert BURN_MS <= values["compute"] < 2 * BURN_MS
    assert len(heap) == 200_000


def test_time_between_timed_phases_is_untimed_and_leaves_the_compute():
    """With the forward and backward pass timed as a block, the step's wall time inside
    no phase is ``untimed``; it and the optimizer are not compute, and the phases add up
    to the step."""

    def body(timer):
        with timer.host_timed("forward_backward"):
            burn(BURN_MS, cpu_clock_ms)
            with timer.host_timed("route"):  # nested: inside forward_backward's time
                burn(BURN_MS / 4, cpu_clock_ms)
        burn(BURN_MS / 2, cpu_clock_ms)  # Python between the loop's phases
        time.sleep(SLEEP_MS / 1e3)  # ... and a wait there
        with timer.host_timed("optimizer"):
            burn(BURN_MS / 2, cpu_clock_ms)

    values = _step(StepTimer(torch.device("cpu")), body)
    assert values["untimed"] >= SLEEP_MS * 0.9 + BURN_MS / 2  # the wait and the work between
    assert BURN_MS <= values["compute"] <= values["forward_backward"] - values["route"]
    outside = ("route", "optimizer", "untimed")
    total = values["compute"] + values["descheduled"] + sum(values[p] for p in outside)
    assert total == pytest.approx(values["step"], rel=1e-9)


def test_without_a_timed_forward_backward_nothing_is_untimed():
    """Time between phases could then be the compute itself: it stays compute."""

    def body(timer):
        with timer.host_timed("data"):
            time.sleep(SLEEP_MS / 10e3)
        burn(BURN_MS, cpu_clock_ms)  # the model, untimed by this loop

    values = _step(StepTimer(torch.device("cpu")), body)
    assert "untimed" not in values and values["compute"] >= BURN_MS
