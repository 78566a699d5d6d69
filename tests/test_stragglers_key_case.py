"""Issue 21's key case, end to end and as a user types it: ``knapformer demo --steps 16
--world-size 4 --topology g1n4 --slow-rank 2 --slow-factor 2 --no-dashboard``, then
``knapformer stragglers RUN --json`` names rank 2 ``slow_gpu`` and gives no other rank a
``slow_*`` verdict, on a quiet machine and beside a CPU-heavy neighbour (one busy loop
per core, which slows every worker unevenly from step to step).

Rank 2 is the hard one to name: with g1n4 it also holds a video no bag can split, so the
plan gives it most of the work (the layout floor), and a ratio of compute to predicted
work through the origin hid its slowness while it named the lightly loaded rank 0.

Only verdicts are asserted, never times: the neighbour makes every time longer and
noisier, and the verdicts must not depend on how fast the machine is.

Expected to fail for now (not strict): on the CPU workers the workload model prices rank
2's long sequence too high (gamma 0.4; fitted on clean g1n4 runs of this demo, 0.0-0.57,
median 0.19), so a healthy rank 2 computes about 0.7x of what its peers' line predicts
(0.50-1.05 over 5 clean runs) and slowed 2x it reads about 1.1-1.6x. Measured: quiet,
rank 2 named ``slow_gpu`` in 1 of 6 runs (``layout_floor`` in the others); beside the
neighbour, in 6 of 6; no other rank named slow in any. Remove the mark once the
diagnosis prices it right (a CPU-calibrated workload model for the demo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from knapformer.cli import main

SLOW_RANK = 2
KEY_CASE = [
    "demo", "--steps", "16", "--world-size", "4", "--topology", "g1n4",
    "--slow-rank", str(SLOW_RANK), "--slow-factor", "2", "--no-dashboard",
]  # fmt: skip
pytestmark = pytest.mark.timeout(300)


@contextmanager
def cpu_heavy_neighbour() -> Iterator[None]:
    """One busy-looping process per core for the duration of the block."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def _verdicts(out: Path, capsys: pytest.CaptureFixture) -> dict[int, str]:
    """The key case's demo into ``out``, then each rank's verdict from the stragglers CLI."""
    assert main([*KEY_CASE, "--out", str(out)]) == 0
    capsys.readouterr()  # the demo's step lines
    assert main(["stragglers", str(out), "--json"]) == 0
    return {r["rank"]: r["verdict"] for r in json.loads(capsys.readouterr().out)}


@pytest.mark.xfail(
    reason="the workload model overprices rank 2's long sequence on CPU (see module doc)",
    strict=False,
)
@pytest.mark.parametrize("neighbour", ["quiet", "cpu-heavy neighbour"])
def test_rank_2_is_named_slow_gpu_and_no_other_rank_slow(neighbour, tmp_path, capsys):
    if neighbour == "quiet":
        verdicts = _verdicts(tmp_path / "run", capsys)
    else:
        with cpu_heavy_neighbour():
            verdicts = _verdicts(tmp_path / "run", capsys)
    assert sorted(verdicts) == [0, 1, 2, 3]
    assert verdicts[SLOW_RANK] == "slow_gpu", verdicts
    others = {r: v for r, v in verdicts.items() if r != SLOW_RANK and v.startswith("slow_")}
    assert not others, verdicts
