"""Dashboard benchmark at 1,024 GPUs: first page and step switch on a recorded wide run.

Run: ``python bench/dashboard_wide.py [--steps 24] [--switches 6]``.

1. Writes two measured runs in a temporary folder: 1,024 GPUs (topology
   g1n256+g2n128+g4n64+g8n32, ~28,000 sequences and ~65,000 chunks a step, 2.3 MB a
   line) and, as the baseline, 32 GPUs (g1n8+g2n4+g4n2+g8n1, the joint mix: ~90
   sequences), ``--steps`` steps each, with per-rank measurements synthesised as the
   tests do (rank 5 computes twice as long) so every straggler view is drawn too. (At
   1,024 GPUs the per-GPU views show groups of whole bags: `visualization.axes`.)
2. For each run, starts ``knapformer dashboard`` in its own process and measures in
   headless Chromium: time from process start to the first page with its bars drawn,
   and to every view drawn (timeline, traffic, straggler heatmaps, sequence table); then
   ``--switches`` step switches (typing a step and pressing Enter): time until the bars of
   the new step are drawn and until every view shows it, and the server's own callback
   time per switch (from ``/api/status``); and the server's peak RSS.
3. The 32-GPU run is the baseline measured in the same run: the table prints each figure
   for both and their ratio, next to what parsing and validating one plan of each size
   costs (the floor of a step switch: the server must read the plan it shows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

from dashboard_server import served_page, status, wait_until  # noqa: E402
from footer import print_load  # noqa: E402

from knapformer.contract.plan_io import parse_plan_line  # noqa: E402
from knapformer.planning.datamix import parse_mix, sample_lengths  # noqa: E402
from knapformer.planning.planner import plan_routing  # noqa: E402
from knapformer.planning.workload import WorkloadModel  # noqa: E402
from knapformer.testing.measured_plans import with_measurements  # noqa: E402

RUNS = {
    # name: (topology, data mix)
    "32 GPUs": ("g1n8+g2n4+g4n2+g8n1", "joint"),
    "1,024 GPUs": (
        "g1n256+g2n128+g4n64+g8n32",
        "g512b40i256f1s0,g256b20i512f1s0,g256b10i1024f1s0",
    ),
}
DISTINCT = 4  # planned steps per run, cycled (step numbers stay unique)
BARS = "#bag-load .js-plotly-plot"
TITLE = f"document.querySelector('{BARS}')._fullLayout.title.text"


def write_run(path: Path, topology: str, mix: str, steps: int) -> list[str]:
    """``steps`` measured plan lines; returns the distinct lines' JSON (for timing a parse)."""
    rng = np.random.default_rng(0)
    codes = parse_mix(mix)
    model = WorkloadModel(3072, 0.4)
    plans = [
        plan_routing(sample_lengths(codes, rng), topology, model, run=path.parent.name)
        for _ in range(DISTINCT)
    ]
    with open(path, "w", encoding="utf-8") as f:
        for s in range(steps):
            plan = plans[s % DISTINCT].model_copy(update={"step": s, "time": 1.79e9 + s})
            f.write(with_measurements(plan, rng, slow_rank=5, slow_factor=2.0).model_dump_json())
            f.write("\n")
    return path.read_text().splitlines()[:DISTINCT]


def parse_ms(lines: list[str]) -> float:
    """Median time to parse and validate one plan line (ms)."""
    times = []
    for line in lines * 2:
        t0 = time.perf_counter()
        parse_plan_line(line)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _every_view_shows(page, step: int) -> bool:
    """Bars, traffic, heatmaps and table all show ``step`` (the heatmaps end at it)."""
    return page.evaluate(
        f"""() => {{
        const title = id => document.querySelector(`#${{id}} .js-plotly-plot`)
            ._fullLayout.title.text;
        const rows = document.querySelectorAll('#seq-table td[data-dash-column=id]');
        return title('bag-load').includes('step {step} ·')
            && title('traffic').includes('step {step} ·')
            && title('ratio-heatmap').endsWith('–{step}')
            && title('wait-heatmap').endsWith('–{step}')
            && rows.length > 0
            && document.querySelector('#step-label').textContent.startsWith('step {step} ·');
        }}"""
    )


