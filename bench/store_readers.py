"""Run store readers benchmark: the straggler analysis over a window of steps anywhere in
a long run, and the dashboard's whole-run views, on a run store.

Run: ``python bench/store_readers.py [--gpus 1024] [--steps 100000] [--window 1000]``
(``--store RUN`` reuses a run folder that already has a store, e.g. the one
``--keep RUN`` or ``bench/run_store.py --out`` leaves).

1. Synthesises the run through the store's own writer (``bench/run_store.py``'s
   synthesiser: realistic figures, stragglers appearing mid-run), unless ``--store``.
2. ``stragglers`` over ``--window`` steps at the start, the middle and the end of the
   run, as a user runs it: in a fresh Python process on the kept store (not in the
   bench's own, which may have just synthesised it), each window timed from the read of
   its rows to the verdicts and what each step lost (the command's own work: its imports
   and Python start-up come before), with the CPU time of that process over the same
   span (all its threads: the part of the wall clock the machine's load does not add);
   and the whole command once (``knapformer stragglers RUN --steps A:B`` on the middle
   window, Python start-up and printing included).
3. The dashboard in its own process, opened in headless Chromium: time from the page
   request until the whole-run heatmap, the verdicts over the run and the imbalance
   over the run are drawn (``run-heatmap``, ``run-verdicts``, ``run-steps``): the median
   of 3 cold servers and pages, each with the plotly.js the dashboard serves (its
   cartesian bundle once ``make setup`` fetched it), interleaved with 3 served plotly.js's
   full bundle (the baseline, same load); a click on a heatmap cell until its steps are
   drawn, and the server's peak RSS.
4. Baseline, same run: what the JSONL path would read for the same views: the full
   plans of the window (0.55 MB per step at 1,024 GPUs, measured by the recorder bench),
   which at this size is not run.

Targets (PASS/FAIL, exit 1 on a miss): stragglers window <= 2 s; dashboard first draw of
the whole-run views <= 2 s and peak RSS <= 500 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dashboard_server import served_page, wait_until  # noqa: E402
from footer import print_load, print_targets  # noqa: E402
from knapformer.dashboard.plotly_bundle import served as served_bundle  # noqa: E402

from knapformer.contract.plan_io import write_jsonl  # noqa: E402
from knapformer.contract.run_store import read_table  # noqa: E402
from knapformer.diagnosis.step_loss import window_losses  # noqa: E402
from knapformer.diagnosis.store_source import window_rows  # noqa: E402
from knapformer.diagnosis.store_window import window_figures, without_huge_pages  # noqa: E402
from knapformer.diagnosis.stragglers import judge  # noqa: E402
from knapformer.local.launcher import run_fresh  # noqa: E402

TARGETS = {"stragglers_s": 2.0, "first_draw_s": 2.0, "rss_mb": 500.0}
#: Cold first draws of the dashboard per plotly.js bundle (`bench_dashboard`).
DRAW_REPS = 3
#: Bytes of a full plan per step at 1,024 GPUs (issue 32's recorder figure), per GPU.
JSONL_BYTES_PER_GPU_STEP = 0.55e6 / 1024
#: Each whole-run view is drawn: its figure holds the trace it draws.
DRAWN = """() => ['run-heatmap', 'run-verdicts', 'run-steps'].every(id => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  return gd && gd._fullLayout && gd.data && gd.data.length > 0;
})"""
DRILLED = """() => {
  const gd = document.querySelector('#drill-heatmap .js-plotly-plot');
  return gd && gd.data && gd.data.length > 0 && gd.data[0].type === 'heatmap';
}"""


def build_store(run: Path, gpus: int, steps: int) -> float:
    """Synthesise the run's store into ``run`` through the store bench's synthesiser
    (``bench/run_store.py``: the real writer's batch path); seconds."""
    from run_store import write_run

    started = time.perf_counter()
    write_run(run / "store", gpus, steps)
    return time.perf_counter() - started


def add_plans_file(run: Path, gpus: int) -> None:
    """The dashboard lists runs by their plans file: one real plan of the run's size."""
    from knapformer.planning.datamix import parse_mix, sample_lengths
    from knapformer.planning.planner import plan_routing
    from knapformer.planning.workload import WorkloadModel

    if (run / "plans.jsonl").exists():
        return
    mix = parse_mix(f"g{gpus}b2i512f1s0")
    lengths = sample_lengths(mix, np.random.default_rng(0))
    topology = f"g8n{gpus // 8}" if gpus % 8 == 0 else f"g1n{gpus}"
    plan = plan_routing(lengths, topology, WorkloadModel(3072, 0.4), step=0, run=run.name)
    write_jsonl(run / "plans.jsonl", [plan])


def time_windows(run: Path, starts: list[int], window: int) -> tuple[list, list, list]:
    """``stragglers``' own work over ``window`` steps from each of ``starts``: the rows
    read and judged, and what each step lost; (seconds, CPU seconds, ranks named).
    Run in a process of its own (`bench_stragglers`)."""
    times, cpu, named = [], [], set()
    without_huge_pages()  # as the command does (`knapformer.cli.stragglers`)
    for start in starts:
        began, began_cpu = time.perf_counter(), time.process_time()
        named |= _one_window(run, start, start + window - 1)
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)  # all its threads: Parquet decodes on 2
    return times, cpu, sorted(named)


