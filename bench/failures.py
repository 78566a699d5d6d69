"""Benchmark: the fault matrix, timed. For every kind of fault of
`knapformer.testing.fault_worlds.standard_cases` (raise in the forward or in route, a
tensor of the wrong shape, a stall in each balancer phase or in the plan-ahead thread, a
close without finish, a SIGKILL), on 4 and on 8 gloo ranks, ``--repeats`` worlds each:
how many surviving ranks raised an error naming the culprit, the step and the phase, and
how long after the fault the last of them did, against the group's ``--timeout``.

A stall is named once the survivors' collective times out, so their time is the timeout
plus the roll call; a rank that raised and left, or died, is named as soon as its peers'
collective fails. Targets (printed PASS or FAIL, exit 1 when missed): every survivor names
the culprit in every run, each within the timeout plus 5 s; no process but the killed one
ends by a signal (no SIGABRT).

    .venv/bin/python bench/failures.py [--repeats 1] [--timeout 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from footer import print_load, print_targets
from rich.console import Console
from rich.table import Table

from knapformer.testing.fault_checks import struck_at, survivors
from knapformer.testing.fault_worlds import run_fault_world, standard_cases

ANSWER_S = 3.0
BOUND_S = 5.0  # the bound beyond the group timeout


def _named(case, outcome) -> bool:
    """Whether a survivor's error names the culprit (a refusal by every rank at once
    names it too: `invalid input on rank N`, or its layout)."""
    error = outcome.error or ""
    return f"rank {case.culprit}" in error and (
        error.startswith("KnapformerError") or case.culprit in outcome.culprits
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="worlds per size")
    parser.add_argument("--timeout", type=float, default=5.0, help="the group timeout (s)")
    args = parser.parse_args()
    console = Console(highlight=False)
    rows: dict[tuple[str, int], list] = {}
    ends: list[str] = []
    began = time.perf_counter()
    for world in (4, 8):
        cases = standard_cases(world)
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="knapformer-faults-") as folder:
                results, ended = run_fault_world(world, cases, Path(folder), args.timeout,
                                                 ANSWER_S)  # fmt: skip
            ends.append(ended or "every rank returned")
            for case in cases:
                row = rows.setdefault((case.name, world), [0, 0, 0.0, 0])
                began_at = struck_at(results, case)
                for o in survivors(results, case).values():
                    row[0] += 1
                    row[1] += _named(case, o)
                    if began_at is not None and o.raised_at is not None:
                        late = o.raised_at - began_at
                        row[2] = max(row[2], late)
                        row[3] += late > args.timeout + BOUND_S
    table = Table(title=f"the fault matrix: {args.repeats} world(s) per size, group timeout "
                  f"{args.timeout:g} s", title_justify="left")  # fmt: skip
    for name in ("fault", "ranks", "survivors named", "slowest (s after the fault)",
                 f"> timeout + {BOUND_S:g} s"):  # fmt: skip
        table.add_column(name, justify="left" if name == "fault" else "right")
    for (name, world), (seen, named, slowest, late) in rows.items():
        table.add_row(name, str(world), f"{named} of {seen}", f"{slowest:.1f}", str(late))
    console.print(table)
    console.print(f"how the worlds ended: {', '.join(sorted(set(ends)))} "
                  f"({time.perf_counter() - began:.0f} s)")  # fmt: skip
    print_load(console)
    seen = sum(r[0] for r in rows.values())
    named = sum(r[1] for r in rows.values())
    late = sum(r[3] for r in rows.values())
    signals = [e for e in ends if "died" in e and "SIGKILL" not in e]
    return print_targets(
        console,
        [
            (f"every survivor names the culprit ({named} of {seen})", named == seen),
            (f"within the timeout + {BOUND_S:g} s ({late} later)", late == 0),
            (f"no process ends by another signal than the kill ({len(signals)})", not signals),
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
