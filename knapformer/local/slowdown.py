"""Fault injection for the demo: a rank that computes as a GPU ``factor`` times slower
would (thermal throttling, another job on the node), emulated by sleeping.

A slow GPU is slow in every kernel, so its peers wait for it at the next exchange they
share with it. `SlowBalancer` sleeps ``factor - 1`` times the compute it measured since
the last exchange of the whole group, right before the next one: before
``reverse_route`` for the forward pass, and (the training loop calls `lag`) before the
gradient all-reduce for the backward pass. Sleeping at the end of the step instead
would put the slowdown behind every exchange, where no plan could shorten it.
"""

from __future__ import annotations

import time

from knapformer.balancer import SequenceBalancer
from knapformer.plan import COLLECTIVE_PHASES


class SlowBalancer(SequenceBalancer):
    """A `SequenceBalancer` on a rank whose compute is ``slow_factor`` (>= 1) times
    slower; everything else as its parent."""

    def __init__(self, *args, slow_factor: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow_factor = float(slow_factor)
        self._since: tuple[float, float] | None = None  # (host clock, ms inside collectives)

    def route(self, packed_seqs, features=None):
        routed = super().route(packed_seqs, features)
        self._mark()
        return routed

    def reverse_route(self, seqs, features=None):
        self.lag()  # the forward pass's compute, before its last exchange
        back = super().reverse_route(seqs, features)
        self._mark()
        return back

    def lag(self) -> None:
        """Sleep ``slow_factor - 1`` times the compute since the last mark (then mark)."""
        if self._since is not None:
            began, waited = self._since
            compute = (time.perf_counter() - began) * 1e3 - (self._waited() - waited)
            time.sleep(max(compute, 0.0) * (self.slow_factor - 1) / 1e3)
        self._mark()

    def _mark(self) -> None:
        self._since = (time.perf_counter(), self._waited())

    def _waited(self) -> float:
        """Ms of this step spent inside collectives so far (the length gather excepted:
        it precedes every mark)."""
        timings = self.timings
        return sum(timings.get(p, 0.0) for p in COLLECTIVE_PHASES if p != "gather")
