"""The one move primitive of every local search (`move`): sequences leave their bags for
others, what the pass tracks is charged to a *ledger*, and the move is undone, here and
nowhere else, when it leaves a bag it touched at or above the time the pass must beat.

A ledger keeps what its pass scores moves by, and charges a move (each sequence
uncharged from the bag it leaves and charged to the one it enters):

- `Loads` (here, levelling.py): each bag's compute load, and its tokens under a token cap;
- `Tokens` (here, coarse `_level`, which prices again the sequences each round moved): bag
  tokens;
- `PricedLedger` (exchanges.py, `exchange_across`): each sequence's price in its bag, each
  bag's priced load, tokens and per-GPU time, what each GPU and home bag pays to send;
- `_GpuLoads` (refine.py, `refine`): each GPU's compute, node-link and network load, and
  each bag's tokens;
- None (`even_classes`, size_classes.py, which prices again the sequences each round
  moved): nothing.

Moves come as lists (a few, charged one by one in order) or as arrays (a batch of
disjoint moves, charged per bag at once). The two sum floats in different orders, and
each pass keeps the order it has always had: plans are byte-identical across versions.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from knapformer.planning.bags import Step
from knapformer.planning.tuning import TIE


class Ledger(Protocol):
    def charge(self, seqs, src, dst) -> float:
        """Charge sequences ``seqs`` leaving bags ``src`` for bags ``dst``; returns the
        largest per-GPU time of a bag the move touched (inf where it breaks the token
        cap; 0 where the ledger keeps no times)."""

    def undo(self, seqs, src, dst) -> None:
        """Take back the last `charge` of these moves."""


def move(bag: np.ndarray, ledger: Ledger | None, seqs, dst, before: float = math.inf) -> bool:
    """Move sequences ``seqs`` into bags ``dst`` (``bag``: each sequence's bag), charged to
    ``ledger``; undone (False) when a bag it touched ends at or above ``before`` (less a
    tie margin) or over the token cap. ``before`` left out: only the cap is checked."""
    if ledger is not None:
        src = [int(bag[s]) for s in seqs] if isinstance(seqs, list) else bag[seqs]
        if ledger.charge(seqs, src, dst) >= before * (1 - TIE):
            ledger.undo(seqs, src, dst)
            return False
    bag[seqs] = dst
    return True


class Loads:
    """The fixed solver's ledger: each bag's compute load, and its tokens under a token
    cap (the step's `BagLayout`, even spread: no remainder chunk to track)."""

    def __init__(self, step: Step):
        self.layout, self.workload, self.lengths = step.layout, step.workload, step.lengths

    def charge(self, seqs, src, dst) -> float:
        layout = self.layout
        if isinstance(seqs, list):  # one by one, in order
            for seq, s, d in zip(seqs, src, dst, strict=True):
                w, length = float(self.workload[seq]), int(self.lengths[seq])
                layout.add(s, w, length, 0, sign=-1)
                layout.add(d, w, length, 0)
        else:  # a batch: each bag's net change summed at once
            num_bags = len(layout.load)
            w = self.workload[seqs]
            layout.load += np.bincount(dst, w, num_bags) - np.bincount(src, w, num_bags)
            if layout.max_tokens is not None:
                ell = self.lengths[seqs]
                layout.bag_tokens += np.bincount(dst, ell, num_bags).astype(np.int64)
                layout.bag_tokens -= np.bincount(src, ell, num_bags).astype(np.int64)
        if layout.over_token_cap():
            return math.inf
        if isinstance(seqs, list):
            return max(float(layout.load[b] / layout.weight[b]) for b in (*src, *dst))
        touched = np.concatenate([src, dst])
        return float((layout.load[touched] / layout.weight[touched]).max(initial=0.0))

    def undo(self, seqs, src, dst) -> None:
        # Back the way they came, in the same order: the solver's plans have always been
        # made so (a load may then differ in its last bit from before the charge).
        self.charge(seqs, dst, src)


class Tokens:
    """A ledger of each bag's tokens only (``tokens``, as floats: whole numbers, so the
    order of the sums changes no bit), for a pass that prices its bags anew each round."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray):
        self.tokens, self.lengths = tokens, lengths

    def charge(self, seqs, src, dst) -> float:
        ell = self.lengths[seqs]
        np.add.at(self.tokens, src, -ell)
        np.add.at(self.tokens, dst, ell)
        return 0.0

    def undo(self, seqs, src, dst) -> None:
        self.charge(seqs, dst, src)
