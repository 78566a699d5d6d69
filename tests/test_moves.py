"""The move primitive (`moves.move`) does what each pass needs of it: every ledger charges a
move where the sequences go and uncharges where they leave, a move that breaks the token
cap or ends a touched bag at or above the time to beat is undone to the same bits, and a
refinement move leaves the GPUs' loads exactly as its round scored them."""

from __future__ import annotations

import numpy as np
import pytest

from knapformer.planning.bags import BagLayout, Step, bag_shape
from knapformer.planning.chunks import chunk_table
from knapformer.planning.communication import CommModel
from knapformer.planning.exchanges import PricedLedger, _best_exchange
from knapformer.planning.moves import Loads, Tokens, move
from knapformer.planning.pricing import Prices
from knapformer.planning.refine import _GpuLoads
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)
COMM = CommModel.cluster("nvlink")
PER_TOKEN = {g: COMM.ulysses_per_token(MODEL.token_dim, g, MODEL.scale) for g in (1, 2, 4, 8)}


def _placed_step(bag_sizes=(1, 1, 2, 4, 8, 8), per_gpu=6, max_tokens=None, seed=0) -> Step:
    """A step of ``per_gpu`` sequences on every GPU, each placed in a random bag of at most
    its length in GPUs, the layout charged as placement charges it."""
    rng = np.random.default_rng(seed)
    shape = bag_shape(bag_sizes)
    num_gpus = int(shape.size.sum())
    lengths = rng.integers(64, 4096, num_gpus * per_gpu).astype(np.int64)
    src = np.repeat(np.arange(num_gpus), per_gpu)
    workload = MODEL.workload(lengths)
    layout = BagLayout(shape, float(workload.sum()) / num_gpus, max_tokens, None, even=True)
    step = Step.start(shape, lengths, workload, src, layout)
    step.bag[:] = rng.integers(0, len(shape.size), len(lengths))
    layout.add_many(step.bag, workload, lengths)
    return step


def _loads_by_definition(step: Step) -> np.ndarray:
    return np.bincount(step.bag, weights=step.workload, minlength=len(step.layout.size))


def test_a_move_uncharges_where_it_leaves_and_charges_where_it_goes():
    step = _placed_step()
    seq, dst = 5, (int(step.bag[5]) + 1) % len(step.layout.size)
    assert move(step.bag, Loads(step), [seq], [dst])
    assert step.bag[seq] == dst
    np.testing.assert_allclose(step.layout.load, _loads_by_definition(step), rtol=1e-12)


def test_a_batch_of_exchanges_is_charged_as_their_moves_one_by_one():
    """A wide round's disjoint swaps, charged per bag at once: the bags and (to rounding)
    the loads of the same swaps made one by one."""
    one, batch = _placed_step(), _placed_step()
    a, b = np.flatnonzero(one.bag == 0)[:1], np.flatnonzero(one.bag == 3)[:1]
    c = np.flatnonzero(one.bag == 4)[:1]  # moved to bag 5, nothing back
    seqs = np.concatenate([a, b, c])
    dst = np.array([3, 0, 5])
    assert move(batch.bag, Loads(batch), seqs, dst)
    assert move(one.bag, Loads(one), seqs.tolist(), dst.tolist())
    assert np.array_equal(batch.bag, one.bag)
    np.testing.assert_allclose(batch.layout.load, one.layout.load, rtol=1e-12)
    np.testing.assert_allclose(batch.layout.load, _loads_by_definition(batch), rtol=1e-12)


@pytest.mark.parametrize("batch", [False, True])
def test_a_move_over_the_token_cap_is_undone(batch):
    step = _placed_step(max_tokens=10**9)
    layout = step.layout
    full = int(np.argmax(layout.bag_tokens / layout.size))
    layout.max_tokens = int(layout.bag_max_tokens()[full])  # that bag is now just full
    seq = int(np.flatnonzero(step.bag != full)[0])
    bag, tokens = step.bag.copy(), layout.bag_tokens.copy()
    seqs, dst = (np.array([seq]), np.array([full])) if batch else ([seq], [full])
    assert not move(step.bag, Loads(step), seqs, dst)
    assert np.array_equal(step.bag, bag)
    assert np.array_equal(layout.bag_tokens, tokens)
    np.testing.assert_allclose(layout.load, _loads_by_definition(step), rtol=1e-12)


