"""What ranks must agree on, checked collectively (real gloo processes, a 15 s group
timeout): options at construction, the width and dtype of what is routed, and that every
group and wait of the balancer inherits the process group's timeout.

Before these checks, on 4 gloo ranks: a different gamma or solver aborted the process
inside gloo ("Received data size doesn't match"), a different ``phases=`` aborted a peer,
a different topology hung the constructor, a different ``max_tokens_per_gpu`` raised on
one rank only, and a rank routing 65 values per token among ranks routing 64 gave its
peers garbage rows and aborted rank 0. Now every rank raises the same `KnapformerError`
naming the option or the rank, and the whole world finishes. The launcher's deadline is
the only bound on time (a hang would fail there, or at the group timeout with gloo's own
error instead of ours).
"""

from __future__ import annotations

import pytest
import torch

from knapformer.local.launcher import TRAINING_PRELOAD, launch
from knapformer.runtime.roll_call import ANSWER_S

WORLD = 4
TIMEOUT_S = 15
D = 16
pytestmark = pytest.mark.timeout(400)


def _run(fn, tmp_path, *args) -> list:
    return launch(
        fn,
        WORLD,
        args,
        preload=TRAINING_PRELOAD,
        group_timeout_s=TIMEOUT_S,
        workdir=tmp_path,
        deadline_s=300,  # generous: only a hang comes near it
    )


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # the message is what the tests check
        return f"{type(err).__name__}: {err}"
    return None


# ------------------------------------------------------------- construction options
_OPTION_CASES = {
    # name: (options of rank 1 (or of rank 2 for "invalid"), options of the others)
    "gamma": ({"gamma": 0.5}, {}),
    "solver": ({"solver": "greedy"}, {}),
    "phases": ({"phases": ["data"]}, {}),
    "topology": ({"topology": "g2n2"}, {}),
    "max_tokens": ({"max_tokens_per_gpu": 100}, {}),
    "plan_ahead": ({"plan_ahead": True}, {}),
    "invalid": ({"solver": "nope"}, {}),
}


def _options_worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    out: dict = {}
    for name, (odd, even) in _OPTION_CASES.items():
        odd_rank = 2 if name == "invalid" else 1
        options = {"topology": "g1n4", **(odd if rank == odd_rank else even)}
        out[name] = _error(lambda options=options: SequenceBalancer(**options).close())
    # The same options spelt differently agree: a topology term order, a tuple of phases.
    same = {"topology": "g1n2+g1n2"} if rank % 2 else {"topology": "g1n4"}
    same["phases"] = ("data",) if rank % 2 else ["data"]
    out["spelt"] = _error(lambda: SequenceBalancer(**same).close())
    # And then a balancer works.
    bal = SequenceBalancer("g1n2+g2n1")
    mine = [3 + rank, 5]
    bal.plan_routing(mine, token_dim=D)
    x = torch.arange(sum(mine) * D, dtype=torch.float32).reshape(-1, D) + 100 * rank
    _, y, _ = bal.route(x)
    _, back, _ = bal.reverse_route(y)
    out["after"] = torch.equal(back, x)
    bal.close()
    return out


@pytest.fixture(scope="module")
def options_results(tmp_path_factory) -> list[dict]:
    return _run(_options_worker, tmp_path_factory.mktemp("options"))


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("gamma", "gamma (0.4 on ranks 0, 2, 3; 0.5 on rank 1)"),
        ("solver", "solver ('knapformer' on ranks 0, 2, 3; 'greedy' on rank 1)"),
        ("phases", "phases ([] on ranks 0, 2, 3; ['data'] on rank 1)"),
        ("topology", "topology ('g1n4' on ranks 0, 2, 3; 'g2n2' on rank 1)"),
        ("max_tokens", "max_tokens_per_gpu (None on ranks 0, 2, 3; 100 on rank 1)"),
        ("plan_ahead", "plan_ahead (False on ranks 0, 2, 3; True on rank 1)"),
    ],
)
def test_ranks_constructed_with_different_options_all_raise_the_same_error(
    options_results, name, said
):
    messages = [r[name] for r in options_results]
    assert len(set(messages)) == 1, messages  # every rank, the same words
    assert messages[0].startswith("KnapformerError: SequenceBalancer options differ"), messages
    assert said in messages[0], messages[0]


