"""Planning ahead (``SequenceBalancer(..., plan_ahead=True)`` and ``prefetch``) on real
gloo processes: the same plans, step numbers and recordings as the synchronous path, no
collective of the training group inside planning, a clear error for lengths other than
the prefetched ones, and Ctrl-C and shut-down as on the synchronous path."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import torch

from knapformer.contract.plan_io import read_plans
from knapformer.testing.dist_helpers import run_world

WORLD = 4
TOPOLOGY = "g1n2+g2n1"
D = 16
STEPS = 5
pytestmark = pytest.mark.timeout(300)


def _lengths(rank: int, step: int) -> list[int]:
    return [3 + (7 * rank + 5 * step) % 23, 40 * (rank % 2) + step, 11 + step * rank]


class _Collectives:
    """Counts torch.distributed collectives by (thread, group kind) while ``active``."""

    NAMES = ("all_gather", "all_reduce", "all_to_all_single", "broadcast", "gather")

    def __init__(self, balancer) -> None:
        import torch.distributed as dist

        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.active = False
        self._side = balancer.groups.side
        self._orig = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._orig.items():
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                kind = "side" if group is not None and group is self._side else "training"
                self.calls[(threading.current_thread().name, kind, name)] += 1
            return fn(*args, **kwargs)

        return counted

    def restore(self) -> None:
        import torch.distributed as dist

        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _train(rank: int, out: str, ahead: bool) -> dict:
    """STEPS steps of route / reverse_route / all-reduce with a recorder; returns the plans
    (without their times) and the collectives counted inside plan_routing and prefetch."""
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    rec = PlanRecorder(f"{out}/{'ahead' if ahead else 'sync'}.jsonl")
    bal = SequenceBalancer(TOPOLOGY, recorder=rec, plan_ahead=ahead)
    counter = _Collectives(bal)
    plans = []
    try:
        for step in range(STEPS):
            lengths = _lengths(rank, step)
            counter.active = True
            plan = bal.plan_routing(lengths, token_dim=D)
            # The next step's lengths, also after the last step (as a data loader that
            # runs ahead would): finish() and close() must cope with an unused prefetch.
            bal.prefetch(_lengths(rank, step + 1), token_dim=D)
            counter.active = False
            plans.append(json.loads(plan.model_dump_json(exclude={"time", "measurements"})))
            x = torch.full((sum(lengths), D), float(rank))
            _, y, _ = bal.route(x)
            _, back, _ = bal.reverse_route(y * 2)
            assert torch.equal(back, 2 * x)
            bal.all_reduce(torch.ones(3))
        bal.finish()
    finally:
        counter.restore()
        threads = bal._path.thread._thread if ahead else None
        bal.close()
    return {
        "plans": plans,
        "steps": bal.step,
        "calls": dict(counter.calls),
        "thread_alive": threads is not None and threads.is_alive(),
    }


def _identity_worker(rank: int, world: int, out: str) -> dict:
    return {"sync": _train(rank, out, False), "ahead": _train(rank, out, True)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ahead")
    return out, run_world(_identity_worker, WORLD, out, str(out))


def test_plans_and_step_numbers_are_those_of_the_synchronous_path(trained):
    _, results = trained
    for rank, res in enumerate(results):
        sync, ahead = res["sync"], res["ahead"]
        assert [p["step"] for p in ahead["plans"]] == list(range(STEPS)), rank
        assert ahead["plans"] == sync["plans"], f"rank {rank}: a plan differs"
        assert ahead["steps"] == sync["steps"] == STEPS - 1
    assert all(r["ahead"]["plans"] == results[0]["ahead"]["plans"] for r in results)


def test_planning_ahead_runs_no_collective_of_the_training_group(trained):
    _, results = trained
    for rank, res in enumerate(results):
        sync, ahead = res["sync"]["calls"], res["ahead"]["calls"]
        # The synchronous path gathers on the training thread and group: 2 per step.
        assert sync == {("MainThread", "training", "all_gather"): 2 * STEPS}, (rank, sync)
        # Ahead, plan_routing and prefetch run none; the side group's gathers run on the
        # plan-ahead thread (counted while the training thread waited or prefetched).
        assert sum(ahead.values()) >= 2, ahead  # at least step 0's, not prefetched
        assert all(kind == "side" for _, kind, _ in ahead), (rank, ahead)
        assert all(thread != "MainThread" for thread, _, _ in ahead), (rank, ahead)


def test_recordings_hold_the_same_plans_with_the_same_measured_phases(trained):
    out, _ = trained
    sync = read_plans(out / "sync.jsonl", on_error="raise").plans
    ahead = read_plans(out / "ahead.jsonl", on_error="raise").plans
    assert [p.step for p in ahead] == [p.step for p in sync] == list(range(STEPS))
    for a, s in zip(ahead, sync, strict=True):
        assert a.sequences == s.sequences and a.chunks == s.chunks and a.bags == s.bags
        assert sorted(a.measurements.per_rank_ms) == sorted(s.measurements.per_rank_ms), a.step
        assert all(len(v) == WORLD for v in a.measurements.per_rank_ms.values())
    # finish() gave the last two plans their measurements; the last step ends at finish().
    assert "allreduce" in ahead[-1].measurements.per_rank_ms
    assert "compute" in ahead[-1].measurements.per_rank_ms
    assert "compute" in ahead[-2].measurements.per_rank_ms


def test_close_stops_the_plan_ahead_thread_after_an_unused_prefetch(trained):
    _, results = trained
    assert not any(r["ahead"]["thread_alive"] for r in results)


# ------------------------------------------------------------- wrong lengths
def _mismatch_worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer(TOPOLOGY, plan_ahead=True)
    mine = _lengths(rank, 0)
    bal.prefetch(mine, token_dim=D)
    out: dict = {}
    for name, args in {
        "lengths": ([*mine[:-1], mine[-1] + 1], D),
        "order": (mine[::-1], D),
        "dim": (mine, D + 1),
    }.items():
        try:  # only rank 1 passes the wrong arguments; every rank is told
            bal.plan_routing(*(args if rank == 1 else (mine, D)))
        except ValueError as err:
            out[name] = (str(err), getattr(err, "__notes__", []))
    plan = bal.plan_routing(mine, token_dim=D)  # the prefetched plan is still there
    x = torch.arange(sum(mine) * D, dtype=torch.float32).reshape(-1, D)
    _, y, _ = bal.route(x)
    _, back, _ = bal.reverse_route(y)
    out["plan"] = json.loads(plan.model_dump_json(exclude={"time", "measurements"}))
    out["identity"] = torch.equal(back, x)
    # Once more, and this time every rank gives up after the error (no retry): close()
    # must not leave the plan-ahead thread inside a collective of the side group.
    bal.prefetch(_lengths(rank, 1), token_dim=D)
    bal.prefetch(_lengths(rank, 2), token_dim=D)
    wrong = _lengths(rank, 1)[::-1] if rank == 2 else _lengths(rank, 1)
    out["given_up"] = _message(lambda: bal.plan_routing(wrong, token_dim=D))
    thread = bal._path.thread
    bal.close()
    out["thread_alive"] = thread.alive
    return out


def _message(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def test_lengths_other_than_the_prefetched_ones_fail_every_rank_alike(tmp_path):
    results = run_world(_mismatch_worker, WORLD, tmp_path)
    lengths = _lengths(1, 0)
    for name, check in (("lengths", "local_seq_lens"), ("order", "local_seq_lens"),
                        ("dim", "token_dim")):  # fmt: skip
        said = {r[name][0] for r in results}
        assert len(said) == 1, said  # the same words on every rank
        message = said.pop()
        assert f"{check} on rank 1" in message and "prefetched" in message, message
        assert all(not r[name][1] for rank, r in enumerate(results) if rank != 1)
    # Rank 1 alone is told how its arguments differ, as a note.
    notes = {name: " ".join(results[1][name][1]) for name in ("lengths", "order", "dim")}
    assert str(lengths) in notes["lengths"] and "prefetched" in notes["order"], notes
    assert f"token_dim {D + 1}" in notes["dim"] and f"{D} was prefetched" in notes["dim"]
    # Retried with the right lengths, every rank routes by the same plan.
    assert all(r["plan"] == results[0]["plan"] and r["identity"] for r in results)
    given_up = {r["given_up"] for r in results}
    assert len(given_up) == 1 and "local_seq_lens on rank 2" in given_up.pop()
    assert not any(r["thread_alive"] for r in results)


# -------------------------------------------------------------------- Ctrl-C
def _ctrl_c_worker(rank: int, world: int, flag: str) -> dict:
    import os
    import signal
    from pathlib import Path

    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.testing.polling import wait_until

    bal = SequenceBalancer("g2n1", plan_ahead=True)
    mine = [10 + rank, 3]
    out: dict = {}
    if rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a script
        try:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            bal.plan_routing(mine, token_dim=D)  # rank 1 starts only after the Ctrl-C
        except KeyboardInterrupt:
            out["interrupted"] = True
            Path(flag).touch()
    else:
        # Wait for rank 0's Ctrl-C rather than sleeping: then rank 0 was interrupted while
        # it waited for this rank, however loaded the machine is.
        try:
            wait_until(Path(flag).exists, timeout=120, what="rank 0's Ctrl-C")
            out["came_after_interrupt"] = True
        except TimeoutError:
            out["came_after_interrupt"] = False
    plan = bal.plan_routing(mine, token_dim=D)  # the same call again: the same plan
    out["step"] = plan.step
    out["plan"] = json.loads(plan.model_dump_json(exclude={"time", "measurements"}))
    # Never used: close() must not hang on them, though the second one waits for the
    # measurements of a step that never ends (no plan_routing follows).
    bal.prefetch(mine, token_dim=D)
    bal.prefetch(mine, token_dim=D)
    thread = bal._path.thread._thread
    bal.close()
    out["thread_alive"] = thread.is_alive()
    return out


def test_ctrl_c_while_waiting_for_the_plan_raises_keyboard_interrupt_and_can_be_retried(
    tmp_path,
):
    results = run_world(_ctrl_c_worker, 2, tmp_path, str(tmp_path / "interrupted"))
    # Interrupted while waiting (rank 1 had not even started its step), not after.
    assert results[0].get("interrupted") and results[1]["came_after_interrupt"]
    assert results[0]["step"] == results[1]["step"] == 0
    assert results[0]["plan"] == results[1]["plan"]
    assert not any(r["thread_alive"] for r in results)
