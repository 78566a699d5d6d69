"""The live demo (`knapformer demo`) and the torchrun example, run as real processes."""

from __future__ import annotations

import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import numpy as np
import psutil
import pytest
from in_process import run_here
from knapformer.visualization.phase_figures import step_parts

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans
from knapformer.contract.runfiles import remove_recording
from knapformer.contract.topology import Topology
from knapformer.errors import OptionError
from knapformer.local.config import (
    DEMO_CODES,
    HEAD_DIM,
    DemoConfig,
    default_topology,
    model_shape,
    rank_codes,
    topology_note,
)
from knapformer.planning.datamix import parse_mix
from knapformer.testing.doc_blocks import run_block_of
from knapformer.testing.processes import running, survivors

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STEP_LINE = re.compile(
    r"step\s+(\d+)\s+loss\s+([\d.]+)\s+imbalance\s+([\d.]+) → ([\d.]+)\s+moved\s+([\d,]+) of"
)


# ------------------------------------------------------------------- configuration
def test_default_topology_has_mixed_bags_on_powers_of_two():
    assert default_topology(8) == "g1n2+g2n1+g4n1"
    assert default_topology(4) == "g1n2+g2n1"
    assert default_topology(16) == "g1n2+g2n1+g4n1+g8n1"
    # Any other world gets the same shape: the largest bag below the world size first.
    assert default_topology(6) == "g1n2+g4n1"
    assert default_topology(12) == "g1n2+g2n1+g8n1"
    for world in (1, 2, 4, 8, 16, 32, 6, 12):
        assert Topology.parse(default_topology(world)).num_gpus == world
    for world in range(3, 65):  # a multi-GPU bag from 3 ranks on, heads within the limit
        topo = Topology.parse(default_topology(world))
        assert topo.num_gpus == world and topo.max_bag_size > 1 and topology_note(topo) is None
        model_shape(topo)
    assert "nothing to balance" in topology_note(Topology.parse(default_topology(1)))
    assert "cannot split" in topology_note(Topology.parse(default_topology(2)))


def test_rank_codes_spread_the_mix_over_the_world():
    joint = parse_mix("joint")  # 32 GPUs
    on8 = rank_codes(joint, 8)
    assert [c.gpus for c in on8] == [1] * 8
    # Every 4th GPU of the 32-GPU mix: images, large images, keyframes and videos.
    assert [str(c) for c in on8] == [
        "g1b4i256f1s0",
        "g1b4i256f1s0",
        "g1b5i512f1s0",
        "g1b1i2048f1s0",
        "g1b10i256f4s0",
        "g1b2i256f85s1",
        "g1b2i256f85s1",
        "g1b1i512f85s1",
    ]
    demo8 = parse_mix(DEMO_CODES)
    assert [str(c) for c in rank_codes(demo8, 16)[::2]] == [str(c) for c in rank_codes(demo8, 8)]


