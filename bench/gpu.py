"""GPU check: the balancer's CUDA and NCCL paths and the workload model, on one GPU.

    python bench/gpu.py [--out DIR]             # needs CUDA (``make gpu-check`` runs it)
    python bench/gpu.py --device cpu --quick    # tiny sizes on the CPU with gloo (a test)

1. **balancer**: NCCL at world size 1 with CUDA tensors. ``route`` carries q, k, v
   (float32), a bf16 payload and int64 token ids (above 2**53, so any float conversion
   would show); ``pre_attn``, ``post_attn`` and ``reverse_route`` bring everything home,
   and the backward pass (the reverse all-to-alls) returns gradients; all of it must be
   bit-exact. With one GPU the plan keeps every token in place, so "exact" means every
   row arrives and returns unchanged in its own position. These calls run under CUDA's
   sync debug mode set to "error": a host synchronisation in them fails the check. Then
   a few training steps of a `ToyDiT` with a `PlanRecorder`: its output and gradients
   must match the model run without the balancer, and the recorded plans must carry
   the phase times the balancer measured with CUDA events.
2. **workload fit**: forward + backward of one FLUX-sized `DiTBlock` (d = 3072, 24 heads,
   MLP ratio 4, bf16, PyTorch SDPA) for sequence lengths 256 ... 32768, timed with CUDA
   events after a warm-up (median of the repeats), then ``WorkloadModel.calibrate``: γ,
   the time scale (ms per workload unit), the relative RMS error and R². Every
   measurement holds the same number of tokens, n sequences of length L packed as in
   training, so that kernel launches do not swamp short sequences; one sequence's time
   is the measurement / n.
3. **pack**: the router's work around its all-to-all on this device, for the plan of
   the rank of an 8-GPU ``g1n2+g2n1+g4n1`` plan that reorders the most rows
   (``bench/routing.py``'s `PackCase`): route writes tokens (bf16) and their int64
   positions straight into one send buffer in send order (one pass); its receiver
   splits the bytes back into tensors; reverse_route packs without a gather; its
   receiver gathers them back to the packed order while it splits them. GB/s of payload
   (rows x bytes per row, counted once), against a plain ``index_select`` gather of the
   same bytes held as one tensor, moved as the same words, with the same index (the "vs
   gather" column: its time / ours).

4. **comms**: GPU memory per NCCL communicator made as the balancer makes its groups,
   with resource sharing on and off (``bench/comm_memory.py``, a process each): one-rank
   communicators, so the floor of a communicator's cost. Nothing to measure on the CPU.

Writes DIR/gpu-check.json (every figure), DIR/workload-fit.html (the fit, when plotly is
installed) and DIR/plans.jsonl (the plans part 1 recorded). DIR: ``--out``, else
``$GPU_CHECK_OUT``, else runs/gpu-check. Exit status 1 when a part failed or a check did
not hold, else 0; without CUDA (and without ``--device cpu``) one line says that CUDA is
needed, exit 0.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from comm_memory import communicator_memory, print_comms  # bench/, beside this script
from rich.console import Console
from rich.table import Table
from routing import PACK_TOPOLOGY, PackCase

from knapformer.contract.plan_io import read_plans
from knapformer.local.models import DiTBlock, ToyDiT
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.balancer import SequenceBalancer
from knapformer.runtime.recorder import PlanRecorder
from knapformer.tools.block_benchmark import time_block
from knapformer.tools.calibrate import Calibration, calibrate_lengths

PARTS = ("balancer", "fit", "pack", "comms")
JSON_FILE, HTML_FILE, PLANS_FILE = "gpu-check.json", "workload-fit.html", "plans.jsonl"
DEFAULT_OUT = "runs/gpu-check"


@dataclass(frozen=True)
class Sizes:
    """What each part runs; `FULL` on a GPU, `QUICK` for a smoke run (the CPU test)."""

    route_lens: tuple[int, ...]  # part 1: this rank's sequence lengths (zeros included)
    route_dim: int
    route_heads: int
    train_dim: int  # part 1: the ToyDiT trained with a recorder
    train_heads: int
    train_layers: int
    train_steps: int
    train_max_len: int
    block_dim: int  # part 2
    block_heads: int
    lengths: tuple[int, ...]
    tokens_per_measurement: int
    warmup: int
    repeats: int
    pack_dim: int  # part 3
    pack_tokens: tuple[int, ...]  # tokens per GPU of the 8-GPU plan


FULL = Sizes(
    route_lens=(0, 7, 130, 1, 4096, 0, 333, 16384),
    route_dim=3072,
    route_heads=24,
    train_dim=512,
    train_heads=8,
    train_layers=2,
    train_steps=6,
    train_max_len=4096,
    block_dim=3072,
    block_heads=24,
    lengths=tuple(256 * 2**i for i in range(8)),  # 256 ... 32768
    tokens_per_measurement=32768,
    warmup=3,
    repeats=10,
    pack_dim=3072,
    pack_tokens=(4096, 32768, 131072),
)
QUICK = Sizes(
    route_lens=(0, 7, 130, 1, 64, 0, 33),
    route_dim=64,
    route_heads=4,
    train_dim=32,
    train_heads=4,
    train_layers=2,
    train_steps=4,
    train_max_len=48,
    block_dim=128,
    block_heads=4,
    lengths=(32, 64, 128, 256, 512),
    tokens_per_measurement=512,
    warmup=1,
    repeats=3,
    pack_dim=64,
    pack_tokens=(256, 2048),
)


# ----------------------------------------------------------------------- timing
class Stopwatch:
    """Times one region: CUDA events on a GPU (nothing waits until `ms` is read), else
    the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> Stopwatch:
        if self.cuda:
            self._start.record()
        else:
            self._began = time.perf_counter()
        return self

    def stop(self) -> Stopwatch:
        if self.cuda:
            self._end.record()
        else:
            self._ms = (time.perf_counter() - self._began) * 1e3
        return self

    def ms(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        return self._ms


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int):
    """ms of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    watches = []
    for _ in range(repeats):
        watch = Stopwatch(device).start()
        fn()
        watches.append(watch.stop())
    return [w.ms() for w in watches]


@contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """Inside, a CUDA operation that makes the host wait for the GPU raises (CUDA's sync
    debug mode, process-wide, the autograd thread included); nothing on the CPU."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# ------------------------------------------------------------- part 1: balancer
