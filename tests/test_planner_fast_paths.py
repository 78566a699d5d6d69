"""The planner's fast paths give what the plain formulation gives: the ranked stable
sort, the remainder-pattern chunk table, the by-bag member index of the exchange rounds;
and a large step's poured pool still plans within the solver's bound."""

from dataclasses import replace
from functools import partial
from unittest.mock import patch

import numpy as np
import pytest

from knapformer.planning import auto, bags, chunks, fixed, levelling, pricing
from knapformer.planning.bounds import makespan_floor
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.tuning import FALLBACK_TOLERANCE, FLOOR_MARGIN
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)


@pytest.mark.parametrize("distinct", [1, 7, 300, 40_000])
def test_ranked_stable_sort_is_the_stable_sort(distinct):
    rng = np.random.default_rng(distinct)
    values = rng.integers(0, distinct, 50_000) * 0.37 - 1.0  # many ties, a -0.0 maybe
    values[:3] = [0.0, -0.0, 0.0]
    assert values.size >= bags.RANKED_SORT
    expected = np.argsort(values, kind="stable")
    assert np.array_equal(bags.stable_argsort(values), expected)
    assert np.array_equal(bags.stable_argsort(-values), np.argsort(-values, kind="stable"))


@pytest.mark.parametrize("ascending", [False, True])
@pytest.mark.parametrize("distinct", [3, 400, 50_000])
def test_by_home_heaviest_first_is_the_lexsort(distinct, ascending):
    # Sequence ids in any order (ties go by position) or ascending (ties by id), many
    # ties or none.
    rng = np.random.default_rng(distinct)
    seqs = rng.permutation(60_000)[:40_000]
    if ascending:
        seqs.sort()
    home = rng.integers(0, 300, 60_000)
    lengths = rng.integers(0, distinct, 60_000)
    workload = lengths * 0.75
    assert len(seqs) >= bags.RANKED_SORT
    expected = seqs[np.lexsort((-workload[seqs], home[seqs]))]
    assert np.array_equal(bags.by_home_heaviest_first(seqs, home, workload, 300), expected)
    # The step's shared ranks (of all 60,000, both ways; read off the lengths, as int16
    # where they fit) order a subset the same way.
    step = bags.Step(lengths, workload, home, home, None, home, home)
    assert step.ranks()[0].dtype == (np.int16 if distinct <= 2**15 else np.int64)
    shared = bags.by_home_heaviest_first(seqs, home, workload, 300, step.ranks)
    assert np.array_equal(shared, expected)
    lightest = bags.by_home_heaviest_first(
        seqs, home, -workload, 300, partial(step.ranks, lightest=True)
    )
    assert np.array_equal(lightest, seqs[np.lexsort((workload[seqs], home[seqs]))])
    stable = seqs[np.argsort(-workload[seqs], kind="stable")]
    assert np.array_equal(bags.descending(workload, seqs, step), stable)


def test_by_small_key_is_the_stable_sort():
    key = np.random.default_rng(1).integers(0, 500, 20_000)
    assert np.array_equal(bags.by_small_key(key, 500), np.argsort(key, kind="stable"))
    big = key * 100  # beyond int16: the plain stable sort
    assert np.array_equal(bags.by_small_key(big, 50_000), np.argsort(big, kind="stable"))


@pytest.mark.parametrize("topology", ["g8n16", "g4n32", "g2n8+g4n4+g8n12"])
def test_remainder_patterns_give_the_formulas_chunks(topology):
    lengths = sample_lengths(scale_mix(parse_mix("joint"), 4), np.random.default_rng(3))
    table = plan_routing(lengths, topology, MODEL)
    with patch.object(chunks, "PATTERN_SIZES", 0):  # every size by the cyclic formula
        formula = plan_routing(lengths, topology, MODEL)
    for name in ("seq", "src_gpu", "dst_gpu", "offset", "length"):
        assert np.array_equal(getattr(table.chunks, name), getattr(formula.chunks, name))
    assert table.chunks.length.sum() == sum(map(sum, lengths))


