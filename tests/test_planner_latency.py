"""`bench/planning_latency.py --quick`: one row per mix and a PASS/FAIL line per row and
policy. Only the shape of the report is asserted: how fast a plan is depends on the
machine (the figures are the bench's, not the test's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIXES = ("lowres", "mixres", "joint", "video", "seqheavy")


def test_quick_latency_bench_prints_a_row_and_a_verdict_per_mix_and_policy():
    done = subprocess.run(
        [sys.executable, "bench/planning_latency.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode in (0, 1), done.stderr
    for mix in MIXES:
        assert re.search(rf"│ {mix} +│ +32 │", out), out
        for policy in ("g8", "auto"):
            verdict = re.search(rf"^(PASS|FAIL) {mix} 32 GPUs {policy}: plans in [0-9.]+ ms", out,
                                re.M)  # fmt: skip
            assert verdict, out
    met = re.search(r"^(\d+) of 10 targets met$", out, re.M)
    assert met and (done.returncode == 0) == (met.group(1) == "10"), out