def bench_run(path: Path, steps: int, switches: int) -> dict:
    out: dict = {}
    with served_page(path) as served:
        page, url, started = served.page, served.url, served.started
        try:
            page.goto(url)
            page.wait_for_function(
                f"() => document.querySelectorAll('{BARS} .barlayer .point').length > 0",
                timeout=120_000,
            )
            out["first_bars_s"] = time.perf_counter() - started
            wait_until(
                lambda: (s := status(url))["steps"] == steps and not s["indexing"],
                600,
                "indexing every step",
            )
            last = steps - 1
            wait_until(lambda: _every_view_shows(page, last), 120, "every view of the last step")
            out["first_all_s"] = time.perf_counter() - started
            time.sleep(1.0)
            bars, every, server_ms = [], [], []
            targets = [int(s) for s in np.linspace(steps // 4, steps - 2, switches)]
            for target in targets:
                before = status(url)["callbacks"]
                box = page.locator("#step-input")
                box.fill(str(target))
                t0 = time.perf_counter()
                box.press("Enter")
                wait_until(lambda t=target: f"step {t} ·" in page.evaluate(TITLE), 120, "bars")
                bars.append(time.perf_counter() - t0)
                wait_until(lambda t=target: _every_view_shows(page, t), 120, "every view")
                every.append(time.perf_counter() - t0)
                time.sleep(0.8)  # the page settles; the callbacks of this switch are done
                done = status(url)
                server_ms.append(sum(done["callback_ms"][-(done["callbacks"] - before) :]))
            out["switch_bars_s"] = statistics.median(bars)
            out["switch_all_s"] = statistics.median(every)
            out["switch_all_max_s"] = max(every)
            out["switch_server_ms"] = statistics.median(server_ms)
        except Exception:
            print("page shows:", page.inner_text("#step-label"), file=sys.stderr)
            raise
    out["rss_mib"] = served.rss_mib
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--switches", type=int, default=6)
    args = parser.parse_args()
    console = Console(highlight=False)
    results, shapes = {}, {}
    with tempfile.TemporaryDirectory(prefix="knapformer-bench-") as tmp:
        for name, (topology, mix) in RUNS.items():
            folder = Path(tmp) / name.replace(",", "").replace(" ", "-")
            folder.mkdir()
            path = folder / "plans.jsonl"
            t0 = time.perf_counter()
            lines = write_run(path, topology, mix, args.steps)
            plan = parse_plan_line(lines[0])
            shapes[name] = (len(plan.sequences), len(plan.chunks), len(lines[0]))
            console.print(
                f"{name}: {args.steps} measured steps of {len(plan.sequences):,} sequences, "
                f"{len(plan.chunks):,} chunks ({path.stat().st_size / 2**20:.0f} MiB) written "
                f"in {time.perf_counter() - t0:.1f} s"
            )
            measured = bench_run(path, args.steps, args.switches)
            results[name] = {"parse_ms": parse_ms(lines), **measured}
    base, wide = (results[n] for n in RUNS)
    table = Table(title="dashboard: a 1,024-GPU run against a 32-GPU run (baseline), same session")
    table.add_column("measure")
    for name in RUNS:
        table.add_column(name, justify="right")
    table.add_column("ratio", justify="right")
    rows = [
        ("parse + validate one plan (ms, the floor)", "parse_ms", "{:.0f}"),
        ("first page: bars drawn (s from process start)", "first_bars_s", "{:.2f}"),
        ("first page: every view drawn (s)", "first_all_s", "{:.2f}"),
        ("step switch: bars drawn (s, median)", "switch_bars_s", "{:.2f}"),
        ("step switch: every view drawn (s, median)", "switch_all_s", "{:.2f}"),
        ("step switch: every view drawn (s, max)", "switch_all_max_s", "{:.2f}"),
        ("step switch: server callbacks (ms, median)", "switch_server_ms", "{:.0f}"),
        ("server peak RSS (MiB)", "rss_mib", "{:.0f}"),
    ]
    for label, key, fmt in rows:
        table.add_row(
            label, fmt.format(base[key]), fmt.format(wide[key]), f"{wide[key] / base[key]:.1f}×"
        )
    console.print(table)
    for name, (seqs, chunks, size) in shapes.items():
        console.print(f"{name}: {seqs:,} sequences, {chunks:,} chunks, {size / 1e6:.1f} MB a line")
    print_load(console)


if __name__ == "__main__":
    main()
