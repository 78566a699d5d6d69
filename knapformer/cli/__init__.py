"""The ``knapformer`` command line. Each command group lives in its own module and
registers itself on the one Typer app. User errors (`KnapformerError` from the library,
`UserError` from a command), usage errors, and what the machine or the arguments did to
a command (an `OSError`: a failing disk, a name too long; a `UnicodeError`: an argument
that is not UTF-8 text) become one-line messages ``error: ...``; anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import typer
import typer.main

try:  # recent typer bundles its own click; older ones use the click package
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover
    from click import ClickException, UsageError

from knapformer.cli import (
    dashboard,
    debug,
    demo,
    export,
    failures,
    plans,
    query,
    render,
    stragglers,
)
from knapformer.cli.errors import UserError
from knapformer.errors import KnapformerError, OptionError
from knapformer.local.signals import handling, interrupt

app = typer.Typer(
    name="knapformer",
    help="Record, inspect, show, animate and debug KnapFormer routing plans.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _module in (plans, demo, dashboard, render, debug, export, stragglers, failures, query):
    _module.register(app)


def _one_line_paragraphs(app: typer.Typer) -> None:
    """Typer keeps a docstring's line breaks in ``--help``, which then breaks mid-sentence
    on a narrower terminal: give each command its help with every paragraph on one line,
    for the terminal to wrap."""
    for info in app.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


_one_line_paragraphs(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; never shows a traceback for user errors."""
    with _noting_ctrl_c() as interrupted:
        code = _run(argv)
    if code == 130 and interrupted:
        # Typer turns Ctrl-C inside a command into a bare exit code 130; say so.
        print("interrupted", file=sys.stderr)
    return code


@contextlib.contextmanager
def _noting_ctrl_c() -> Iterator[list[bool]]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is noted in the yielded list."""
    noted: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        noted.append(True)
        interrupt(signum, frame)

    with handling(signal.SIGINT, on_sigint):
        yield noted


def _run(argv: list[str] | None) -> int:
    try:
        code = app(args=argv, standalone_mode=False, prog_name="knapformer")
    except typer.Exit as done:
        return done.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except UsageError as err:
        if not err.format_message():  # no command at all: the help was printed, asked for
            return 0
        # One line like every other error; where to look for the right usage.
        command = err.ctx.command_path if err.ctx is not None else "knapformer"
        print(f"error: {err.format_message()} (see: {command} --help)", file=sys.stderr)
        return err.exit_code
    except ClickException as err:
        err.show()
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except KnapformerError as err:
        print(f"error: {_message(err, argv)}", file=sys.stderr)
        return 1
    except OSError as err:  # the disk, the file system or a limit of the machine
        print(f"error: {os_error_message(err)}", file=sys.stderr)
        return 1
    except UnicodeError as err:
        print(f"error: {unicode_error_message(err)}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0


def os_error_message(err: OSError) -> str:
    """``PATH: Input/output error`` (the file when the error names one)."""
    reason = err.strerror or str(err) or type(err).__name__
    name = err.filename
    if name is None:
        return reason
    shown = os.fsdecode(name) if isinstance(name, bytes) else str(name)
    return f"{_printable(shown)}: {reason}"


def unicode_error_message(err: UnicodeError) -> str:
    """What was not text: an argument with bytes that are not UTF-8 (Python keeps them
    as surrogates), shown with those bytes escaped."""
    text = getattr(err, "object", None)
    if isinstance(text, str):
        return f"{_printable(text)} is not valid UTF-8 text"
    return f"not valid UTF-8 text ({err})"


def _printable(text: str, width: int = 200) -> str:
    """``text`` shortened, with bytes that are not UTF-8 as ``\\xff``."""
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _message(err: KnapformerError, argv: list[str] | None) -> str:
    """The one line for a user error; options the library names become this command's
    flags (``heads`` -> ``--heads``)."""
    if not isinstance(err, OptionError):
        return str(err)
    return err.with_flags(_flags(sys.argv[1:] if argv is None else argv))


def _flags(argv: list[str]) -> dict[str, str]:
    """Parameter name -> long flag of the command named in ``argv`` (empty if none)."""
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    command = typer.main.get_command(app).commands.get(name)  # type: ignore[attr-defined]
    if command is None:
        return {}
    return {
        param.name: max(param.opts, key=len)
        for param in command.params
        if param.name and param.opts and param.param_type_name == "option"
    }
