"""Worlds of gloo processes that train through one injected fault after another, for the
tests and ``bench/failures.py``: what every rank raised, and how long after the fault.

`fault_worker` runs a list of `FaultCase` on one world: each case makes a fresh process
group with a short timeout, trains a ToyDiT a few steps through a balancer (rank
``fault.rank``'s injects the fault, `knapformer.local.faults`) and records each rank's
`Outcome`, written to ``<folder>/<case>/outcomes/rank<r>.json`` as the case ends (a rank
killed later keeps its earlier outcomes). A stalled rank is released once every other
rank has raised, and leaves; a killed rank ends the world, so a case that kills comes
last. The world's default group is never used for a collective, so it survives every
case.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from knapformer.local.config import Fault

D_MODEL, HEADS, STEPS = 32, 4, 4


@dataclass(frozen=True)
class FaultCase:
    """One fault: ``fault`` on ``topology`` (None: nothing goes wrong), or rank
    ``close_early`` closing its balancer without ``finish()`` at ``step``."""

    name: str
    topology: str
    fault: Fault | None = None
    plan_ahead: bool = False
    close_early: int | None = None
    step: int = 2
    link_probe_every: int = 0
    flight_recorder: int = 0  # torch's flight-recorder entries per rank (0: off)

    @property
    def culprit(self) -> int | None:
        return self.fault.rank if self.fault is not None else self.close_early

    @property
    def kills(self) -> bool:
        return self.fault is not None and self.fault.kind == "kill"


@dataclass
class Outcome:
    """What one rank did in one case: ``error`` (``Type: message``, None when it finished),
    the ``culprits`` its balancer named, when it raised (``time.time()``) and when its fault
    struck (the culprit only)."""

    error: str | None = None
    culprits: list[int] = field(default_factory=list)
    raised_at: float | None = None
    struck_at: float | None = None


def fault_worker(
    rank: int, world: int, cases: list[FaultCase], timeout_s: float, answer_s: float, folder: str
) -> None:
    """Run ``cases`` in order on this world (``folder``: where each case's run goes)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    for case in cases:
        outcome = _run_case(rank, world, case, timeout_s, answer_s, Path(folder), store)
        path = outcome_file(Path(folder), case.name, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(outcome)))
        gc.collect()  # the case's groups go now, not in the middle of the next case
    if any(case.kills for case in cases):
        dist.destroy_process_group()  # no final barrier with the dead rank


def outcome_file(folder: Path, case: str, rank: int) -> Path:
    return folder / case / "outcomes" / f"rank{rank}.json"


def _run_case(rank, world, case, timeout_s, answer_s, folder, store) -> Outcome:
    import torch.distributed as dist

    from knapformer.runtime.recorder import PlanRecorder

    key = f"case/{case.name}/"
    # Read by torch when it makes a group: the case's groups keep a flight recorder or not.
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(case.flight_recorder)
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
    recorder = PlanRecorder(folder / case.name / "plans.jsonl")
    balancer = _balancer(rank, world, case, group, recorder, answer_s, store, key)
    outcome = Outcome()
    try:
        with balancer:
            _train(rank, case, balancer, lambda: _struck(store, key))
    except Exception as err:
        outcome.raised_at = time.time()
        outcome.error = f"{type(err).__name__}: {err}"
        outcome.culprits = list(getattr(err, "culprits", []))
    finally:
        if rank != case.culprit:
            store.add(key + "done", 1)
    store.add(key + "ended", 1)
    while store.add(key + "ended", 0) < world - case.kills:  # the strike time is there now
        time.sleep(0.01)
    if store.check([key + "struck"]):
        outcome.struck_at = float(store.get(key + "struck"))
    return outcome


def _struck(store, key: str, at: float | None = None) -> None:
    """Keep when the case's fault struck, in the store (a killed rank leaves no file)."""
    store.set(key + "struck", repr(time.time() if at is None else at))


def _balancer(rank, world, case, group, recorder, answer_s, store, key):
    from knapformer.local.faults import faulty
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.balancer_config import (
        BalancerConfig,
        JournalOptions,
        LinkProbeOptions,
    )

    config = BalancerConfig(
        case.topology,
        plan_ahead=case.plan_ahead,
        run=case.name,
        link_probe=LinkProbeOptions(every=case.link_probe_every, bytes=4096, rounds=1),
        journal=JournalOptions(answer_s=answer_s),
    )
    if case.fault is None or rank != case.fault.rank:
        return SequenceBalancer(config, process_group=group, recorder=recorder)

    def release() -> bool:  # every other rank has raised: the stalled one may leave
        return store.add(key + "done", 0) >= world - 1

    cls = faulty(SequenceBalancer)
    return cls(config, process_group=group, recorder=recorder, fault=case.fault,
               release=release, on_strike=lambda at: _struck(store, key, at))  # fmt: skip


