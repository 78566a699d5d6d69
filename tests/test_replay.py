"""Replay: a recorded plan re-executed on local gloo processes, one per GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from in_process import run_here

import knapformer
from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_json
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.processes import CLI, running, survivors
from knapformer.tools.replay import replay

ROOT = Path(__file__).resolve().parent.parent
MIX8 = (
    "g2b4i256f1s0,g1b5i512f1s0,g1b5i1024f1s0,g1b1i2048f1s0,g1b10i256f4s0,g1b1i512f4s0,g1b2i256f85s1"
)


def fresh_plan(path: Path, gpus: list[int] | None = None) -> dict:
    """A plan made by today's planner (8 GPUs, bags of 1, 1, 2, 4), written to ``path``."""
    lengths = sample_lengths(parse_mix(MIX8), np.random.default_rng(5), length_scale=0.25)
    plan = plan_routing(lengths, "g1n2+g2n1+g4n1", WorkloadModel(3072, 0.4), gpus=gpus, step=7)
    write_json(path, plan)
    return json.loads(path.read_text())


def test_fresh_plan_replays_ok(tmp_path):
    path = tmp_path / "plan.json"
    record = fresh_plan(path, gpus=list(range(8, 16)))  # a second replica's ranks
    proc = run_here("replay", str(path), "--heads", "8", "--dim", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "identical plan" in out and "verdict: OK" in out
    assert "every token reached its chunk's GPU and came back" in out
    # One row per recorded GPU rank, with the tokens the plan moves.
    moved = {g: 0 for g in range(8, 16)}
    c = record["chunks"]
    for src, dst, n in zip(c["src_gpu"], c["dst_gpu"], c["length"], strict=True):
        if src != dst:
            moved[src] += n
    for gpu, tokens in moved.items():
        assert any(
            line.split("│")[1].strip() == str(gpu) and line.split("│")[2].strip() == f"{tokens:,}"
            for line in out.splitlines()
            if line.count("│") > 3
        ), f"no row for GPU {gpu} with {tokens} tokens sent"


def test_plans_with_speeds_and_a_time_scale_replay(tmp_path):
    """Re-planning uses the recorded GPU speeds (e.g. learnt by the history cost model)
    and the calibrated time scale: such a plan replays as identical."""
    lengths = sample_lengths(parse_mix(MIX8), np.random.default_rng(5), length_scale=0.25)
    speeds = [1.0, 0.5, 1.0, 1.1, 0.8, 1.0, 1.0, 1.0]
    model = WorkloadModel(3072, 0.4, scale=2.5e-3, unit="ms")
    plan = plan_routing(lengths, "g1n2+g2n1+g4n1", model, step=3, gpu_speed=speeds)
    nominal = plan_routing(lengths, "g1n2+g2n1+g4n1", model, step=3)
    assert not np.array_equal(plan.sequences.bag, nominal.sequences.bag)  # speeds matter
    path = tmp_path / "plan.json"
    write_json(path, plan)
    result = replay(read_plans(path).plans[0])
    assert result.replanned and result.ok, result.first_problem
    # The recorded speeds are compared too: a plan claiming others is named.
    record = json.loads(path.read_text())
    record["gpu_speed"][1] = 0.9
    path.write_text(json.dumps(record))
    proc = run_here("replay", str(path))
    assert proc.returncode == 1 and "verdict: MISMATCH" in proc.stdout


def swap_first_split_chunks(record: dict) -> int:
    """Swap the GPUs of the first two chunks of a sequence in the 4-GPU bag of a plan
    record: still a valid plan, but not what the planner makes. Returns the first chunk."""
    c = record["chunks"]
    first = next(i for i in range(len(c["seq"]) - 1)
                 if c["seq"][i] == c["seq"][i + 1] and c["dst_gpu"][i] >= 4)  # fmt: skip
    c["dst_gpu"][first], c["dst_gpu"][first + 1] = c["dst_gpu"][first + 1], c["dst_gpu"][first]
    return first


def test_wrong_destination_is_named(tmp_path):
    path = tmp_path / "plan.json"
    record = fresh_plan(path)
    c = record["chunks"]
    first = swap_first_split_chunks(record)
    path.write_text(json.dumps(record))
    assert not read_plans(path).problems  # valid: only replay can tell
    proc = run_here("replay", str(path))
    assert proc.returncode == 1
    assert f"chunk {first} dst_gpu: recorded GPU {c['dst_gpu'][first]}" in proc.stdout
    assert "verdict: MISMATCH" in proc.stdout


def test_a_different_planner_is_named_when_plans_differ(tmp_path):
    path = tmp_path / "plan.json"
    record = fresh_plan(path)
    swap_first_split_chunks(record)
    record["planner_version"] = "0.0.1"
    path.write_text(json.dumps(record))
    proc = run_here("replay", str(path))
    assert proc.returncode == 1
    assert f"recorded by planner 0.0.1, this is {knapformer.__version__}" in proc.stdout


def test_changed_length_is_named(tmp_path):
    path = tmp_path / "plan.json"
    record = fresh_plan(path)
    s, c = record["sequences"], record["chunks"]
    seq = 3
    last = max(i for i, q in enumerate(c["seq"]) if q == seq)
    s["length"][seq] += 5  # the chunk grows with it, so the plan stays valid
    c["length"][last] += 5
    path.write_text(json.dumps(record))
    proc = run_here("replay", str(path))
    assert proc.returncode == 1
    assert f"sequence {seq} workload: recorded" in proc.stdout


def test_chunk_outside_its_bag_is_rejected(tmp_path):
    path = tmp_path / "plan.json"
    record = fresh_plan(path)
    c = record["chunks"]
    i = next(i for i, dst in enumerate(c["dst_gpu"]) if dst >= 4)
    c["dst_gpu"][i] = 0
    path.write_text(json.dumps(record))
    proc = run_here("replay", str(path))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    assert str(i) in proc.stderr


def test_broken_router_is_caught(tmp_path, monkeypatch):
    """The token check itself: a reverse_route that scrambles rows must be reported."""
    from knapformer.runtime.balancer import SequenceBalancer

    original = SequenceBalancer.reverse_route

    def scrambled(self, seqs, features=None):
        lens, out, feats = original(self, seqs, features)
        return lens, out.flip(0), {k: v.flip(0) for k, v in feats.items()}

    monkeypatch.setattr(SequenceBalancer, "reverse_route", scrambled)  # inherited by fork
    path = tmp_path / "plan.json"
    fresh_plan(path)
    result = replay(read_plans(path).plans[0], start_method="fork")
    assert not result.ok and result.plan_difference is None
    assert "reverse_route: row 0 got token" in result.first_problem


def test_legacy_plan_replays_recorded_routing(legacy_path):
    proc = run_here("replay", str(legacy_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "planning not re-checked" in proc.stdout and "legacy" in proc.stdout
    assert "verdict: OK" in proc.stdout


def test_too_many_gpus_and_bad_heads_are_refused(tmp_path, capsys):
    # Refused before any worker starts (nothing announced), so it runs in-process.
    path = tmp_path / "big.json"
    write_json(path, plan_routing([[10]] * 65, "g1n65", WorkloadModel(64)))
    assert main(["replay", str(path)]) == 1
    out, err = capsys.readouterr()
    assert err.strip() == (
        "error: the plan has 65 GPUs; replay runs one local process per GPU and stops at 64"
    )
    small = tmp_path / "small.json"
    fresh_plan(small)
    assert main(["replay", str(small), "--heads", "6"]) == 1
    out, err = capsys.readouterr()
    assert "--heads 6 must be a positive multiple" in err
    assert out == ""  # refused before announcing a replay
    assert main(["replay", str(small), "--heads", "8", "--dim", "12"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "error: --dim 12 must be a positive multiple of --heads 8"


SAMPLES = sorted(p.name for p in (ROOT / "sample_plans").glob("*.json*"))


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLES)
def test_every_sample_plan_replays(name):
    proc = run_here("replay", str(ROOT / "sample_plans" / name))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "verdict: OK" in proc.stdout


@pytest.mark.slow
def test_ctrl_c_during_replay_says_interrupted_and_stops_every_worker():
    import os
    import signal
    import time

    import psutil

    replay = [*CLI, "replay", "sample_plans/joint32_g8n4.json"]
    # Its own process group, as a terminal's foreground job.
    with running(replay, start_new_session=True) as proc:
        first = proc.stdout.readline()  # announced: the 32 workers are starting
        assert first.startswith("replaying"), first + proc.stderr.read()
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while len(parent.children(recursive=True)) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        children = parent.children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group: workers too
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted", err
    assert "verdict" not in out
    # The workers, the fork server and the resource tracker: none outlives the command.
    alive = survivors(children)
    assert alive == [], [(p.pid, p.name()) for p in alive]
