"""How readers write a step's figures: one formatter for the summary line, shared by the
demo's per-step print, ``show``, ``simulate`` and the dashboard."""

from __future__ import annotations

import re

import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans
from knapformer.contract.stats import before_after, share, summary_line
from knapformer.local.demo import StepReport, format_report

LINE = re.compile(r"imbalance ([\d.]+) → ([\d.]+)  moved ([\d,]+) of ([\d,]+) tokens \(([\d.]+)%\)")


def test_the_summary_line_carries_the_numbers_it_was_given():
    m = LINE.fullmatch(summary_line(1.84219, 1.01349, 12_345, 67_890))
    assert m is not None
    assert float(m[1]) == pytest.approx(1.84219, abs=5e-4)
    assert float(m[2]) == pytest.approx(1.01349, abs=5e-4)
    assert int(m[3].replace(",", "")) == 12_345 and int(m[4].replace(",", "")) == 67_890
    assert float(m[5]) == pytest.approx(100 * 12_345 / 67_890, abs=0.05)
    assert share(0, 0) == "0 of 0 (0.0%)"  # a step without tokens is not a division error


def test_the_demo_prints_the_summary_line_of_its_step():
    report = StepReport(3, 0.25, 2.5, 1.004, 700, 9_000, 12.5)
    line = format_report(report)
    assert summary_line(2.5, 1.004, 700, 9_000) in line
    assert line.startswith("step    3  loss  0.2500  ") and line.endswith("  12.5 ms")


def test_show_writes_imbalance_and_moved_tokens_as_the_formatter_does(plan8_path, capsys):
    assert main(["show", str(plan8_path)]) == 0
    out = capsys.readouterr().out
    st = read_plans(plan8_path, on_error="raise").plans[0].stats
    assert f"imbalance max/mean: {before_after(st.imbalance_before, st.imbalance_after)}" in out
    assert f"moved tokens: {share(st.moved_tokens, st.total_tokens)}" in out