def _one_window(run: Path, first: int, last: int) -> set[tuple[int, str]]:
    """The command's work over steps ``first..last``; the ranks it named. Nothing else of
    the window outlives it: a user's command computes one window, and the next window
    here would otherwise run beside this one's matrices (200 MB at 1,024 GPUs) and pay
    for the fresh memory (0.2-0.4 s of CPU, measured, in the middle window)."""
    w = window_figures(window_rows(run, first, last))
    report = judge(w.m, w.scopes, w.bandwidth)
    window_losses(w.m)
    return {(r.rank, r.verdict) for r in report.named}


def bench_stragglers(run: Path, window: int) -> dict:
    """Seconds of the analysis over ``window`` steps at the run's start, middle and end,
    in a fresh Python process as a user's ``knapformer stragglers RUN --steps A:B`` is
    (not in this one, which may have just synthesised the store), and the whole command
    once (wall clock, Python start-up included)."""
    steps = read_table(run, "steps", columns=["step"])["step"].to_numpy()
    first, last = int(steps[0]), int(steps[-1])
    starts = [first, (first + last - window) // 2, last - window + 1]
    times, cpu, named = run_fresh(time_windows, run, starts, window)
    began = time.perf_counter()
    span = f"{starts[1]}:{starts[1] + window - 1}"
    command = Path(sys.executable).parent / "knapformer"
    subprocess.run(
        [str(command), "stragglers", str(run), "--steps", span], check=True, capture_output=True
    )
    command_s = time.perf_counter() - began
    return {"window_s": times, "cpu_s": cpu, "command_s": command_s, "named": named}


def _server_rss_mb() -> float:
    """The dashboard server's RSS now (the bench's one child running Python)."""
    servers = [p for p in psutil.Process().children() if "serve(" in " ".join(p.cmdline())]
    return servers[0].memory_info().rss / 1e6 if servers else float("nan")


def _browser_cpu_s() -> float:
    """CPU seconds so far of this process's Chromium processes (all of them: the page's
    renderer, the browser, its GPU and network processes)."""
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "chrom" in proc.name().lower():
                cpu = proc.cpu_times()
                total += cpu.user + cpu.system
    return total


def _first_draw(page, url: str) -> tuple[float, float]:
    """Seconds from the page request until the whole-run views are drawn (`DRAWN`), and
    Chromium's CPU seconds over the same (what the machine's load does not add)."""
    began, began_cpu = time.perf_counter(), _browser_cpu_s()
    page.goto(url)
    page.wait_for_function(DRAWN, timeout=120_000)
    return time.perf_counter() - began, _browser_cpu_s() - began_cpu


def _drill_down(page) -> float:
    """Seconds from a click on a heatmap cell until its steps are drawn and labelled."""
    box = page.locator("#run-heatmap .nsewdrag").first.bounding_box()
    x, y = box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5
    # Hover first, as a user would: Plotly's click names the point its hover found,
    # and a click at the very moment the page is still laying itself out finds none.
    page.mouse.move(x, y)
    page.wait_for_selector("#run-heatmap .hoverlayer .hovertext", timeout=60_000)
    began = time.perf_counter()
    page.mouse.click(x, y)
    page.wait_for_function(DRILLED, timeout=120_000)
    wait_until(lambda: "steps" in page.inner_text("#drill-label"), 60, "drill label")
    return time.perf_counter() - began


def bench_dashboard(run: Path, reps: int = DRAW_REPS) -> dict:
    """First draw of the whole-run views (median of ``reps`` cold servers and pages), the
    same with plotly.js's full bundle (the baseline: reps interleaved with those, so both
    see the same load), a drill-down, and the server's peak RSS."""
    out: dict = {"bundle": served_bundle().describe()}
    for name in ("first_draw_s", "first_cpu_s", "full_draw_s", "full_cpu_s"):
        out[name] = []
    for rep in range(reps):
        for full in (True, False) if rep % 2 == 0 else (False, True):
            with served_page(run, full_plotly_js=full) as served:
                drawn, cpu = _first_draw(served.page, served.url)
                out["full_draw_s" if full else "first_draw_s"].append(drawn)
                out["full_cpu_s" if full else "first_cpu_s"].append(cpu)
                if full or rep < reps - 1:
                    continue
                # the last rep of the bundle served: what the page shows, a drill-down
                out["first_rss_mb"] = _server_rss_mb()
                out["summary"] = served.page.inner_text("#run-summary")
                out["drill_s"] = _drill_down(served.page)
                out["drill_label"] = served.page.inner_text("#drill-label")
            out["rss_mb"] = max(out.get("rss_mb", 0.0), served.rss_mib * 2**20 / 1e6)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--store", type=Path, help="a run folder with a store to reuse")
    parser.add_argument(
        "--keep", type=Path, help="synthesise the run into this folder and keep it (for --store)"
    )
    args = parser.parse_args()
    console = Console(highlight=False, width=110)
    with tempfile.TemporaryDirectory(prefix="knapformer-store-readers-") as scratch:
        run = args.store or args.keep or Path(scratch) / "run"
        built = None if args.store else build_store(run, args.gpus, args.steps)
        gpus = int(read_table(run, "steps", (None, None), ["gpus"])["gpus"][0].as_py())
        steps = read_table(run, "steps", columns=["step"]).num_rows
        add_plans_file(run, gpus)
        store_mb = sum(f.stat().st_size for f in (run / "store").iterdir()) / 1e6
        stragglers = bench_stragglers(run, min(args.window, steps))
        dash = bench_dashboard(run)
    window = min(args.window, steps)
    table = Table(
        title=f"Run store readers: {gpus:,} GPUs x {steps:,} steps, store {store_mb:,.0f} MB"
        + (f" (synthesised in {built:.0f} s)" if built else ""),
        title_justify="left",
    )
    for name in ("reader", "store", "JSONL path (same data)", "target"):
        table.add_column(name, justify="left" if name == "reader" else "right")
    jsonl_gb = JSONL_BYTES_PER_GPU_STEP * gpus * window / 1e9
    worst = max(stragglers["window_s"])
    first_draw = float(np.median(dash["first_draw_s"]))
    full_draw = float(np.median(dash["full_draw_s"]))
    draws = {k: " / ".join(f"{t:.2f}" for t in v) for k, v in dash.items() if isinstance(v, list)}
    each = " / ".join(f"{t:.2f}" for t in stragglers["window_s"])
    cpu = " / ".join(f"{t:.2f}" for t in stragglers["cpu_s"])
    rows = [
        (f"stragglers, {window:,} steps: start / middle / end of the run (fresh process)",
         f"{each} s",
         f"{jsonl_gb:,.2f} GB of plans to parse: not run", f"≤ {TARGETS['stragglers_s']:g} s"),
        ("  CPU time of the same (the machine's load aside)", f"{cpu} s", "", ""),
        ("  the whole command (Python start-up included)", f"{stragglers['command_s']:.2f} s",
         "", ""),
        (f"dashboard: whole-run views first drawn (median of {len(dash['first_draw_s'])} cold "
         "pages)", f"{first_draw:.2f} s",
         f"{JSONL_BYTES_PER_GPU_STEP * gpus * steps / 1e9:,.0f} GB of plans: not run",
         f"≤ {TARGETS['first_draw_s']:g} s"),
        ("  each page", f"{draws['first_draw_s']} s", "", ""),
        ("  Chromium's CPU time of each (the machine's load aside)",
         f"{draws['first_cpu_s']} s", "", ""),
        ("  baseline: plotly.js's full bundle, interleaved (median)",
         f"{full_draw:.2f} s", "", ""),
        ("  each page", f"{draws['full_draw_s']} s", "", ""),
        ("  Chromium's CPU time of each", f"{draws['full_cpu_s']} s", "", ""),
        ("dashboard server RSS at the first draw", f"{dash['first_rss_mb']:,.0f} MB", "",
         f"≤ {TARGETS['rss_mb']:g} MB"),
        ("dashboard: a heatmap cell opened (256 steps read)", f"{dash['drill_s']:.2f} s", "", ""),
        ("dashboard server peak RSS, drill-down included", f"{dash['rss_mb']:,.0f} MB", "",
         f"≤ {TARGETS['rss_mb']:g} MB"),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"named over the windows: {stragglers['named'] or 'nobody'}")
    console.print(f"dashboard: {dash['bundle']}")
    console.print(f"whole run: {dash['summary']}")
    console.print(f"drill-down: {dash['drill_label']}")
    print_load(console)
    return print_targets(
        console,
        [
            (
                f"stragglers over {window:,} steps ≤ {TARGETS['stragglers_s']:g} s ({worst:.2f} s)",
                worst <= TARGETS["stragglers_s"],
            ),
            (
                f"dashboard first draw ≤ {TARGETS['first_draw_s']:g} s "
                f"({first_draw:.2f} s, median)",
                first_draw <= TARGETS["first_draw_s"],
            ),
            (
                f"dashboard RSS ≤ {TARGETS['rss_mb']:g} MB ({dash['first_rss_mb']:,.0f} MB at "
                f"the first draw, {dash['rss_mb']:,.0f} MB at most)",
                dash["rss_mb"] <= TARGETS["rss_mb"],
            ),
        ],
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
