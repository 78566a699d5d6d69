"""Simulator: the published headline on the synthetic mixes, fair comparisons, CLI."""

from __future__ import annotations

import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans
from knapformer.planning.datamix import parse_mix
from knapformer.tools.simulate import simulate


@pytest.mark.parametrize("mix", ["joint", "mixres"])
def test_headline_speedup_on_g8n4(mix):
    result = simulate(parse_mix(mix), ["g8n4"], steps=6, solvers=["knapformer"])
    summary = result.get("g8n4", "knapformer")
    assert 2.0 <= summary.speedup <= 3.0
    assert summary.worst_imbalance_after <= 1.01
    # The gain comes from a mix that is badly imbalanced to start with.
    assert summary.mean_imbalance_before > 2.0


def test_lowres_has_little_to_gain():
    summary = simulate(parse_mix("lowres"), ["g8n4"], steps=6, solvers=["knapformer"]).get("g8n4")
    assert summary.mean_imbalance_before < 1.15
    assert 1.0 <= summary.speedup < 1.15


def test_every_topology_and_solver_sees_the_same_steps():
    result = simulate(parse_mix("mixres"), ["g8n4", "g1n32", "g2n16"], steps=3)
    assert len(result.summaries) == 3 * 2
    befores = {tuple(s.makespan_before) for s in result.summaries}
    assert len(befores) == 1  # unbalanced step time depends on the sampled lengths only
    # Single-GPU bags cannot split the 2048 px images: balancing barely helps.
    assert result.get("g1n32").speedup < 1.1 < result.get("g2n16").speedup


def test_communication_counts_route_and_reverse_route():
    s = simulate(parse_mix("joint"), ["g4n8"], steps=2, token_dim=1024, dtype_bytes=4).get("g4n8")
    assert s.mean_moved_tokens > 0
    assert s.comm_bytes == pytest.approx(2 * s.mean_moved_tokens * 1024 * 4)


def test_topology_that_does_not_fit_the_mix_is_refused():
    with pytest.raises(ValueError, match="g8n2 has 16 GPUs but the data mix fills 32"):
        simulate(parse_mix("joint"), ["g8n4", "g8n2"], steps=1)


def test_cli_records_one_run_folder_per_topology_and_solver(tmp_path, capsys):
    out = tmp_path / "whatif"
    code = main(
        ["simulate", "--data-codes", "mixres", "--topology", "g8n4", "g1n32",
         "--steps", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "g8n4" in text and "g1n32" in text and "greedy" in text
    assert f"knapformer dashboard {out}" in text
    runs = {"g8n4-knapformer", "g8n4-greedy", "g1n32-knapformer", "g1n32-greedy"}
    # <run>/plans.jsonl is the layout the dashboard's folder run picker lists.
    assert {p.name for p in out.iterdir()} == runs
    for run in runs:
        result = read_plans(out / run / "plans.jsonl")
        assert not result.problems
        # Each run alone holds its steps, once each, so step numbers are unambiguous.
        assert [p.step for p in result.plans] == [0, 1]
        assert {p.run for p in result.plans} == {run}
        topology, solver = run.split("-")
        assert {(p.topology, p.solver) for p in result.plans} == {(topology, solver)}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "file.txt", "exists and is not a folder"),
        (lambda tmp: tmp / "file.txt" / "sub", "cannot create the --out folder"),
        (lambda tmp: tmp / "sim.jsonl", "--out is a folder"),
    ],
)
def test_cli_unusable_out_fails_before_simulating(tmp_path, capsys, make, message):
    (tmp_path / "file.txt").write_text("not a folder")
    out = make(tmp_path)
    code = main(
        ["simulate", "--data-codes", "mixres", "--topology", "g8n4", "--steps", "2",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1
    assert "g8n4" not in captured.out  # no table: nothing was simulated
    assert not (tmp_path / "sim.jsonl").exists()


def test_cli_user_errors_are_one_line(capsys):
    assert main(["simulate", "--data-codes", "joint", "--topology", "g8n2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: topology g8n2") and err.count("\n") == 1
    assert main(["simulate", "--data-codes", "g8b4x", "--topology", "g8n1"]) == 1
    assert "data code 'g8b4x'" in capsys.readouterr().err


@pytest.mark.parametrize("cluster", ["nvlink", "pcie"])
def test_auto_is_simulated_beside_fixed_topologies_with_comm_apart(cluster):
    from knapformer.planning.communication import CommModel

    comm = CommModel.cluster(cluster)
    result = simulate(parse_mix("joint"), ["g8n4", "g4n8", "auto"], steps=2,
                      solvers=["knapformer"], comm=comm)  # fmt: skip
    auto = result.get("auto")
    assert auto.topology == "auto" and len(auto.partitions) == 2
    for name in ("g8n4", "g4n8"):
        fixed = result.get(name)
        assert fixed.partitions == [name, name]
        # auto's step is never slower than a fixed layout of its family, step by step
        for a, f in zip(auto.step_ms, fixed.step_ms, strict=True):
            assert a <= f * (1 + 1e-9), (name, cluster)
    for s in result.summaries:
        for step, compute, comm_ms in zip(s.step_ms, s.compute_ms, s.comm_ms, strict=True):
            assert step == pytest.approx(compute + comm_ms) and comm_ms >= 0
    # Slower links cost the fixed groups of 8 more than the choice that avoids them.
    assert result.get("g8n4").mean_comm_ms > auto.mean_comm_ms


def test_auto_needs_gpus_that_cut_into_nodes():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        simulate(parse_mix("g12b4i256f1s0"), ["auto"], steps=1)


def test_cli_simulates_and_records_auto(tmp_path, capsys):
    out = tmp_path / "whatif"
    args = ["--topology", "g8n4", "auto", "--steps", "2", "--solver", "knapformer", "--cluster"]
    code = main(["simulate", "--data-codes", "joint", *args, "pcie", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "modelled step, ms" in text and "pcie: 25 GB/s in a node of 8" in text
    assert {p.name for p in out.iterdir()} == {"g8n4-knapformer", "auto-knapformer"}
    plans = read_plans(out / "auto-knapformer" / "plans.jsonl").plans
    assert [p.policy for p in plans] == ["auto", "auto"]
    assert all(p.solver_options["comm"]["intra_gbs"] == 25.0 for p in plans)
