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


def test_versions_bench_compares_two_trees_and_sees_the_same_plans():
    # HEAD against this tree: the plans must be the same (the digests agree); a revision
    # that does not exist is refused with git's reason, nothing left behind.
    done = subprocess.run(
        [sys.executable, "bench/planning_versions.py", "--base", "HEAD", "--gpus", "32",
         "--pairs", "1", "--steps", "1", "--mixes", "joint,seqheavy"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for mix in ("joint", "seqheavy"):
        for policy in ("g8", "auto"):
            figures = r" +│ +[0-9.]+" * 6
            row = re.search(rf"│ {mix} +│ +32 │ {policy}{figures} │ +(\w+) │", done.stdout)
            assert row and row.group(1) == "yes", done.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                               text=True).stdout  # fmt: skip
    bad = subprocess.run(
        [sys.executable, "bench/planning_versions.py", "--base", "no-such-revision-xyz"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "cannot check out 'no-such-revision-xyz'" in bad.stderr
    after = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                           text=True).stdout  # fmt: skip
    assert after == worktrees
