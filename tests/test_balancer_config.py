"""`BalancerConfig`: the balancer's options as one object that checks itself when made, with
the per-step topology's, the link probe's and the journal's options nested; the flat
keywords of ``SequenceBalancer(topology, **options)`` still build the same config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel
from knapformer.runtime.balancer_config import (
    AutoTopology,
    BalancerConfig,
    JournalOptions,
    LinkProbeOptions,
)
from knapformer.testing.dist_helpers import run_world


def test_a_config_parses_its_topology_and_keeps_the_defaults():
    config = BalancerConfig("g1n2+g2n1")
    assert config.topology == Topology.parse("g2n1+g1n2") and config.auto is None
    assert config.link_probe == LinkProbeOptions() and config.journal == JournalOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gamma = 1.0  # type: ignore[misc]


def test_auto_gets_its_nested_options_resolved():
    config = BalancerConfig("auto", auto=AutoTopology(node_size=4, comm="infiniband"))
    assert config.topology == "auto" and isinstance(config.auto.comm, CommModel)
    assert config.auto.comm.node_size == 4
    assert BalancerConfig(" auto ").auto == AutoTopology()  # made with its defaults
    assert config.auto.sizes(8) == (1, 2, 4)  # within a node of 4 ranks


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: BalancerConfig("g1n3x"), "g1n3x"),
        (lambda: BalancerConfig("g1n2", gamma=-1.0), "gamma"),
        (lambda: BalancerConfig("g1n2", solver="nope"), "unknown solver 'nope'"),
        (lambda: BalancerConfig("g1n2", cost_model="oracle"), "unknown cost_model 'oracle'"),
        (lambda: BalancerConfig("g1n2", time_scale=0.0), "time_scale must be a positive"),
        (lambda: BalancerConfig("g1n2", cost_model="history", gpu_speed=(1.0, 1.0)),
         "gpu_speed is learnt by cost_model='history'"),
        (lambda: BalancerConfig("g1n2", phases=("step",)), "phase 'step' is derived"),
        (lambda: BalancerConfig("g1n2", auto=AutoTopology(node_size=4)),
         "auto-topology options are for topology='auto'"),
        (lambda: AutoTopology(node_size=0), "node_size must be a positive whole number"),
        (lambda: AutoTopology(comm=3.0), "comm must be a CommModel or a cluster name"),
        (lambda: LinkProbeOptions(every=-1), "link_probe_every must be a whole number >= 0"),
        (lambda: LinkProbeOptions(bytes=2**40), "link_probe_bytes must be at most"),
        (lambda: JournalOptions(size=0), "journal size must be a whole number >= 1"),
        (lambda: JournalOptions(answer_s=0), "answer_s must be a number of seconds"),
        (lambda: BalancerConfig("g1n2", link_probe=3), "link_probe must be a LinkProbeOptions"),
    ],
)  # fmt: skip
def test_an_invalid_option_cannot_be_made(make, says):
    with pytest.raises(KnapformerError, match=says.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_the_flat_keywords_build_the_same_config():
    flat = BalancerConfig.from_options(
        "auto", gamma=0.3, node_size=4, min_group=2, link_probe_every=2, link_probe_rounds=3
    )
    nested = BalancerConfig(
        "auto", gamma=0.3, auto=AutoTopology(node_size=4, min_group=2),
        link_probe=LinkProbeOptions(every=2, rounds=3),
    )  # fmt: skip
    assert flat == nested
    assert flat.flat()["node_size"] == 4 and flat.flat()["link_probe_rounds"] == 3
    with pytest.raises(KnapformerError, match=r"node_size=4 is an option of topology='auto'"):
        BalancerConfig.from_options("g1n2", node_size=4)
    # Defaults of the auto-only keywords are no such mistake (a list or a tuple alike).
    assert BalancerConfig.from_options("g1n2", group_sizes=[1, 2, 4, 8]).auto is None


def test_the_world_is_checked_when_the_config_is_resolved():
    config = BalancerConfig("g1n2+g2n1", gpu_speed=(1.0, 1.0))
    with pytest.raises(KnapformerError, match="world size 3 does not fit"):
        config.resolve((0, 1, 2), 0)
    with pytest.raises(KnapformerError, match="gpu_speed has 2 values for 4 GPUs"):
        config.resolve((0, 1, 2, 3), 0)
    options, layout = BalancerConfig("g1n2", gamma=0.2).resolve((0, 1, 2, 3), 3)
    assert options.gamma == 0.2 and layout.num_replicas == 2 and layout.group_ranks == [2, 3]


def _worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    out = {}
    config = BalancerConfig("g1n2", gamma=0.3, link_probe=LinkProbeOptions(every=1, bytes=64))
    with SequenceBalancer(config) as bal:
        plan = bal.plan_routing([3 + rank, 4], token_dim=8)
        out["config"] = bal.config == config and bal.gamma == 0.3
        out["probed"] = plan.measurements.link_probe is not None
        bal.finish()
    with SequenceBalancer("g1n2", gamma=0.3, link_probe_every=1, link_probe_bytes=64) as bal:
        out["same"] = bal.config == config
        bal.finish()
    try:
        SequenceBalancer(config, gamma=0.5)
    except KnapformerError as err:
        out["both"] = str(err)
    x = torch.zeros(1)
    torch.distributed.all_reduce(x)  # the failed constructor made no collective
    return out


@pytest.mark.timeout(300)
def test_a_balancer_takes_a_config_or_the_flat_keywords_not_both(tmp_path):
    for r in run_world(_worker, 2, tmp_path):
        assert r["config"] and r["probed"] and r["same"], r
        assert "not both (got gamma besides a BalancerConfig)" in r["both"], r