def test_model_heads_split_across_every_bag():
    for topo in ("g1n2+g2n1+g4n1", "g1n2+g3n2", "g8n1", "g1n1"):
        t = Topology.parse(topo)
        d_model, heads = model_shape(t)
        assert all(heads % g == 0 for g in t.bag_sizes) and heads >= 4
        assert d_model == heads * 16
    with pytest.raises(ValueError, match="g7n1"):
        model_shape(Topology.parse("g5n1+g7n1+g3n1"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "6", "--topology", "g1n2+g2n1"], "world size 6"),
        (["--steps", "-1"], "--steps must be at least 0, got -1"),
        (["--data-codes", "g2b4x"], "g2b4x"),
        (["--topology", "g2x1"], "g2x1"),
        (["--world-size", "4", "--slow-rank", "4"], "--slow-rank 4 is not a rank of the world"),
        (["--slow-rank", "1", "--slow-factor", "0.5"], "--slow-factor must be a number >= 1"),
        (["--cost-model", "oracle"], "unknown --cost-model 'oracle'"),
        (["--head-dim", "7"], "--head-dim must be even, >= 2 (RoPE) and <= 256, got 7"),
        (["--head-dim", "99999998"], "--head-dim must be even, >= 2 (RoPE) and <= 256"),
        (["--length-scale", "0"], "--length-scale must be a number in (0, 1], got 0"),
        (["--length-scale", "inf"], "--length-scale must be a number in (0, 1], got inf"),
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--seed", "-1"], "--seed must be at least 0, got -1"),
        (["--world-size", "65"], "--world-size is 65; at most 64 is supported"),
    ],
)
def test_bad_options_give_one_line_errors_before_starting(tmp_path, capsys, args, message):
    code = main(["demo", "--no-dashboard", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_busy_dashboard_port_is_a_one_line_error(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["demo", "--port", str(port), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and str(port) in err and "Traceback" not in err
    assert not (tmp_path / "o" / "plans.jsonl").exists()  # no worker was started


def test_a_new_run_replaces_the_old_runs_plan_files_only(tmp_path):
    names = ["plans.jsonl", "plans.1.jsonl", "plans.group1.jsonl", "plans.group1.2.jsonl"]
    keep = ["notes.txt", "plans.json", "plans.backup.jsonl", "other.jsonl"]
    for name in names + keep:
        (tmp_path / name).write_text("x")
    remove_recording(tmp_path / "plans.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_every_config_field_is_a_command_line_option_with_its_default_and_help():
    import typer.main

    from knapformer.cli import app

    command = typer.main.get_command(app).commands["demo"]
    options = {p.name: p for p in command.params}
    for f in fields(DemoConfig):
        option = options.pop(f.name)
        assert f"--{f.name.replace('_', '-')}" in option.opts, (f.name, option.opts)
        assert option.default == f.default, f.name
        assert option.help == f.metadata["help"], f.name
    # What the command adds to the config: the dashboard it serves.
    assert sorted(options) == ["dashboard", "port"]


def test_a_config_is_checked_where_it_is_made():
    cfg = DemoConfig()
    assert str(cfg.parsed_topology) == "g1n2+g2n1+g4n1" and len(cfg.codes) == 8
    with pytest.raises(OptionError, match="head_dim must be even") as err:
        DemoConfig(head_dim=99_999_998)
    assert err.value.options == ["head_dim"] and "99999998" in str(err.value)
    with pytest.raises(OptionError, match=r"length_scale .* got inf"):
        DemoConfig(length_scale=math.inf)
    with pytest.raises(ValueError, match="g9n1"):
        DemoConfig(topology="g9n1")  # 9 GPUs in an 8-rank world
    with pytest.raises(FrozenInstanceError):
        cfg.steps = -1  # type: ignore[misc]  (no way around the checks)


def test_the_config_does_not_import_torch():
    code = "import knapformer.local.config, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_demo_headless_records_measured_plans():
    """The README's run of the demo: 8 workers, 5 steps (run once, shared with
    tests/test_docs.py, which checks the README shows what it prints)."""
    run = run_block_of("README.md", "knapformer demo --steps 5")
    printed = run.output("knapformer demo --steps 5")
    result = read_plans(run.path("runs/docs/demo/plans.jsonl"), on_error="raise")  # validates
    plans = result.plans
    assert [p.step for p in plans] == [0, 1, 2, 3, 4]
    for plan in plans:
        assert plan.topology == "g1n2+g2n1+g4n1" and plan.gpus == list(range(8))
        assert plan.run == "demo" and plan.token_dim == 4 * HEAD_DIM  # 4 heads
        ms = plan.measurements.per_rank_ms
        for phase in ("plan", "record", "route", "reverse_route", "forward_backward", "optimizer"):
            assert len(ms[phase]) == 8, phase
            assert all(math.isfinite(v) and v > 0 for v in ms[phase]), (phase, ms[phase])
        # Ulysses re-sharding happens only in the multi-GPU bags (ranks 2 to 7).
        assert ms["pre_attn"][:2] == [0.0, 0.0] and min(ms["pre_attn"][2:]) > 0
        # the whole step's time: at the next plan_routing, the last one's at finish()
        assert len(ms["step"]) == 8 and min(ms["step"]) > 0
        # every millisecond of it is in a phase: the phase stack the views draw adds up to
        # each rank's step, link-probe steps (0, 2, 4) included
        stack = step_parts(plan)
        assert "untimed" in ms and ("probe" in ms) == (plan.step % 2 == 0)
        np.testing.assert_allclose(sum(stack.parts.values()), ms["step"], rtol=0.01)
    # The printed per-step lines describe the recorded plans.
    lines = [STEP_LINE.search(line) for line in printed.splitlines()]
    lines = [m for m in lines if m]
    assert [int(m.group(1)) for m in lines] == [0, 1, 2, 3, 4]
    for m, plan in zip(lines, plans, strict=True):
        stats = plan.stats
        assert float(m.group(3)) == pytest.approx(stats.imbalance_before, abs=0.006)
        assert float(m.group(4)) == pytest.approx(stats.imbalance_after, abs=0.006)
        assert int(m.group(5).replace(",", "")) == stats.moved_tokens
        assert math.isfinite(float(m.group(2)))
    assert "done: 5 steps" in printed and f"d_model={4 * HEAD_DIM} heads=4" in printed


@pytest.mark.slow
def test_six_workers_get_a_default_topology_that_balances(tmp_path):
    out = tmp_path / "demo"
    proc = run_here(
        *("demo", "--steps", "2", "--world-size", "6"),
        *("--no-dashboard", "--out", str(out), "--head-dim", "32"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "topology g1n2+g4n1" in proc.stdout and "note:" not in proc.stdout
    assert "d_model=128 heads=4" in proc.stdout  # --head-dim reaches the model
    plans = read_plans(out / "plans.jsonl", on_error="raise").plans
    assert len(plans) == 2
    for plan in plans:
        assert plan.token_dim == 4 * 32  # 4 heads of --head-dim
        # The video sequence no longer sets the step alone: balancing pays off.
        assert plan.topology == "g1n2+g4n1"
        assert plan.stats.imbalance_after < 0.8 * plan.stats.imbalance_before


def _endless_demo(*options: str) -> list:
    """``knapformer demo`` of two workers in one 2-GPU bag that runs until stopped."""
    return [BIN / "knapformer", "demo", "--steps", "0", "--world-size", "2", "--topology", "g2n1",
            *options]  # fmt: skip


def _until_first_step(proc: subprocess.Popen) -> list[str]:
    """The demo's stdout lines up to its first step line (or its end; 180 s at most)."""
    seen = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        seen.append(proc.stdout.readline())
        if STEP_LINE.search(seen[-1]) or not seen[-1]:
            break
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--plan-ahead", "--cost-model", "history"]])
def test_ctrl_c_stops_workers_and_dashboard_leaving_nothing_running(tmp_path, options):
    out = tmp_path / "demo"
    with running(_endless_demo("--port", "0", "--out", str(out), *options)) as proc:
        seen = _until_first_step(proc)
        assert any("dashboard: http://127.0.0.1:" in s for s in seen), "".join(seen)
        assert STEP_LINE.search(seen[-1]), "".join(seen) + proc.stderr.read()
        parent = psutil.Process(proc.pid)
        children = parent.children(recursive=True)
        assert len(children) >= 3  # the fork server and two workers
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "workers stopped" in stderr and stderr.rstrip().endswith("interrupted"), stderr
    assert "Traceback" not in stderr
    alive = survivors(children)
    assert alive == [], [(p.pid, p.name()) for p in alive]
    # The workers stopped together after a whole step and flushed the recorder: valid
    # lines only, and even the last plan carries both ranks' measured times.
    result = read_plans(out / "plans.jsonl")
    assert result.problems == [] and len(result.plans) >= 1
    assert [p.step for p in result.plans] == list(range(len(result.plans)))
    assert all(len(p.measurements.per_rank_ms["route"]) == 2 for p in result.plans)


@pytest.mark.slow
def test_a_killed_worker_is_named_once_without_tracebacks(tmp_path):
    with running(_endless_demo("--no-dashboard", "--out", str(tmp_path / "demo"))) as proc:
        seen = _until_first_step(proc)
        assert STEP_LINE.search(seen[-1]), "".join(seen) + proc.stderr.read()
        # The workers are the fork server's children, started in rank order.
        workers = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if p.ppid() != proc.pid
        ]
        rank1 = max(workers, key=lambda p: (p.create_time(), p.pid))
        rank1.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    # Rank 0 fails in its next collective because rank 1 is gone: only rank 1 is named,
    # by the launcher and in the incident rank 0's balancer recorded.
    lines = stderr.strip().splitlines()
    assert lines[-1] == "error: worker rank 1 died (SIGKILL)", stderr
    incident = [line for line in lines if line.startswith("incident: ")]
    assert len(incident) == 1 and "rank 1 did not answer (its process is gone" in incident[0]
    assert "Traceback" not in stdout + stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=str(BIN)) is None, reason="needs torchrun")
def test_torchrun_example_records_plans():
    """docs/recording.md's run of the example (2 ranks, 3 steps; run once, shared with
    tests/test_docs.py, which checks the page shows what it prints)."""
    command = "examples/train_toy_dit.py --steps 3 --topology g2n1 --out runs/docs/toy"
    run = run_block_of("docs/recording.md", command)  # ended with status 0, or it raises
    plans = read_plans(run.path("runs/docs/toy/plans.jsonl"), on_error="raise").plans
    assert [p.step for p in plans] == [0, 1, 2]
    assert all(p.run == "toy" and p.topology == "g2n1" for p in plans)
    # finish() gave the last plan its times as well: every plan has both ranks' times.
    assert all(len(p.measurements.per_rank_ms["forward_backward"]) == 2 for p in plans)
    assert run.output(command).count("loss") == 3
