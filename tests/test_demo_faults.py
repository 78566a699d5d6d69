"""``knapformer demo --fail-rank R --fail-kind K --fail-step S --fail-phase P``: the injected
fault ends the run (exit 1), and what it prints names the rank, the step and the phase;
the run's incident is recorded for ``knapformer stragglers`` and the dashboard."""

from __future__ import annotations

import subprocess

import pytest
from in_process import run_here

from knapformer.cli import main
from knapformer.contract.incident import run_incident

pytestmark = pytest.mark.timeout(300)
DEMO = ["demo", "--no-dashboard", "--world-size", "4", "--steps", "6", "--group-timeout", "4"]


def _demo(out, *args) -> subprocess.CompletedProcess:
    return run_here(*DEMO, "--out", str(out), "--link-probe-every", "0", *args)


def test_a_raise_in_the_forward_names_the_rank_step_and_phase(tmp_path):
    done = _demo(tmp_path, "--fail-rank", "2", "--fail-kind", "raise", "--fail-step", "2")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: worker rank 2 raised SimulatedFault: CUDA out of memory"), last
    assert "rank 2, step 2, forward" in last
    assert "rank 2 raised SimulatedFault" in done.stderr  # the incident, as recorded
    incident = run_incident(tmp_path / "plans.jsonl")
    assert incident is not None and incident.step == 2 and incident.culprit_ranks == [2]
    assert "after route" in incident.message
    seen = run_here("stragglers", str(tmp_path))
    assert seen.stdout.startswith(f"incident: {incident.message}"), seen.stdout + seen.stderr


def test_a_stall_names_the_rank_that_never_entered_and_where_it_was(tmp_path):
    args = ("--fail-rank", "3", "--fail-kind", "stall", "--fail-step", "2", "--fail-phase",
            "post_attn")  # fmt: skip
    done = _demo(tmp_path, *args)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    # The stalled rank raised nothing: the launcher names it as its peers' balancers did.
    assert last.startswith("error: worker rank 3 was named by ranks "), last
    assert "step 2, " in last and "rank 3 never entered it (last seen: pre_attn" in last, last
    assert "rank 3 will stall at step 2, post_attn" in done.stdout
    incident = run_incident(tmp_path / "plans.jsonl")
    assert incident.culprit_ranks == [3] and incident.culprits[0].kind == "never_entered"
    assert incident.culprits[0].last_phase == "pre_attn" and incident.step == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fail-rank", "4"], "--fail-rank 4 is not a rank of the world (0..3)"),
        (["--fail-rank", "1", "--fail-kind", "explode"], "unknown --fail-kind 'explode'"),
        (["--fail-rank", "1", "--fail-phase", "lunch"], "unknown --fail-phase 'lunch'"),
        (["--fail-rank", "1", "--fail-kind", "shape", "--fail-phase", "forward"],
         "--fail-kind shape gives a tensor of another shape in route"),
        (["--fail-rank", "1", "--fail-phase", "plan_ahead"], "needs --plan-ahead"),
        (["--fail-rank", "1", "--fail-step", "9"], "--fail-step 9 is beyond the run's 6 steps"),
        (["--fail-rank", "1", "--fail-phase", "probe", "--fail-step", "3",
          "--link-probe-every", "2"], "the link probe runs every 2 step(s)"),
        (["--group-timeout", "0.5"], "--group-timeout must be a number of seconds in [1, 3600]"),
    ],
)  # fmt: skip
def test_bad_fault_options_are_refused_before_starting(tmp_path, capsys, args, message):
    code = main([*DEMO, "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o").exists()
