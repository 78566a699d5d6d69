"""Benchmark the run store: a whole run's size, the writer's speed and the readers' times.

    .venv/bin/python bench/run_store.py                       # 1,024 GPUs x 100,000 steps
    .venv/bin/python bench/run_store.py --steps 2000 --gpus 64    # a quick look

1. A synthetic run of ``--gpus`` x ``--steps`` (realistic figures: every recorded phase,
   noise, a link probe every 100 steps, rank 5/8 of the way through the group turning
   1.5x slow at 40 % of the run and another slow in bursts from 70 %) written through
   the real `StoreWriter`'s batch path: bytes per rank-step (target <= 32), against
   the JSONL of full plans (bytes per plan measured on real plans of this size);
2. the per-step write path (`StoreWriter.add_plan`: statistics, measured figures, rows,
   segments) on real plans with measurements, on one core: steps/s at ``--gpus``
   (target >= 100) and ms per step at ``--big-gpus`` (target: keeps up at one step/s),
   with the writer's memory; ``record()`` on the training thread with the store on
   (median, target <= 0.05 ms);
   Each segment's steps carry what the step lost (`knapformer.diagnosis.step_loss`,
   over the segment as its window): the loss columns filled at ``--gpus`` (target:
   every step), the CPU time per step of that loss and of its window fit alone, at
   ``--gpus`` x 256 steps and ``--big-gpus`` x 60 (a segment at one step per second),
   and the fit's grid search against the every-pair enumeration it replaces above
   `knapformer.planning.line_fit.EXACT_RANKS` ranks, on 128 GPUs x 10 steps;
3. readers on the written run: the slowest rank of every step (pyarrow, target <= 1 s;
   DuckDB beside it, from the steps table and from all rank rows), the whole-run
   rank_windows, a 1,000-step window in the middle, each against parsing full plans
   from JSONL (timed on a sample, extrapolated);
4. the same figures "on paper" for 10,000 GPUs (sizes scale with rank-steps, per-step
   costs with GPUs, as fitted between ``--gpus`` and ``--big-gpus``).

Prints PASS/FAIL per target; exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from knapformer.contract.phases import RECORDED_PHASES
from knapformer.contract.plan_io import parse_plan_line
from knapformer.contract.run_store import list_segments, read_table, store_folder
from knapformer.contract.store_schema import LOSS_PARTS, RANKS, STEPS, loss_column, phase_column
from knapformer.diagnosis.measured import measure
from knapformer.diagnosis.rank_steps import rank_steps
from knapformer.diagnosis.step_loss import step_losses
from knapformer.planning import line_fit
from knapformer.planning.compute_model import fit_compute
from knapformer.runtime.recorder import PlanRecorder
from knapformer.runtime.store_rows import plan_rows, quantise_ms
from knapformer.runtime.store_writer import StoreWriter
from knapformer.testing.measured_plans import with_measurements
from knapformer.testing.mix_plans import make_plans

CHUNK = 250  # steps synthesised at a time
PROBE_EVERY = 100


def synth_chunk(rng: np.random.Generator, first: int, count: int, n: int) -> tuple:
    """(ranks, steps) tables of steps ``first .. first+count-1`` of ``n`` GPUs."""
    shape = (count, n)
    step = np.arange(first, first + count)
    bag_size = np.where(np.arange(n) < n // 2, 1, np.where(np.arange(n) < 3 * n // 4, 2, 4))
    bag = np.concatenate([np.arange(n // 2), n // 2 + np.arange(n // 4) // 2,
                          n // 2 + n // 8 + np.arange(n - 3 * n // 4) // 4])[:n]  # fmt: skip
    slow = np.ones(shape)
    total = synth_chunk.total
    slow[:, 5 * n // 8] = np.where(step >= 0.4 * total, 1.5, 1.0)
    burst = (step >= 0.7 * total) & ((step // 50) % 3 == 0)
    slow[:, n // 3] = np.where(burst, 1.4, 1.0)
    load = 1.0 + rng.normal(0, 0.002, shape)
    compute = 400.0 * load * rng.lognormal(0, 0.03, shape) * slow
    per_work = compute / load
    rate = per_work / np.median(per_work, axis=1, keepdims=True)
    ms = {p: np.full(shape, np.nan) for p in RECORDED_PHASES}
    ms["compute"] = compute
    for name, base in (("route", 2.5), ("reverse_route", 2.5), ("gather", 0.3)):
        ms[name] = base * rng.lognormal(0, 0.1, shape)
    multi = bag_size > 1
    for name in ("pre_attn", "post_attn"):
        ms[name] = np.where(multi, 1.0 * rng.lognormal(0, 0.1, shape), 0.0)
    exchanges = ms["route"] + ms["pre_attn"] + ms["post_attn"] + ms["reverse_route"]
    ms["forward_backward"] = compute + exchanges
    ms["allreduce"] = ms["forward_backward"].max(axis=1, keepdims=True) - ms[
        "forward_backward"
    ] + 3.0 * rng.lognormal(0, 0.05, shape)  # fmt: skip
    ms["plan"] = ms["gather"] + 2.0 * rng.lognormal(0, 0.05, shape)
    ms["record"] = 0.02 * rng.lognormal(0, 0.2, shape)
    ms["optimizer"] = 6.0 * rng.lognormal(0, 0.02, shape)
    ms["data"] = 0.1 * rng.lognormal(0, 0.5, shape)
    ms["host"] = 0.3 * rng.lognormal(0, 0.2, shape)
    ms["gc"] = np.where(rng.random(shape) < 0.01, 15.0, 0.0)
    ms["untimed"] = 0.4 * rng.lognormal(0, 0.2, shape)
    probe = (step % PROBE_EVERY == 0)[:, None]
    ms["probe"] = np.where(probe, 5.0 * rng.lognormal(0, 0.05, shape), np.nan)
    ms["step"] = sum(ms[p] for p in ("forward_backward", "allreduce", "plan", "record",
                                     "optimizer", "data", "host", "untimed"))  # fmt: skip
    del ms["descheduled"]  # a GPU: never measured
    tokens_in = rng.integers(2_000, 60_000, shape)
    columns = {
        "step": np.repeat(step, n),
        "time": np.repeat(1.8e9 + step * 0.5, n),
        "rank": np.tile(np.arange(n, dtype=np.int32), count),
        "bag": np.tile(bag.astype(np.int32), count),
        "predicted_load": load.astype(np.float32).ravel(),
        "rate": rate.astype(np.float32).ravel(),
        "tokens_in": tokens_in.ravel(),
        "tokens_out": (tokens_in.mean(axis=1, keepdims=True) * load).astype(np.int32).ravel(),
        "tokens_moved": (tokens_in * rng.uniform(0.6, 0.8, shape)).astype(np.int32).ravel(),
        "speed": None,
        "wait_ms": quantise_ms(ms["allreduce"]).ravel(),
        "link_gbps": _probed(probe, 300.0, rng, shape),  # NVLink inside a node
        "link_cross_gbps": _probed(probe, 45.0, rng, shape),  # InfiniBand across nodes
    }
    columns |= {phase_column(p): quantise_ms(v).ravel() for p, v in ms.items()}
    ranks = pa.table(
        {f.name: _array(columns.get(f.name), f, count * n) for f in RANKS}, schema=RANKS
    )
    return ranks, synth_steps(step, n, compute, rate, tokens_in, ms)


def _probed(probe, gbps: float, rng, shape) -> np.ndarray:
    """A link probe's column: about ``gbps`` in the probed steps, NaN (null) elsewhere."""
    return np.where(probe, gbps * rng.lognormal(0, 0.05, shape), np.nan).astype(np.float32).ravel()


