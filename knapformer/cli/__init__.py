"""The ``knapformer`` command line. Each command group lives in its own module and
registers itself on the one Typer app; user errors become one-line messages."""

from __future__ import annotations

import sys

import typer

try:  # recent typer bundles its own click; older ones use the click package
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click import ClickException

from knapformer.cli import dashboard, debug, demo, plans, render
from knapformer.cli.errors import UserError

app = typer.Typer(
    name="knapformer",
    help="Record, inspect, show, animate and debug KnapFormer routing plans.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _module in (plans, demo, dashboard, render, debug):
    _module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; never shows a traceback for user errors."""
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as done:
        return done.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except ClickException as err:
        err.show()
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0