def test_an_invalid_option_on_one_rank_fails_every_rank_naming_it(options_results):
    own = options_results[2]["invalid"]
    assert own is not None and "unknown solver 'nope'" in own, own
    for rank in (0, 1, 3):
        msg = options_results[rank]["invalid"]
        assert msg is not None and "invalid on rank 2 (its own error says why)" in msg, msg


def test_options_spelt_differently_agree_and_a_balancer_works_after_the_failures(
    options_results,
):
    assert all(r["spelt"] is None for r in options_results), options_results
    assert all(r["after"] for r in options_results)


# ------------------------------------------------------------------ routed rows
def _rows_worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer("g1n2+g2n1")
    mine = [4 + rank, 6, 3]
    bal.plan_routing(mine, token_dim=64)
    n = sum(mine)
    good = torch.ones(n, 64)
    out = {
        "width": _error(lambda: bal.route(torch.ones(n, 65) if rank == 1 else good)),
        "dtype": _error(lambda: bal.route(good.double() if rank == 2 else good)),
        "features": _error(
            lambda: bal.route(
                good, {"pos": torch.zeros(n, dtype=torch.int32 if rank else torch.int64)}
            )
        ),
    }
    _, y, _ = bal.route(good * rank)  # after the failures, a route works
    t = bal.tables.num_chunk_tokens
    out["reverse"] = _error(lambda: bal.reverse_route(torch.ones(t, 32) if rank == 3 else y))
    _, back, _ = bal.reverse_route(y)
    out["identity"] = torch.equal(back, good * rank)
    bal.close()
    return out


def test_a_rank_routing_another_width_or_dtype_is_named_on_every_rank(tmp_path):
    results = _run(_rows_worker, tmp_path)
    for case, said in (
        ("width", "64 torch.float32 values per token on ranks 0, 2, 3; "
                  "65 torch.float32 values per token on rank 1"),
        ("dtype", "64 torch.float32 values per token on ranks 0, 1, 3; "
                  "64 torch.float64 values per token on rank 2"),
        ("features", "features of different number, dtypes or shapes"),
        ("reverse", "32 torch.float32 values per token on rank 3"),
    ):  # fmt: skip
        messages = [r[case] for r in results]
        assert len(set(messages)) == 1, messages
        assert messages[0].startswith("KnapformerError: "), messages[0]
        assert said in messages[0], messages[0]
    assert "route:" in results[0]["width"] and "reverse_route:" in results[0]["reverse"]
    assert "ranks 1, 2, 3" in results[0]["features"], results[0]["features"]
    assert all(r["identity"] for r in results)


# --------------------------------------------------------------------- timeouts
def _timeouts_worker(rank: int, world: int) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.groups import group_timeout

    bal = SequenceBalancer("g2n1", plan_ahead=True)  # 2 replicas of one 2-GPU bag
    groups = bal.groups
    made = {
        "balance": group_timeout(groups.group),
        "bag": group_timeout(groups.my_bag_group),
        "side": group_timeout(groups.side),
    }
    out = {name: t.total_seconds() for name, t in made.items()}
    out["owned"] = len(list(groups.owned()))
    out["plan_wait_s"] = bal._path.wait_s
    bal.close()
    return out


def test_every_group_and_wait_inherits_the_process_group_timeout(tmp_path):
    for r in _run(_timeouts_worker, tmp_path):
        assert r["balance"] == r["bag"] == r["side"] == TIMEOUT_S, r
        assert r["owned"] == 2, r  # balance group (also the bag's: it spans it), side group
        # plan_routing waits for the plan-ahead thread at most two group timeouts and the
        # time its roll call takes to name whom a failure is to blame.
        assert r["plan_wait_s"] == 2 * TIMEOUT_S + ANSWER_S, r


