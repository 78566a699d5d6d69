"""The fault matrix, asserted on one world: ``tests/test_failures.py`` runs it on 4 gloo
ranks, ``tests/test_failures_8.py`` on 8 (each imports these tests and defines the
``world`` and ``fault_world`` fixtures).

Every case of `knapformer.testing.fault_worlds.standard_cases` runs on a fresh process
group with a TIMEOUT_S timeout: a rank raises in its forward or in route, gives a tensor
of the wrong shape, stalls in each balancer phase or in the plan-ahead thread, closes
without finish(), or is killed. Every surviving rank must raise one error that names the
culprit, the step and the phase, within the timeout plus a generous slack; the incident
and every live rank's journal are written beside the case's plans; and no process ends
in SIGABRT (only the killed rank dies).
"""

from __future__ import annotations

import pytest

from knapformer.contract.incident import journal_file, read_incident, run_incident
from knapformer.contract.phases import JOURNAL_PHASES
from knapformer.testing.fault_checks import check_named, outcomes, phase_of, survivors
from knapformer.testing.fault_worlds import STALL_PHASES, run_fault_world, standard_cases

TIMEOUT_S = 3.0
ANSWER_S = 2.0


def run(world: int, folder) -> dict:
    cases = {c.name: c for c in standard_cases(world)}
    results, ended = run_fault_world(world, list(cases.values()), folder, TIMEOUT_S, ANSWER_S)
    return {"cases": cases, "results": results, "ended": ended, "folder": folder}


def _case(fault_world, name):
    return fault_world["cases"][name], fault_world["results"]


def _bag_of(world: int, rank: int) -> int:
    """The index of ``rank``'s bag in the fault worlds' topologies (bags in plan order)."""
    return {4: [0, 1, 2, 2], 8: [0, 1, 2, 2, 3, 3, 3, 3]}[world][rank]


def test_only_the_killed_rank_died_and_no_rank_aborted(fault_world, world):
    kill = fault_world["cases"]["kill"]
    assert fault_world["ended"] == f"worker rank {kill.culprit} died (SIGKILL)"
    lived = [r for r, res in enumerate(fault_world["results"]) if "kill" in res]
    assert lived == [r for r in range(world) if r != kill.culprit]


def test_a_raise_in_the_forward_is_named_with_what_it_raised(fault_world, world):
    case, results = _case(fault_world, "raise_forward")
    said = check_named(results, case, "raised SimulatedFault: CUDA out of memory", TIMEOUT_S)
    culprit = case.culprit
    assert "CUDA out of memory" in outcomes(results, case)[culprit].error
    for rank, message in said.items():
        assert "after route (in the training loop's code)" in message, message
        # Its bag's peers fail in pre_attn of its bag; the others in the group's next one.
        if _bag_of(world, rank) == _bag_of(world, culprit):
            assert phase_of(message) == f"pre_attn of bag {_bag_of(world, culprit)}", message
        else:
            assert phase_of(message) == "reverse_route", message


def test_a_raise_inside_route_is_named_in_route(fault_world):
    case, results = _case(fault_world, "raise_route")
    said = check_named(results, case, "raised SimulatedFault", TIMEOUT_S)
    for message in said.values():
        assert phase_of(message) == "route" and "in route (step 2)" in message, message


def test_an_own_shape_error_in_route_is_refused_by_every_rank_at_once(fault_world):
    case, results = _case(fault_world, "shape_route")
    seen = outcomes(results, case)
    assert "packed_seqs has shape" in seen[case.culprit].error, seen[case.culprit].error
    for rank, o in survivors(results, case).items():
        assert o.error == (
            f"KnapformerError: route: invalid input on rank {case.culprit} (its own error "
            "says why); nothing was sent"
        ), (rank, o.error)


def test_a_head_dim_of_its_own_in_pre_attn_is_refused_in_the_bag_and_named_outside(
    fault_world, world
):
    case, results = _case(fault_world, "shape_pre_attn")
    bag = _bag_of(world, case.culprit)
    for rank, o in outcomes(results, case).items():
        if _bag_of(world, rank) == bag:  # the bag refused it together, before sending
            assert o.error.startswith("KnapformerError: pre_attn: the ranks give attention "
                                      "tensors of different layouts"), (rank, o.error)  # fmt: skip
            assert f"head_dim 9 in torch.float32 on rank {case.culprit}" in o.error, o.error
        else:  # the rest of the group is told which ranks left the step, and why
            assert o.error.startswith("CollectiveFailure: step 2, reverse_route"), o.error
            assert f"rank {case.culprit} raised KnapformerError: pre_attn" in o.error, o.error


