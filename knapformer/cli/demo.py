"""``knapformer demo``: a live multi-process training run that records plans and serves the
dashboard on them (what ``make demo`` runs). The training itself is `knapformer.local.demo`."""

from __future__ import annotations

import inspect
import statistics
import sys
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import typer

from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.contract.runfiles import plans_file
from knapformer.errors import KnapformerError, MissingExtraError
from knapformer.local.config import DemoConfig, topology_note


def register(app: typer.Typer) -> None:
    app.command()(demo)


def demo(
    dashboard: bool = typer.Option(
        True, "--dashboard/--no-dashboard", help="serve the live dashboard on the plans"
    ),
    port: int = typer.Option(8050, min=0, max=65535, help="dashboard port on 127.0.0.1"),
    **options: Any,
) -> None:
    """Train a small DiT on CPU workers with the balancer, record every plan, show it live."""
    cfg = DemoConfig(**options)  # bad options fail here, before anything starts
    from knapformer.local.demo import format_report, prepare_out, run_demo  # imports torch
    from knapformer.local.launcher import WorkerFailed
    from knapformer.local.signals import ignoring_sigint

    topo = cfg.parsed_topology
    d_model, heads = cfg.model_dims
    plans = plans_file(cfg.out)
    # The earlier recording goes before the server starts: it must never read the old run.
    server = _start_dashboard(plans, port, lambda: prepare_out(cfg)) if dashboard else None
    try:
        print(
            f"knapformer demo: {cfg.world_size} CPU workers (gloo), topology {topo}, "
            f"ToyDiT d_model={d_model} heads={heads} layers={cfg.n_layers}, "
            f"{'until Ctrl-C' if cfg.steps == 0 else f'{cfg.steps} steps'}; "
            f"recording to {plans}",
            flush=True,
        )
        note = None if cfg.auto else topology_note(topo)
        if note is not None:
            print(f"note: topology {topo}: {note}", flush=True)
        if (
            cfg.slow_rank is not None
            or cfg.cost_model != "modelled"
            or cfg.plan_ahead
            or cfg.fault is not None
        ):
            print(_options_line(cfg), flush=True)
        if server is not None:
            print(f"dashboard: {server.url}  (Ctrl-C stops everything)", flush=True)
        started = time.perf_counter()
        try:
            reports = run_demo(
                cfg,
                on_report=lambda r: print(format_report(r), flush=True),
                on_start=lambda: print(f"started {cfg.world_size} workers", flush=True),
            )
        except WorkerFailed as err:
            if err.traceback:  # the failing rank's only; its peers print nothing
                print(err.traceback, file=sys.stderr, end="", flush=True)
            _print_incident(plans)
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


def _config_options() -> list[inspect.Parameter]:
    """One typer option per `DemoConfig` field, with the field's default and help: the
    options are declared once, on the config (``--world-size`` from ``world_size``; a bool
    field gives ``--x/--no-x``)."""
    types = typing.get_type_hints(DemoConfig)
    return [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(
                f.default, help=f.metadata["help"], show_default=f.metadata["shown"] or True
            ),
            annotation=types[f.name],
        )
        for f in fields(DemoConfig)
    ]


def _take_config_options(command: Callable[..., None]) -> None:
    """Replace ``command``'s ``**options`` by the config's options, for typer to read."""
    own = list(inspect.signature(command).parameters.values())[:-1]  # all but **options
    params = _config_options() + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}


_take_config_options(demo)


def _print_incident(plans: Path) -> None:
    """What the run's balancers named, as they wrote it beside the plans (if they did)."""
    from knapformer.contract.incident import incident_file, run_incident

    try:
        incident = run_incident(plans)
    except KnapformerError as err:
        print(f"the run's incident cannot be read: {err}", file=sys.stderr, flush=True)
        return
    if incident is not None:
        where = incident_file(plans.parent)
        print(f"{incident.headline()}\n(recorded in {where})", file=sys.stderr, flush=True)


def _options_line(cfg: DemoConfig) -> str:
    """What the run does beyond the defaults, in one line."""
    parts = []
    if cfg.slow_rank is not None:
        parts.append(f"rank {cfg.slow_rank} computes {cfg.slow_factor:g}x slower")
    if cfg.cost_model != "modelled":
        parts.append(f"cost model {cfg.cost_model}")
    if cfg.plan_ahead:
        parts.append("planning ahead")
    if cfg.fault is not None:
        f = cfg.fault
        parts.append(f"rank {f.rank} will {f.kind} at step {f.step}, {f.phase}")
    return "; ".join(parts)


def _start_dashboard(plans: Path, port: int, prepare: Callable[[], None]):
    """The dashboard in a background thread, or ``None`` (headless) if it is unavailable.
    ``prepare`` (removing the earlier recording) runs once the port is known to be free,
    before the server reads anything."""
    try:
        require("dashboard", "the demo's dashboard")
    except MissingExtraError as err:
        print(f"{err}; running headless", flush=True)
        return None
    from knapformer.dashboard.server import check_free, start_server

    check_free("127.0.0.1", port)  # a busy port fails before the old recording goes
    prepare()
    return start_server(plans, host="127.0.0.1", port=port)


def _wait_for_ctrl_c() -> None:
    stop = threading.Event()
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        print("stopped")