def test_member_index_groups_as_a_stable_sort_by_slot():
    rng = np.random.default_rng(7)
    num_bags, n = 12, 300
    bag = rng.integers(0, num_bags, n)
    members = levelling._Members(bag.copy(), rng.integers(1, 999, n), rng.random(n), num_bags)
    for turn in range(200):  # random exchanges: moves (nothing back) and swaps
        a, b = (int(x) for x in rng.choice(num_bags, 2, replace=False))
        in_a = np.flatnonzero(members.bag[:n] == a)
        in_b = np.flatnonzero(members.bag[:n] == b)
        if in_a.size == 0:
            continue
        out_of_b = int(rng.choice(in_b)) if in_b.size and rng.random() < 0.5 else -1
        if turn:  # the first turn reads the index as built, nothing moved yet
            members.swap(a, b, int(rng.choice(in_a)), out_of_b)
        chosen = [int(x) for x in rng.choice(num_bags, 5, replace=False)]
        got, slot = members.grouped(chosen)
        slot_of = np.full(num_bags, len(chosen))
        slot_of[chosen] = np.arange(len(chosen))
        every = slot_of[members.bag]
        want = np.flatnonzero(every < len(chosen))
        want = want[np.argsort(every[want], kind="stable")]
        assert np.array_equal(got, want) and np.array_equal(slot, every[want])


def test_wide_round_pairs_group_as_the_member_index():
    # Both sides of a wide round's pairs, by one sort of every member's slot: what the
    # by-bag index gives each side, after exchanges made by the narrow rounds' swaps too.
    rng = np.random.default_rng(8)
    num_bags, n = 40, 900
    members = levelling._Members(rng.integers(0, num_bags, n), rng.integers(1, 999, n),
                                 rng.random(n), num_bags)  # fmt: skip
    for _ in range(30):
        in_a = np.flatnonzero(members.bag[:n] == 3)
        if in_a.size:
            members.swap(3, 5, int(in_a[0]), -1)
        bags_ = rng.permutation(num_bags)
        over, partners = bags_[:15], bags_[15:30]
        got = members.in_pairs(over, partners)
        want = (*members.grouped(over.tolist()), *members.grouped(partners.tolist()))
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_large_pool_is_poured_and_plans_within_the_bound():
    # seqheavy on 1,024 GPUs under g8: ~12,000 small sequences leave their full home bags.
    lengths = sample_lengths(scale_mix(parse_mix("seqheavy"), 32), np.random.default_rng(2))
    poured = []
    real = fixed._pour

    def spy(pool, step):
        poured.append(len(pool))
        return real(pool, step)

    with patch.object(fixed, "_pour", spy):
        plan = plan_routing(lengths, "g8n128", MODEL)
    assert poured and poured[0] > fixed.POUR_TAIL
    plan.validated()
    greedy = plan_routing(lengths, "g8n128", MODEL, solver="greedy").stats
    assert plan.stats.makespan_over_lb <= 1 + FALLBACK_TOLERANCE
    assert plan.stats.moved_fraction <= greedy.moved_fraction + 1e-9


@pytest.mark.parametrize("topology", ["g1n128", "g2n64"])
def test_wide_rounds_level_as_well_as_narrow_rounds(topology):
    # With the wide rounds forced on a small step, every pair exchanges at once; the plan
    # stays valid and ends as close to the bound as the narrow rounds alone get it.
    lengths = sample_lengths(scale_mix(parse_mix("lowres"), 4), np.random.default_rng(4))
    narrow = plan_routing(lengths, topology, MODEL).stats
    rounds = []
    real = levelling._paired_exchanges

    def spy(*args):
        found = real(*args)
        rounds.append(len(found[0]))
        return found

    forced = patch.object(levelling, "WIDE_BAGS", 0)
    with forced, patch.object(levelling, "_paired_exchanges", spy):
        plan = plan_routing(lengths, topology, MODEL)
    assert rounds and rounds[0] > levelling.SEARCH_PARTNERS  # many pairs exchanged at once
    plan.validated()
    wide = plan.stats
    assert wide.tokens_after.sum() == sum(map(sum, lengths))
    assert wide.makespan_over_lb <= max(narrow.makespan_over_lb, 1 + levelling.SEARCH_TOLERANCE)