def synth_steps(step, n, compute, rate, tokens_in, ms) -> pa.Table:
    """The steps rows of a synthetic chunk, from its rank figures."""
    slowest = np.argmax(rate, axis=1)
    measured = np.median(ms["step"], axis=1)
    ideal = compute.mean(axis=1) / np.median(rate, axis=1)
    columns = {
        "step": step, "time": 1.8e9 + step * 0.5, "gpus": np.full(len(step), n),
        "partition": [f"g1n{n // 2}+g2n{n // 8}+g4n{n // 16}"] * len(step),
        "bags": [f"g1@0-{n // 2 - 1} g2@{n // 2}-{3 * n // 4 - 1} g4@{3 * n // 4}-{n - 1}"]
        * len(step),
        "imbalance_before": tokens_in.max(axis=1) / tokens_in.mean(axis=1),
        "imbalance_after": np.full(len(step), 1.002), "floor_load": np.full(len(step), 0.6),
        "makespan_over_lb": np.full(len(step), 1.002),
        "moved_tokens": (tokens_in.sum(axis=1) * 0.7).astype(np.int64),
        "total_tokens": tokens_in.sum(axis=1), "plan_ms": np.median(ms["plan"], axis=1),
        "step_ms": ms["step"].max(axis=1), "straggler": slowest, "slowest_rank": slowest,
        "slowest_rate": rate.max(axis=1), "full_plan": step % 100 == 0,
        "measured_ms": measured, "ideal_ms": ideal, "lost_ms": measured - ideal,
    }  # fmt: skip
    columns |= {loss_column(p): np.zeros(len(step)) for p in LOSS_PARTS}
    columns[loss_column("slow_ranks")] = compute.max(axis=1) - np.median(compute, axis=1)
    return pa.table({f.name: _array(columns.get(f.name), f, len(step)) for f in STEPS},
                    schema=STEPS)  # fmt: skip


