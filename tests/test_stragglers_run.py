"""End to end: a slow rank injected into a real 8-rank gloo run of the demo is named by
``knapformer stragglers --json``, and no other rank is (the measurements the balancer
records and the straggler tool that reads them, together)."""

from __future__ import annotations

import json

import pytest

from knapformer.cli import main
from knapformer.testing.doc_blocks import run_block_of

WORLD = 8
SLOW_RANK = 5  # in the 4-GPU bag of g1n2+g2n1+g4n1: its bag mates wait for it, and are not slow
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def recording():
    # docs/debugging.md's walkthrough runs this demo (mixed data, balanced: any imbalance
    # left is the slow GPU's); run once, shared with tests/test_docs.py.
    run = run_block_of("docs/debugging.md", "--slow-rank 5 --slow-factor 2 --steps 16")
    return run.path("runs/docs/slow/plans.jsonl")


def test_the_slow_rank_is_named_and_no_other(recording, capsys):
    assert main(["stragglers", str(recording), "--json"]) == 0
    ranks = {r["rank"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(ranks) == list(range(WORLD))
    assert ranks[SLOW_RANK]["verdict"] == "slow_gpu", ranks[SLOW_RANK]
    for rank, r in ranks.items():
        if rank != SLOW_RANK:
            assert r["verdict"] == "ok", r


def test_the_runs_store_gives_the_verdicts_of_its_plans(recording, capsys):
    """The demo records every step in its run store too: `stragglers` reads it (auto
    prefers the store) and names what it names from the plans."""
    run = recording.parent
    assert (run / "store").is_dir()
    verdicts = {}
    for source in ("plans", "store"):
        assert main(["stragglers", str(run), "--json", "--source", source]) == 0
        verdicts[source] = {r["rank"]: r["verdict"] for r in json.loads(capsys.readouterr().out)}
    assert verdicts["store"] == verdicts["plans"]
    assert verdicts["store"][SLOW_RANK] == "slow_gpu"
