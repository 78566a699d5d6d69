"""Benchmark the PlanRecorder: what recording costs the training loop.

    .venv/bin/python bench/recorder.py                 # ~2-3 minutes on 2 cores
    .venv/bin/python bench/recorder.py --quick         # skip the demo runs (~10 s)

1. ``record()`` on the training thread for plans of 256 and 1024 sequences (median and
   99th percentile; target <= 0.3 ms), against the baseline of writing the plan
   synchronously (serialise + one write + flush on the training thread);
2. plans written per second by the background writer, against the same synchronous loop;
3. the latency tail while the writer serialises big plans (up to 32,768 sequences, ~2 MB
   a line), piecewise serialisation against the one-call ``model_dump_json`` it replaced:
   the longest stretch the writer holds the GIL per plan (what a training thread can
   wait at most), then, with both threads running, the longest ``record()`` call and the
   stalls of the training thread (the widest gap between two clock reads of its busy
   loop per step: GIL waits, and the OS running other work — shown with recording off);
4. the demo's median step time with and without the recorder, in the same run (runs
   alternate off/on to spread machine noise evenly; target <= 1 % slower), and the
   recorder hook's own time inside each step (its ``record`` phase), the direct figure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from knapformer.planning.datamix import parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.recorder import PlanRecorder

MODEL = WorkloadModel(token_dim=3072, gamma=0.4)


def plans_of(num_seqs: int, count: int, seed: int = 0) -> list:
    """``count`` plans of exactly ``num_seqs`` sequences (the joint mix, trimmed)."""
    codes = parse_mix("joint")
    factor = max(1, -(-num_seqs // 89))  # the joint mix holds ~89 sequences per 32 GPUs
    codes = scale_mix(codes, factor + 1)
    gpus = sum(c.gpus for c in codes)
    topo = f"g1n{gpus // 2}+g2n{gpus // 8}+g4n{gpus // 16}"
    rng = np.random.default_rng(seed)
    out = []
    for step in range(count):
        per_gpu = sample_lengths(codes, rng)
        left, trimmed = num_seqs, []
        for lengths in per_gpu:
            trimmed.append(lengths[:left])
            left -= len(trimmed[-1])
        assert left == 0, "mix too small"
        out.append(plan_routing(trimmed, topo, MODEL, step=step))
    return out


class OneCallRecorder(PlanRecorder):
    """The baseline of the latency tail: serialises each plan in one ``model_dump_json``
    call, as the recorder did before it serialised piecewise."""

    def _serialize(self, plan) -> list[bytes]:
        return [(plan.model_dump_json() + "\n").encode()]


def time_record(
    plans: list, path: Path, gap_s: float, recorder: type[PlanRecorder] = PlanRecorder
) -> tuple[list[float], float]:
    """ms per record() call, one call per simulated step of ``gap_s`` seconds, and the
    longest stall of the training thread in each step (ms)."""
    times, stalls = [], []
    with recorder(path, queue_size=len(plans)) as rec:
        for plan in plans:
            began = time.perf_counter()
            rec.record(plan)
            times.append((time.perf_counter() - began) * 1e3)
            # the "training step": keeps the thread busy, as training would
            stalls.append(_busy(gap_s) * 1e3)
    assert rec.written == (len(plans) if rec.enabled else 0) and rec.dropped == 0
    return times, stalls


class NoRecorder(PlanRecorder):
    """The noise floor of the latency tail: the same loop with recording off."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, enabled=False, **kwargs)


def time_sync(plans: list, path: Path, gap_s: float) -> list[float]:
    """Baseline: serialise and write on the training thread."""
    times = []
    with open(path, "a", encoding="utf-8") as f:
        for plan in plans:
            began = time.perf_counter()
            f.write(plan.model_dump_json() + "\n")
            f.flush()
            times.append((time.perf_counter() - began) * 1e3)
            _busy(gap_s)
    return times


def _busy(seconds: float) -> float:
    """Spin for ``seconds``; returns the widest gap between two clock reads (seconds)."""
    now = time.perf_counter()
    end, widest = now + seconds, 0.0
    while now < end:
        last, now = now, time.perf_counter()
        widest = max(widest, now - last)
    return widest


