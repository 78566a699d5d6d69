"""Fault injection for the demo: a rank that computes as a GPU ``factor`` times slower
would (thermal throttling, another job on the node), emulated by sleeping.

Its measured compute (the step without the time inside collectives) is made ``factor``
times longer: `SlowBalancer` sleeps ``factor - 1`` times the compute since its last
sleep, at the exchanges of the whole group where a slow GPU makes its peers wait:
before ``reverse_route`` (the forward pass, with the optimizer step and data of the
step before) and, when the training loop calls `lag`, before the gradient all-reduce
(the backward pass). Sleeping at the end of the step instead would put the slowdown
behind every exchange, where no plan could shorten it.
"""

from __future__ import annotations

import time

from knapformer.contract.plan import COLLECTIVE_PHASES
from knapformer.runtime.balancer import SequenceBalancer


class SlowBalancer(SequenceBalancer):
    """A `SequenceBalancer` on a rank whose compute is ``slow_factor`` (>= 1) times
    slower; everything else as its parent."""

    def __init__(self, *args, slow_factor: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow_factor = float(slow_factor)
        self._since: tuple[float, float] | None = None  # (host clock, ms in collectives)
        self._ended_steps_ms = 0.0  # time inside collectives of the steps that ended

    def plan_routing(self, *args, **kwargs):
        if self._since is None:
            self._mark()
        # The step's timings start afresh: keep what the ending one spent in collectives.
        self._ended_steps_ms += self._in_step()
        return super().plan_routing(*args, **kwargs)

    def reverse_route(self, seqs, features=None):
        self.lag()  # before the forward pass's last exchange
        return super().reverse_route(seqs, features)

    def lag(self) -> None:
        """Sleep ``slow_factor - 1`` times the compute since the last sleep."""
        if self._since is not None:
            began, waited = self._since
            compute = (time.perf_counter() - began) * 1e3 - (self._waited() - waited)
            time.sleep(max(compute, 0.0) * (self.slow_factor - 1) / 1e3)
        self._mark()

    def _mark(self) -> None:
        self._since = (time.perf_counter(), self._waited())

    def _waited(self) -> float:
        """Ms spent inside collectives since the first step."""
        return self._ended_steps_ms + self._in_step()

    def _in_step(self) -> float:
        timings = self.timings
        return sum(timings.get(p, 0.0) for p in COLLECTIVE_PHASES)
