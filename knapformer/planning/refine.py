"""The GPU-exact refinement of a small ``topology="auto"`` step (`refine`), within a fixed
budget of scored cells a round (`_within_budget`)."""

from __future__ import annotations

import numpy as np

from knapformer.planning.bags import (
    Step,
    least,
)
from knapformer.planning.chunks import chunk_table
from knapformer.planning.communication import CommModel
from knapformer.planning.exchanges import spread_sample
from knapformer.planning.moves import move
from knapformer.planning.pricing import compute_per_gpu, modelled_makespan, route_per_token
from knapformer.planning.token_cap import within_token_cap
from knapformer.planning.tuning import (
    EPS,
    REFINE_CELLS,
    REFINE_PARTNERS,
    REFINE_ROUNDS,
    REFINE_SAMPLE,
    TIE,
)
from knapformer.planning.workload import WorkloadModel


def _within_budget(mine, theirs, num_bags, num_gpus, workload):
    """``mine`` and ``theirs`` (sequence ids), or spread samples of them (`spread_sample`)
    when scoring every move of ``mine`` to each of ``num_bags`` bags and every swap with
    ``theirs`` on each of ``num_gpus`` GPUs would exceed ``REFINE_CELLS``: half the
    candidates go to moves, the rest to swaps."""
    cap = max(REFINE_CELLS // num_gpus, 2 * num_bags)
    if len(mine) * (num_bags + len(theirs)) <= cap:
        return mine, theirs
    most = min(len(mine), max(REFINE_SAMPLE, cap // (2 * num_bags)))
    mine = spread_sample(mine, workload, most)
    swaps = max(REFINE_SAMPLE, (cap - len(mine) * num_bags) // len(mine))
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
    before = modelled_makespan(step, model, comm, speed)
    state = _GpuLoads(step, model, comm, speed)
    for _ in range(REFINE_ROUNDS):
        load = state.load()
        moves, changes = state.candidates(load)
        k = _best_candidate(state.with_changes(*changes), load, moves, state, max_tokens)
        if k < 0:
            break
        state.apply(moves, k)
    if np.array_equal(state.bag, step.bag):
        return step
    layout = step.layout
    refined = Step(step.lengths, step.workload, step.src_pos, step.home_bag, layout, state.bag,
                   step.rem)  # fmt: skip
    refined.chunks = chunk_table(refined)
    if modelled_makespan(refined, model, comm, speed) < before * (1 - TIE):
        layout.load[:] = np.bincount(state.bag, weights=step.workload, minlength=len(layout.size))
        if max_tokens is not None:
            layout.bag_tokens[:] = state.bag_tokens.astype(np.int64)
        return refined
    return step


class _GpuLoads:
    """Each GPU's modelled load during `refine`, in three parts: compute + Ulysses
    (``base``), and the tokens it sends or receives over the node's link (``intra``) and the
    network (``inter``); a GPU's load is ``base + max(intra * ci, inter * ce)``. Chunks
    count as L/g tokens each."""

    def __init__(self, step: Step, model: WorkloadModel, comm: CommModel, speed):
        layout = step.layout
        self.step, self.shape, self.size = step, layout.shape, layout.size
        self.num_gpus = num_gpus = len(self.shape.bag_of_pos)
        compute, tokens = compute_per_gpu(step, model, speed)
        self.kappa = np.array(
            [comm.ulysses_per_token(model.token_dim, int(g), model.scale) for g in self.size]
        )
        self.base = compute + self.kappa[self.shape.bag_of_pos] * tokens
        seq, pos, _, length = step.chunks
        src = step.src_pos
        self.node = np.arange(num_gpus) // int(comm.node_size)
        away = src[seq] != pos
        across = self.node[src[seq]] != self.node[pos]
        links = (away & ~across, away & across)
        ends = [np.concatenate([src[seq][m], pos[m]]) for m in links]
        weights = [np.tile(length[m].astype(np.float64), 2) for m in links]
        self.intra, self.inter = (
            np.bincount(e, weights=w, minlength=num_gpus)
            for e, w in zip(ends, weights, strict=True)
        )
        self.ci, self.ce = route_per_token(comm, model)
        self.inv_speed = np.ones(num_gpus) if speed is None else 1.0 / speed
        self.bag = step.bag.copy()
        self.bag_tokens = np.bincount(self.bag, weights=step.lengths, minlength=len(self.size))
        self.fl = step.lengths.astype(np.float64)

    def load(self) -> np.ndarray:
        return self.base + np.maximum(self.intra * self.ci, self.inter * self.ce)

    def with_changes(self, db, di, de) -> np.ndarray:
        """(k, num_gpus) loads after each of k candidate changes."""
        return self.base + db + np.maximum((self.intra + di) * self.ci, (self.inter + de) * self.ce)

    def deltas(self, seqs, to):
        """(base, intra, inter) changes (k, num_gpus) of moving ``seqs`` to bags ``to``."""
        size, kappa, bag_of_pos = self.size, self.kappa, self.shape.bag_of_pos
        frm = self.bag[seqs]
        ell, w = self.fl[seqs][:, None], self.step.workload[seqs][:, None]
        sig = self.step.src_pos[seqs]
        in_a = bag_of_pos[None, :] == frm[:, None]
        in_b = bag_of_pos[None, :] == to[:, None]
        ga, gb = size[frm][:, None], size[to][:, None]
        d_base = (in_b * (w / gb * self.inv_speed + kappa[to][:, None] * ell / gb)
                  - in_a * (w / ga * self.inv_speed + kappa[frm][:, None] * ell / ga))  # fmt: skip
        recv = (in_b * (ell / gb) - in_a * (ell / ga)) * (np.arange(self.num_gpus) != sig[:, None])
        same = self.node[None, :] == self.node[sig][:, None]
        d_in, d_out = recv * same, recv * ~same
        rows = np.arange(len(seqs))
        d_in[rows, sig] += d_in.sum(1)
        d_out[rows, sig] += d_out.sum(1)
        return d_base, d_in, d_out

    def allowed(self, seqs, to):
        lengths, size = self.step.lengths, self.size
        ok = (lengths[seqs] >= size[to]) | (size[to] == self.step.layout.class_size[0])
        return ok & (to != self.bag[seqs]) & (lengths[seqs] > 0)

    def candidates(self, load):
        """The round's candidates: moves (s1 to bags t1) of a sequence of the slowest GPU's
        bag (or one it sends) to any bag, then swaps (s2 with o2) with one of the least
        loaded bags' sequences; with their (base, intra, inter) changes."""
        step, bag, size = self.step, self.bag, self.size
        lengths, src = step.lengths, step.src_pos
        p = int(load.argmax())
        a = int(self.shape.bag_of_pos[p])
        mine = np.flatnonzero(((bag == a) | ((src == p) & (bag != a))) & (lengths > 0))
        per_bag = np.maximum.reduceat(load, step.layout.start)
        light = least(per_bag, min(REFINE_PARTNERS + 1, len(size)))
        light = light[light != a][:REFINE_PARTNERS]
        theirs = np.flatnonzero(np.isin(bag, light) & (lengths > 0))
        mine, theirs = _within_budget(mine, theirs, len(size), self.num_gpus, step.workload)
        # A sequence's change depends only on it and where it goes: every move of ``mine``
        # is scored once (a swap's half is one of them), and ``theirs`` once per bag of
        # ``mine``; each candidate's rows are gathered from those (the same bits).
        every = np.arange(len(size))
        s1, t1 = np.repeat(mine, len(size)), np.tile(every, len(mine))
        moved = self.deltas(s1, t1)
        keep = self.allowed(s1, t1)
        row1 = np.flatnonzero(keep)
        s1, t1 = s1[keep], t1[keep]
        homes, home_of = np.unique(bag[mine], return_inverse=True)
        i2 = np.repeat(np.arange(len(mine)), len(theirs))
        j2 = np.tile(np.arange(len(theirs)), len(mine))
        s2, o2 = mine[i2], theirs[j2]
        keep = (bag[s2] != bag[o2]) & self.allowed(s2, bag[o2]) & self.allowed(o2, bag[s2])
        s2, o2, i2, j2 = s2[keep], o2[keep], i2[keep], j2[keep]
        back = self.deltas(np.repeat(theirs, len(homes)), np.tile(homes, len(theirs)))
        rows = np.concatenate([row1, i2 * len(size) + bag[o2]])
        changes = tuple(x[rows] for x in moved)
        if len(o2):
            others = j2 * len(homes) + home_of[i2]
            for change, x in zip(changes, back, strict=True):
                change[len(s1) :] += x[others]
        return (s1, t1, s2, o2), changes

    def apply(self, moves, k: int) -> None:
        """Make candidate ``k`` of `candidates`."""
        s1, t1, s2, o2 = moves
        bag = self.bag
        if k < len(s1):
            seqs, dst = [int(s1[k])], [int(t1[k])]
        else:
            j = k - len(s1)
            seqs, dst = [int(s2[j]), int(o2[j])], [int(bag[o2[j]]), int(bag[s2[j]])]
        move(bag, self, seqs, dst)

    def charge(self, seqs, src, dst) -> float:
        """`Ledger.charge`: the GPUs' loads changed as `candidates` scored the move (the
        same bits), and the bags' tokens."""
        db, di, de = self.deltas(np.array(seqs), np.array(dst))
        if len(seqs) == 2:  # a swap: both sequences' changes, summed as scored
            db, di, de = db[0] + db[1], di[0] + di[1], de[0] + de[1]
        else:
            db, di, de = db[0], di[0], de[0]
        self._undo = self.base, self.intra, self.inter, self.bag_tokens.copy()
        self.base, self.intra, self.inter = self.base + db, self.intra + di, self.inter + de
        for x, s, to in zip(seqs, src, dst, strict=True):
            self.bag_tokens[s] -= self.fl[x]
            self.bag_tokens[to] += self.fl[x]
        return 0.0  # (no bag time to beat: the round's scoring chose the move)

    def undo(self, seqs, src, dst) -> None:
        self.base, self.intra, self.inter, self.bag_tokens = self._undo


def _best_candidate(new, load, moves, state: _GpuLoads, max_tokens) -> int:
    """The candidate (row of ``new``, the loads after each) that lowers the slowest GPU
    most, or at an equal top the squared load above the mean; -1 when none helps or
    none is left. Under a token cap, candidates that break it are out."""
    if not len(new):
        return -1
    top, mean = float(load.max()), float(load.mean())
    spill = float(np.square(np.maximum(load - mean, 0.0)).sum())
    if max_tokens is not None:
        s1, t1, s2, o2 = moves
        bag, size, fl, bag_tokens = state.bag, state.size, state.fl, state.bag_tokens
        moved_to = np.concatenate([t1, bag[o2]])
        moved = np.concatenate([s1, s2])
        gain = fl[moved] - np.concatenate([np.zeros(len(s1)), fl[o2]])
        new[~within_token_cap(bag_tokens, size, bag[moved], moved_to, gain, max_tokens)] = np.inf
    worst = new.max(1)
    score = np.square(np.maximum(new - mean, 0.0)).sum(1)
    better = worst < top * (1 - TIE)
    if better.any():
        return int(np.argmin(np.where(better, worst, np.inf)))
    better = (worst <= top * (1 + EPS)) & (score < spill * (1 - TIE))
    if not better.any():
        return -1
    return int(np.flatnonzero(better)[np.argmin(score[better])])
