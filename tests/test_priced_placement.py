"""Auto's one-by-one priced placement (`mixed._PricedBags.place`) under a token cap: each
sequence goes where a scan of every bag with room sends it."""

from __future__ import annotations

import copy
from math import inf

import numpy as np

from knapformer.planning import mixed
from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.tuning import EPS
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)


def _scan_with_room(layout, prices, load, row, limit):
    """(bag, cost, sent, whether the cap passed a least loaded bag over) for ``row`` by
    scanning every bag: home while it has room and stays within ``limit``, else the least
    loaded bag with room of each allowed size, overall and in the source's node, where the
    larger of its and the home bag's per-GPU time ends lowest (the first on a tie)."""
    _, w, length, h, node, at_home = row
    weight, room = layout.weight, layout.token_room(length)
    per = np.asarray(load) / weight
    b, lowest, cost, sent, capped = -1, inf, 0.0, 0.0, False
    if at_home == at_home and room[h]:
        b, lowest, cost = h, (load[h] + at_home) / weight[h], at_home
    if lowest <= limit:
        return b, cost, sent, capped
    cls, bag_node = layout.shape.class_of_bag_array, prices.bag_node
    for c, g in enumerate(layout.class_size.tolist()):
        if c and g > length:
            break
        for group in (cls == c, (cls == c) & (bag_node == node)):
            if not group.any():
                continue
            capped |= not room[np.flatnonzero(group)[np.argmin(per[group])]]
            group &= room
            if not group.any():
                continue
            top = int(np.flatnonzero(group)[np.argmin(per[group])])  # lowest bag on a tie
            if top == h:
                continue
            route = (prices.intra if bag_node[top] == node else prices.inter) * length
            kap = float(prices.kappa[top])
            value = (load[top] + w + kap * length + route) / float(weight[top])
            if h >= 0:
                value = max(value, (load[h] + route) / float(weight[h]))
            if value < lowest:
                b, lowest, cost, sent = top, value, w + kap * length + route, route
    return b, cost, sent, capped


def test_capped_placement_picks_what_a_scan_of_the_bags_with_room_picks(monkeypatch):
    """Every one-by-one placement of a capped auto plan (each mixed partition's heavy
    sequences and pool), replayed from where it started: the heaps' least bags with room
    are the scan's, also where the cap passes a least loaded bag over."""
    calls = []
    place = mixed._place_priced
    monkeypatch.setattr(mixed, "_place_priced", lambda *a: calls.append(
        (a[0].copy(), copy.deepcopy(a[1]), a[2].copy(), a[3], a[4])) or place(*a))  # fmt: skip
    lengths = sample_lengths(scale_mix(parse_mix("joint"), 4), np.random.default_rng(11))
    plan_routing(lengths, "auto", MODEL, comm=CommModel(), max_tokens_per_gpu=12_000)
    passed_over, away = 0, 0
    for order, step, load, prices, level in calls:
        assert step.layout.max_tokens == 12_000
        limit, layout = level * (1 + EPS), copy.deepcopy(step.layout)
        rows = list(mixed._rows(order, step, prices))
        chosen = mixed._PricedBags(step.layout, prices, load).place(rows, step.layout, limit)
        expected, scanned = [], load.tolist()
        for row in rows:
            b, cost, sent, capped = _scan_with_room(layout, prices, scanned, row, limit)
            expected.append(b)
            scanned[b] += cost
            if sent and row[3] >= 0:
                scanned[row[3]] += sent
            layout.add(b, 0.0, row[2], 0)
            passed_over += capped
        assert chosen == expected
        away += sum(b != row[3] for b, row in zip(chosen, rows, strict=True))
    assert len(calls) >= 2 and passed_over > 100 and away > 100
