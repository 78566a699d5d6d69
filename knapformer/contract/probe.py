"""The link probe of a step: who exchanged with whom, and how long each exchange took.

A synchronous all-to-all cannot say whose link is slow: every peer waits for the slow
transfer alike. The probe can. In each round of a round-robin schedule every GPU of the
balance group exchanges ``bytes`` each way with exactly one partner (or idles, for an odd
count) and times that exchange alone: the least of a few back to back, since a rank
descheduled for a moment slows one of them and a slow link every one. Rounds are
separated by a barrier, so a late rank never shows in another pair's time. A slow link
then slows every pair of its own rank and no other pair, whatever the rank's peers do.

The schedule is the circle method: for ``m`` = the GPU count rounded up to even, round
``r`` (0 <= r < m - 1) pairs position ``m - 1`` with ``r`` and ``(r + i) mod (m - 1)``
with ``(r - i) mod (m - 1)`` for 1 <= i < m / 2; position ``m - 1`` is a dummy (idle)
when the count is odd. Over its ``m - 1`` rounds every pair meets exactly once. A plan
stores the rounds it ran (`LinkProbe.rounds`), so a reader rebuilds each partner with
`probe_partners` and needs nothing but this module.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field

from knapformer.contract.limits import (
    MAX_GPUS,
    MAX_MEASURED_MS,
    MAX_PROBE_BYTES,
    MAX_PROBE_ROUNDS,
    figure_problem,
)


def probe_round_count(num_gpus: int) -> int:
    """Rounds in which every pair of ``num_gpus`` positions meets once (0 below 2)."""
    if num_gpus < 2:
        return 0
    return num_gpus - 1 if num_gpus % 2 == 0 else num_gpus


def probe_partners(num_gpus: int, round_index: int) -> np.ndarray:
    """(num_gpus,) int64: the position each position exchanges with in round
    ``round_index`` of the schedule (the module doc); -1 for the one that idles."""
    rounds = probe_round_count(num_gpus)
    if not 0 <= round_index < rounds:
        raise ValueError(f"round {round_index} is not one of the {rounds} rounds of {num_gpus}")
    m = num_gpus + num_gpus % 2
    partner = np.full(m, -1, dtype=np.int64)
    partner[m - 1], partner[round_index] = round_index, m - 1
    i = np.arange(1, m // 2)
    a, b = (round_index + i) % (m - 1), (round_index - i) % (m - 1)
    partner[a], partner[b] = b, a
    partner = partner[:num_gpus]
    partner[partner >= num_gpus] = -1  # paired with the dummy: idle
    return partner


class LinkProbe(BaseModel):
    """One step's probe (the module doc). ``ms[k][i]``: GPU ``gpus[i]``'s time for its
    exchange in round ``rounds[k]`` (0 when it idled); ``node[i]``: which host it is on
    (an index: GPUs on one host share it), so that links are compared with their own
    kind (inside a node, across nodes)."""

    bytes: Annotated[int, Field(ge=1, le=MAX_PROBE_BYTES, description="sent each way")]
    rounds: list[Annotated[int, Field(ge=0, lt=MAX_GPUS)]] = Field(
        max_length=MAX_PROBE_ROUNDS, description="round of the schedule, in the order run"
    )
    ms: list[list[Annotated[float, Field(ge=0.0, le=MAX_MEASURED_MS, allow_inf_nan=False)]]] = (
        Field(max_length=MAX_PROBE_ROUNDS, description="per round, per GPU: exchange time")
    )
    node: list[Annotated[int, Field(ge=0, lt=MAX_GPUS)]] = Field(
        description="per GPU: index of its host"
    )

    def problem(self, num_gpus: int) -> str | None:
        """What does not fit a plan of ``num_gpus`` GPUs (None when all does)."""
        where = "measurements.link_probe"
        rounds = probe_round_count(num_gpus)
        if len(self.ms) != len(self.rounds):
            return f"{where} has {len(self.ms)} rows of times for {len(self.rounds)} rounds"
        if len(self.node) != num_gpus:
            return f"{where}.node has {len(self.node)} values for {num_gpus} GPUs"
        for k, (r, row) in enumerate(zip(self.rounds, self.ms, strict=True)):
            if r >= rounds:
                return f"{where}.rounds[{k}] = {r}, but {num_gpus} GPUs have {rounds} rounds"
            if len(row) != num_gpus:
                return f"{where}.ms[{k}] has {len(row)} values for {num_gpus} GPUs"
            # A non-zero time below MIN_FIGURE (a subnormal) is noise, as every figure.
            problem = figure_problem(row, f"{where}.ms[{k}]", 0.0, MAX_MEASURED_MS, unit=" ms")
            if problem is not None:
                return problem
        return None