def check_balancer(device: torch.device, sizes: Sizes, out_dir: Path) -> dict:
    """Part 1 on a process group of this one process (NCCL on a GPU, gloo on the CPU)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        routing = check_routing(device, sizes)
        training = train_with_recorder(device, sizes, out_dir / PLANS_FILE)
    finally:
        dist.destroy_process_group()
    checks = {**routing.pop("checks"), **training.pop("checks")}
    return {
        "backend": backend,
        "exact": all(checks.values()),
        "checks": checks,
        **routing,
        **training,
    }


def _round_trip(bal: SequenceBalancer, q, k, v, payload, ids, heads: int) -> dict:
    """route -> pre_attn -> post_attn (attention = v) -> reverse_route -> backward."""
    dim = q.shape[1]
    chunk_lens, q1, got = bal.route(q, {"k": k, "v": v, "payload": payload, "ids": ids})
    k1, v1 = got["k"], got["v"]
    split = (q1.shape[0], heads, dim // heads)
    seq_lens, q2, k2, v2 = bal.pre_attn(q1.reshape(split), k1.reshape(split), v1.reshape(split))
    _, out = bal.post_attn(v2)
    home_lens, back_v, back = bal.reverse_route(
        out.reshape(-1, dim),
        {
            "q": q2.reshape(-1, dim),
            "k": k2.reshape(-1, dim),
            **{n: got[n] for n in ("payload", "ids")},
        },
    )
    weights = {name: torch.randn_like(t) for name, t in (("q", q), ("k", k), ("v", v))}
    loss = (back_v * weights["v"]).sum() + sum((back[n] * weights[n]).sum() for n in "qk")
    loss.backward()
    return {
        "chunk_lens": chunk_lens,
        "routed": {"q": q1, "k": k1, "v": v1, "payload": got["payload"], "ids": got["ids"]},
        "pre_attn": (seq_lens, q2, k2, v2),
        "out": out,
        "home_lens": home_lens,
        "back": {"v": back_v, **back},
        "weights": weights,
    }


def check_routing(device: torch.device, sizes: Sizes) -> dict:
    """Every row (with its id) arrives and returns bit-exact, gradients too, no sync."""
    lens, dim, heads = list(sizes.route_lens), sizes.route_dim, sizes.route_heads
    rows = sum(lens)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(rows, dim, device=device, generator=gen).requires_grad_() for _ in range(3)
    )
    payload = torch.randn(rows, dim, device=device, generator=gen).to(torch.bfloat16)
    ids = torch.arange(rows, device=device, dtype=torch.int64) + (1 << 60)
    bal = SequenceBalancer("g1n1")
    try:
        bal.plan_routing(lens, token_dim=dim)
        sync_error = None
        try:
            with no_host_sync(device):
                r = _round_trip(bal, q, k, v, payload, ids, heads)
        except RuntimeError as err:
            if "synchroniz" not in str(err):
                raise
            sync_error = str(err).splitlines()[0]
            for t in (q, k, v):
                t.grad = None
            r = _round_trip(bal, q, k, v, payload, ids, heads)  # still check exactness
        timings = dict(bal.timings)
    finally:
        bal.close()
    sent = {"q": q, "k": k, "v": v, "payload": payload, "ids": ids}
    shape = (rows, heads, dim // heads)
    seq_lens, q2, k2, v2 = r["pre_attn"]
    checks = {
        "route: one chunk per non-empty sequence": r["chunk_lens"] == [n for n in lens if n],
        "route: rows and ids arrive bit-exact": all(
            torch.equal(r["routed"][n], sent[n].detach()) for n in sent
        ),
        "pre_attn: whole sequences, every head": seq_lens == [n for n in lens if n]
        and all(torch.equal(a, b.detach().reshape(shape)) for a, b in ((q2, q), (k2, k), (v2, v))),
        "post_attn: output back in chunk rows": torch.equal(r["out"], v.detach().reshape(shape)),
        "reverse_route: every row and id home": r["home_lens"] == lens
        and all(torch.equal(r["back"][n], sent[n].detach()) for n in sent),
        "backward: gradients exact": all(
            sent[n].grad is not None and torch.equal(sent[n].grad, r["weights"][n]) for n in "qkv"
        ),
        "no host synchronisation in route ... backward": sync_error is None,
    }
    return {
        "checks": checks,
        "hot_path_sync": sync_error,
        "route_tokens": rows,
        "route_bytes_per_token": dim * (3 * q.element_size() + payload.element_size()) + 8,
        "round_trip_ms": {p: timings[p] for p in timings if p != "plan"},
    }


def train_with_recorder(device: torch.device, sizes: Sizes, path: Path) -> dict:
    """A few steps of a ToyDiT through the balancer with a recorder; compared with the
    same model run without the balancer, and the recorded plans read back."""
    path.unlink(missing_ok=True)
    torch.manual_seed(0)
    model = ToyDiT(sizes.train_dim, sizes.train_heads, sizes.train_layers).to(device)
    reference = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    out_diff = grad_diff = 0.0
    bal = SequenceBalancer("g1n1", recorder=PlanRecorder(path), run="gpu-check")
    try:
        watch = None
        for _ in range(sizes.train_steps):
            if watch is not None:  # read after the step, as training would
                bal.add_timing("forward_backward", watch.ms())
            lens = rng.integers(0, sizes.train_max_len, size=6).tolist()
            bal.plan_routing(lens, token_dim=sizes.train_dim)
            x = torch.randn(sum(lens), sizes.train_dim, device=device)
            watch = Stopwatch(device).start()
            out = model(x, lens, balancer=bal)
            out.square().mean().backward()
            watch.stop()
            ref = reference(x, lens)
            ref.square().mean().backward()
            out_diff = max(out_diff, _max_diff(out, ref))
            for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True):
                grad_diff = max(grad_diff, _max_diff(p.grad, p_ref.grad))
            model.zero_grad()
            reference.zero_grad()
        bal.add_timing("forward_backward", watch.ms())
        bal.finish()
    finally:
        bal.close()
    plans = read_plans(path, on_error="raise").plans
    per_step = [dict(p.measurements.per_rank_ms) if p.measurements else {} for p in plans]
    timed = [{k: v[0] for k, v in m.items()} for m in per_step]
    wanted = ("plan", "route", "reverse_route", "forward_backward")
    checks = {
        "model: output as without the balancer": out_diff <= 1e-5,
        "model: gradients as without the balancer": grad_diff <= 1e-5,
        "recorder: one plan per step": [p.step for p in plans] == list(range(sizes.train_steps)),
        "recorder: route, reverse_route, forward_backward timed": bool(timed)
        and all(all(np.isfinite(t.get(k, np.nan)) and t[k] > 0 for k in wanted) for t in timed),
    }
    return {
        "checks": checks,
        "model_max_abs_diff": out_diff,
        "grad_max_abs_diff": grad_diff,
        "recorded_ms": timed,
    }


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


# --------------------------------------------------------- part 2: workload fit
def fit_workload(device: torch.device, sizes: Sizes) -> tuple[dict, Calibration]:
    """Time forward + backward of one DiTBlock per sequence length, then fit the model."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    d = sizes.block_dim
    torch.manual_seed(0)
    block = DiTBlock(d, sizes.block_heads, mlp_ratio=4).to(device=device, dtype=dtype)
    points = []
    for length in sizes.lengths:
        n = max(1, sizes.tokens_per_measurement // length)
        times = time_block(block, [length] * n, d, dtype, device, sizes.warmup, sizes.repeats)
        ms = statistics.median(times)
        points.append(
            {
                "length": length,
                "sequences": n,
                "ms": ms,
                "ms_per_sequence": ms / n,
                "spread": (max(times) - min(times)) / ms,
                "tflops": 3 * _forward_flops(length, d) * n / (ms * 1e9),
            }
        )
    lengths = np.array([p["length"] for p in points], dtype=np.float64)
    cal = calibrate_lengths(lengths, [p["ms_per_sequence"] for p in points], d)
    for p, predicted in zip(points, cal.predicted, strict=True):
        p["fit_ms_per_sequence"] = float(predicted)
    result = {
        "token_dim": d,
        "heads": sizes.block_heads,
        "mlp_ratio": 4,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": sizes.warmup,
        "repeats": sizes.repeats,
        "gamma": cal.gamma,
        "scale_ms_per_unit": cal.scale,
        "rel_rms_error": cal.rel_rms_error,
        "r2": cal.r2,
        "points": points,
    }
    return result, cal


def _forward_flops(length: int, d: int) -> float:
    """FLOPs of one sequence's forward pass: the workload model's terms, un-scaled."""
    linear, attention = WorkloadModel(d).terms(length)
    return float(linear + attention) * 1e12


# ------------------------------------------------------------------ part 3: pack
def pack_throughput(device: torch.device, sizes: Sizes) -> dict:
    """GB/s of the router's packing around the all-to-all vs a plain gather."""
    rows_out = []
    for tokens in sizes.pack_tokens:
        rows_out.extend(_pack_rows(tokens, device, sizes))
    return {
        "topology": PACK_TOPOLOGY,
        "dim": sizes.pack_dim,
        "dtype": "bfloat16",
        "exact": all(r["exact"] for r in rows_out),
        "rows": rows_out,
    }


def _pack_rows(tokens: int, device, sizes) -> list[dict]:
    case = PackCase.make(tokens, torch.bfloat16, sizes.pack_dim, device)
    exact = case.exact()
    timed = {
        name: statistics.median(time_ms(fn, device, sizes.warmup, sizes.repeats * 2))
        for name, fn in case.phases().items()
    }
    gather = timed["index_select gather"]
    return [
        _pack_row(name, tokens, case.rank, case.rows, case.nbytes, ms, gather, exact)
        for name, ms in timed.items()
    ]


def _pack_row(phase, tokens, rank, rows, nbytes, ms, gather_ms, exact) -> dict:
    return {
        "phase": phase,
        "tokens_per_gpu": tokens,
        "rank": rank,
        "rows": rows,
        "bytes": nbytes,
        "ms": ms,
        "gb_per_s": nbytes / (ms * 1e6),
        "vs_gather": gather_ms / ms,
        "exact": exact,
    }


# ---------------------------------------------------------------------- output
def print_balancer(console: Console, res: dict) -> None:
    table = Table(title=f"1. balancer on {res['backend']}, world size 1: exactness")
    table.add_column("check")
    table.add_column("result")
    for name, ok in res["checks"].items():
        table.add_row(name, "[green]ok[/]" if ok else "[bold red]FAILED[/]")
    console.print(table)
    if res["hot_path_sync"]:
        console.print(f"[bold red]host synchronisation:[/] {res['hot_path_sync']}")
    steps = Table(title="recorded phase times per step (ms, CUDA events on a GPU)")
    phases = ("plan", "route", "reverse_route", "forward_backward", "record", "step")
    steps.add_column("step", justify="right")
    for phase in phases:
        steps.add_column(phase, justify="right")
    for i, times in enumerate(res["recorded_ms"]):
        steps.add_row(str(i), *(f"{times[p]:.3f}" if p in times else "-" for p in phases))
    console.print(steps)


def print_fit(console: Console, res: dict) -> None:
    table = Table(
        title=f"2. DiT block forward + backward, d = {res['token_dim']}, {res['heads']} heads, "
        f"{res['dtype']} (median of {res['repeats']})"
    )
    for col in ("L", "seqs", "ms", "ms/seq", "fit ms/seq", "fit error", "spread", "TFLOP/s"):
        table.add_column(col, justify="right")
    for p in res["points"]:
        error = p["fit_ms_per_sequence"] / p["ms_per_sequence"] - 1
        table.add_row(
            str(p["length"]),
            str(p["sequences"]),
            f"{p['ms']:.3f}",
            f"{p['ms_per_sequence']:.4f}",
            f"{p['fit_ms_per_sequence']:.4f}",
            f"{error:+.1%}",
            f"{p['spread']:.1%}",
            f"{p['tflops']:.3g}",
        )
    console.print(table)
    console.print(
        f"γ = {res['gamma']:.4g}   scale = {res['scale_ms_per_unit']:.4g} ms per workload "
        f"unit   rel. RMS error = {res['rel_rms_error']:.2%}   R² = {res['r2']:.5f}   "
        "(TFLOP/s: 3 × forward FLOPs of the model's terms)"
    )


def print_pack(console: Console, res: dict) -> None:
    table = Table(
        title=f"3. router packing, {res['dtype']} tokens of d = {res['dim']} + int64 "
        f"positions, plan {res['topology']}"
    )
    for col in ("tokens/GPU", "rank", "rows", "MB", "phase", "ms", "GB/s", "vs gather", "exact"):
        table.add_column(col, justify="right")
    for r in res["rows"]:
        table.add_row(
            str(r["tokens_per_gpu"]),
            str(r["rank"]),
            str(r["rows"]),
            f"{r['bytes'] / 1e6:.1f}",
            r["phase"],
            f"{r['ms']:.4f}",
            f"{r['gb_per_s']:.1f}",
            f"{r['vs_gather']:.2f}",
            "ok" if r["exact"] else "[bold red]NO[/]",
        )
    console.print(table)


def write_fit_html(path: Path, cal: Calibration, lengths: np.ndarray, title: str) -> str | None:
    """The fit as one self-contained page; returns why not when plotly is missing."""
    try:
        from knapformer.visualization.calibration import calibration_figure, length_fit_figure
    except ImportError as err:
        return f"not written: {err} (plotly comes with knapformer[dashboard])"
    figures = [
        length_fit_figure(lengths, cal.measured, cal.model, title=title),
        calibration_figure(cal, title=title),
    ]
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)
    ]
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>KnapFormer GPU check: "
        f"workload fit</title></head><body>{''.join(parts)}</body></html>",
        encoding="utf-8",
    )
    return None


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        }
    return info


