"""What each step lost against an ideal one (knapformer.diagnosis.step_loss), on synthetic
measured runs whose answer is known, and in ``knapformer stragglers --loss``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.step_loss import PARTS, step_losses, summarise
from knapformer.testing.measured_plans import measured_run


def _losses(plans):
    return step_losses([measure(p).figures() for p in plans])


def test_the_parts_and_what_is_left_add_up_to_the_loss():
    for loss in _losses(measured_run(10, noise=0.1, slow_rank=5, slow_factor=2.0)):
        assert all(v >= 0 for k, v in loss.parts().items() if k != "other")
        assert sum(loss.parts().values()) == pytest.approx(loss.lost_ms)
        assert loss.ideal_ms == pytest.approx(loss.ideal_compute_ms + loss.ideal_exchange_ms)


def test_a_slow_rank_costs_the_step_its_excess_compute():
    clean = summarise(_losses(measured_run(12, noise=0.02, seed=3)))
    slow = summarise(_losses(measured_run(12, noise=0.02, seed=3, slow_rank=5, slow_factor=2.0)))
    # rank 5 takes twice its ~100 ms: about 100 ms more per step, put on slow ranks
    assert slow["slow_ranks"] > clean["slow_ranks"] + 50
    assert slow["slow_ranks"] == max(slow[p] for p in PARTS)


def test_input_is_the_longest_wait_for_data():
    plans = measured_run(6, noise=0.02)
    for plan in plans:
        per_rank = plan.measurements.per_rank_ms
        per_rank["data"] = [0.0] * len(plan.gpus)
        per_rank["data"][2] = 40.0
    assert all(loss.part_ms["input"] == pytest.approx(40.0) for loss in _losses(plans))


def test_the_steps_fixed_costs_are_named_and_little_is_left_as_other():
    plans = measured_run(10, noise=0.02, seed=4, optimizer_ms=12.0, untimed_ms=6.0)
    losses = _losses(plans)
    summary = summarise(losses)
    assert summary["optimizer"] == pytest.approx(12.0, rel=0.1)
    assert summary["untimed"] == pytest.approx(6.0, rel=0.1)  # the typical rank's
    assert summary["allreduce"] == pytest.approx(3.0, rel=0.1)  # its transfer, no wait
    assert summary["gather"] == pytest.approx(0.3, rel=0.1)
    for loss in losses:
        assert abs(loss.part_ms["other"]) <= 0.1 * loss.lost_ms, loss.parts()
    # without those phases measured, the same time would be "other"
    for plan in plans:
        for phase in ("optimizer", "untimed", "allreduce", "gather"):
            del plan.measurements.per_rank_ms[phase]
    assert summarise(_losses(plans))["other"] > 15.0


def test_stragglers_loss_prints_every_step_as_json(tmp_path, capsys):
    path = tmp_path / "plans.jsonl"
    plans = measured_run(5, noise=0.05, slow_rank=1, slow_factor=2.0)
    path.write_text("".join(p.model_dump_json() + "\n" for p in plans))
    assert main(["stragglers", str(path), "--loss", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == list(range(5))
    assert all(set(PARTS) <= set(r) and np.isfinite(r["lost_ms"]) for r in rows)
    assert main(["stragglers", str(path), "--loss"]) == 0
    out = capsys.readouterr().out
    assert "lost" in out
    # every part shown is explained, and the ones that never counted are said to be 0
    assert "slow ranks: the longest measured compute above" in out
    assert "other: what no measured phase names" in out
    assert "0 in every step, not shown:" in out and "optimizer" in out.split("not shown:")[1]
