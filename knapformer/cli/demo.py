"""``knapformer demo``: a live multi-process training run that records plans and serves the
dashboard on them (what ``make demo`` runs). The training itself is `knapformer.local.demo`."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import typer

from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.contract.runfiles import PLANS_FILE, plans_file
from knapformer.errors import MissingExtraError


def register(app: typer.Typer) -> None:
    app.command()(demo)


def demo(
    steps: int = typer.Option(200, help="training steps; 0 trains until Ctrl-C"),
    world_size: int = typer.Option(8, "--world-size", help="worker processes (CPU, gloo)"),
    topology: str | None = typer.Option(
        None,
        help="compute bags, e.g. g1n2+g2n1+g4n1 (default: bags of 1, 1, 2, 4, ... GPUs, the "
        "largest the largest power of two below --world-size: 6 gives g1n2+g4n1)",
    ),
    data_codes: str | None = typer.Option(
        None,
        "--data-codes",
        help="data mix: a name (joint, mixres, lowres) or codes gGbBiIfFsS,... "
        "(default: the joint mix's data types on 8 GPUs)",
    ),
    out: Path = typer.Option(Path("runs/demo"), help=f"directory for {PLANS_FILE}"),
    dashboard: bool = typer.Option(
        True, "--dashboard/--no-dashboard", help="serve the live dashboard on the plans"
    ),
    port: int = typer.Option(8050, help="dashboard port on 127.0.0.1"),
    every: int = typer.Option(1, help="record every k-th step's plan"),
    slow_rank: int | None = typer.Option(
        None, "--slow-rank", help="make this rank's compute --slow-factor times slower"
    ),
    slow_factor: float = typer.Option(
        2.0, "--slow-factor", help="how much slower --slow-rank computes (it sleeps F-1 times)"
    ),
    cost_model: str = typer.Option(
        "modelled",
        "--cost-model",
        help="modelled: the workload model; history: also learn each GPU's speed from its "
        "measured compute",
    ),
    plan_ahead: bool = typer.Option(
        False, "--plan-ahead", help="gather and plan each next step on a side channel"
    ),
    # Defaults stated here, not imported: the demo module imports torch, which the
    # command line loads only for a command that needs it (tests/test_demo.py checks them).
    head_dim: int = typer.Option(
        16,
        "--head-dim",
        help="width of an attention head; larger: more compute per token (d_model = heads "
        "x head_dim; bench/stragglers.py uses 64)",
    ),
    length_scale: float = typer.Option(
        0.0625,
        "--length-scale",
        help="the data mix's sequence lengths times this (small: a step takes well under 1 s)",
    ),
) -> None:
    """Train a small DiT on CPU workers with the balancer, record every plan, show it live."""
    from knapformer.local.demo import (
        DEMO_CODES,
        DemoConfig,
        check_config,
        format_report,
        model_shape,
        run_demo,
        topology_note,
    )
    from knapformer.local.launcher import WorkerFailed
    from knapformer.local.signals import ignoring_sigint

    cfg = DemoConfig(
        steps=steps,
        world_size=world_size,
        topology=topology,
        data_codes=data_codes or DEMO_CODES,
        out=out,
        every=every,
        slow_rank=slow_rank,
        slow_factor=slow_factor if slow_rank is not None else 1.0,
        cost_model=cost_model,
        plan_ahead=plan_ahead,
        head_dim=head_dim,
        length_scale=length_scale,
    )
    topo, _ = check_config(cfg)  # bad options fail here, before anything starts
    d_model, heads = model_shape(topo, cfg.head_dim)
    plans = plans_file(out)
    server = _start_dashboard(plans, port) if dashboard else None
    try:
        print(
            f"knapformer demo: {world_size} CPU workers (gloo), topology {topo}, "
            f"ToyDiT d_model={d_model} heads={heads} layers={cfg.n_layers}, "
            f"{'until Ctrl-C' if steps == 0 else f'{steps} steps'}; recording to {plans}",
            flush=True,
        )
        note = topology_note(topo)
        if note is not None:
            print(f"note: topology {topo}: {note}", flush=True)
        if slow_rank is not None or cost_model != "modelled" or plan_ahead:
            print(_options_line(cfg), flush=True)
        if server is not None:
            print(f"dashboard: {server.url}  (Ctrl-C stops everything)", flush=True)
        started = time.perf_counter()
        try:
            reports = run_demo(
                cfg,
                on_report=lambda r: print(format_report(r), flush=True),
                on_start=lambda: print(f"started {world_size} workers", flush=True),
            )
        except WorkerFailed as err:
            if err.traceback:  # the failing rank's only; its peers print nothing
                print(err.traceback, file=sys.stderr, end="", flush=True)
            raise UserError(str(err)) from err
        except KeyboardInterrupt:
            print("workers stopped", file=sys.stderr, flush=True)
            raise
        if reports:
            median = statistics.median(r.step_ms for r in reports)
            print(
                f"done: {len(reports)} steps in {time.perf_counter() - started:.1f} s, "
                f"median step {median:.1f} ms; plans in {plans}",
                flush=True,
            )
        if server is not None:
            print(f"training finished; the dashboard stays up at {server.url} (Ctrl-C stops)")
            _wait_for_ctrl_c()
    finally:
        if server is not None:
            with ignoring_sigint():
                server.stop()


def _options_line(cfg) -> str:
    """What the run does beyond the defaults, in one line."""
    parts = []
    if cfg.slow_rank is not None:
        parts.append(f"rank {cfg.slow_rank} computes {cfg.slow_factor:g}x slower")
    if cfg.cost_model != "modelled":
        parts.append(f"cost model {cfg.cost_model}")
    if cfg.plan_ahead:
        parts.append("planning ahead")
    return "; ".join(parts)


def _start_dashboard(plans: Path, port: int):
    """The dashboard in a background thread, or ``None`` (headless) if it is unavailable."""
    try:
        require("dashboard", "the demo's dashboard")
    except MissingExtraError as err:
        print(f"{err}; running headless", flush=True)
        return None
    from knapformer.dashboard.server import start_server

    return start_server(plans, host="127.0.0.1", port=port)


def _wait_for_ctrl_c() -> None:
    stop = threading.Event()
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        print("stopped")
