"""The background writer both recorders share: order, a bounded queue that never blocks,
close and drain with a timeout, the idle callback, the exit hook and a forked child."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from knapformer.runtime.background import BackgroundWriter


def test_items_are_handled_in_order_on_the_named_thread():
    seen: list[tuple[int, str]] = []
    finished: list[str] = []
    writer = BackgroundWriter(
        "test-writer",
        lambda item: seen.append((item, threading.current_thread().name)),
        queue_size=100,
        finish=lambda: finished.append(threading.current_thread().name),
    )
    assert not writer.started
    assert all(writer.put(i) for i in range(50))
    assert writer.close() is True
    assert seen == [(i, "test-writer") for i in range(50)]
    assert finished == ["test-writer"]  # after the last item, on the thread
    assert writer.flushed and writer.unhandled == 0
    assert writer.close() is False  # idempotent
    assert writer.put(50) is False  # closed: refused, nothing queued


def test_a_full_queue_drops_and_counts_without_waiting():
    entered, release = threading.Event(), threading.Event()

    def stuck(item):
        entered.set()
        release.wait(10)

    writer = BackgroundWriter("test-writer", stuck, queue_size=2)
    assert writer.put(0)
    assert entered.wait(5)  # the thread holds item 0; the queue is empty
    results = [writer.put(i) for i in range(1, 8)]
    # returned while the thread was still stuck: no put waited for room
    assert not release.is_set()
    assert results == [True, True] + [False] * 5 and writer.dropped == 5
    release.set()
    writer.close()
    assert writer.flushed


def test_close_gives_up_after_its_timeout_and_counts_what_was_not_reached():
    entered, release = threading.Event(), threading.Event()
    handled: list[int] = []

    def stuck(item):
        entered.set()
        release.wait(10)
        handled.append(item)

    writer = BackgroundWriter("test-writer", stuck, queue_size=10)
    for i in range(4):
        writer.put(i)
    assert entered.wait(5)
    writer.close(timeout=0.2)  # the thread is stuck on item 0: 1, 2, 3 not reached
    assert not writer.flushed and writer.unhandled == 3
    release.set()


def test_drain_returns_once_the_items_before_it_are_handled():
    handled: list[int] = []
    gate = threading.Event()

    def slow(item):
        gate.wait(10)
        handled.append(item)

    writer = BackgroundWriter("test-writer", slow, queue_size=10)
    for i in range(3):
        writer.put(i)
    threading.Timer(0.05, gate.set).start()
    writer.drain(timeout=10)
    assert handled == [0, 1, 2]
    assert not writer.closed  # drain does not close
    writer.close()


def test_a_put_racing_close_is_handled_or_refused():
    handled: list[int] = []
    for _ in range(3):
        writer = BackgroundWriter("test-writer", handled.append, queue_size=100_000)
        handled.clear()
        accepted = [0] * 4
        barrier = threading.Barrier(5)

        def hammer(k: int, writer=writer, accepted=accepted, barrier=barrier) -> None:
            barrier.wait()
            for i in range(2000):
                accepted[k] += writer.put(i)

        threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        barrier.wait()
        writer.close()
        for t in threads:
            t.join()
        assert writer.flushed
        assert sum(accepted) == len(handled)  # every True was handled, no False was


def test_the_idle_callback_runs_when_no_item_comes():
    idled = threading.Event()
    state = {"armed": True}

    def idle_s():
        return 0.01 if state["armed"] else None

    def on_idle():
        state["armed"] = False
        idled.set()

    writer = BackgroundWriter(
        "test-writer", lambda item: None, queue_size=4, idle_s=idle_s, on_idle=on_idle
    )
    writer.put(1)
    assert idled.wait(10)
    writer.close()
    with pytest.raises(ValueError):
        BackgroundWriter("test-writer", print, queue_size=1, idle_s=idle_s)


EXIT_SCRIPT = """
import sys
from knapformer.runtime.background import BackgroundWriter
out = open(sys.argv[1], "w")
def at_exit():
    writer.close()
    out.write("closed\\n")
    out.close()
writer = BackgroundWriter("w", lambda item: out.write(f"{item}\\n"), queue_size=8, at_exit=at_exit)
for i in range(3):
    writer.put(i)
if sys.argv[2] == "close":
    writer.close()
    out.write("before exit\\n")
    out.flush()
"""


@pytest.mark.parametrize("how", ["exit", "close"])
def test_the_exit_hook_runs_at_interpreter_exit_unless_closed_first(tmp_path, how):
    out = tmp_path / "out.txt"
    subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(out), how], check=True, timeout=60)
    lines = out.read_text().split()
    if how == "exit":
        assert lines == ["0", "1", "2", "closed"]
    else:  # closed by hand: the hook was unregistered and never ran
        assert lines == ["0", "1", "2", "before", "exit"]


def test_a_forked_child_queues_nothing(monkeypatch):
    # A forked child differs from its parent by its pid alone (the thread stays in the
    # parent); only the launcher may create processes (test_launcher), so the child's pid
    # is given, not forked.
    writer = BackgroundWriter("test-writer", lambda item: None, queue_size=4)
    assert writer.put(0)
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    assert writer.put(1) is False
    monkeypatch.setattr(os, "getpid", lambda: parent)
    assert writer.put(2)
    assert writer.close() is True
