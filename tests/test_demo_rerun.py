"""A demo re-run in the folder of an earlier run shows the new run only (issue 31): the
earlier recording is removed before the dashboard starts, so the server never reads it.
Before, ``demo --steps 30 --no-dashboard`` then ``demo --steps 8`` in the same folder
served 38 steps, the timeline running back from the old run's last step to 0.

The earlier run is a real demo's recording (`sample_plans/demo.jsonl`, 30 steps of 8
workers) copied in, with a rotated part beside it: a second demo would only repeat
what the second run does below."""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request
from pathlib import Path

import pytest

from knapformer.contract.plan_io import read_plans
from knapformer.testing.polling import wait_until
from knapformer.testing.processes import CLI, running

SECOND = 3
EARLIER = Path(__file__).resolve().parents[1] / "sample_plans" / "demo.jsonl"
_URL_AT = "dashboard: "


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "api/status", timeout=30) as answer:
        return json.loads(answer.read())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_demo_rerun_in_one_folder_serves_only_the_new_run(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    shutil.copy(EARLIER, out / "plans.jsonl")
    shutil.copy(EARLIER, out / "plans.1.jsonl")
    earlier = len(read_plans(out / "plans.jsonl").plans)
    assert earlier > SECOND
    common = ["--world-size", "4", "--out", str(out)]

    seen_steps = []
    with running([*CLI, "demo", "--steps", str(SECOND), "--port", "0", *common]) as second:
        url = None
        for line in second.stdout:
            if line.startswith(_URL_AT):
                url = line[len(_URL_AT) :].split()[0]
            if url is not None:  # while it trains, the page never counts the old steps
                seen_steps.append(_status(url)["steps"])
            if line.startswith("training finished"):
                break
        assert url is not None, second.stderr.read()
        # the server may still be reading the last lines the workers wrote
        wait_until(lambda: _status(url)["steps"] == SECOND, 60, "the new run's steps shown")
        status = _status(url)
        second.send_signal(signal.SIGINT)
        second.communicate(timeout=60)
    assert status["steps"] == SECOND and status["problems"] == 0, status
    assert max(seen_steps) <= SECOND, seen_steps
    plans = read_plans(out / "plans.jsonl").plans
    assert [p.step for p in plans] == list(range(SECOND))
    assert not (out / "plans.1.jsonl").exists()  # the old run is gone, not kept aside
