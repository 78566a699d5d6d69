"""The incident record of a failed step (knapformer/contract/incident.py): what it holds and
refuses, and every reader showing it: ``knapformer validate``, ``knapformer stragglers``,
``knapformer report`` and the dashboard's header (over HTTP, as the page asks)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest

from knapformer.contract.incident import (
    Culprit,
    Incident,
    incident_file,
    journal_file,
    parse_incident,
    read_incident,
    remove_incident,
    run_incident,
    write_incident,
)
from knapformer.errors import KnapformerError
from knapformer.testing.processes import CLI, ROOT

MESSAGE = (
    "step 3, pre_attn of bag 1 (ranks 2, 3): rank 3 never entered it (last seen: route, "
    "step 3, 20.1 s ago)"
)


def _incident(**changes) -> Incident:
    culprit = Culprit(
        rank=3, kind="never_entered", says=MESSAGE.split(": ", 1)[1], last_step=3,
        last_phase="route", last_bag=-1, seconds_ago=20.1,
    )  # fmt: skip
    fields = dict(
        run="demo", time=1.7e9, step=3, phase="pre_attn", bag=1, ranks=[2, 3], reporter=2,
        culprits=[culprit], cause="RuntimeError: Timed out waiting 20000ms", message=MESSAGE,
    )  # fmt: skip
    return Incident(**(fields | changes))


@pytest.fixture
def failed_run(tmp_path, sample_dir):
    """A run folder: eight plans the demo recorded (with measurements) and the incident."""
    run = tmp_path / "run"
    run.mkdir()
    lines = (sample_dir / "demo.jsonl").read_text().splitlines()[:8]
    (run / "plans.jsonl").write_text("\n".join(lines) + "\n")
    write_incident(_incident(), run)
    return run


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def test_an_incident_round_trips_and_is_found_beside_the_plans(failed_run):
    path = incident_file(failed_run)
    assert read_incident(path) == _incident()
    assert run_incident(failed_run / "plans.jsonl") == _incident()
    assert run_incident(failed_run.parent / "elsewhere" / "plans.jsonl") is None
    assert _incident().headline() == f"incident: {MESSAGE}"
    assert journal_file(failed_run, 5) == failed_run / "journal" / "rank5.json"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"{nope", "not JSON"),
        (b"[1, 2]", "an incident is a JSON object"),
        (b'{"incident_version": 2}', "incident_version"),
        (b'{"incident_version": 1, "nope": 1}', "invalid incident"),
        (b" " * (64 * 2**20 + 1), "more than an incident may hold"),
    ],
)
def test_a_hostile_incident_file_is_one_clear_error(text, says):
    with pytest.raises(KnapformerError, match=says):
        parse_incident(text, "x.json")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"phase": "forward_backward"}, "unknown phase"),
        ({"ranks": [2, 2]}, "repeat a rank"),
        ({"ranks": [-1]}, "ranks must lie"),
        ({"time": float("nan")}, "finite number"),
        ({"step": 2**60}, "step"),
        ({"culprits": [{"rank": 3, "kind": "raised", "says": "x"}] * 2}, "name a rank twice"),
        ({"culprits": [{"rank": 3, "kind": "bored", "says": "x"}]}, "kind"),
    ],
)
def test_an_incident_that_cannot_be_true_is_refused(change, says):
    record = json.loads(_incident().model_dump_json()) | change
    with pytest.raises(KnapformerError, match=says):
        parse_incident(json.dumps(record), "x.json")


def test_a_new_run_in_the_folder_removes_the_old_incident_and_journals(failed_run):
    (failed_run / "journal").mkdir()
    journal_file(failed_run, 0).write_text("{}")
    remove_incident(failed_run)
    assert not incident_file(failed_run).exists() and not (failed_run / "journal").exists()
    assert (failed_run / "plans.jsonl").is_file()


def test_validate_checks_the_incident_of_a_run_and_an_incident_file(failed_run, tmp_path):
    done = _cli("validate", failed_run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"incident.json: incident OK ({MESSAGE})" in done.stdout
    assert "8 plan(s) OK" in done.stdout
    alone = _cli("validate", incident_file(failed_run))
    assert alone.returncode == 0 and "incident OK" in alone.stdout
    bad = tmp_path / "incident.json"
    bad.write_text('{"incident_version": 1, "step": 3}')
    refused = _cli("validate", bad)
    assert refused.returncode == 1 and "invalid incident" in refused.stdout, refused.stdout


def test_stragglers_names_the_incident_first(failed_run, steps50_path):
    done = _cli("stragglers", failed_run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"incident: {MESSAGE}"
    as_json = _cli("stragglers", failed_run, "--json")
    assert isinstance(json.loads(as_json.stdout), list)  # still one document
    assert f"incident: {MESSAGE}" in as_json.stderr
    # A run that failed before any step was measured still says why.
    shutil.copy(steps50_path, failed_run / "plans.jsonl")
    early = _cli("stragglers", failed_run)
    assert early.returncode == 1 and early.stdout.startswith(f"incident: {MESSAGE}")


def test_the_report_shows_the_incident(failed_run):
    out = failed_run / "report.html"
    done = _cli("report", failed_run, "-o", out)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert "class='incident' role='alert'>incident: step 3, pre_attn of bag 1" in page


def test_the_dashboard_header_shows_the_incident_of_the_shown_run(failed_run):
    from knapformer.dashboard.server import start_server

    handle = start_server(failed_run, port=0)
    try:
        deps = json.loads(_http(handle.url + "_dash-dependencies"))
        view = _run_callback(handle, deps, "view.data", {"tick.n_intervals": 1})["view"]["data"]
        assert view["incident"] == f"incident: {MESSAGE}"
        banner = _run_callback(handle, deps, "incident.children", {"view.data": view})
        assert banner["incident"]["children"] == f"incident: {MESSAGE}"
        assert banner["incident"]["style"].get("display") != "none"
        incident_file(failed_run).unlink()  # a run without one: the banner is hidden
        view = _run_callback(handle, deps, "view.data", {"tick.n_intervals": 2})["view"]["data"]
        assert view["incident"] is None
        banner = _run_callback(handle, deps, "incident.children", {"view.data": view})
        assert banner["incident"]["style"] == {"display": "none"}
    finally:
        handle.stop()


def _http(url: str, body: dict | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.read().decode()


def _run_callback(handle, deps: list[dict], output: str, values: dict) -> dict:
    """Run the app's callback whose outputs include ``output``, its inputs and states set
    from ``values`` (None elsewhere), as the page would; its response."""
    dep = next(d for d in deps if output in d["output"])

    def items(specs):
        return [{**s, "value": values.get(f"{s['id']}.{s['property']}")} for s in specs]

    outputs = [
        dict(zip(("id", "property"), name.split("."), strict=True))
        for name in dep["output"].strip(".").split("...")
    ]
    body = {
        "output": dep["output"], "outputs": outputs, "inputs": items(dep["inputs"]),
        "state": items(dep["state"]), "changedPropIds": list(values),
    }  # fmt: skip
    return json.loads(_http(handle.url + "_dash-update-component", body))["response"]


def test_an_unreadable_incident_is_said_and_the_readers_go_on(failed_run):
    incident_file(failed_run).write_text('{"incident_version": 1, "step": "three"}')
    done = _cli("stragglers", failed_run)
    assert done.returncode == 0, done.stderr
    assert (
        "the run's incident cannot be read: " in done.stderr and "invalid incident" in done.stderr
    )
    report = _cli("report", failed_run, "-o", failed_run / "report.html")
    assert report.returncode == 0 and "the run's incident is left out: " in report.stderr
    assert "class='incident'" not in (failed_run / "report.html").read_text()
