"""``knapformer dashboard PATH``: the live web dashboard of recorded plans."""

from __future__ import annotations

from pathlib import Path

import typer

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError, text_option
from knapformer.cli.extras import require
from knapformer.contract.runfiles import RUNS_LAYOUT


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command()(dashboard)


def dashboard(
    path: Path = typer.Argument(
        ...,
        metavar="PATH",
        help="plans: a .jsonl (followed live), a .json (ours or legacy), or a folder "
        f"of runs (each {RUNS_LAYOUT})",
    ),
    host: str = typer.Option("127.0.0.1", help="address to bind; other than 127.0.0.1 warns"),
    port: int = typer.Option(8050, callback=bounded, help="TCP port (0 picks a free one)"),
) -> None:
    """Serve a live dashboard of routing plans: per-bag load, timeline, traffic, sequences."""
    text_option(host, "--host")
    require("dashboard", "knapformer dashboard")
    # Dash is imported inside the command so `import knapformer` stays light.
    from knapformer.dashboard.server import serve

    if path.exists() and not (path.is_file() or path.is_dir()):
        # A device or a FIFO would be read for ever (/dev/zero never ends).
        raise UserError(f"{path}: not a regular file or a folder; give a plan file or a run folder")
    if not path.exists():
        # Not an error: a training job may create the file in a moment; the page says so.
        print(f"note: {path} does not exist yet; the dashboard will show it when it appears")
    try:
        serve(path, host=host, port=port)  # until Ctrl-C: KeyboardInterrupt, exit code 130
    except KeyboardInterrupt:
        print("dashboard stopped")
        raise
