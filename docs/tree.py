"""Print the source tree: each folder, and each module with the first sentence of its
docstring (a module's first line says what it is).

Run: ``python docs/tree.py`` (docs/development.md shows its output).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100
NAME_WIDTH = 22
#: Folders listed module by module, and what each is for.
FOLDERS = {
    "knapformer": "the core a training job installs: no reader, no CUDA needed to import",
    "knapformer/tools": "offline tools over plans and the planner",
    "knapformer/local": "worker processes on this machine",
    "knapformer/cli": "the `knapformer` command, one module per command group",
    "dashboard": "reader: the live web dashboard (extra `dashboard`)",
    "visualization": "reader: plotly figures, the manim animation, the HTML report",
    "bench": "benchmarks, each against a baseline measured in the same run",
    "bench/baselines": "the baselines the benchmarks compare against",
    "examples": "jobs to run with torchrun, and measured data",
    "sample_plans": "real plans made by the planner and the demo (see its README.md)",
    "docs": "these pages, their pictures and the scripts that generate them",
    "docs/examples": "the scripts whose code and output the pages show",
}


def first_sentence(path: Path) -> str:
    """The first sentence of the module docstring of ``path`` (empty when there is none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    return re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]


def folder_lines(folder: str, what: str) -> list[str]:
    lines = [f"{folder}/".ljust(NAME_WIDTH) + what]
    modules = sorted((ROOT / folder).glob("*.py"))
    for path in modules:
        summary = first_sentence(path)
        if path.name == "__init__.py" and not summary:
            continue
        name = "  " + path.name + " "
        wrapped = textwrap.wrap(summary, WIDTH - NAME_WIDTH) or [""]
        lines.append(name.ljust(NAME_WIDTH) + wrapped[0])
        lines += [" " * NAME_WIDTH + more for more in wrapped[1:]]
    return lines


def main() -> None:
    for folder, what in FOLDERS.items():
        if (ROOT / folder).is_dir():
            print("\n".join(folder_lines(folder, what)))
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    print("tests/".ljust(NAME_WIDTH) + f"pytest: {len(tests)} test modules, one per concern")


if __name__ == "__main__":
    main()
