"""End to end: a slow rank injected into a real 4-rank gloo run of the demo is named by
``knapformer stragglers --json``, and no other rank is (the measurements the balancer
records and the straggler tool that reads them, together)."""

from __future__ import annotations

import json

import pytest

from knapformer.cli import main
from knapformer.local.demo import DemoConfig, run_demo

WORLD = 4
SLOW_RANK = 3  # in the 2-GPU bag of g1n2+g2n1: its bag mate waits for it, and is not slow
EVEN = "g4b4i512f1s0"  # every rank the same kind of data: any imbalance is the slow GPU's
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    out = tmp_path_factory.mktemp("slow")
    cfg = DemoConfig(
        steps=12, world_size=WORLD, out=out, data_codes=EVEN, slow_rank=SLOW_RANK, slow_factor=3.0
    )
    run_demo(cfg)
    return out / "plans.jsonl"


def test_the_slow_rank_is_named_and_no_other(recording, capsys):
    assert main(["stragglers", str(recording), "--json"]) == 0
    ranks = {r["rank"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(ranks) == list(range(WORLD))
    assert ranks[SLOW_RANK]["verdict"] == "slow_gpu", ranks[SLOW_RANK]
    for rank, r in ranks.items():
        if rank != SLOW_RANK:
            assert r["verdict"] == "ok", r