def _auto_candidates(lengths, price_all: bool):
    """The auto plan of a step and (floor, modelled makespan) of every candidate it priced;
    ``price_all``: with the floors' skips turned off (the bags' and the routed floor)."""
    comm, seen = CommModel(), []
    per_token = {g: comm.ulysses_per_token(MODEL.token_dim, g, 1.0) for g in (1, 2, 4, 8)}
    real = auto.modelled_makespan

    def spy(step, model, comm_, speed):
        value = real(step, model, comm_, speed)
        seen.append((makespan_floor(step, per_token), value))
        return value

    floor = (lambda step, per_token: 0.0) if price_all else auto.makespan_floor
    routed = (lambda *args: 0.0) if price_all else auto.routed_floor
    with (patch.object(auto, "modelled_makespan", spy), patch.object(auto, "makespan_floor", floor),
          patch.object(auto, "routed_floor", routed)):  # fmt: skip
        plan = plan_routing(lengths, "auto", MODEL, comm=comm)
    return plan, seen


@pytest.mark.parametrize(
    ("mix", "factor"), [("seqheavy", 1), ("seqheavy", 32), ("joint", 1), ("mixres", 4)]
)
def test_auto_skips_only_candidates_its_floor_rules_out(mix, factor):
    lengths = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(11))
    plan, priced = _auto_candidates(lengths, price_all=False)
    every, all_priced = _auto_candidates(lengths, price_all=True)
    assert all(floor <= value for floor, value in all_priced)  # a true lower bound
    assert plan.topology == every.topology
    assert np.array_equal(plan.sequences.bag, every.sequences.bag)
    assert np.array_equal(plan.chunks.dst_gpu, every.chunks.dst_gpu)
    if (mix, factor) == ("seqheavy", 32):  # g4n256 and g8n128 lose to the mixed partition
        assert len(priced) < len(all_priced)


def _auto_ceilings(lengths, solver: str, ceiling_on: bool):
    """The auto plan of a step and (ceiling, exact modelled makespan) of every ceiling asked
    for (the plain or the routed one); ``ceiling_on=False``: no ceiling settles anything."""
    comm, seen = CommModel(), []
    real = auto.makespan_ceiling

    def spy(step, model, comm_, per_token, routed=False):
        value = real(step, model, comm_, per_token, routed)
        table = step.chunks or chunks.chunk_table(step)
        exact = pricing.modelled_makespan(replace(step, chunks=table), model, comm_, None)
        seen.append((value, exact))
        return value if ceiling_on else np.inf

    with patch.object(auto, "makespan_ceiling", spy):
        plan = plan_routing(lengths, "auto", MODEL, solver=solver, comm=comm)
    return plan, seen


@pytest.mark.parametrize(
    ("mix", "factor", "solver"),
    [("video", 4, "knapformer"), ("joint", 4, "knapformer"), ("lowres", 4, "greedy"),
     ("seqheavy", 1, "knapformer"), ("joint", 1, "greedy")],
)  # fmt: skip
def test_auto_ceiling_bounds_every_candidate_and_changes_no_plan(mix, factor, solver):
    lengths = sample_lengths(scale_mix(parse_mix(mix), factor), np.random.default_rng(17))
    plan, seen = _auto_ceilings(lengths, solver, ceiling_on=True)
    exact, _ = _auto_ceilings(lengths, solver, ceiling_on=False)
    # A ceiling as tight as the exact price may round below it: auto adds FLOOR_MARGIN.
    assert seen and all(
        exact_value <= ceiling * (1 + FLOOR_MARGIN) for ceiling, exact_value in seen
    )
    assert plan.topology == exact.topology
    assert np.array_equal(plan.sequences.bag, exact.sequences.bag)
    assert all(np.array_equal(getattr(plan.chunks, c), getattr(exact.chunks, c))
               for c in ("seq", "dst_gpu", "offset", "length"))  # fmt: skip


