"""Numeric options checked where they are parsed, against the one table of their ranges
(`knapformer.contract.limits.OPTION_BOUNDS`): a value out of range is one ``error:`` line
naming the flag, before the command runs."""

from __future__ import annotations

from typing import Any

import typer

from knapformer.contract.limits import check_option


def bounded(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """The parsed ``value`` of a numeric option, once within its range (an `OptionError`
    otherwise, which the command line prints with the flag's name)."""
    if ctx.resilient_parsing:  # completion, --help: nothing runs
        return value
    return check_option(param.name or "", value)
