"""What the balancer measures, on real gloo processes: compute apart from the time inside
collectives, the slow rank seen as compute and its peers as waiting, measurements that
add no collective, and the history cost model taking work off a slow rank of the demo
(whose plans then replay with the speeds it learnt)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from knapformer.contract.phases import COLLECTIVE_PHASES
from knapformer.contract.plan_io import read_plans
from knapformer.local.slowdown import burn
from knapformer.planning.history import recorded_speeds
from knapformer.runtime.timing import cpu_clock_ms
from knapformer.testing.dist_helpers import run_world

WORLD = 4
TOPOLOGY = "g1n2+g2n1"
D, HEADS = 32, 4
STEPS = 4
SLOW_RANK, SLOW_S = 1, 0.25
pytestmark = pytest.mark.timeout(300)


class _Count:
    """Counts every torch.distributed collective called through the module."""

    NAMES = ("all_gather", "all_reduce", "all_to_all_single", "broadcast", "gather", "send")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls: Counter[str] = Counter()
        for name in self.NAMES:
            fn = getattr(dist, name)
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        calls = dict(self.calls)
        self.calls.clear()
        return calls


def _steps(rank: int, counter: _Count, measured: bool, out: str) -> dict:
    """STEPS training steps of a ToyDiT through the balancer; rank SLOW_RANK burns CPU time
    in its compute (on the CPU, a slower device). ``measured``: with a recorder, the
    history cost model and an extra phase."""
    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    options = {}
    if measured:
        options = {
            "recorder": PlanRecorder(f"{out}/plans.jsonl"),
            "cost_model": "history",
            "phases": ["data"],
            "time_scale": 0.5,  # ms per workload unit, as `knapformer calibrate` fits
        }
    bal = SequenceBalancer(TOPOLOGY, **options)
    torch.manual_seed(0)
    model = ToyDiT(D, HEADS, 1)
    per_step = []
    counter.take()
    for step in range(STEPS):
        lengths = [5 + (3 * rank + step) % 7, 20 + rank]
        bal.plan_routing(lengths, token_dim=D)
        out_ = model(torch.randn(sum(lengths), D), lengths, bal)
        out_.square().mean().backward()
        if rank == SLOW_RANK:
            burn(SLOW_S * 1e3, cpu_clock_ms)  # a slow GPU: its peers wait for it
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        bal.all_reduce(flat)
        bal.add_timing("data", 1.0)
        per_step.append(counter.take())
    bal.finish()
    finishing = counter.take()
    bal.close()
    return {"per_step": per_step, "finish": finishing}


def _worker(rank: int, world: int, out: str) -> dict:
    counter = _Count()
    return {"bare": _steps(rank, counter, False, out), "measured": _steps(rank, counter, True, out)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("measured")
    results = run_world(_worker, WORLD, out, str(out))
    return read_plans(out / "plans.jsonl", on_error="raise").plans, results


def test_measurements_add_no_collective(run):
    _, results = run
    for rank, res in enumerate(results):
        bare, measured = res["bare"]["per_step"], res["measured"]["per_step"]
        # Recording, the history cost model and an extra phase: not one more collective.
        assert measured == bare, (rank, measured, bare)
        assert all(calls["all_gather"] == 2 for calls in measured)  # the length gather
        assert all(calls["all_reduce"] == 1 for calls in measured)  # the user's own
        # finish(): one small all-gather carries the last step's measurements.
        assert res["measured"]["finish"] == {"all_gather": 1}, res["measured"]["finish"]


def test_a_time_scale_makes_workloads_milliseconds(run):
    from knapformer.planning.workload import WorkloadModel

    plans, _ = run
    for plan in plans:
        assert plan.workload_unit == "ms" and plan.scale == 0.5
        modelled = WorkloadModel(D).workload(plan.sequences.length)
        np.testing.assert_allclose(plan.sequences.workload, 0.5 * modelled)


def test_compute_is_the_step_without_collectives_data_and_host_work(run):
    from knapformer.contract.phases import host_ms

    plans, _ = run
    assert [p.step for p in plans] == list(range(STEPS))
    for plan in plans[:-1]:
        ms = plan.measurements.per_rank_ms
        assert ms["data"] == [1.0] * WORLD  # a phase of the training loop's own
        inside = sum(np.asarray(ms[p]) for p in COLLECTIVE_PHASES if p in ms)
        outside = np.asarray(ms["data"]) + host_ms(ms, WORLD)  # planning, recording
        assert (host_ms(ms, WORLD) > 0).all()
        # On the CPU the compute is the thread's CPU time in it, the rest is `descheduled`.
        wall = np.asarray(ms["step"]) - inside - outside
        np.testing.assert_allclose(np.asarray(ms["compute"]) + ms["descheduled"], wall)
        assert (np.asarray(ms["compute"]) <= wall + 1e-9).all()
        # a 2-GPU bag: Ulysses exchanges too; no link probe unless asked for
        assert set(COLLECTIVE_PHASES) - {"probe"} <= set(ms) and "probe" not in ms


def test_the_slow_rank_computes_longer_and_the_others_wait_for_it(run):
    plans, _ = run
    for plan in plans[1:-1]:  # the first step holds start-up costs
        ms = plan.measurements.per_rank_ms
        compute, allreduce = np.asarray(ms["compute"]), np.asarray(ms["allreduce"])
        others = [r for r in range(WORLD) if r != SLOW_RANK]
        # The burn is compute on the slow rank and waiting in the all-reduce elsewhere.
        assert compute.argmax() == SLOW_RANK, (plan.step, compute)
        assert allreduce.argmin() == SLOW_RANK, (plan.step, allreduce)  # the last to arrive
        # The burn takes at least its CPU time and sits outside every collective: whatever
        # the load, the slow rank's compute holds all of it, and every other rank waited.
        assert compute[SLOW_RANK] >= SLOW_S * 1e3, (plan.step, compute)
        wait = allreduce - allreduce.min()
        assert (wait[others] > 0).all(), (plan.step, wait)


# ------------------------------------------------------------- history cost model
@pytest.fixture(scope="module")
def history_demo(tmp_path_factory):
    from knapformer.local.demo import DemoConfig, run_demo

    out = tmp_path_factory.mktemp("history")
    cfg = DemoConfig(
        steps=16, world_size=WORLD, out=out, slow_rank=SLOW_RANK, slow_factor=3.0,
        cost_model="history",
    )  # fmt: skip
    run_demo(cfg)
    return read_plans(out / "plans.jsonl", on_error="raise").plans


def test_history_takes_work_off_the_slow_rank_of_the_demo(history_demo):
    plans = history_demo
    assert [p.step for p in plans] == list(range(16))
    speeds = plans[-1].gpu_speed
    # It sleeps twice its compute: whatever the machine's load, it is learnt as the slowest.
    assert speeds is not None and int(np.argmin(speeds)) == SLOW_RANK, speeds
    # What the planner decided with the speeds it learnt, against the same lengths planned
    # at nominal speed (the planner is a pure function): less work for the slow rank. How
    # much less depends on the measured times, so it is tested on synthetic measurements
    # (tests/test_history.py), not on a run whose speed varies with the machine's load.
    with_speeds = [p for p in plans if p.gpu_speed is not None]
    assert len(with_speeds) >= len(plans) // 2
    for plan in plans[:2]:  # before anything is learnt, planning again reproduces the plan
        assert plan.gpu_speed is None
        np.testing.assert_array_equal(
            _replanned_at_nominal_speed(plan).stats.tokens_after, plan.stats.tokens_after
        )
    given, nominal = [], []
    for plan in with_speeds:
        given.append(plan.stats.tokens_after[SLOW_RANK])
        nominal.append(_replanned_at_nominal_speed(plan).stats.tokens_after[SLOW_RANK])
    # never more than at nominal speed, and less over the run
    assert all(g <= n for g, n in zip(given, nominal, strict=True)), (given, nominal)
    assert sum(given) < sum(nominal), (given, nominal)


def _replanned_at_nominal_speed(plan):
    """The plan's recorded lengths planned again as it was, but at nominal GPU speed."""
    from knapformer.planning.planner import plan_routing
    from knapformer.planning.workload import WorkloadModel

    seqs = plan.sequences
    lengths = [seqs.length[seqs.src_gpu == gpu] for gpu in plan.gpus]
    model = WorkloadModel(plan.token_dim, plan.gamma)
    return plan_routing(lengths, plan.topology, model, solver=plan.solver, step=plan.step)