def _chunks_by_definition(lengths, bag, bag_gpus):
    """The even-spread chunk table one sequence at a time, as chunks.chunk_table documents it:
    L // g tokens per chunk, the L % g remainder one token each to the next GPUs of a cycle
    through the bag's sequences in id order; zero-length chunks dropped."""
    cycle = [0] * len(bag_gpus)
    rows = []
    for seq, (length, b) in enumerate(zip(lengths.tolist(), bag.tolist(), strict=True)):
        gpus = bag_gpus[b]
        g, rem, offset = len(gpus), length % len(gpus), 0
        for k, gpu in enumerate(gpus):
            size = length // g + ((k - cycle[b]) % g < rem)
            if size:
                rows.append((seq, gpu, offset, size))
            offset += size
        cycle[b] = (cycle[b] + rem) % g
    return [np.array(col) for col in zip(*rows, strict=True)]


@pytest.mark.parametrize("whole", [0.0, 0.9])
def test_chunk_table_of_one_gpu_bags_and_few_remainders_is_the_definition(whole):
    """One-GPU bags take the whole sequence; where most lengths are multiples of their bag
    size, the remainder cycles are run over the others only: the same table."""
    rng = np.random.default_rng(5)
    lengths = [rng.integers(1, 3000, 40) for _ in range(32)]
    for part in lengths:  # a share ``whole`` of lengths made multiples of 8
        part[rng.random(part.size) < whole] &= ~7
    plan = plan_routing(lengths, "g1n8+g2n4+g4n2+g8n1", MODEL)
    expected = _chunks_by_definition(plan.sequences.length, plan.sequences.bag, plan.bags)
    for name, column in zip(("seq", "dst_gpu", "offset", "length"), expected, strict=True):
        assert np.array_equal(getattr(plan.chunks, name), column), name


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e9])
def test_ranks_read_by_length_are_the_sorted_ranks(scale):
    # The workload model's workloads (many ties, lengths 0 included) are ranked off a
    # table by length; workloads that are not a non-decreasing function of the length
    # fall back to the sort: Step.ranks is the dense ranking of -workload either way.
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[0, 0], rng.integers(1, 5000, 20_000)])
    model = WorkloadModel(token_dim=3072, gamma=0.4, scale=scale)
    workload = model.workload(lengths)
    assert bags._ranks_by_length(lengths, workload) is not None
    shuffled = workload[rng.permutation(workload.size)]  # not a function of the length
    falling = model.workload(lengths.max() - lengths)  # a function, but decreasing
    for w in (workload, shuffled, falling):
        step = bags.Step(lengths, w, lengths, lengths, None, lengths, lengths)
        rank, distinct = step.ranks()
        expected, expected_distinct = bags._dense_ranks(-w, np.int64)
        assert distinct == expected_distinct and np.array_equal(rank, expected)
    assert bags._ranks_by_length(lengths, shuffled) is None
    assert bags._ranks_by_length(lengths, falling) is None


def _cycle_starts_by_definition(bag, rem, size):
    """Each sequence's remainder start: its bag's earlier remainders summed, mod the size."""
    cycle, starts = {}, []
    for b, r, g in zip(bag.tolist(), rem.tolist(), size.tolist(), strict=True):
        starts.append(cycle.get(b, 0))
        cycle[b] = (cycle.get(b, 0) + r) % g
    return np.array(starts, dtype=np.int64)


@pytest.mark.parametrize("sizes", [(8,), (1, 2, 4, 8), (3,), (2, 3, 8)])
def test_remainder_cycle_starts_are_the_definition(sizes):
    # Summed in uint16 when every size is a power of two: 100,000 remainders in few bags
    # run far past 2**16 and wrap around; other sizes are summed in int64.
    rng = np.random.default_rng(len(sizes))
    n, num_bags = 100_000, 5
    bag_size = rng.choice(sizes, num_bags)
    bag = rng.integers(0, num_bags, n)
    size = bag_size[bag]
    rem = rng.integers(0, 1 << 20, n) % size
    rem[rng.random(n) < 0.3] = 0
    expected = _cycle_starts_by_definition(bag, rem, size)
    distinct = np.unique(bag_size)
    got = chunks._remainder_starts(bag, rem, size, distinct)
    assert np.array_equal(got[rem > 0], expected[rem > 0])  # a start is read only there
    assert np.array_equal(chunks._cycle_starts(bag, rem, size, distinct), expected)
    if len(sizes) == 1:  # one size for every bag, given once
        assert np.array_equal(chunks._cycle_starts(bag, rem, sizes[0], sizes), expected)