def test_the_token_ledger_counts_every_bags_tokens():
    step = _placed_step()
    lengths = step.lengths.astype(np.float64)
    tokens = np.bincount(step.bag, weights=lengths, minlength=len(step.layout.size))
    seqs = np.array([0, 7, 11])
    move(step.bag, Tokens(tokens, lengths), seqs, np.array([2, 4, 5]))
    assert np.array_equal(step.bag[seqs], [2, 4, 5])
    assert np.array_equal(
        tokens, np.bincount(step.bag, weights=lengths, minlength=len(step.layout.size))
    )


def test_a_move_without_a_ledger_only_moves():
    step = _placed_step()
    load = step.layout.load.copy()
    assert move(step.bag, None, np.array([3, 4]), np.array([5, 0]))
    assert np.array_equal(step.bag[[3, 4]], [5, 0])
    assert np.array_equal(step.layout.load, load)


def _priced(step: Step) -> PricedLedger:
    prices = Prices.of(step.layout.shape, step.src_pos, PER_TOKEN, COMM, MODEL)
    return PricedLedger(step, prices)


FIGURES = ("price", "load", "tokens", "gpu_sends", "bag_sends", "extra", "per", "sent")


def test_a_priced_swap_is_the_step_priced_anew():
    """A swap charged to the priced ledger leaves every figure as pricing the moved step
    from scratch gives (each sequence's price to the bit: a price is its own)."""
    step = _placed_step(max_tokens=10**9)
    ledger = _priced(step)
    x, y = int(np.flatnonzero(step.bag == 0)[0]), int(np.flatnonzero(step.bag == 4)[0])
    assert move(step.bag, ledger, [x, y], [4, 0])
    fresh = _priced(step)
    assert np.array_equal(ledger.price, fresh.price)
    for name in FIGURES[1:]:
        np.testing.assert_allclose(getattr(ledger, name), getattr(fresh, name), rtol=1e-12)


@pytest.mark.parametrize(("bag_sizes", "seed", "moved"), [((1, 1, 2, 4, 8, 8), 4, 1),
                                                         ((2, 2, 2, 2), 5, 2)])  # fmt: skip
def test_a_move_charged_at_the_prices_its_scoring_quoted_is_charged_as_priced_anew(
    bag_sizes, seed, moved
):
    """`exchange_across` hands the move the prices `_best_exchange` scored it by (a move
    or a swap): every figure the same bits as a charge that prices the move itself."""
    quoted_step = _placed_step(bag_sizes, seed=seed)
    priced_step = _placed_step(bag_sizes, seed=seed)
    quoted, priced = _priced(quoted_step), _priced(priced_step)
    a = int(np.argmax(quoted.per))
    light = np.array([b for b in np.argsort(quoted.per).tolist() if b != a][:4])
    cols = [np.flatnonzero(quoted_step.bag == b) for b in light.tolist()]
    found = _best_exchange(quoted, a, np.flatnonzero(quoted_step.bag == a), light, cols, None)
    moves = [m for m in found if m[0] >= 0]
    assert len(moves) == moved
    quoted.quotes = {seq: quote for seq, _, _, quote in moves}
    seqs, dst = [m[0] for m in moves], [m[2] for m in moves]
    assert move(quoted_step.bag, quoted, seqs, dst) == move(priced_step.bag, priced, seqs, dst)
    assert not quoted.quotes  # taken
    for name in FIGURES:
        assert np.array_equal(getattr(quoted, name), getattr(priced, name)), name


def test_a_priced_move_that_reaches_the_time_to_beat_is_undone_bit_for_bit():
    step = _placed_step()
    ledger = _priced(step)
    per = ledger.per  # the exchange pass reads this array between moves
    before = {name: getattr(ledger, name).copy() for name in FIGURES}
    bag = step.bag.copy()
    seq = int(np.flatnonzero(step.bag == 4)[0])
    assert not move(step.bag, ledger, [seq], [0], before=float(per.min()))
    assert np.array_equal(step.bag, bag)
    assert ledger.per is per
    for name in FIGURES:
        assert np.array_equal(getattr(ledger, name), before[name]), name


