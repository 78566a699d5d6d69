"""SequenceBalancer when ranks disagree or one rank's input is bad (real gloo processes).

Every case must end the same way on every rank of the balance group: all raise in the
same call (so none waits in a collective for a peer that already left), and the next
valid step plans and routes as usual. A rank that hung would fail the whole world at the
process group's timeout instead. Every case runs on the synchronous path and planning
ahead, where the errors are raised on the plan-ahead thread and handed to plan_routing.
"""

from __future__ import annotations

import pytest
import torch

from knapformer.testing.dist_helpers import run_world

WORLD = 4
D = 16
pytestmark = pytest.mark.timeout(300)


def _try(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def _worker(rank: int, world: int, ahead: bool) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer("g1n2+g2n1", plan_ahead=ahead)
    mine = [5 + rank, 3]
    out: dict[str, str | None] = {}

    def case(name: str, lengths, token_dim, **kwargs) -> None:
        if ahead and name == "two":  # prefetched (and checked) before plan_routing
            bal.prefetch(lengths, token_dim=token_dim)
        out[name] = _try(lambda: bal.plan_routing(lengths, token_dim=token_dim, **kwargs))

    # 10: a bad token_dim on one rank only (its own check fails before any collective).
    case("bad_dim", mine, 0 if rank == 2 else D)
    case("dim_type", mine, "sixteen" if rank == 1 else D)
    # 10: packed rows that do not match the lengths, on one rank.
    rows = sum(mine) + (1 if rank == 3 else 0)
    case("packed", mine, D, packed_seqs=torch.zeros(rows, D))
    # 10: two ranks with different mistakes.
    case("two", [-1] if rank == 0 else mine, -5 if rank == 3 else D)
    # 11: ranks passing different token dims (64 vs 65 on one rank).
    case("dims_differ", mine, 65 if rank == 1 else 64)
    # 12: absurd lengths on some ranks.
    case("huge", [2**62] if rank == 1 else ([2**40] if rank == 2 else mine), D)
    case("huge_sum", [2**23, 2**23, 1] if rank == 0 else mine, D)
    case("many", [0] * (2**20 + 1) if rank == 3 else mine, D)
    # After all that, the balancer still plans and routes.
    plan = bal.plan_routing(mine, token_dim=D, packed_seqs=torch.zeros(sum(mine), D))
    x = torch.arange(sum(mine) * D, dtype=torch.float32).reshape(-1, D) + 1000 * rank
    _, routed, _ = bal.route(x)
    _, back, _ = bal.reverse_route(routed)
    out["after"] = (plan.step, torch.equal(back, x), bal.step)
    bal.close()
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "ahead"])
def results(request, tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("faults"), request.param)


def _peers(results, name: str, bad: set[int]) -> list[str]:
    return [r[name] for rank, r in enumerate(results) if rank not in bad]


def test_a_bad_token_dim_on_one_rank_fails_every_rank_together(results):
    assert "token_dim must be" in results[2]["bad_dim"] and "0" in results[2]["bad_dim"]
    for msg in _peers(results, "bad_dim", {2}):
        assert msg is not None and "invalid token_dim on rank 2 " in msg, msg
    assert "'sixteen'" in results[1]["dim_type"]
    for msg in _peers(results, "dim_type", {1}):
        assert msg is not None and "invalid token_dim on rank 1 " in msg, msg


def test_packed_rows_that_do_not_match_the_lengths_fail_every_rank(results):
    own = results[3]["packed"]
    assert own is not None and "packed_seqs has shape (12, 16)" in own and "11 tokens" in own
    for msg in _peers(results, "packed", {3}):
        assert msg is not None and "invalid packed_seqs on rank 3 " in msg, msg


def test_different_mistakes_on_two_ranks_are_all_named(results):
    assert "negative length -1" in results[0]["two"]
    assert "token_dim must be" in results[3]["two"]
    for msg in _peers(results, "two", {0, 3}):
        assert "local_seq_lens on rank 0" in msg and "token_dim on rank 3" in msg, msg


def test_ranks_passing_different_token_dims_are_refused_on_every_rank(results):
    messages = [r["dims_differ"] for r in results]
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages  # the same words everywhere
    assert "64 on ranks 0, 2, 3" in messages[0] and "65 on rank 1" in messages[0]


@pytest.mark.parametrize("name", ["huge", "huge_sum", "many"])
def test_absurd_lengths_fail_identically_on_every_rank(results, name):
    messages = [r[name] for r in results]
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages
    if name == "huge":
        assert "rank 1" in messages[0] and str(2**62) in messages[0], messages[0]
    elif name == "huge_sum":
        assert "rank 0" in messages[0] and str(2**24 + 1) in messages[0], messages[0]
    else:
        assert "rank 3" in messages[0] and str(2**20 + 1) in messages[0], messages[0]


def test_the_balancer_plans_and_routes_after_the_failures(results):
    for r in results:
        step, identity, counter = r["after"]
        # Failed calls planned nothing: the good step is the first plan.
        assert step == 0 and counter == 0 and identity