def test_prefix_within_groups_keeps_each_groups_running_sum_within_its_room():
    rng = np.random.default_rng(9)
    group = np.sort(rng.integers(0, 40, 5_000))
    values = rng.random(group.size)
    room = rng.random(40)[group] * 80
    total, first, expected = np.cumsum(values), {}, []
    for i, g in enumerate(group.tolist()):  # the group's running sum, off the global one
        first.setdefault(g, i)
        before = total[first[g] - 1] if first[g] else 0.0
        expected.append(total[i] - before <= room[i] * (1 + bags.EPS))
    got = bags.prefix_within_groups(values, group, room)
    assert got.any() and not got.all() and np.array_equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_within_bags_is_the_prefix_within_groups(seed):
    rng = np.random.default_rng(seed)
    num_bags = 40
    bag = np.sort(rng.choice(num_bags - 5, 3000))  # ascending, some bags without rows
    values = rng.integers(1, 50, bag.size) * 0.1
    room = rng.integers(0, 400, num_bags) * 0.1  # sums land on the room now and then
    want = bags.prefix_within_groups(values, bag, room[bag])
    assert np.array_equal(bags.prefix_within_bags(values, bag, room), want)
    assert 0 < want.sum() < want.size  # some stay, some leave
    tokens = rng.integers(0, 3000, num_bags)  # integer room (a token cap)
    want = bags.prefix_within_groups(values * 10, bag, tokens[bag])
    assert np.array_equal(bags.prefix_within_bags(values * 10, bag, tokens), want)


