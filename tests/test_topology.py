import numpy as np
import pytest

from knapformer.contract.topology import Topology, consecutive_bags


def test_parse_orders_bags_smallest_first_with_contiguous_ranks():
    topo = Topology.parse("g4n1+g1n2+g2n1")
    assert topo.bag_sizes == (1, 1, 2, 4)
    assert topo.num_gpus == 8
    assert topo.bags() == [[0], [1], [2, 3], [4, 5, 6, 7]]
    assert str(topo) == "g1n2+g2n1+g4n1"


def test_bags_follow_the_given_ranks():
    assert Topology.parse("g2n2").bags([8, 9, 10, 11]) == [[8, 9], [10, 11]]


def test_repeated_bag_size_is_merged():
    topo = Topology.parse("g1n2+g1n3")
    assert topo.bag_sizes == (1,) * 5
    assert str(topo) == "g1n5"


def test_replicas_are_consecutive_rank_groups():
    topo = Topology.parse("g2n2")
    assert topo.num_replicas(8) == 2
    assert topo.balance_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.group_of(6, 8) == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("g2", "'g2'"),
        ("g0n2", "zero"),
        ("g2n0", "zero"),
        ("g2n2+", "''"),
        ("gXn2", "'gXn2'"),
        ("g2n2 g1n1", "'g2n2 g1n1'"),
    ],
)
def test_malformed_topologies_name_the_problem(text, fragment):
    for _ in range(2):  # parses are cached: a bad string must raise every time
        with pytest.raises(ValueError) as err:
            Topology.parse(text)
        assert fragment in str(err.value)


@pytest.mark.parametrize("sizes", [(), (1, 2.0), (1, np.int64(2)), (2, 0), (1, -1), (1, "2")])
def test_bag_sizes_must_be_positive_ints(sizes):
    with pytest.raises(ValueError, match="positive ints"):
        Topology(sizes)


@pytest.mark.parametrize("sizes", [(1,) * 6, (2, 2, 2), (6,), (1, 1, 4), (2, 1, 1, 2), (4, 1, 1)])
def test_consecutive_bags_are_the_slices_in_order_each_a_new_list(sizes):
    gpus = [10 + i for i in range(sum(sizes))]
    starts = np.cumsum((0, *sizes[:-1])).tolist()
    expected = [gpus[s : s + g] for s, g in zip(starts, sizes, strict=True)]
    first = consecutive_bags(gpus, sizes)
    assert first == expected
    assert consecutive_bags(tuple(gpus), list(sizes)) == expected  # any sequence in
    first[0].append(-1)  # a plan's bags are its own: the next ones are unchanged
    assert consecutive_bags(gpus, sizes) == expected


@pytest.mark.parametrize("world", [0, 3, 6, 9])
def test_world_size_that_does_not_fit_is_rejected(world):
    with pytest.raises(ValueError, match=f"world size {world}"):
        Topology.parse("g2n2").balance_groups(world)


def test_bags_reject_wrong_gpu_count():
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        Topology.parse("g2n2").bags([0, 1, 2])


def test_heads_for_is_the_smallest_common_multiple_of_bag_sizes_at_least_asked():
    assert Topology.parse("g1n2+g2n1+g4n1").heads_for(4) == 4
    assert Topology.parse("g2n1+g3n1").heads_for(4) == 6
    assert Topology.parse("g8n4").heads_for(4) == 8
    assert Topology.parse("g1n4").heads_for(5) == 5
