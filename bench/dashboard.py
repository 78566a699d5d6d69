"""Dashboard benchmark: a 10,000-step JSONL of 256-sequence plans.

Run: ``python bench/dashboard.py [--steps 10000] [--distinct 400] [--updates 8]``.

1. Plans ``--distinct`` steps with the planner (32 GPUs, topology g1n8+g2n4+g4n2+g8n1,
   256 sequences each) and writes ``--steps`` lines cycling through them (step numbers
   and times are unique), in a temporary folder.
2. Starts ``knapformer dashboard`` on it in its own process and measures, in headless
   Chromium: time from process start to the first rendered page (the bar chart drawn),
   time until every step is indexed, the server's time per live update (the Dash
   callbacks of each new step, from the server's own timer at ``/api/status``) and the
   browser-visible latency of an appended step, and the server's peak RSS.
3. Baseline, same run: a non-incremental reader that re-reads the whole file with
   ``read_plans`` — what a dashboard would pay per update (and before its first page)
   without the tailer and the summaries; its time and memory growth.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

from dashboard_server import PeakRss, served_page, status, wait_until  # noqa: E402
from footer import print_load  # noqa: E402

from knapformer.contract.plan_io import read_plans  # noqa: E402
from knapformer.planning.datamix import parse_mix, sample_lengths  # noqa: E402
from knapformer.planning.planner import plan_routing  # noqa: E402
from knapformer.planning.workload import WorkloadModel  # noqa: E402

TOPOLOGY = "g1n8+g2n4+g4n2+g8n1"
# 16*8 + 8*8 + 8*8 = 256 sequences on 32 GPUs, resolutions 256..1024 px.
MIX = "g16b8i256f1s0,g8b8i512f1s0,g8b8i1024f1s0"
# The bar chart of a step is drawn: bars exist in the plot's SVG.
RENDERED = "() => document.querySelectorAll('#bag-load .barlayer .point').length > 0"
TARGETS = {"first_page_s": 5.0, "update_ms": 300.0, "rss_mib": 1024.0}


def make_file(path: Path, steps: int, distinct: int) -> list:
    """Write ``steps`` plan lines; returns the distinct plans (for appending later)."""
    model = WorkloadModel(3072, 0.4)
    rng = np.random.default_rng(0)
    codes = parse_mix(MIX)
    plans = [
        plan_routing(sample_lengths(codes, rng), TOPOLOGY, model, step=s, run="bench")
        for s in range(distinct)
    ]
    assert len(plans[0].sequences) == 256
    with open(path, "w", encoding="utf-8") as f:
        for s in range(steps):
            plan = plans[s % distinct].model_copy(update={"step": s, "time": 1.79e9 + s})
            f.write(plan.model_dump_json() + "\n")
    return plans


def bench_dashboard(path: Path, plans: list, steps: int, updates: int) -> dict:
    out: dict = {}
    with served_page(path) as served:
        page, url, started = served.page, served.url, served.started
        out["ready_s"] = served.ready_s
        try:
            page.goto(url)
            page.wait_for_function(RENDERED, timeout=60_000)
            out["first_page_s"] = time.perf_counter() - started
            out["steps_at_first_page"] = int(
                page.inner_text("#stat-steps").split()[0].replace(",", "")
            )
            wait_until(
                lambda: (s := status(url))["steps"] == steps and not s["indexing"],
                600,
                "indexing every step",
            )
            out["indexed_s"] = time.perf_counter() - started
            # Let the page catch up with the fully indexed file before timing updates.
            wait_until(lambda: page.inner_text("#stat-steps") == f"{steps:,}", 60, "page caught up")
            time.sleep(1.5)
            before = status(url)["callbacks"]
            latencies = []
            for k in range(updates):
                n = steps + k
                plan = plans[n % len(plans)].model_copy(update={"step": n, "time": 1.79e9 + n})
                with open(path, "a", encoding="utf-8") as f:
                    f.write(plan.model_dump_json() + "\n")
                t0 = time.perf_counter()
                wait_until(
                    lambda n=n: (
                        f"step {n}"
                        in page.evaluate(
                            "document.querySelector('#bag-load .js-plotly-plot')"
                            "._fullLayout.title.text"
                        )
                    ),
                    60,
                    f"step {n} shown",
                )
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.3)
            final = status(url)
            timings = final["callback_ms"][-(final["callbacks"] - before) :]
            # Each update runs the run watcher, the callbacks that follow its view (header,
            # notices, step selection, timeline) and the per-step one; idle ticks in
            # between complete none. Sum per update = all callback time / updates.
            out["update_ms_per_step"] = sum(timings) / updates
            out["callback_ms_max"] = max(timings)
            out["visible_latency_s"] = statistics.median(latencies)
            out["visible_latency_max_s"] = max(latencies)
        except Exception:
            print(
                "page shows:",
                page.inner_text("#stat-steps"),
                "|",
                page.inner_text("#step-label"),
                "|",
                page.inner_text("#detail-notice"),
                page.evaluate(
                    "document.querySelector('#bag-load .js-plotly-plot')._fullLayout.title.text"
                ),
                file=sys.stderr,
            )
            raise
    out["rss_mib"] = served.rss_mib
    return out


def bench_baseline(path: Path) -> dict:
    """Re-read and validate the whole file, as a non-incremental dashboard would."""
    gc.collect()
    me = psutil.Process()
    rss0 = me.memory_info().rss
    peak = PeakRss(os.getpid())
    t0 = time.perf_counter()
    result = read_plans(path)
    seconds = time.perf_counter() - t0
    held = me.memory_info().rss - rss0
    peak_growth = peak.stop() - rss0
    n = len(result.records)
    del result
    return {"read_s": seconds, "held_mib": held / 2**20, "peak_mib": peak_growth / 2**20, "n": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--distinct", type=int, default=400)
    parser.add_argument("--updates", type=int, default=8)
    args = parser.parse_args()
    console = Console(highlight=False)
    with tempfile.TemporaryDirectory(prefix="knapformer-bench-") as tmp:
        path = Path(tmp) / "plans.jsonl"
        t0 = time.perf_counter()
        plans = make_file(path, args.steps, args.distinct)
        size = path.stat().st_size
        console.print(
            f"wrote {args.steps:,} plans ({args.distinct} planned, cycled) of 256 sequences "
            f"on 32 GPUs: {size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s"
        )
        dash = bench_dashboard(path, plans, args.steps, args.updates)
        base = bench_baseline(path)
    t = Table(title=f"dashboard on a {args.steps:,}-step JSONL ({size / 2**20:.0f} MiB)")
    t.add_column("measure")
    t.add_column("dashboard", justify="right")
    t.add_column("baseline: re-read whole file", justify="right")
    t.add_column("target", justify="right")
    t.add_column("ok", justify="center")

    def ok(value, target):
        return "yes" if value <= target else "NO"

    t.add_row(
        "first rendered page (s from process start)",
        f"{dash['first_page_s']:.2f} ({dash['steps_at_first_page']:,} steps indexed)",
        f"{base['read_s']:.2f} (read before any page)",
        "≤ 5",
        ok(dash["first_page_s"], TARGETS["first_page_s"]),
    )
    t.add_row("  of which: server answering HTTP (s)", f"{dash['ready_s']:.2f}", "", "", "")
    t.add_row("all steps indexed (s)", f"{dash['indexed_s']:.2f}", f"{base['read_s']:.2f}", "", "")
    t.add_row(
        "server time per live update (ms)",
        f"{dash['update_ms_per_step']:.0f} (max callback {dash['callback_ms_max']:.0f})",
        f"{base['read_s'] * 1e3:.0f}",
        "≤ 300",
        ok(dash["update_ms_per_step"], TARGETS["update_ms"]),
    )
    t.add_row(
        "new step visible in browser (s, median / max)",
        f"{dash['visible_latency_s']:.2f} / {dash['visible_latency_max_s']:.2f}",
        "",
        "≤ 2",
        ok(dash["visible_latency_max_s"], 2.0),
    )
    t.add_row(
        "peak memory (MiB)",
        f"{dash['rss_mib']:.0f} (server RSS)",
        f"+{base['peak_mib']:.0f} peak, +{base['held_mib']:.0f} held ({base['n']:,} plans)",
        "≤ 1024",
        ok(dash["rss_mib"], TARGETS["rss_mib"]),
    )
    console.print(t)
    print_load(console)


if __name__ == "__main__":
    main()