def test_history_speeds_are_a_function_of_the_recording(history_demo):
    # Every rank computed the same speeds from the same gathered figures: they are what
    # the recorded measurements give, step by step.
    assert recorded_speeds(history_demo) == {p.step: p.gpu_speed for p in history_demo}


def test_plans_with_learnt_speeds_replay(history_demo, tmp_path):
    from knapformer.tools.replay import replay

    plan = history_demo[-1]
    assert plan.gpu_speed is not None
    result = replay(plan)
    assert result.replanned and result.ok, result.first_problem
    # Re-planned at nominal speeds, the plan would differ: the speeds were used.
    nominal = json.loads(plan.model_dump_json())
    nominal["gpu_speed"] = None
    from knapformer.contract.plan import RoutingPlan

    assert not replay(RoutingPlan.model_validate(nominal)).ok


# ------------------------------------------------------------------ arguments
def _argument_errors(rank: int, world: int) -> dict[str, str]:
    from knapformer.runtime.balancer import SequenceBalancer

    cases = {
        "cost_model": {"cost_model": "oracle"},
        "speeds_and_history": {"cost_model": "history", "gpu_speed": [1.0, 1.0]},
        "speed_count": {"gpu_speed": [1.0, 0.5, 1.0]},
        "speed_value": {"gpu_speed": [1.0, 0.0]},
        "time_scale": {"time_scale": -2.0},
        "derived_phase": {"phases": ["compute"]},
    }
    errors = {}
    for name, options in cases.items():
        try:
            SequenceBalancer("g1n2", **options).close()
        except ValueError as err:
            errors[name] = str(err)
    bal = SequenceBalancer("g1n2")
    for name, call in {
        "add_step": lambda: bal.add_timing("step", 1.0),
        "collective": lambda: bal.collective("forward").__enter__(),
    }.items():
        try:
            call()
        except ValueError as err:
            errors[name] = str(err)
    bal.close()
    return errors


def test_bad_measurement_and_cost_model_arguments_name_the_value(tmp_path):
    (errors,) = run_world(_argument_errors, 2, tmp_path)[:1]
    assert "'oracle'" in errors["cost_model"] and "history" in errors["cost_model"]
    assert "learnt by cost_model='history'" in errors["speeds_and_history"]
    assert "2 finite positive speeds" in errors["speed_count"] and "0.5" in errors["speed_count"]
    assert "[1.0, 0.0]" in errors["speed_value"]
    assert "-2.0" in errors["time_scale"]
    assert "'compute' is derived" in errors["derived_phase"]
    assert "'step' is derived" in errors["add_step"]
    assert "'forward' is not a collective phase" in errors["collective"]