def throughput(plans: list, path: Path) -> tuple[float, float]:
    """Plans per second: background writer (enqueue all, close) vs synchronous writes."""
    began = time.perf_counter()
    with PlanRecorder(path, queue_size=len(plans)) as rec:
        for plan in plans:
            rec.record(plan)
    bg = len(plans) / (time.perf_counter() - began)
    assert rec.written == len(plans)
    began = time.perf_counter()
    with open(path.with_suffix(".sync"), "a", encoding="utf-8") as f:
        for plan in plans:
            f.write(plan.model_dump_json() + "\n")
            f.flush()
    return bg, len(plans) / (time.perf_counter() - began)


class _SleepMarks:
    """Stands in for the recorder's ``time`` module: notes when the writer releases the
    GIL (``time.sleep(0)``) without sleeping."""

    def __init__(self):
        self.marks: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.marks.append(time.thread_time())

    def __getattr__(self, name: str):
        return getattr(time, name)


def gil_holds(plans: list) -> tuple[list[float], list[float]]:
    """Per plan, ms of the longest stretch without releasing the GIL: one-call serialising
    (``model_dump_json``, one C call) and the piecewise writer's (between its releases).
    CPU time of this thread, so other processes on a busy machine do not inflate it."""
    import knapformer.runtime.plan_lines as lines_module  # where the writer yields the GIL

    one, piecewise = [], []
    rec = PlanRecorder(Path(tempfile.gettempdir()) / "unused.jsonl", enabled=False)
    marks = _SleepMarks()
    real_time, lines_module.time = lines_module.time, marks
    try:
        for plan in plans:
            began = time.thread_time()
            plan.model_dump_json()
            one.append((time.thread_time() - began) * 1e3)
            marks.marks = [time.thread_time()]
            rec._serialize(plan)
            marks.marks.append(time.thread_time())
            piecewise.append(max(np.diff(marks.marks)) * 1e3)
    finally:
        lines_module.time = real_time
    return one, piecewise


def gil_table(sizes: tuple[int, ...], count: int = 20) -> Table:
    table = Table(
        title=f"longest stretch the writer holds the GIL, per plan ({count} plans; CPU time)"
    )
    for col in (
        "sequences",
        "JSON line",
        "one call: median",
        "max",
        "piecewise: median",
        "max",
        "median ratio",
    ):
        table.add_column(col, justify="right")
    for n in sizes:
        plans = plans_of(n, count, seed=n)
        one, piece = gil_holds(plans)
        table.add_row(
            str(n),
            f"{(len(plans[0].model_dump_json()) + 1) / 1024:,.0f} KiB",
            f"{statistics.median(one):.2f} ms",
            f"{max(one):.2f} ms",
            f"{statistics.median(piece):.2f} ms",
            f"{max(piece):.2f} ms",
            f"{statistics.median(one) / statistics.median(piece):.0f}x",
        )
    return table


WRITERS = {
    NoRecorder: "off (noise)",
    OneCallRecorder: "one call (before)",
    PlanRecorder: "piecewise",
}


def latency_tail(tmp: Path, count: int = 40, repeats: int = 3) -> Table:
    """Longest record() call and training-thread stalls, one-call writer (the baseline)
    against piecewise, runs alternating between the two ``repeats`` times.

    The stall of a step is the widest gap in its busy loop: GIL waits, but also the OS
    running something else on a busy machine (the row with recording off shows how much);
    the median over steps is robust to the latter, the max is not."""
    table = Table(
        title=f"latency tail while the writer serialises ({count} plans x {repeats} runs "
        "per writer, one per 20 ms step)"
    )
    for col in (
        "sequences",
        "JSON line",
        "writer",
        "max record()",
        "stall per step: median",
        "p90",
        "max",
        "median vs one call",
    ):
        table.add_column(col, justify="right")
    for n in (1024, 8192, 32768):
        plans = plans_of(n, count, seed=n)
        size = len(plans[0].model_dump_json()) + 1
        seen: dict[type, tuple[list[float], list[float]]] = {
            NoRecorder: ([], []),
            OneCallRecorder: ([], []),
            PlanRecorder: ([], []),
        }
        for i in range(repeats):
            for kind, (times, stalls) in seen.items():
                t, st = time_record(plans, tmp / f"tail{n}-{i}.jsonl", gap_s=0.02, recorder=kind)
                times += t
                stalls += st
        baseline = statistics.median(seen[OneCallRecorder][1])
        for kind, (times, stalls) in seen.items():
            median = statistics.median(stalls)
            table.add_row(
                str(n),
                f"{size / 1024:,.0f} KiB",
                WRITERS[kind],
                f"{max(times):.2f} ms",
                f"{median:.2f} ms",
                f"{np.percentile(stalls, 90):.2f} ms",
                f"{max(stalls):.2f} ms",
                f"{median / baseline:.2f}",
            )
    return table


