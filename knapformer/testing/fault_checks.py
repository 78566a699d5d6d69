"""What every rank of a fault world must have reported for each kind of fault: the checks
``tests/test_failures.py`` (4 ranks) and ``tests/test_failures_8.py`` (8 ranks) share.

Each check takes the world's outcomes (`knapformer.testing.fault_worlds.Outcome`, per
rank per case), the case and the group timeout, and fails with the offending rank's
message. Times are bounded generously (a loaded machine): the named error must come
within the group's timeout plus ``slack_s``.
"""

from __future__ import annotations

from knapformer.testing.fault_worlds import FaultCase, Outcome

#: Seconds beyond the group timeout a test allows for the named error (the roll call
#: takes a few on an idle machine; a loaded one may take more).
SLACK_S = 30.0


def outcomes(results: list[dict | None], case: FaultCase) -> dict[int, Outcome]:
    """Each rank's outcome of ``case``; a rank that died in it has none."""
    return {r: res[case.name] for r, res in enumerate(results) if case.name in res}


def survivors(results: list[dict | None], case: FaultCase) -> dict[int, Outcome]:
    return {r: o for r, o in outcomes(results, case).items() if r != case.culprit}


def struck_at(results: list[dict | None], case: FaultCase) -> float | None:
    return next((o.struck_at for o in outcomes(results, case).values() if o.struck_at), None)


def check_named(
    results: list[dict | None],
    case: FaultCase,
    says: str,
    timeout_s: float,
    slack_s: float = SLACK_S,
) -> dict[int, str]:
    """Every survivor raised a `CollectiveFailure` naming the culprit (``says``: the words
    after ``rank <culprit>``), its step and a phase, within ``timeout_s + slack_s`` of the
    fault; returns their messages."""
    culprit, step = case.culprit, case.fault.step if case.fault else case.step
    began = struck_at(results, case)
    messages = {}
    for rank, o in survivors(results, case).items():
        assert o.error is not None, f"{case.name}: rank {rank} finished, unaware of rank {culprit}"
        assert o.error.startswith("CollectiveFailure: "), f"{case.name}: rank {rank}: {o.error}"
        assert f"rank {culprit} {says}" in o.error, f"{case.name}: rank {rank}: {o.error}"
        assert f"step {step}," in o.error, f"{case.name}: rank {rank}: {o.error}"
        assert culprit in o.culprits, f"{case.name}: rank {rank} named {o.culprits}: {o.error}"
        if began is not None:
            late = o.raised_at - began
            assert late < timeout_s + slack_s, f"{case.name}: rank {rank} took {late:.1f} s"
        messages[rank] = o.error
    assert messages, f"{case.name}: no survivor reported"
    return messages


def phase_of(message: str) -> str:
    """The collective a named failure is about: what follows ``step N, `` up to ``(``."""
    head = message.split(": ", 2)[1] if message.startswith("CollectiveFailure") else message
    return head.split(", ", 1)[1].split(" (")[0]