# --------------------------------------------- per-sequence rows and attention heads
def _exchanges_worker(rank: int, world: int) -> dict:
    """Each exchange given a layout of its own on one rank: every rank must raise in the
    same call, nothing sent; then the same calls with one layout work."""
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer("g1n2+g2n1")  # ranks 2, 3 share a bag
    mine = [4 + rank, 6, 3]
    bal.plan_routing(mine, token_dim=32)
    _, x, _ = bal.route(torch.ones(sum(mine), 32))
    cond = torch.ones(3, 8)
    t = x.shape[0]
    out = {
        "seq_width": _error(lambda: bal.per_token(torch.ones(3, 9) if rank == 1 else cond)),
        "seq_dtype": _error(lambda: bal.gather_sequences(cond.double() if rank == 3 else cond)),
        "seq_count": _error(lambda: bal.per_token(torch.ones(2, 8) if rank == 0 else cond)),
        "head_dim": _error(lambda: bal.pre_attn(*(torch.ones(t, 4, 16 if rank == 3 else 8),) * 3)),
        "heads": _error(lambda: bal.pre_attn(*(torch.ones(t, 3 if rank == 2 else 4, 8),) * 3)),
    }
    _, q, _, _ = bal.pre_attn(*(torch.ones(t, 4, 8),) * 3)
    out["post_dtype"] = _error(lambda: bal.post_attn(q.half() if rank == 2 else q))
    _, back = bal.post_attn(q)
    out["after"] = (tuple(back.shape), tuple(bal.per_token(cond).shape)) == ((t, 4, 8), (t, 8))
    bal.close()
    return out


@pytest.fixture(scope="module")
def exchanges_results(tmp_path_factory) -> list[dict]:
    return _run(_exchanges_worker, tmp_path_factory.mktemp("exchanges"))


@pytest.mark.parametrize(
    ("case", "ranks", "said"),
    [
        ("seq_width", (0, 1, 2, 3), "8 torch.float32 values per sequence on ranks 0, 2, 3; "
                                    "9 torch.float32 values per sequence on rank 1"),
        ("seq_dtype", (0, 1, 2, 3), "8 torch.float64 values per sequence on rank 3"),
        ("seq_count", (1, 2, 3), "gather_sequences: invalid input on rank 0"),
        ("head_dim", (2, 3), "4 heads of head_dim 8 in torch.float32 on rank 2; 4 heads of "
                             "head_dim 16 in torch.float32 on rank 3"),
        ("post_dtype", (2, 3), "in torch.float16 on rank 2"),
    ],
)  # fmt: skip
def test_an_exchange_with_a_layout_of_its_own_is_refused_on_every_rank_it_spans(
    exchanges_results, case, ranks, said
):
    """Before these checks: a per-sequence tensor of another width or dtype on one rank,
    or a pre_attn whose head_dim differs, ended in SIGABRT ("Received data size doesn't
    match"); one with another count raised on that rank alone while its peers waited."""
    messages = {r: exchanges_results[r][case] for r in ranks}
    assert len(set(messages.values())) == 1, messages  # every rank, the same words
    assert next(iter(messages.values())).startswith("KnapformerError: "), messages
    assert said in next(iter(messages.values())), messages
    if case == "seq_count":  # the rank whose own check failed says what was wrong
        assert "per-sequence tensor has shape (2, 8)" in exchanges_results[0][case]
    elif case in ("head_dim", "post_dtype"):  # the 1-GPU bags exchange nothing, raise nothing
        assert [exchanges_results[r][case] for r in (0, 1)] == [None, None]


def test_a_head_count_one_bag_size_cannot_split_fails_the_bag_together(exchanges_results):
    own = exchanges_results[2]["heads"]
    assert "3 attention heads cannot be split evenly" in own, own
    assert "pre_attn: invalid input on rank 2" in exchanges_results[3]["heads"]


def test_every_exchange_works_after_the_refusals(exchanges_results):
    assert all(r["after"] for r in exchanges_results)