def _refining(seed: int):
    step = _placed_step(bag_sizes=(1, 1, 2, 4), per_gpu=4, seed=seed)
    step.chunks = chunk_table(step)
    return _GpuLoads(step, MODEL, COMM, None)


@pytest.mark.parametrize("swap", [False, True])
def test_a_refinement_move_leaves_the_loads_its_round_scored(swap):
    """`refine` scores every candidate's GPU loads, then makes one: the loads after it are
    the scored ones, bit for bit, the bags' tokens follow, and an undo restores both."""
    state = _refining(3)
    load = state.load()
    moves, changes = state.candidates(load)
    scored = state.with_changes(*changes)
    s1, _, s2, o2 = moves
    assert len(s1) and len(s2)
    k = len(s1) + len(s2) // 2 if swap else len(s1) // 2
    tokens = state.bag_tokens.copy()
    state.apply(moves, k)
    assert np.array_equal(state.load(), scored[k])
    sizes = state.size
    expected = np.bincount(state.bag, weights=state.fl, minlength=len(sizes))
    assert np.array_equal(state.bag_tokens, expected)
    seqs = [int(s2[k - len(s1)]), int(o2[k - len(s1)])] if swap else [int(s1[k])]
    state.undo(seqs, None, None)
    assert np.array_equal(state.load(), load)
    assert np.array_equal(state.bag_tokens, tokens)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_a_refinement_round_scores_every_candidate_as_its_own_moves(seed):
    """`candidates` scores each move of the slowest bag's sequences once and gathers a
    swap's two halves from those: every row is the plain formulation's (the sequence's
    change where it goes, plus, for a swap, its partner's), bit for bit."""
    state = _refining(seed)
    (s1, t1, s2, o2), changes = state.candidates(state.load())
    assert len(s1) and len(s2)
    bag = state.bag
    plain = state.deltas(np.concatenate([s1, s2]), np.concatenate([t1, bag[o2]]))
    back = state.deltas(o2, bag[s2])
    for change, whole, other in zip(changes, plain, back, strict=True):
        whole[len(s1) :] += other
        assert np.array_equal(change, whole)


@pytest.mark.parametrize(("bag_sizes", "seed"), [((1, 1, 2, 4, 8, 8), 4), ((2, 2, 2, 2), 5),
                                                 ((1, 1, 2, 4), 6)])  # fmt: skip
def test_a_small_steps_price_table_scores_the_exchanges_priced_one_call_at_a_time(bag_sizes, seed):
    """A small step's exchange pass looks its prices up in one table (`PricedLedger`
    ``table``): the same prices, inf where a sequence is shorter than the group, and the
    same exchange and quotes as pricing each exchange's pairs in one call."""
    step = _placed_step(bag_sizes, seed=seed)
    short = step.lengths[::5]  # a view: 1 to 7 tokens, shorter than some groups
    short[:] = 1 + np.arange(len(short)) % 7
    step.workload[::5] = MODEL.workload(short)
    prices = Prices.of(step.layout.shape, step.src_pos, PER_TOKEN, COMM, MODEL)
    table, plain = PricedLedger(step, prices, table=True), PricedLedger(step, prices)
    order, shut_out = np.argsort(plain.per, kind="stable"), False
    for a in order[::-1][:3].tolist():
        light = np.array([b for b in order.tolist() if b != a])
        cols = [np.flatnonzero(step.bag == b) for b in light.tolist()]
        ma = np.flatnonzero(step.bag == a)
        mb = np.concatenate([x for c in cols for x in (c, [-1])])
        looked_up, priced = (x.exchange_prices(mb, a, ma, light) for x in (table, plain))
        for x, y in zip(sum(looked_up, ()), sum(priced, ()), strict=True):
            assert np.array_equal(x, y)
        shut_out |= bool(np.isinf(looked_up[0][0]).any() or np.isinf(looked_up[1][0]).any())
        found = _best_exchange(table, a, ma, light, cols, None)
        assert found is not None
        assert found == _best_exchange(plain, a, ma, light, cols, None)
    assert shut_out  # some short sequence may not go somewhere: priced inf there