# ------------------------------------------------------------------------ main
def needs_cuda_line() -> str:
    return (
        f"gpu-check skipped: it needs CUDA, and torch {torch.__version__} sees no CUDA "
        "device here (bench/gpu.py --device cpu --quick runs it on the CPU with tiny sizes)"
    )


def run_parts(device, sizes, out_dir, parts, console) -> tuple[dict, list[str]]:
    """Every part, each on its own: one that fails is reported, the others still run."""
    results: dict = {}
    failures: list[str] = []
    steps = {
        "balancer": (lambda: check_balancer(device, sizes, out_dir), print_balancer),
        "fit": (lambda: fit_workload(device, sizes), print_fit),
        "pack": (lambda: pack_throughput(device, sizes), print_pack),
        "comms": (lambda: communicator_memory(device), print_comms),
    }
    for name in parts:
        run, show = steps[name]
        began = time.perf_counter()
        try:
            res = run()
        except Exception as err:
            console.print(f"[bold red]part {name} FAILED:[/] {type(err).__name__}: {err}")
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            failures.append(f"{name}: {type(err).__name__}: {err}")
            continue
        if name == "fit":
            res, cal = res
            lengths = np.array([p["length"] for p in res["points"]], dtype=np.float64)
            title = f"{environment(device).get('gpu', 'CPU')}, {res['dtype']}"
            res["html"] = write_fit_html(out_dir / HTML_FILE, cal, lengths, title) or HTML_FILE
        res["wall_s"] = time.perf_counter() - began
        show(console, res)
        results[name] = res
        failures.extend(_check_failures(name, res))
    return results, failures


