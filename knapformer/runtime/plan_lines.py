"""A routing plan as the recorder writes it: one JSON line that every reader accepts.

Used on the recorder's writer thread (`knapformer.runtime.recorder`), never on the
training thread: `reader_problem` says why a reader would refuse a plan,
`finite_times` leaves out what JSON cannot hold (inf, nan), and `line_pieces`
builds the line a piece at a time, letting go of the GIL as it goes.
"""

from __future__ import annotations

import math
import time

from pydantic import ValidationError

from knapformer.contract.plan import Measurements, RoutingPlan
from knapformer.contract.plan_io import describe_validation_error, json_line_pieces

# JSON written between two releases of the GIL by the writer thread: ~0.2 ms of work.
# (A release costs a system call, up to 0.1 ms on a busy machine: not after every piece.)
_YIELD_BYTES = 16 << 10


def line_pieces(plan: RoutingPlan) -> list[bytes]:
    """The plan's JSON line with its newline, in pieces: serialising a multi-MB plan in
    one call (or joining it into one buffer) would hold the GIL, and so stall the
    training thread, for many milliseconds."""
    pieces, since_yield = [], 0
    for piece in json_line_pieces(plan):
        pieces.append(piece)
        since_yield += len(piece)
        if since_yield >= _YIELD_BYTES:
            time.sleep(0)  # releases the GIL: a waiting training thread runs now
            since_yield = 0
    pieces.append(b"\n")
    return pieces


def reader_problem(plan: RoutingPlan) -> str | None:
    """Why a reader would refuse ``plan`` (None: it would read it), by the contract's own
    validation: `RoutingPlan` validated from the plan's fields as they are, columns
    included (no copy, no JSON; ~11 ms for 32,768 sequences on the writer thread)."""
    fields = {name: getattr(plan, name) for name in RoutingPlan.model_fields}
    for name in ("sequences", "chunks"):
        fields[name] = getattr(plan, name).columns()  # a derived chunk table is made here
    if plan.measurements is not None:
        fields["measurements"] = plan.measurements.model_dump()
    try:
        RoutingPlan.model_validate(fields)
    except ValidationError as err:
        return describe_validation_error(err)
    except Exception as err:  # a structure validation could not even look at
        return f"malformed plan ({type(err).__name__}: {err})"
    return None


def finite_times(plan: RoutingPlan) -> tuple[RoutingPlan, list[str]]:
    """``plan``, or a copy without its non-finite measured times (JSON has no inf or nan:
    they would be written null, which no reader accepts as a time), and a description of
    each one left out; the caller's plan is left as it was."""
    if plan.measurements is None:
        return plan, []
    kept, dropped = _finite_measurements(plan.measurements, plan.gpus)
    if not dropped:
        return plan, dropped
    return plan.model_copy(update={"measurements": kept}), dropped


def _finite_measurements(measured: Measurements, gpus: list[int]) -> tuple[Measurements, list[str]]:
    """A copy of ``measured`` without non-finite times, and a description of each one
    left out: a phase of ``per_rank_ms`` with any such value goes as a whole (it must hold
    one value per GPU), ``plan_ms`` becomes ``None``."""
    dropped: list[str] = []
    plan_ms = measured.plan_ms
    if plan_ms is not None and not math.isfinite(plan_ms):
        dropped.append(f"plan_ms ({plan_ms})")
        plan_ms = None
    per_rank: dict[str, list[float]] = {}
    for phase, values in measured.per_rank_ms.items():
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            where = ", ".join(
                f"GPU {gpus[i] if i < len(gpus) else i}: {values[i]}" for i in bad[:3]
            )
            dropped.append(f"per_rank_ms[{phase!r}] ({where}{', ...' if len(bad) > 3 else ''})")
        else:
            per_rank[phase] = values
    if not dropped:
        return measured, dropped
    kept = measured.model_copy(update={"plan_ms": plan_ms, "per_rank_ms": per_rank})
    return kept, dropped
