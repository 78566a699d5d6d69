"""A job started as torchrun starts one, with no launcher around it
(knapformer/testing/torchrun_job.py): a rank whose training loop raises between the
balancer's calls and never closes its balancer is still named by its peer, through
``sys.excepthook`` and the process group's store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from knapformer.testing.processes import ROOT

pytestmark = pytest.mark.timeout(240)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_uncaught_error_of_a_rank_that_never_closes_is_named_by_its_peer():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE="2")
    command = [sys.executable, "-m", "knapformer.testing.torchrun_job", "--job", "balanced",
               "--fault-rank", "1", "--timeout", "3", "--no-close"]  # fmt: skip
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=env | {"RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    (out0, err0), (_, err1) = (p.communicate(timeout=200) for p in procs)
    assert procs[1].returncode == 1 and "CUDA out of memory" in err1, err1
    assert procs[0].returncode == 1, err0
    named = [line for line in out0.splitlines() if line.startswith("named: ")]
    assert len(named) == 1, out0 + err0
    # Rank 0 waits in route of step 2 (its group timeout), then asks: rank 1 said, from
    # its excepthook, what it raised and where.
    assert named[0].startswith("named: CollectiveFailure: step 2, route (ranks 0, 1): rank 1 "
                               "raised RuntimeError: CUDA out of memory"), named  # fmt: skip
    assert "after gather (in the training loop's code) (step 2)" in named[0], named
    assert "terminate called" not in err0 + err1