def _array(values, field: pa.Field, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, field.type)
    if field.name.endswith("_ms") and field.type == pa.float32():
        values = quantise_ms(values)
    return pa.array(values, field.type, from_pandas=True)


def write_run(folder: Path, gpus: int, steps: int) -> tuple[float, int]:
    """Write the synthetic run; (seconds, peak RSS bytes above the start)."""
    rng = np.random.default_rng(0)
    synth_chunk.total = steps
    process, start = psutil.Process(), psutil.Process().memory_info().rss
    peak, spent = 0, 0.0
    with StoreWriter(folder, segment_steps=1000) as writer:
        for first in range(0, steps, CHUNK):
            ranks, rows = synth_chunk(rng, first, min(CHUNK, steps - first), gpus)
            began = time.perf_counter()
            writer.add_columns(ranks, rows)
            spent += time.perf_counter() - began
            peak = max(peak, process.memory_info().rss - start)
        began = time.perf_counter()
    return spent + time.perf_counter() - began, peak


def real_plans(gpus: int, count: int) -> list:
    """``count`` real plans of ``gpus`` GPUs (the joint mix) with measurements."""
    rng = np.random.default_rng(1)
    plans = make_plans(min(count, 8), factor=max(gpus // 32, 1))
    out = [with_measurements(plans[i % len(plans)], rng, mean_compute_ms=400.0,
                             slow_rank=plans[0].gpus[-3], slow_factor=1.5)
           for i in range(min(count, 8))]  # fmt: skip
    return out


def fresh(plan, step: int):
    """``plan`` as step ``step``, its statistics not computed yet (as the writer gets it)."""
    copy = plan.model_copy(update={"step": step})
    copy._stats = None
    return copy


def time_add_plan(folder: Path, plans: list, count: int, segment: int) -> tuple[float, int]:
    """ms per step of `StoreWriter.add_plan` (on this thread), and RSS growth (bytes)."""
    process = psutil.Process()
    start, peak = process.memory_info().rss, 0
    writer = StoreWriter(folder, segment_steps=segment)
    inputs = [fresh(plans[s % len(plans)], s) for s in range(count)]
    began = time.perf_counter()
    for plan in inputs:
        writer.add_plan(plan)
        peak = max(peak, process.memory_info().rss - start)
    writer.close()
    return (time.perf_counter() - began) * 1e3 / count, peak


def loss_filled(folder: Path) -> tuple[int, int]:
    """(steps whose loss columns hold a value, steps) of the store in ``folder``."""
    lost = read_table(folder, "steps", columns=["lost_ms"])["lost_ms"]
    return len(lost) - lost.null_count, len(lost)


def segment_figures(plans: list, steps: int) -> list:
    """The figures the writer keeps for a segment's loss, of ``steps`` steps."""
    return [plan_rows(fresh(plans[s % len(plans)], s)).figures for s in range(steps)]


def time_loss(plans: list, steps: int) -> tuple[float, float]:
    """CPU ms per step of a ``steps``-step segment's loss (what the writer computes when
    it closes the segment), and of the window's compute fit alone."""
    figures = segment_figures(plans, steps)
    began = time.process_time()
    step_losses(figures)
    loss_s = time.process_time() - began
    m = rank_steps(figures)
    began = time.process_time()
    fit_compute(m.predicted_share, m.compute_ms)
    return loss_s * 1e3 / steps, (time.process_time() - began) * 1e3 / steps


def exact_against_grid(plans: list, steps: int) -> tuple[float, float, bool]:
    """CPU s of the window fit of ``steps`` steps of ``plans`` by the every-pair
    enumeration and by the grid (`knapformer.planning.line_fit`), and whether both put
    the same ranks off the group's line."""
    m = rank_steps(segment_figures(plans, steps))
    fits, times = [], []
    for exact_ranks in (10**9, line_fit.EXACT_RANKS):
        kept, line_fit.EXACT_RANKS = line_fit.EXACT_RANKS, exact_ranks
        try:
            began = time.process_time()
            fits.append(fit_compute(m.predicted_share, m.compute_ms))
            times.append(time.process_time() - began)
        finally:
            line_fit.EXACT_RANKS = kept
    return times[0], times[1], bool((fits[0].agrees == fits[1].agrees).all())


def time_record(folder: Path, plans: list, calls: int) -> list[float]:
    """ms of each `PlanRecorder.record` call with the store on (a 10 ms step between)."""
    times = []
    with PlanRecorder(folder / "plans.jsonl", every=10**9) as rec:
        for s in range(calls):
            plan = fresh(plans[s % len(plans)], s + 1)
            began = time.perf_counter()
            rec.record(plan)
            times.append((time.perf_counter() - began) * 1e3)
            time.sleep(0.01)
    return times


def timed(action) -> tuple[float, object]:
    began = time.perf_counter()
    result = action()
    return time.perf_counter() - began, result


def jsonl_sample(plans: list, folder: Path) -> tuple[float, float]:
    """(bytes per plan, s to parse one and find its slowest rank) of full plans in JSONL."""
    path = folder / "sample.jsonl"
    with PlanRecorder(path, store=False) as rec:
        for s, plan in enumerate(plans):
            rec.record(fresh(plan, s))
    lines = path.read_bytes().splitlines()
    began = time.perf_counter()
    for line in lines:
        m = measure(parse_plan_line(line.decode()))
        int(np.nanargmax(m.compute_ratio))
    return len(path.read_bytes()) / len(lines), (time.perf_counter() - began) / len(lines)


def store_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def hundredths_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of one ranks segment as written, the same with ms as int32 hundredths)."""
    segment = list_segments(folder, "ranks")[len(list_segments(folder, "ranks")) // 2].path
    table = pq.read_table(segment)
    for i, field in enumerate(table.schema):
        if field.name.endswith("_ms"):
            values = pa.compute.round(pa.compute.multiply(table[i], 100.0))
            table = table.set_column(i, field.name, values.cast(pa.int32()))
    other = segment.with_name("hundredths.parquet")
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    others = [f.name for f in table.schema if f.name not in floats]
    pq.write_table(table, other, compression="zstd", use_byte_stream_split=floats,
                   use_dictionary=others)  # fmt: skip
    sizes = segment.stat().st_size, other.stat().st_size
    other.unlink()
    return sizes


def run(args: argparse.Namespace, tmp: Path) -> bool:
    from rich.console import Console
    from rich.table import Table

    console, n, steps = Console(), args.gpus, args.steps
    rank_steps = n * steps
    run_folder = tmp / "run"
    run_folder.mkdir(parents=True, exist_ok=True)
    store = store_folder(run_folder)
    write_s, write_rss = write_run(store, n, steps)
    size = store_bytes(store)
    per_rank_step = size / rank_steps
    plans = real_plans(n, 8)
    line_bytes, parse_s = jsonl_sample(plans[:4], tmp)
    add_ms, _ = time_add_plan(tmp / "per-step" / "store", plans, args.plan_steps, 256)
    big = real_plans(args.big_gpus, 4)
    big_ms, big_rss = time_add_plan(tmp / "big", big, args.big_steps, 60)
    filled, written = loss_filled(tmp / "per-step" / "store")
    loss_ms, fit_ms = time_loss(plans, 256)
    big_loss_ms, big_fit_ms = time_loss(big, 60)
    exact_s, grid_s, same = exact_against_grid(real_plans(128, 8), 10)
    record_ms = time_record(tmp / "record", plans, args.record_calls)
    as_float, as_hundredths = hundredths_bytes(store)

    slowest_s, slowest = timed(
        lambda: read_table(run_folder, "steps", columns=["step", "slowest_rank", "slowest_rate"])
    )
    duck_steps_s = duck_ranks_s = float("nan")
    try:
        import duckdb

        files = lambda t: [str(s.path) for s in list_segments(store, t)]  # noqa: E731
        steps_sql = f"SELECT step, slowest_rank FROM read_parquet({files('steps')})"
        duck_steps_s, _ = timed(lambda: duckdb.sql(steps_sql).fetchall())
        if not args.skip_duckdb_ranks:
            duck_ranks_s, _ = timed(lambda: duckdb.sql(
                f"SELECT step, arg_max(rank, rate) FROM read_parquet({files('ranks')}) "
                "GROUP BY step").fetchall())  # fmt: skip
    except ImportError:
        pass
    windows_s, windows = timed(lambda: read_table(run_folder, "rank_windows"))
    middle = steps // 2
    window = (middle, min(middle + 999, steps - 1))
    window_s, window_rows = timed(lambda: read_table(run_folder, "ranks", window))
    window_steps = window[1] - window[0] + 1

    table = Table(title=f"run store: {n:,} GPUs x {steps:,} steps ({rank_steps:,} rank-steps)")
    for col in ("figure", "store", "JSONL full plans", "target", ""):
        table.add_column(col, justify="right")
    checks: list[bool] = []

    def row(name: str, value: str, baseline: str, target: str, ok: bool | None) -> None:
        if ok is not None:
            checks.append(ok)
        table.add_row(name, value, baseline, target, {None: "", True: "PASS", False: "FAIL"}[ok])

    row("bytes per rank-step", f"{per_rank_step:.1f} B", f"{line_bytes / n:,.0f} B", "<= 32 B",
        per_rank_step <= 32)  # fmt: skip
    row("whole run", _gb(size), _gb(line_bytes * steps) + " (extrapolated)", "<= 3.2 GB at "
        "1,024 x 100,000", None)  # fmt: skip
    row("ms as int32 hundredths (one segment)", f"{as_float:,} B float32/128",
        f"{as_hundredths:,} B int32", "", None)  # fmt: skip
    row("batch write (synthetic run)", f"{write_s:.1f} s, +{_mb(write_rss)} RSS", "", "", None)
    row(f"per-step write path, {n:,} GPUs", f"{1e3 / add_ms:,.0f} steps/s ({add_ms:.1f} ms)",
        f"{1 / parse_s:,.1f} plans/s parsed", ">= 100 steps/s", 1e3 / add_ms >= 100)  # fmt: skip
    row(f"per-step write path, {args.big_gpus:,} GPUs", f"{big_ms:.1f} ms/step, "
        f"+{_mb(big_rss)} RSS", "", "keeps up at 1 step/s", big_ms < 1000)  # fmt: skip
    row(f"steps with their loss, per-step path, {n:,} GPUs", f"{filled:,} of {written:,}", "",
        "every step", filled == written)  # fmt: skip
    for gpus, segment, loss, fit in ((n, 256, loss_ms, fit_ms), (args.big_gpus, 60, big_loss_ms,
                                                                  big_fit_ms)):  # fmt: skip
        row(f"  step loss (its window fit), {gpus:,} GPUs x {segment}", f"{loss:.1f} ms/step "
            f"({fit:.1f}) CPU", "", "", None)  # fmt: skip
    row("  window fit, 128 GPUs x 10: grid / every pair", f"{grid_s:.3f} s / {exact_s:.3f} s CPU",
        "", "same ranks off", same)  # fmt: skip
    median = statistics.median(record_ms)
    row("record(), store on (median / p99)", f"{median:.4f} / {np.percentile(record_ms, 99):.3f}"
        " ms", "", "<= 0.05 ms", median <= 0.05)  # fmt: skip
    row("slowest rank per step, whole run (pyarrow)", f"{slowest_s:.3f} s ({slowest.num_rows:,})",
        f"{parse_s * steps:,.0f} s (extrapolated)", "<= 1 s", slowest_s <= 1.0)  # fmt: skip
    row("  the same, DuckDB: steps / all rank rows", f"{duck_steps_s:.3f} s / "
        f"{duck_ranks_s:.1f} s", "", "", None)  # fmt: skip
    row("whole-run rank_windows (heatmap data)", f"{windows_s:.3f} s ({windows.num_rows:,} rows)",
        "", "", None)  # fmt: skip
    row(f"{window_steps:,}-step window, all columns", f"{window_s:.3f} s "
        f"({window_rows.num_rows:,} rows)", f"{parse_s * window_steps:,.0f} s (extrapolated)",
        "", None)  # fmt: skip
    console.print(table)

    paper = Table(title="on paper: 10,000 GPUs x 100,000 steps (scaled from the figures above)")
    for col in ("figure", "store", "JSONL full plans"):
        paper.add_column(col, justify="right")
    per_gpu_ms = (big_ms - add_ms) / max(args.big_gpus - n, 1)
    paper.add_row("whole run", _gb(per_rank_step * 1e9), _gb(line_bytes / n * 1e9))
    paper.add_row("per-step write path", f"{add_ms + per_gpu_ms * (10_000 - n):.0f} ms/step", "")
    paper.add_row("slowest rank per step (steps table)", f"{slowest_s * 1e5 / steps:.2f} s", "")
    paper.add_row("rank_windows rows (segments of 1,000 steps)", f"{10_000 * 100:,}", "")
    paper.add_row("1,000-step window", f"{window_s * 10_000 / n * 1000 / window_steps:.1f} s "
                  f"({10_000 * 1000:,} rows)", "")  # fmt: skip
    console.print(paper)
    names = ("size", "per-step write", "4,096-GPU writer", "loss columns", "grid fit",
             "record()", "slowest rank")  # fmt: skip
    for ok, what in zip(checks, names, strict=True):
        console.print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return all(checks)


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f} GB"


def _mb(b: float) -> str:
    return f"{b / 1e6:,.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--big-gpus", type=int, default=4096, help="GPUs of the keep-up check")
    parser.add_argument("--plan-steps", type=int, default=300, help="steps of the per-step path")
    parser.add_argument("--big-steps", type=int, default=30)
    parser.add_argument("--record-calls", type=int, default=300)
    parser.add_argument("--skip-duckdb-ranks", action="store_true",
                        help="skip DuckDB's scan of every rank row")  # fmt: skip
    parser.add_argument("--out", type=Path, help="keep the run here (default: a temp folder)")
    args = parser.parse_args()
    if args.gpus < 16 or args.gpus % 16 or args.big_gpus % 32 or args.steps < 1:
        parser.error("--gpus must be a multiple of 16, --big-gpus of 32, --steps >= 1")
    if args.out is not None:
        ok = run(args, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-run-store-") as tmp:
            ok = run(args, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
