"""What a benchmark prints under its table: how busy the machine was while it ran, and one
PASS/FAIL line per target with the exit status (1 when a target is missed), so a script
run by hand or by ``make docs-bench`` says so plainly."""

from __future__ import annotations

import os

from rich.console import Console


def print_load(console: Console) -> None:
    """The one-minute load average: absolute times on a shared machine depend on it."""
    load = os.getloadavg()[0]
    console.print(f"load average during the run: {load:.1f} on {os.cpu_count()} CPUs")


def print_targets(console: Console, checks: list[tuple[str, bool]]) -> int:
    """Print one line per ``(text, met)`` check and a count; return the exit status."""
    for text, ok in checks:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {text}")
    failed = sum(not ok for _, ok in checks)
    console.print(f"{len(checks) - failed} of {len(checks)} targets met")
    return 1 if failed else 0