def _check_failures(name: str, res: dict) -> list[str]:
    if name == "balancer":
        return [f"balancer: {c}" for c, ok in res["checks"].items() if not ok]
    if name == "pack" and not res["exact"]:
        return ["pack: unpacking did not restore the packed tensors bit-exact"]
    return []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("GPU_CHECK_OUT") or DEFAULT_OUT),
        help=f"folder of the JSON and HTML (default: $GPU_CHECK_OUT, else {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument(
        "--show",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the tables of a recorded gpu-check.json",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts takes {', '.join(PARTS)}; got {args.parts}")
    return args


def show_recorded(path: Path, console: Console) -> int:
    """The tables of a gpu-check.json written by an earlier run (a GPU's, shown where
    there is none); exit status 1 when that run failed."""
    report = json.loads(path.read_text(encoding="utf-8"))
    env = report["environment"]
    console.print(
        f"recorded {report['when']} on {env.get('gpu', env['device'])}: torch {env['torch']}"
        + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if "cuda" in env else "")
    )
    shows = {"balancer": print_balancer, "fit": print_fit, "pack": print_pack}
    shows["comms"] = print_comms
    for name, show in shows.items():
        if name in report and "error" not in report[name]:
            show(console, report[name])
    for failure in report["failures"]:
        console.print(f"[bold red]  {failure}[/]")
    console.print("GPU check passed" if report["ok"] else "[bold red]GPU CHECK FAILED[/]")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show is not None:
        return show_recorded(args.show, Console(width=140))
    if args.device == "cuda" and not torch.cuda.is_available():
        print(needs_cuda_line())
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # on a busy CPU, waking a second thread can take 20 ms
    sizes = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console(width=140)
    began = time.perf_counter()
    results, failures = run_parts(device, sizes, args.out, args.parts, console)
    report = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": environment(device),
        "quick": args.quick,
        "sizes": asdict(sizes),
        **results,
        "failures": failures,
        "ok": not failures,
        "wall_s": time.perf_counter() - began,
    }
    (args.out / JSON_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    console.print(f"figures: {args.out / JSON_FILE}")
    if failures:
        console.print("[bold red]GPU CHECK FAILED[/]")
        for failure in failures:
            console.print(f"[bold red]  {failure}[/]")
        return 1
    console.print("[bold green]GPU check passed[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