def test_a_per_sequence_tensor_of_the_wrong_count_is_refused_by_every_rank(fault_world):
    case, results = _case(fault_world, "shape_sequences")
    seen = outcomes(results, case)
    assert "per-sequence tensor has shape" in seen[case.culprit].error
    for rank, o in survivors(results, case).items():
        assert o.error.startswith(
            f"KnapformerError: gather_sequences: invalid input on rank {case.culprit}"
        ), (rank, o.error)


@pytest.mark.parametrize("phase", STALL_PHASES)
def test_a_stall_in_each_balancer_phase_is_named_with_where_the_rank_was_last_seen(
    fault_world, world, phase
):
    case, results = _case(fault_world, f"stall_{phase}")
    said = check_named(results, case, "never entered it (last seen: ", TIMEOUT_S)
    bag = _bag_of(world, case.culprit)
    named_phases = {phase_of(m).split(" of bag")[0] for m in said.values()}
    expected = {"gather" if phase == "plan" else phase}
    if phase in ("pre_attn", "post_attn"):  # peers outside the bag fail in reverse_route
        expected.add("reverse_route")
    assert named_phases == expected, said
    for message in said.values():
        if f"{phase} of bag" in message:
            assert f"{phase} of bag {bag} (" in message, message


def test_a_stall_of_the_plan_ahead_thread_is_named(fault_world):
    case, results = _case(fault_world, "stall_plan_ahead")
    said = check_named(results, case, "never entered it (last seen: plan_ahead, step 1", TIMEOUT_S)
    assert {phase_of(m) for m in said.values()} == {"plan_ahead"}, said


def test_close_without_finish_on_one_rank_is_named_on_every_rank_itself_included(fault_world):
    case, results = _case(fault_world, "close_early")
    check_named(results, case, "closed its balancer without finish() at step 1", TIMEOUT_S)
    own = outcomes(results, case)[case.culprit].error
    assert own.startswith(f"KnapformerError: close() without finish() on rank {case.culprit} "
                          "at step 1: the other ranks trained on"), own  # fmt: skip


def test_a_killed_rank_is_named_as_gone(fault_world):
    case, results = _case(fault_world, "kill")
    check_named(results, case, "did not answer (its process is gone; last seen: ", TIMEOUT_S)


@pytest.mark.parametrize("name", ["raise_forward", "stall_pre_attn", "kill"])
def test_the_incident_and_every_live_ranks_journal_are_written_beside_the_plans(
    fault_world, world, name
):
    case, results = _case(fault_world, name)
    plans = fault_world["folder"] / name / "plans.jsonl"
    incident = run_incident(plans)
    assert incident is not None and incident.step == 2, incident
    assert case.culprit in incident.culprit_ranks, incident
    assert incident.phase in JOURNAL_PHASES and incident.message.startswith("step 2, ")
    assert read_incident(plans.parent / "incident.json") == incident
    dumped = sorted(r for r in range(world) if journal_file(plans.parent, r).is_file())
    alive = sorted(outcomes(results, case))
    assert dumped == alive, (dumped, alive)  # the stalled culprit too; not a dead one


def test_the_flight_recorder_dumps_map_each_failed_collective_to_its_phase(fault_world, world):
    """The post_attn stall ran with torch's flight recorder on: the dumps written beside
    the incident map each survivor's failed collective to its step, phase and bag."""
    from knapformer.tools.flight_recorder import analyse, dump_files, read_dump, read_journals

    case, _ = _case(fault_world, "stall_post_attn")
    folder = fault_world["folder"] / case.name
    files = dump_files([folder])
    assert sorted(files) == list(range(world))  # every rank dumped, the stalled one too
    report = analyse({r: read_dump(p, r) for r, p in files.items()}, read_journals(folder))
    bag = _bag_of(world, case.culprit)
    mapped = {(p.rank, p.step, p.phase, p.bag) for p in report.pending}
    for rank in range(world):
        if rank == case.culprit:
            continue
        phase = "post_attn" if _bag_of(world, rank) == bag else "reverse_route"
        assert (rank, 2, phase, bag if phase == "post_attn" else None) in mapped, mapped
    behind = [ranks for ranks in report.missing.values() if case.culprit in ranks]
    assert behind, report.missing  # the stalled rank never entered its bag's collective
    assert not [n for n in report.notes if "wrapped" in n or "no dump" in n], report.notes