def _train(rank: int, case: FaultCase, balancer, closing) -> None:
    """``STEPS`` steps of a ToyDiT with per-sequence conditioning, as a training loop
    would run them; rank ``close_early`` closes at ``case.step`` instead (``closing()``
    first)."""
    import numpy as np
    import torch

    from knapformer.local.models import ToyDiT

    torch.manual_seed(0)
    model = ToyDiT(D_MODEL, HEADS, 1)
    params = list(model.parameters())

    def lengths(step: int) -> list[int]:
        rng = np.random.default_rng([step, rank])
        return rng.integers(4, 24, size=int(rng.integers(1, 4))).tolist()

    for step in range(STEPS):
        if rank == case.close_early and step == case.step:
            closing()
            balancer.close()
            return
        mine = lengths(step)
        balancer.plan_routing(mine, token_dim=D_MODEL)
        if case.plan_ahead and step + 1 < STEPS:
            balancer.prefetch(lengths(step + 1), token_dim=D_MODEL)
        x = torch.randn(sum(mine), D_MODEL)
        y = model(x, mine, balancer)
        cond = balancer.per_token(torch.randn(len(mine), 2, requires_grad=True))
        (y.square().mean() + cond.sum()).backward()
        balancer.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]))
    balancer.finish()


#: The topology of each world the fault tests and the bench run.
TOPOLOGIES = {4: "g1n2+g2n1", 8: "g1n2+g2n1+g4n1"}
#: The phases a stall is injected in, one case each (the balancer's own phases).
STALL_PHASES = ("plan", "route", "pre_attn", "post_attn", "reverse_route")


def standard_cases(world: int, step: int = 2) -> list[FaultCase]:
    """Every fault kind on a ``world`` of 4 or 8 ranks, the kill last. The culprit sits in
    the largest bag (its last rank), but for a fault in ``route`` and an early close
    (rank 1, a bag of its own) and a kill (the largest bag's first rank)."""
    topo, last = TOPOLOGIES[world], world - 1
    first_of_big = world // 2
    cases = [
        FaultCase("raise_forward", topo, Fault(last, "raise", step, "forward")),
        FaultCase("raise_route", topo, Fault(1, "raise", step, "route")),
        FaultCase("shape_route", topo, Fault(last, "shape", step, "route")),
        FaultCase("shape_pre_attn", topo, Fault(last, "shape", step, "pre_attn")),
        FaultCase("shape_sequences", topo, Fault(0, "shape", step, "gather_sequences")),
    ]
    cases += [
        FaultCase(
            f"stall_{phase}",
            topo,
            Fault(last, "stall", step, phase),
            flight_recorder=256 if phase == "post_attn" else 0,
        )
        for phase in STALL_PHASES
    ]
    cases += [
        FaultCase(
            "stall_plan_ahead", topo, Fault(last, "stall", step, "plan_ahead"), plan_ahead=True
        ),
        FaultCase("close_early", topo, close_early=1, step=step),
        FaultCase("kill", topo, Fault(first_of_big, "kill", step, "forward")),
    ]
    return cases


def run_fault_world(
    world: int, cases: list[FaultCase], folder: Path, timeout_s: float, answer_s: float
) -> tuple[list[dict[str, Outcome]], str | None]:
    """``cases`` on ``world`` gloo processes: each rank's outcome of each case it lived
    through, and how the world ended (None: every rank returned; else the launcher's
    ``WorkerFailed`` message, e.g. the killed rank)."""
    from knapformer.local.launcher import TRAINING_PRELOAD, WorkerFailed, launch

    args = (cases, timeout_s, answer_s, str(folder))
    ended = None
    try:
        launch(
            fault_worker, world, args, preload=TRAINING_PRELOAD, group_timeout_s=120,
            workdir=folder, settle_s=timeout_s + answer_s + 30,
            deadline_s=len(cases) * (2 * timeout_s + answer_s + 10) + 120,
        )  # fmt: skip
    except WorkerFailed as err:
        ended = str(err)
    results: list[dict[str, Outcome]] = [{} for _ in range(world)]
    for case in cases:
        for rank in range(world):
            path = outcome_file(folder, case.name, rank)
            if path.is_file():
                results[rank][case.name] = Outcome(**json.loads(path.read_text()))
    return results, ended
