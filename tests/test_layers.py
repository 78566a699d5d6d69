"""The layer rule of the package, read from the source: every import points down.

Layers, lowest first (docs/concepts.md, "Layers and rules"):

    errors < contract < planning < diagnosis < runtime < integrations < local < tools < readers
    < cli

A module may import its own layer and any layer below it. The readers
(``knapformer.dashboard``, ``knapformer.visualization``) see the plan contract,
planning and diagnosis only: never the torch side, the local workers or the tools.
``knapformer.testing`` (test and bench helpers) may import anything but the command line.
Imports under ``if TYPE_CHECKING:`` are not run, so they do not count for the layers;
imports inside functions do. For circles they all count: two modules that name each
other, even for a type checker only, are one concept split in two.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each part of the one import name lives in the repository.
SOURCES = {
    "knapformer": ROOT / "knapformer",
    "knapformer.dashboard": ROOT / "dashboard",
    "knapformer.visualization": ROOT / "visualization",
}
ORDER = (
    "errors",
    "contract",
    "planning",
    "diagnosis",
    "runtime",
    "integrations",
    "local",
    "tools",
    "readers",
    "cli",
    "testing",
)
# The package root re-exports lazily (by name, through importlib), so it sits at the bottom.
_LAYER_OF_PREFIX = {
    "knapformer.errors": "errors",
    "knapformer.contract": "contract",
    "knapformer.planning": "planning",
    "knapformer.diagnosis": "diagnosis",
    "knapformer.runtime": "runtime",
    "knapformer.compat": "runtime",
    "knapformer.integrations": "integrations",
    "knapformer.local": "local",
    "knapformer.tools": "tools",
    "knapformer.dashboard": "readers",
    "knapformer.visualization": "readers",
    "knapformer.cli": "cli",
    "knapformer.testing": "testing",
}
# What a reader may import beyond its own layer: no torch side, local workers or tools.
READERS_SEE = {"errors", "contract", "planning", "diagnosis", "readers"}


def layer_of(module: str) -> str | None:
    if module == "knapformer":
        return "errors"
    for prefix, layer in _LAYER_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def modules() -> Iterator[tuple[str, Path]]:
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "knapformer" and parts and parts[0] in ("dashboard", "visualization"):
                continue
            yield ".".join((package, *parts)), path


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def imports_of(module: str, path: Path, type_only: bool = False) -> set[str]:
    """The knapformer modules ``module`` imports when it runs (absolute names); with
    ``type_only``, also those it imports for a type checker only."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if type_only else _type_checking_blocks(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.add(base)
            # `from knapformer.contract import plan` imports the module knapformer.contract.plan
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in KNOWN and name != module}


KNOWN = frozenset(name for name, _ in modules())  # listed once: a walk of every folder


@cache
def graph(type_only: bool = False) -> dict[str, set[str]]:
    """Every module's imports (`imports_of`; with ``type_only``, what a circle is looked for
    in), parsed on first use: in the worker that runs these tests, not in every worker's
    collection."""
    return {module: imports_of(module, path, type_only) for module, path in modules()}


def allowed(importer: str, imported: str) -> bool:
    mine, theirs = layer_of(importer), layer_of(imported)
    if mine is None or theirs is None:
        return False
    if mine == "readers":
        return theirs in READERS_SEE
    if mine != "testing" and theirs == "readers":
        return mine == "cli"
    return ORDER.index(theirs) <= ORDER.index(mine)


def test_every_module_has_a_layer():
    assert [m for m in KNOWN if layer_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(KNOWN))
def test_imports_point_down(module):
    wrong = sorted(i for i in graph()[module] if not allowed(module, i))
    assert wrong == [], (
        f"{module} ({layer_of(module)}) imports "
        + ", ".join(f"{i} ({layer_of(i)})" for i in wrong)
        + f"; the layer order is {' < '.join(ORDER)}"
    )


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (its modules in order, the first repeated last), or
    None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_type_only_imports_included():
    cycle = cycle_in(graph(type_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_a_circle_made_of_a_type_only_import():
    graph = {"a": {"b"}, "b": set()}
    assert cycle_in(graph) is None
    typed = {"a": {"b"}, "b": {"a"}}  # b names a under TYPE_CHECKING
    assert cycle_in(typed) == ["a", "b", "a"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n")
    assert len(_type_checking_blocks(tree)) > 0


def test_the_rule_catches_a_reader_that_imports_the_torch_side():
    assert not allowed("knapformer.visualization.figures", "knapformer.runtime.router")
    assert not allowed("knapformer.contract.plan", "knapformer.dashboard.app")
    assert not allowed("knapformer.planning.planner", "knapformer.runtime.balancer")
    assert allowed("knapformer.cli.dashboard", "knapformer.dashboard.server")


BARE_READER_IMPORT = ("dashboard", "visualization")


@pytest.mark.parametrize(
    "folder", ["knapformer", "dashboard", "visualization", "tests", "bench", "docs", "examples"]
)
def test_nothing_imports_a_reader_by_its_bare_name(folder):
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.partition(".")[0] in BARE_READER_IMPORT for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "import the readers as knapformer.dashboard / knapformer.visualization"
