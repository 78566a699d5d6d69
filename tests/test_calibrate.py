"""Calibration recovers a known time scale k and γ from noisy synthetic measurements."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.contract.plan import Measurements
from knapformer.contract.plan_io import write_jsonl
from knapformer.planning.datamix import parse_mix, sample_lengths
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.calibrate import calibrate_file, calibrate_plans

K, GAMMA, D = 0.8, 0.7, 1024


def true_ms(length: float) -> float:
    return K * (24 * length * D * D + GAMMA * 4 * length * length * D) / 1e12


def write_csv(path, rng, n=200, noise=0.03):
    lengths = rng.integers(256, 32768, size=n)
    with path.open("w") as f:
        f.write("length,latency,gpu\n")
        for length in lengths:
            f.write(f"{length},{true_ms(float(length)) * (1 + noise * rng.standard_normal())},0\n")


def test_csv_fit_recovers_k_and_gamma(tmp_path):
    path = tmp_path / "m.csv"
    write_csv(path, np.random.default_rng(1))
    cal = calibrate_file(path, token_dim=D)
    assert cal.scale == pytest.approx(K, rel=0.05)
    assert cal.gamma == pytest.approx(GAMMA, rel=0.1)
    assert 0.01 < cal.rel_rms_error < 0.06  # the 3% noise, not more


def make_measured_plans(rng, steps=6, noise=0.02):
    """Plans of a mixed topology whose per-GPU 'compute' times follow the true model:
    a GPU computes 1/g of every sequence of its bag of g GPUs."""
    plans = []
    for step in range(steps):
        lengths = sample_lengths(parse_mix("mixres"), rng, length_scale=0.5)
        plan = plan_routing(lengths, "g1n8+g2n4+g4n2+g8n1", WorkloadModel(D, 0.4), step=step)
        times = []
        for gpu in plan.gpus:
            bag = next(b for b, members in enumerate(plan.bags) if gpu in members)
            g = len(plan.bags[bag])
            total = sum(
                true_ms(float(length)) / g
                for length, b in zip(plan.sequences.length, plan.sequences.bag, strict=True)
                if b == bag
            )
            times.append(total * (1 + noise * rng.standard_normal()))
        plan.measurements = Measurements(plan_ms=1.0, per_rank_ms={"compute": times})
        plans.append(plan)
    return plans


def test_plan_fit_recovers_k_and_gamma(tmp_path):
    plans = make_measured_plans(np.random.default_rng(2))
    cal = calibrate_plans(plans)
    assert cal.phase == "compute"
    assert cal.scale == pytest.approx(K, rel=0.05)
    assert cal.gamma == pytest.approx(GAMMA, rel=0.15)
    assert len(cal.measured) == 6 * 32
    # Through a file, as the CLI reads it.
    path = tmp_path / "plans.jsonl"
    write_jsonl(path, plans)
    again = calibrate_file(path)
    assert again.scale == pytest.approx(cal.scale) and again.gamma == pytest.approx(cal.gamma)


def test_plans_without_measured_phase_are_refused(sample_dir):
    with pytest.raises(ValueError, match="no plan carries per-rank times"):
        calibrate_file(sample_dir / "joint32_g8n4.json")
    with pytest.raises(ValueError, match="no plan measures phase 'forward'"):
        calibrate_plans(make_measured_plans(np.random.default_rng(3), steps=1), phase="forward")


def test_cli_prints_fit_and_writes_plot(tmp_path, capsys):
    csv = tmp_path / "m.csv"
    write_csv(csv, np.random.default_rng(4))
    html = tmp_path / "fit.html"
    assert main(["calibrate", str(csv), "--token-dim", str(D), "--plot", str(html)]) == 0
    out = capsys.readouterr().out
    gamma = float(out.split("γ (attention weight)     =")[1].split()[0])
    assert gamma == pytest.approx(GAMMA, rel=0.1)
    page = html.read_text()
    assert "plotly" in page and "perfect model (y = x)" in page
    assert f" = {gamma:.3g}, rel. RMS error" in page  # the fitted γ in the title


def test_cli_bad_csv_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("tokens,ms\n100,1.0\n")
    assert main(["calibrate", str(bad), "--token-dim", "64"]) == 1
    err = capsys.readouterr().err
    assert "expected a header with columns length,latency" in err and err.count("\n") == 1
    bad.write_text("length,latency\n100,fast\n")
    assert main(["calibrate", str(bad), "--token-dim", "64"]) == 1
    assert "bad.csv:2: length and latency must be numbers" in capsys.readouterr().err
    assert main(["calibrate", str(bad)]) == 1
    assert "needs --token-dim" in capsys.readouterr().err


def test_errors_are_per_point_and_a_fit_off_by_a_fifth_is_not_usable(tmp_path, capsys):
    # 25% noise over lengths 256..32k: R² is high (the times span 1,000×), yet a typical
    # point is off by ~17%. Before, this printed "relative RMS error" and a `use:` line.
    path = tmp_path / "noisy.csv"
    write_csv(path, np.random.default_rng(5), n=200, noise=0.25)
    cal = calibrate_file(path, token_dim=D)
    errors = np.abs(cal.predicted - cal.measured) / cal.measured
    assert cal.r2 > 0.5 and cal.median_error == pytest.approx(np.median(errors))
    assert cal.median_error > 0.10 and cal.unusable_reason is not None
    assert main(["calibrate", str(path), "--token-dim", str(D)]) == 0
    out = capsys.readouterr().out
    assert f"off by {np.median(errors):.1%} (median), {errors.max():.0%} at most" in out
    assert "use: WorkloadModel" not in out and "not usable" in out
    assert "relative RMS" not in out


def test_advice_follows_from_the_data(tmp_path):
    # Plans whose compute phase was measured: the advice must not ask for a compute phase.
    plans = make_measured_plans(np.random.default_rng(6), steps=3, noise=0.2)
    cal = calibrate_plans(plans)
    assert cal.phase == "compute" and cal.unusable_reason is not None
    assert "record a `compute` phase" not in cal.remedy
    assert "compute phase" not in cal.remedy and "record more steps (these plans give 3)" in (
        cal.remedy
    )
    # The same times under "step" only: the advice names the phase that was used.
    for plan in plans:
        times = plan.measurements.per_rank_ms.pop("compute")
        plan.measurements.per_rank_ms["step"] = times
    cal = calibrate_plans(plans)
    assert cal.remedy.startswith("phase 'step' includes more than compute")
    # Lengths of one narrow band cannot tell γ from k: the CSV advice says so, with the span.
    rng = np.random.default_rng(7)
    path = tmp_path / "narrow.csv"
    lengths = rng.integers(1000, 1500, size=50)
    rows = "".join(
        f"{n},{true_ms(float(n)) * (1 + 0.3 * rng.standard_normal())}\n" for n in lengths
    )
    path.write_text("length,latency\n" + rows)
    cal = calibrate_file(path, token_dim=D)
    assert cal.unusable_reason is not None
    spread = lengths.max() / lengths.min()
    assert f"the lengths span only {lengths.min():,}..{lengths.max():,} tokens ({spread:.1f}×)" in (
        cal.remedy
    )