def demo_steps(world: int, steps: int, record: bool, out: Path) -> tuple[list[float], list[float]]:
    """Step times of one demo run (first steps dropped: warm-up) and, when recording,
    the recorder's own time per step (the slowest rank's ``record`` phase)."""
    from knapformer.contract.plan_io import read_plans
    from knapformer.local.demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=steps, world_size=world, out=out, record=record)
    reports = run_demo(cfg)
    hook = []
    if record:
        for plan in read_plans(out / "plans.jsonl", on_error="raise").plans[3:]:
            times = plan.measurements.per_rank_ms.get("record") if plan.measurements else None
            if times:
                hook.append(max(times))
    return [r.step_ms for r in reports[3:]], hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the demo runs")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="demo steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="demo runs per setting")
    args = parser.parse_args()
    # The plan files are only timed, not kept: the folder goes away even on Ctrl-C.
    with tempfile.TemporaryDirectory(prefix="bench-recorder-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    """Every measurement, writing its plan files under ``tmp``."""
    console = Console()
    table = Table(title="record() on the training thread (ms per call)")
    for col in (
        "sequences",
        "JSON line",
        "recorder median",
        "recorder p99",
        "sync median",
        "sync p99",
        "median speed-up",
    ):
        table.add_column(col, justify="right")
    rates = Table(title="plans written per second")
    for col in ("sequences", "background writer", "synchronous baseline"):
        rates.add_column(col, justify="right")
    for n in (256, 1024):
        plans = plans_of(n, 100, seed=n)
        size = len(plans[0].model_dump_json()) + 1
        rec, _ = time_record(plans, tmp / f"rec{n}.jsonl", gap_s=0.005)
        sync = time_sync(plans, tmp / f"sync{n}.jsonl", gap_s=0.005)
        table.add_row(
            str(n),
            f"{size / 1024:.0f} KiB",
            f"{statistics.median(rec):.4f}",
            f"{np.percentile(rec, 99):.4f}",
            f"{statistics.median(sync):.3f}",
            f"{np.percentile(sync, 99):.3f}",
            f"{statistics.median(sync) / statistics.median(rec):.0f}x",
        )
        bg, sy = throughput(plans, tmp / f"rate{n}.jsonl")
        rates.add_row(str(n), f"{bg:,.0f}", f"{sy:,.0f}")
    console.print(table)
    console.print(rates)
    console.print(gil_table((1024, 8192, 32768)))
    console.print(latency_tail(tmp))

    if args.quick:
        return
    runs: dict[bool, list[float]] = {False: [], True: []}
    per_run: dict[bool, list[float]] = {False: [], True: []}
    hook: list[float] = []
    for i in range(args.repeats):
        for record in (False, True):
            times, own = demo_steps(args.world_size, args.steps, record, tmp / f"demo{i}{record}")
            runs[record] += times
            hook += own
            per_run[record].append(statistics.median(times))
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    demo = Table(
        title=f"demo step time, {args.world_size} CPU workers, {args.steps} steps x "
        f"{args.repeats} runs per setting (first 3 steps of each run dropped)"
    )
    for col in ("recorder", "median step (ms)", "run medians (ms)", "vs off"):
        demo.add_column(col, justify="right")
    demo.add_row("off", f"{off:.1f}", ", ".join(f"{m:.1f}" for m in per_run[False]), "")
    demo.add_row(
        "on (every step)",
        f"{on:.1f}",
        ", ".join(f"{m:.1f}" for m in per_run[True]),
        f"{(on / off - 1) * 100:+.1f} %",
    )
    console.print(demo)
    # Step medians of separate runs spread by several percent on a shared machine; the
    # hook's own time, measured inside each step, is the direct figure.
    share = statistics.median(hook) / on * 100
    console.print(
        f"recorder hook per step (slowest rank, recorded as phase 'record'): median "
        f"{statistics.median(hook):.2f} ms, p90 {np.percentile(hook, 90):.2f} ms = "
        f"{share:.2f} % of the median step (target <= 1 %)"
    )


if __name__ == "__main__":
    main()