def _g8_step(mix: str, seed: int):
    """A step of ``mix`` on 128 GPUs in bags of 8, flat: (lengths per GPU, every
    sequence's tokens, its source position, its workload, the bag shape)."""
    lengths = sample_lengths(scale_mix(parse_mix(mix), 4), np.random.default_rng(seed))
    flat = np.concatenate(lengths)
    src = np.repeat(np.arange(len(lengths)), [len(x) for x in lengths])
    shape = bags.bag_shape((8,) * (len(lengths) // 8))
    return lengths, flat, src, MODEL.workload(flat), shape


@pytest.mark.parametrize("capped", [False, True])
def test_staying_home_in_bulk_is_the_plain_formulation(capped):
    # The vectorised stay-at-home pass against its plain formulation: the stayers of each
    # home bag by a per-row room, gathered, then summed into the bags' loads.
    lengths, flat, src, workload, shape = _g8_step("lowres", 9)
    cap = int(0.9 * flat.sum() / len(lengths)) if capped else None  # 90% of the mean
    steps = []
    for _ in range(2):
        layout = bags.BagLayout(shape, workload.sum() / len(lengths), cap, None, even=True)
        steps.append(bags.Step.start(shape, flat, workload, src, layout))
    fixed._stay_home_in_bulk(steps[0])
    plain, layout = steps[1], steps[1].layout
    order = bags.by_home_heaviest_first(np.arange(len(flat)), src // 8, workload, len(shape.size))
    hb, cost = plain.home_bag[order], workload[order]
    stays = bags.prefix_within_groups(cost, hb, (layout.capacity - layout.load)[hb])
    assert 0 < stays.sum() < len(flat)  # some stay, some are left to the pool
    if capped:
        token_room = cap * layout.size[hb] - layout.bag_tokens[hb]
        fit = bags.prefix_within_groups(flat[order].astype(np.float64), hb, token_room)
        assert (stays & fit).sum() < stays.sum()  # the cap keeps some more from staying
        stays &= fit
    plain.bag[order[stays]] = hb[stays]
    layout.add_many(hb[stays], cost[stays], flat[order[stays]])
    assert np.array_equal(steps[0].bag, plain.bag)
    assert np.array_equal(steps[0].layout.load, layout.load)
    if capped:
        assert np.array_equal(steps[0].layout.bag_tokens, layout.bag_tokens)


def _one_class_step(wide: bool):
    """A one-bag-size step and the sequences left to place: mixres on 128 GPUs in bags of
    8, bags partly filled at home (more sequences than bags: one by one), or lowres on
    1,024 one-GPU bags as the solver leaves it to this placement, its pool poured down to
    fewer sequences than bags (as at 4,096 GPUs: in batches)."""
    if not wide:
        lengths, flat, src, workload, shape = _g8_step("mixres", 5)
        capacity = 0.9 * workload.sum() / len(lengths)
        layout = bags.BagLayout(shape, capacity, None, None, even=True)
        step = bags.Step.start(shape, flat, workload, src, layout)
        first, order = np.arange(0, len(flat), 3), bags.descending(workload, np.arange(len(flat)))
        layout.add_many(src[first] // 8, workload[first], None)  # a third placed at home
        return step, order[np.isin(order, first, invert=True)]
    lengths = sample_lengths(scale_mix(parse_mix("lowres"), 32), np.random.default_rng(5))
    flat, shape = np.concatenate(lengths), bags.bag_shape((1,) * len(lengths))
    src = np.repeat(np.arange(len(lengths)), [len(x) for x in lengths])
    workload = MODEL.workload(flat)
    layout = bags.BagLayout(shape, workload.sum() / len(lengths), None, None, even=True)
    step = bags.Step.start(shape, flat, workload, src, layout)
    fixed._stay_home_in_bulk(step)
    with patch.object(fixed, "POUR_TAIL", 1000):
        return step, fixed._pour(bags.descending(workload, np.flatnonzero(step.bag < 0)), step)


@pytest.mark.parametrize(("wide", "short"), [(False, 16), (True, 16), (True, 120)])
@pytest.mark.parametrize("prefer_home", [False, True])
def test_one_class_placement_is_the_least_occupied_rule(prefer_home, wide, short):
    # The one-bag-size placement against the rule written out: a sequence stays home
    # while its home bag has room (when preferred), else goes to the least occupied bag
    # (ties: the lowest id), bags partly filled beforehand; one by one, in batches, or
    # (``short`` batches raised) in batches and runs one by one in turn.
    step, order = _one_class_step(wide)
    layout, workload = step.layout, step.workload
    load, batches, real = layout.load.tolist(), [], fixed._batch
    assert (len(order) <= len(load)) == wide

    def spy(*args):
        found = real(*args)
        batches.append(len(found[0]))
        return found

    with patch.object(fixed, "_batch", spy), patch.object(fixed, "SHORT_BATCH", short):
        fixed._place_in_order(order, step, prefer_home)
    assert (max(batches, default=0) >= short) == wide  # batches placed some
    if short > 16:  # and some were left to the runs one by one
        assert min(batches) < short and len(order) > fixed.BY_HEAP
    safe, kept_home = layout.capacity.tolist(), 0
    for seq in order.tolist():
        h, w = int(step.home_bag[seq]), float(workload[seq])
        want = min(range(len(load)), key=lambda b: (load[b] / safe[b], b))
        if prefer_home and load[h] + w <= safe[h] * (1 + fixed.EPS):
            kept_home += want != h
            want = h
        assert step.bag[seq] == want
        load[want] += w
    assert np.array_equal(layout.load, load) and not step.rem.any()
    assert (kept_home > 0) == prefer_home  # staying home mattered


@pytest.mark.parametrize("per_bag", [3, 32, 48])
def test_stay_home_order_of_ascending_homes_is_the_lexsort(per_bag):
    # Homes ascending with the ids (a fixed layout's step), few sequences per bag, many
    # ties of workload: the (home, rank) run sort gives the lexsort's order, on every
    # sequence or a subset (the ones still unplaced).
    rng = np.random.default_rng(per_bag)
    num_bags = 6_000 // per_bag
    home = np.sort(rng.integers(0, num_bags, num_bags * per_bag))
    lengths = rng.integers(1, 400, home.size)
    workload = MODEL.workload(lengths)
    step = bags.Step(lengths, workload, home, home, None, home, home)
    for light in (np.arange(home.size), np.flatnonzero(rng.random(home.size) < 0.8)):
        assert bags.RANKED_SORT <= light.size <= fixed.HOME_RUNS * num_bags
        expected = light[np.lexsort((-workload[light], home[light]))]
        assert np.array_equal(fixed._by_home_heaviest_first(light, step, num_bags), expected)
    shuffled = bags.Step(lengths, workload, home, rng.permutation(home), None, home, home)
    light = np.arange(home.size)  # homes not ascending: the general path, the same order
    expected = light[np.lexsort((-workload, shuffled.home_bag))]
    assert np.array_equal(fixed._by_home_heaviest_first(light, shuffled, num_bags), expected)


def _plain_score_rows(out, slot, w, key, back, seg, span, wa, wb, pa, pb):
    """`levelling._score_rows` as one block, without buffers: its plain formulation."""
    ideal = (pa - pb) / (1.0 / wa + 1.0 / wb)
    target = np.clip(w[out] - ideal[slot], 0.0, span / 2) + np.arange(len(pa))[slot] * span
    hit = np.searchsorted(key, target)
    member = back[np.stack([np.maximum(hit - 1, seg[slot]), np.minimum(hit, seg[slot + 1] - 1)])]
    delta = w[out] - w[member]
    new_max = np.maximum(pa[slot] - delta / wa[slot], pb[slot] + delta / wb[slot])
    new_max[~((delta > 0) & (new_max < pa[slot] * (1 - 1e-9)))] = np.inf
    heavier = new_max[1] < new_max[0]
    return np.where(heavier, new_max[1], new_max[0]), np.where(heavier, member[1], member[0])


@pytest.mark.parametrize("weights", ["one", "eight", "speeds"])
def test_wide_round_scores_blocks_as_the_plain_formulation(weights):
    # Blocks of rows scored into reused buffers, a weight of 1 dividing nothing, a scalar
    # weight or one per bag: every row's score and member as the plain formulation, bit for bit.
    rng = np.random.default_rng(12)
    k, n = 60, 3000
    w = np.append(rng.integers(1, 400, n) / 97.0, np.zeros(2 * k))  # members, then phantoms
    slot = np.sort(rng.integers(0, k, n // 2))
    out = rng.permutation(n)[: n // 2]
    out = out[np.lexsort((out, slot))]  # grouped by pair, ids ascending
    back_slot = np.append(np.sort(rng.integers(0, k, n // 3)), np.arange(k))  # + a phantom each
    back = np.append(rng.permutation(n)[: n // 3], n + np.arange(k))
    span = 2.0 * float(w[back].max()) + 1.0
    key = back_slot * span + w[back]
    by_key = np.argsort(key, kind="stable")
    key, back = key[by_key], back[by_key]
    seg = np.searchsorted(key, np.arange(k + 1) * span)
    weight = {"one": np.ones(2 * k), "eight": np.full(2 * k, 8.0),
              "speeds": rng.uniform(0.5, 1.0, 2 * k)}[weights]  # fmt: skip
    pb = rng.uniform(0.8, 1.0, k)
    pa = pb + rng.uniform(0.0, 0.1, k)  # some exchanges lower the pair, some overshoot
    args = (out, slot, w, key, back, seg, span, weight[:k], weight[k:], pa, pb)
    with patch.object(levelling, "WIDE_BLOCK", 256):  # several blocks, a short last one
        score, came = levelling._score_rows(*args)
    want_score, want_came = _plain_score_rows(*args)
    assert score.tobytes() == want_score.tobytes() and np.array_equal(came, want_came)
    assert np.isfinite(score).any() and np.isinf(score).any()
