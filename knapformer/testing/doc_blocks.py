"""The console blocks of the docs, each run once per test session and shared.

tests/test_docs.py compares a block's output with its page. A behaviour test that needs
the same processes (a multi-process demo, a torchrun job) takes the block's run from
here and asserts on what its commands printed and the files they wrote, instead of
starting the same processes a second time. Whichever test asks first runs the block.
Runs are kept per process: tests/suite_order.py puts the tests that share a block's run
in one unit of work, that of the block's page, so that one worker makes it.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _load_make_docs() -> ModuleType:
    """docs/make_docs.py, the generator of the blocks (a script, not a package module)."""
    if "make_docs" in sys.modules:
        return sys.modules["make_docs"]
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "docs" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


make_docs = _load_make_docs()


@dataclass(frozen=True)
class BlockRun:
    """One run of a console block's commands."""

    block: Any  # make_docs.Block
    outputs: tuple[tuple[str, str], ...]  # (command, what it printed), in order
    folder: Path  # a copy of runs/docs/ as the commands left it

    @property
    def text(self) -> str:
        """The block's text as the generator writes it."""
        return make_docs.block_text(list(self.outputs))

    def output(self, fragment: str) -> str:
        """What the one command containing ``fragment`` printed."""
        found = [out for command, out in self.outputs if fragment in command]
        if len(found) != 1:
            raise LookupError(f"{len(found)} commands of {self.block.where} run {fragment!r}")
        return found[0]

    def path(self, scratch_path: str) -> Path:
        """Where ``runs/docs/...`` (as the commands name it) is kept after the run."""
        relative = Path(scratch_path).relative_to(make_docs.SCRATCH)
        return self.folder / relative


# A failed run is kept too: every test that shares it reports the failure, none reruns it.
_RUNS: dict[tuple[str, tuple[str, ...]], BlockRun | Exception] = {}
_KEPT = tempfile.TemporaryDirectory(prefix="knapformer-docs-")  # removed at exit


def run_of(block: Any) -> BlockRun:
    """The run of ``block`` (a make_docs.Block): its commands run the first time only."""
    key = (block.where, tuple(block.commands))
    if key not in _RUNS:
        folder = Path(_KEPT.name) / str(len(_RUNS))
        try:
            outputs = make_docs.run_commands(block, keep=folder)
            _RUNS[key] = BlockRun(block, tuple(outputs), folder)
        except make_docs.DocsError as err:
            _RUNS[key] = err
    run = _RUNS[key]
    if isinstance(run, Exception):
        raise run
    return run


def block_of(page: str, fragment: str) -> Any:
    """The one console block of ``page`` (relative to the repository) with a command
    containing ``fragment``."""
    blocks = [
        b
        for b in make_docs.find_blocks(ROOT / page)
        if b.kind == "console" and any(fragment in c for c in b.commands)
    ]
    if len(blocks) != 1:
        where = [b.where for b in blocks]
        raise LookupError(f"{len(blocks)} console blocks of {page} run {fragment!r}: {where}")
    return blocks[0]


def run_block_of(page: str, fragment: str) -> BlockRun:
    """The run of the console block of ``page`` whose commands contain ``fragment``."""
    return run_of(block_of(page, fragment))
