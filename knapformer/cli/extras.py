"""The optional extras the reader commands need, checked before a command starts.

The core installs without Dash, plotly, manim or PyAV (pyproject.toml's extras
``dashboard`` and ``animate`` bring them). A reader command run without its extra stops
with one line naming the extra to install, not an ImportError traceback.
"""

from __future__ import annotations

import importlib

from knapformer.errors import MissingExtraError

#: Extra -> the modules it provides that the commands import (pyproject.toml lists the
#: packages; tests/test_extras.py checks that the two agree).
EXTRA_MODULES = {
    "dashboard": ("dash", "plotly"),
    "animate": ("manim", "av"),
    "tensorboard": ("tensorboard",),
    "query": ("duckdb",),
}


def require(extra: str, what: str, *modules: str) -> None:
    """Import ``modules`` (default: every module of ``extra``), or raise
    `MissingExtraError` naming ``extra`` when one of them is not installed."""
    for module in modules or EXTRA_MODULES[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:  # it, or a package it needs: the extra brings both
            raise MissingExtraError(extra, what, err.name or module) from err
