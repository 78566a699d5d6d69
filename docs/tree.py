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
    "knapformer": "the one import name; the core a training job installs (no reader, no CUDA)",
    "knapformer/contract": "layer 1, the plan contract: schema, statistics, files, limits, units",
    "knapformer/planning": "layer 2, planning: workload model, planner, history, data mixes",
    "knapformer/diagnosis": "layer 3, diagnosis: measured figures and straggler verdicts",
    "knapformer/runtime": "layer 4, the torch side: balancer, exchanges, timing, recorder",
    "knapformer/integrations": "layer 5, balanced forwards of other libraries' models",
    "knapformer/integrations/diffusers": "diffusers transformers, a declaration each",
    "knapformer/local": "layer 6, worker processes on this machine (launcher, demo)",
    "knapformer/tools": "layer 7, offline tools over plans and the planner",
    "knapformer/cli": "the `knapformer` command, one module per command group (top layer)",
    "knapformer/testing": "helpers shared by the tests and the benchmarks",
    "dashboard": "reader, installed as knapformer.dashboard: the live web dashboard",
    "visualization": "reader, installed as knapformer.visualization: figures, animation, report",
    "bench": "benchmarks, each against a baseline measured in the same run",
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
    lines = [f"{folder}/".ljust(NAME_WIDTH - 1) + " " + what]
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
