"""The GPU-exact refinement of a small ``topology="auto"`` step (`refine`), within a fixed
budget of scored cells a round (`_within_budget`)."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import (
    Step,
    chunk_table,
    least,
)
from knapformer.planning.communication import CommModel
from knapformer.planning.exchanges import spread_sample
from knapformer.planning.pricing import compute_per_gpu, modelled_makespan, route_per_token
from knapformer.planning.tuning import REFINE_CELLS, REFINE_PARTNERS, REFINE_ROUNDS, TIE
from knapformer.planning.workload import WorkloadModel


def _within_budget(mine, theirs, num_bags, num_gpus, workload):
    """``mine`` and ``theirs`` (sequence ids), or spread samples of them (`spread_sample`)
    when scoring every move of ``mine`` to each of ``num_bags`` bags and every swap with
    ``theirs`` on each of ``num_gpus`` GPUs would exceed ``REFINE_CELLS``: half the
    candidates go to moves, the rest to swaps."""
    cap = max(REFINE_CELLS // num_gpus, 2 * num_bags)
    if len(mine) * (num_bags + len(theirs)) <= cap:
        return mine, theirs
    most = min(len(mine), max(4, cap // (2 * num_bags)))
    mine = spread_sample(mine, workload, most)
    swaps = max(4, (cap - len(mine) * num_bags) // len(mine))
    return mine, spread_sample(theirs, workload, swaps)


def refine(step: Step, model: WorkloadModel, comm: CommModel, speed, max_tokens) -> Step:
    """GPU-exact refinement of a small step (its chunk table made): the bag-level prices
    spread a sequence's sending over its home bag, but one GPU sends it, and a long video
    sent to another node puts that GPU above its bag. Each round scores, on every GPU at
    once, moving one sequence of the slowest GPU's bag (or one it sends) to any bag, or
    swapping it with one of the least loaded bags' sequences, and applies the one that
    lowers the slowest GPU most (or, at an equal top, the load above the mean). Chunks are
    scored as L/g tokens each; the result is kept only where its exact modelled makespan
    (`modelled_makespan`) is lower. Returns the better step."""
    layout, lengths, workload, home = step.layout, step.lengths, step.workload, step.home_bag
    shape, size = layout.shape, layout.size
    num_gpus = len(shape.bag_of_pos)
    before = modelled_makespan(step, model, comm, speed)
    compute, tokens = compute_per_gpu(step, model, speed)
    kappa = np.array([comm.ulysses_per_token(model.token_dim, int(g), model.scale) for g in size])
    base = compute + kappa[shape.bag_of_pos] * tokens
    seq, pos, _, length = step.chunks
    src = step.src_pos
    node = np.arange(num_gpus) // int(comm.node_size)
    away = src[seq] != pos
    across = node[src[seq]] != node[pos]
    ends = [np.concatenate([src[seq][m], pos[m]]) for m in (away & ~across, away & across)]
    weights = [np.tile(length[m].astype(np.float64), 2) for m in (away & ~across, away & across)]
    intra, inter = (
        np.bincount(e, weights=w, minlength=num_gpus) for e, w in zip(ends, weights, strict=True)
    )
    ci, ce = route_per_token(comm, model)
    inv_speed = np.ones(num_gpus) if speed is None else 1.0 / speed
    bag = step.bag.copy()
    bag_tokens = np.bincount(bag, weights=lengths, minlength=len(size))
    fl = lengths.astype(np.float64)
    gpu = np.arange(num_gpus)
    smallest = layout.class_size[0]

    def deltas(seqs, to):
        """(base, intra, inter) changes (k, num_gpus) of moving ``seqs`` to bags ``to``."""
        frm = bag[seqs]
        ell, w, sig = fl[seqs][:, None], workload[seqs][:, None], src[seqs]
        in_a = shape.bag_of_pos[None, :] == frm[:, None]
        in_b = shape.bag_of_pos[None, :] == to[:, None]
        ga, gb = size[frm][:, None], size[to][:, None]
        d_base = (in_b * (w / gb * inv_speed + kappa[to][:, None] * ell / gb)
                  - in_a * (w / ga * inv_speed + kappa[frm][:, None] * ell / ga))  # fmt: skip
        recv = (in_b * (ell / gb) - in_a * (ell / ga)) * (gpu[None, :] != sig[:, None])
        same = node[None, :] == node[sig][:, None]
        d_in, d_out = recv * same, recv * ~same
        rows = np.arange(len(seqs))
        d_in[rows, sig] += d_in.sum(1)
        d_out[rows, sig] += d_out.sum(1)
        return d_base, d_in, d_out

    def allowed(seqs, to):
        ok = (lengths[seqs] >= size[to]) | (size[to] == smallest)
        return ok & (to != bag[seqs]) & (lengths[seqs] > 0)

    for _ in range(REFINE_ROUNDS):
        load = base + np.maximum(intra * ci, inter * ce)
        top = float(load.max())
        mean = float(load.mean())
        spill = float(np.square(np.maximum(load - mean, 0.0)).sum())
        p = int(load.argmax())
        a = int(shape.bag_of_pos[p])
        mine = np.flatnonzero(((bag == a) | ((src == p) & (bag != a))) & (lengths > 0))
        per_bag = np.maximum.reduceat(load, layout.start)
        light = least(per_bag, min(REFINE_PARTNERS + 1, len(size)))
        light = light[light != a][:REFINE_PARTNERS]
        theirs = np.flatnonzero(np.isin(bag, light) & (lengths > 0))
        mine, theirs = _within_budget(mine, theirs, len(size), num_gpus, workload)
        # Moves to every bag, then swaps with the light bags' sequences.
        s1 = np.repeat(mine, len(size))
        t1 = np.tile(np.arange(len(size)), len(mine))
        keep = allowed(s1, t1)
        s1, t1 = s1[keep], t1[keep]
        s2 = np.repeat(mine, len(theirs))
        o2 = np.tile(theirs, len(mine))
        keep = (bag[s2] != bag[o2]) & allowed(s2, bag[o2]) & allowed(o2, bag[s2])
        s2, o2 = s2[keep], o2[keep]
        db, di, de = deltas(np.concatenate([s1, s2]), np.concatenate([t1, bag[o2]]))
        if len(o2):
            xb, xi, xe = deltas(o2, bag[s2])
            db[len(s1) :] += xb
            di[len(s1) :] += xi
            de[len(s1) :] += xe
        if not len(db):
            break
        new = base + db + np.maximum((intra + di) * ci, (inter + de) * ce)
        if max_tokens is not None:
            moved_to = np.concatenate([t1, bag[o2]])
            moved = np.concatenate([s1, s2])
            gain = fl[moved] - np.concatenate([np.zeros(len(s1)), fl[o2]])
            ok = np.ceil((bag_tokens[moved_to] + gain) / size[moved_to]) <= max_tokens
            ok &= np.ceil((bag_tokens[bag[moved]] - gain) / size[bag[moved]]) <= max_tokens
            new[~ok] = np.inf
        worst = new.max(1)
        score = np.square(np.maximum(new - mean, 0.0)).sum(1)
        better = worst < top * (1 - 1e-9)
        if not better.any():
            better = (worst <= top * (1 + 1e-12)) & (score < spill * (1 - 1e-9))
            if not better.any():
                break
            k = int(np.flatnonzero(better)[np.argmin(score[better])])
        else:
            k = int(np.argmin(np.where(better, worst, np.inf)))
        base, intra, inter = base + db[k], intra + di[k], inter + de[k]
        if k < len(s1):
            moves = [(int(s1[k]), int(t1[k]))]
        else:
            j = k - len(s1)
            moves = [(int(s2[j]), int(bag[o2[j]])), (int(o2[j]), int(bag[s2[j]]))]
        for x, to in moves:
            bag_tokens[bag[x]] -= fl[x]
            bag_tokens[to] += fl[x]
        for x, to in moves:
            bag[x] = to
    if np.array_equal(bag, step.bag):
        return step
    refined = Step(lengths, workload, src, home, layout, bag, step.rem)
    refined.chunks = chunk_table(refined)
    if modelled_makespan(refined, model, comm, speed) < before * (1 - TIE):
        layout.load[:] = np.bincount(bag, weights=workload, minlength=len(size))
        if max_tokens is not None:
            layout.bag_tokens[:] = bag_tokens.astype(np.int64)
        return refined
    return step
