"""Regenerate the parts of README.md and docs/*.md that a script produces, or check them.

Run: ``make docs`` (``python docs/make_docs.py``), ``make docs-bench``
(``python docs/make_docs.py --bench``), or ``python docs/make_docs.py --check``.
``--only REGEX`` regenerates just the blocks with a command that REGEX matches, e.g.
``python docs/make_docs.py --bench --only bench/routing.py docs/performance.md``.
``--jobs N`` runs N console blocks at once (each in a folder of its own); benchmarks
always run one at a time.

An HTML comment right before a block says how the block is made:

    <!-- console columns=120 mask-columns="plan ms"
    $ knapformer simulate --data-codes joint --topology g8n4 --steps 2
    -->
    ```console
    (rewritten: "$ command" and what it printed, for every command of the marker)
    ```

Markers:

- ``console``: each ``$ `` line is a bash command, run as from the repository root in a
  fixed environment (`command_env`); the fenced block after the marker becomes
  ``$ command`` followed by its output (stdout and stderr together), for each command in
  turn. A block runs in a folder of its own (`block_tree`): the repository's top-level
  entries, by symlink, and an empty ``runs/docs/`` (the scratch folder for the files its
  commands write), so it may rely on its own earlier commands only, and blocks may run
  at once.
- ``console-bench``: the same for commands that are slow or print machine-dependent
  figures (the benchmarks). Only ``--bench`` runs them; the staleness test skips them.
- ``include PATH``: the fenced block holds the text of the file PATH.
- ``docs-index order="a b ..."`` ... ``<!-- /docs-index -->``: a list linking every page
  of docs/ (pages named in ``order`` first, the others by name), each with its summary
  line, the first sentence of the page.

Options of console markers (``key=value``, shell quoting):

- ``columns=N``: the terminal width the commands see (default 120);
- ``exit=N``: exit status the last command must end with (default 0; the others 0);
  ``exit=any`` takes whatever it ends with (a benchmark that exits 1 when it misses a
  target still has its table written);
- ``mask-columns="a, b"``: table columns holding timings, ignored when comparing;
- ``mask=REGEX``: more text ignored when comparing;
- ``optional=REGEX``: whole lines that a run may print or not (a note that depends on the
  machine's load), left out of both sides when comparing;
- ``stop-after=REGEX``: the command is a server: it gets Ctrl-C (SIGINT) once a line
  matching REGEX is printed, and its output ends with that line;
- ``timeout=S``: seconds a command may take (default 600);
- ``needs=browser``: what the commands need, as pytest marks of the test that re-runs
  them (comma-separated; ``browser``: Chromium, skipped by ``-m "not browser"``).

A console block whose output changed only in what is masked keeps its recorded text, so
``make docs`` changes a page only where a command's output changed; benchmark blocks are
always rewritten.

When comparing (``--check`` and tests/test_docs.py), timings (a number with ms, s, µs,
min), dates, clock times, temporary paths, PIDs and local ports are masked, and runs of
spaces and of table rules count as one, so a timing that widens a table column is not a
change; every other character of a recorded output must match what the command prints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
#: The scratch folder of a block's commands, relative to the folder they run in.
SCRATCH = Path("runs") / "docs"
DEFAULT_COLUMNS = 120
DEFAULT_TIMEOUT_S = 600.0
KINDS = ("console", "console-bench", "include", "docs-index")
OPTIONS = ("columns", "exit", "mask-columns", "mask", "optional", "stop-after", "timeout", "needs")

_MARKER = re.compile(r"^<!--\s*(" + "|".join(map(re.escape, KINDS)) + r")(?=\s|-->|$)(.*)$")
_INDEX_END = "<!-- /docs-index -->"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BOX = re.compile(r"[\u2500-\u257f]+")
# What differs between two runs of the same command on the same code.
_MASKS = [
    (re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?\s?(?:ms|s|µs|us|min)\b"), "<time>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?"), "<date>"),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b"), "<clock>"),
    (re.compile(r"/tmp/[^\s'\"),]+"), "<tmp>"),
    (re.compile(r"\btmp[a-z0-9_]{6,}\b"), "<tmp>"),
    (re.compile(r"\b(pid|PID)(\s*[=:]?\s*)\d+"), r"\1\2<pid>"),
    (re.compile(r"((?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\]):)\d+"), r"\1<port>"),
]


class DocsError(Exception):
    """A marker that cannot be used, or a command that did not behave as marked."""


@dataclass
class Block:
    """One generated region of a markdown file.

    ``start``/``end`` index the file's lines: ``start`` is the first line of the
    generated text, ``end`` the line after it (the closing fence or index marker).
    """

    path: Path
    line: int  # 1-based line of the marker, for messages and test ids
    kind: str
    start: int
    end: int
    recorded: str
    commands: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.line}"

    @property
    def columns(self) -> int:
        return int(self.options.get("columns", DEFAULT_COLUMNS))

    @property
    def expected_exit(self) -> int | None:
        """The exit status the last command must end with; None: any (``exit=any``)."""
        value = self.options.get("exit", "0")
        return None if value == "any" else int(value)

    @property
    def timeout_s(self) -> float:
        return float(self.options.get("timeout", DEFAULT_TIMEOUT_S))

    @property
    def masked_columns(self) -> list[str]:
        spec = self.options.get("mask-columns", "")
        return [name.strip() for name in spec.split(",") if name.strip()]


# ------------------------------------------------------------------------- parsing
def shown(path: Path) -> str:
    """``path`` as messages show it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def doc_files() -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def find_blocks(path: Path) -> list[Block]:
    """Every marked block of the markdown file ``path``, in file order (markers inside
    fenced code are examples, not markers)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    inside = set()
    for start, end in fences(lines):
        inside.update(range(start, end + 1))
    blocks = []
    i = 0
    while i < len(lines):
        match = _MARKER.match(lines[i]) if i not in inside else None
        if not match:
            i += 1
            continue
        block, i = _parse_block(path, lines, i, match.group(1), match.group(2))
        blocks.append(block)
    return blocks


def fences(lines: list[str]) -> list[tuple[int, int]]:
    """(opening, closing) line indexes of the top-level fenced code blocks. A fence closes
    with a line of at least as many backticks as opened it, so a ```` block can show a
    ``` block."""
    found, opening, ticks = [], None, ""
    for k, line in enumerate(lines):
        match = re.match(r"^(`{3,})", line)
        if not match:
            continue
        if opening is None:
            opening, ticks = k, match.group(1)
        elif line.strip().startswith(ticks) and set(line.strip()) == {"`"}:
            found.append((opening, k))
            opening = None
    return found


def _parse_block(path: Path, lines: list[str], i: int, kind: str, rest: str) -> tuple[Block, int]:
    where = f"{shown(path)}:{i + 1}"
    header, body, after = _marker_text(lines, i, rest, where)
    try:
        words = shlex.split(header)
    except ValueError as err:
        raise DocsError(f"{where}: cannot parse the marker's options: {err}") from None
    options, arguments = {}, []
    for word in words:
        key, eq, value = word.partition("=")
        if eq and kind != "include":
            if key not in OPTIONS and key != "order":
                raise DocsError(f"{where}: unknown option {key!r} (known: {', '.join(OPTIONS)})")
            options[key] = value
        else:
            arguments.append(word)
    commands = [line.strip()[2:] for line in body if line.strip()]
    if any(not line.strip().startswith("$ ") for line in body if line.strip()):
        raise DocsError(f"{where}: every line inside a marker must be a command starting '$ '")
    if kind.startswith("console") and not commands:
        raise DocsError(f"{where}: a console marker needs at least one '$ command' line")
    if kind == "include" and len(arguments) != 1:
        raise DocsError(f"{where}: include takes one path, got {arguments}")
    if kind == "docs-index":
        end = next((k for k in range(after, len(lines)) if lines[k].strip() == _INDEX_END), None)
        if end is None:
            raise DocsError(f"{where}: docs-index has no closing {_INDEX_END}")
        start = after
    else:
        start, end = _fence_after(lines, after, where)
    block = Block(
        path=path,
        line=i + 1,
        kind=kind,
        start=start,
        end=end,
        recorded="\n".join(lines[start:end]),
        commands=commands,
        options=options,
        argument=arguments[0] if arguments else "",
    )
    return block, end + 1


def _marker_text(lines: list[str], i: int, rest: str, where: str) -> tuple[str, list[str], int]:
    """(options text, command lines, index of the line after the marker)."""
    if rest.rstrip().endswith("-->"):
        return rest.rstrip()[:-3], [], i + 1
    for k in range(i + 1, len(lines)):
        if lines[k].strip() == "-->":
            return rest, lines[i + 1 : k], k + 1
    raise DocsError(f"{where}: marker comment is never closed with a line '-->'")


def _fence_after(lines: list[str], k: int, where: str) -> tuple[int, int]:
    """(first content line, closing fence line) of the fenced block opening at ``k``."""
    match = re.match(r"^(`{3,})", lines[k]) if k < len(lines) else None
    if match is None:
        raise DocsError(f"{where}: the marker must be followed directly by a ``` block")
    ticks = match.group(1)
    for end in range(k + 1, len(lines)):
        if lines[end].strip().startswith(ticks) and set(lines[end].strip()) == {"`"}:
            return k + 1, end
    raise DocsError(f"{where}: the ``` block after the marker is never closed")


def unmarked_console_blocks(path: Path) -> list[int]:
    """1-based lines of ```console blocks that no console marker produces."""
    lines = path.read_text(encoding="utf-8").splitlines()
    produced = {b.start - 1 for b in find_blocks(path) if b.kind.startswith("console")}
    return [
        start + 1
        for start, _ in fences(lines)
        if lines[start].strip() == "```console" and start not in produced
    ]


# ------------------------------------------------------------------------- running
def command_env(columns: int) -> dict[str, str]:
    """The environment every command runs in: the same on every machine, apart from the
    paths a shell needs. The venv's bin comes first so `knapformer` and `torchrun` are the
    ones of the Python running this script; PYTHONPATH makes them use this tree."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {
        "PATH": path,
        "PYTHONPATH": str(ROOT),
        "HOME": os.environ.get("HOME", str(ROOT)),
        "COLUMNS": str(columns),
        "LINES": "50",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "LC_ALL": "C.UTF-8",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",  # stdout and stderr interleave as on a terminal
        "OMP_NUM_THREADS": "1",  # torchrun warns when it has to set this itself
    }
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env


def run_block(block: Block, log=None) -> str:
    """Run the commands of a console block; returns the block's new text."""
    return block_text(run_commands(block, log))


def run_commands(block: Block, log=None, keep: Path | None = None) -> list[tuple[str, str]]:
    """Run the commands of a console block: (command, what it printed) for each. ``keep``:
    a new folder that receives a copy of ``runs/docs/`` as the commands left it (for a
    test that asserts on the files a block's run wrote instead of running it again)."""
    with block_tree() as tree:
        outputs = _run_commands(block, tree, log)
        if keep is not None:
            shutil.copytree(tree / SCRATCH, keep, symlinks=True)
        return outputs


def block_text(outputs: list[tuple[str, str]]) -> str:
    """A console block's text: each ``$ command`` followed by what it printed."""
    parts = []
    for command, output in outputs:
        parts.append(f"$ {command}")
        if output:
            parts.append(output)
    return "\n".join(parts)


@contextlib.contextmanager
def block_tree() -> Iterator[Path]:
    """A new temporary folder for one block's run, removed afterwards: every top-level
    entry of the repository but ``runs/``, by symlink, and an empty ``runs/docs/``.

    The commands name paths relative to the repository (``sample_plans/...``,
    ``runs/docs/...``) and print them so, as when run from its root; but what they write
    under ``runs/`` is their own, so blocks run at once (the tests spread them over their
    workers, and a ``make docs`` may run beside them) cannot empty each other's scratch
    folder. What they write elsewhere (``docs/...``) lands in the repository."""
    tree = Path(tempfile.mkdtemp(prefix="knapformer-docs-"))
    try:
        for entry in ROOT.iterdir():
            if entry.name != "runs":
                (tree / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        (tree / SCRATCH).mkdir(parents=True)
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def _run_commands(block: Block, tree: Path, log=None) -> list[tuple[str, str]]:
    outputs = []
    for k, command in enumerate(block.commands):
        started = time.perf_counter()
        if "stop-after" in block.options:
            output = _run_server(command, block, tree)
        else:
            output, status = _run(command, block, tree)
            expected = block.expected_exit if k == len(block.commands) - 1 else 0
            if expected is not None and status != expected:
                raise DocsError(
                    f"{block.where}: `{command}` exited with {status}, expected {expected}; "
                    f"it printed:\n{output}"
                )
        if log is not None:
            log(f"{block.where}: {command}  ({time.perf_counter() - started:.1f} s)")
        outputs.append((command, output))
    return outputs


def _start(command: str, block: Block, tree: Path) -> subprocess.Popen:
    """``command`` in bash, in the block's ``tree``, in `command_env`, stdout and stderr as
    one stream."""
    return subprocess.Popen(
        ["bash", "-c", command],
        cwd=tree,
        env=command_env(block.columns),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # so a timeout can stop every process the command started
        preexec_fn=_default_ctrl_c,
    )


def _run(command: str, block: Block, tree: Path) -> tuple[str, int]:
    proc = _start(command, block, tree)
    try:
        out, _ = proc.communicate(timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        raise DocsError(f"{block.where}: `{command}` ran past {block.timeout_s} s") from None
    return clean_output(out.decode("utf-8", errors="replace")), proc.returncode


def _run_server(command: str, block: Block, tree: Path) -> str:
    """Run until a line matches stop-after, then Ctrl-C; the output up to that line."""
    pattern = re.compile(block.options["stop-after"])
    proc = _start(command, block, tree)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            lines.put(raw.decode("utf-8", errors="replace"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + block.timeout_s
    try:
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise DocsError(
                    f"{block.where}: `{command}` never printed {pattern.pattern!r}"
                ) from None
            if line is None:
                raise DocsError(
                    f"{block.where}: `{command}` ended before printing {pattern.pattern!r}:\n"
                    + "".join(seen)
                )
            seen.append(line)
            if pattern.search(line):
                return clean_output("".join(seen))
    finally:
        _stop_group(proc, first=signal.SIGINT)


def _default_ctrl_c() -> None:
    """In the child before exec: Ctrl-C as in a terminal, even when this script runs in
    the background (a shell starts background jobs with SIGINT ignored, and an ignored
    signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM) -> None:
    """Stop the command's process group: ``first``, then SIGKILL after 10 s."""
    for sig, wait_s in ((first, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def clean_output(text: str) -> str:
    """Terminal output as a markdown block shows it: no colour codes, carriage returns or
    trailing spaces, no trailing blank lines."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    lines = [line.split("\r")[-1].rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


# ------------------------------------------------------------------ other blocks
def include_text(block: Block) -> str:
    path = ROOT / block.argument
    if not path.is_file():
        raise DocsError(f"{block.where}: include of a missing file {block.argument}")
    return path.read_text(encoding="utf-8").rstrip("\n")


def index_text(block: Block) -> str:
    """The list of docs pages for a docs-index block."""
    order = block.options.get("order", "").split()
    pages = {p.stem: p for p in DOCS.glob("*.md") if p != block.path}
    names = [n for n in order if n in pages] + sorted(n for n in pages if n not in order)
    entries = []
    for name in names:
        title, summary = page_title_and_summary(pages[name])
        link = os.path.relpath(pages[name], block.path.parent)
        entries.append(f"- [{title}]({link}): {summary}")
    return "\n".join(entries)


def page_title_and_summary(page: Path) -> tuple[str, str]:
    """The page's ``# title`` and the first sentence of its first paragraph."""
    lines = page.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("# "):
        raise DocsError(f"{shown(page)}:1: a page starts with a '# title' line")
    paragraph = []
    for line in lines[1:]:
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    text = " ".join(paragraph)
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    return lines[0][2:].strip(), sentence


def fresh_text(block: Block, log=None) -> str:
    """What the block should hold now (runs the commands of console blocks)."""
    if block.kind.startswith("console"):
        return run_block(block, log)
    if block.kind == "include":
        return include_text(block)
    return index_text(block)


# ----------------------------------------------------------------------- comparing
def masked(text: str, block: Block) -> list[str]:
    """``text`` line by line with what may differ between runs masked."""
    lines = mask_table_columns(text.split("\n"), block.masked_columns)
    extra = block.options.get("mask")
    optional = block.options.get("optional")
    out = []
    for line in lines:
        if optional and re.fullmatch(optional, line):
            continue
        for pattern, replacement in _MASKS:
            line = pattern.sub(replacement, line)
        if extra:
            line = re.sub(extra, "<masked>", line)
        out.append(" ".join(_BOX.sub(lambda m: m.group(0)[0], line).split()))
    return out


def mask_table_columns(lines: list[str], names: list[str]) -> list[str]:
    """Blank the cells of the named columns in rich tables (``┃`` header, ``│`` rows).

    A wrapped header is read over all its lines ("plan" over "ms" is "plan ms")."""
    if not names:
        return lines
    out, header, hidden = [], None, set()
    for line in lines:
        if line.lstrip().startswith("┃"):
            cells = line.split("┃")[1:-1]
            if header is None or len(header) != len(cells):
                header = [""] * len(cells)
            header = [f"{h} {c.strip()}".strip() for h, c in zip(header, cells, strict=True)]
            hidden = {i for i, name in enumerate(header) if name in names}
        elif line.lstrip().startswith("│") and hidden:
            header = None
            parts = line.split("│")
            for i in hidden:
                if i + 1 < len(parts) - 1:
                    parts[i + 1] = " <masked> "
            line = "│".join(parts)
        else:
            header = None
        out.append(line)
    return out


def same_output(recorded: str, fresh: str, block: Block) -> bool:
    """Whether the recorded text still shows what the command prints: equal once masked,
    with runs of spaces and table rules (even across line breaks) counted as one."""
    if not block.kind.startswith("console"):
        return recorded == fresh
    return " ".join(masked(recorded, block)).split() == " ".join(masked(fresh, block)).split()


def difference(recorded: str, fresh: str, block: Block) -> str:
    """A unified diff of the masked texts, for messages."""
    return "\n".join(
        difflib.unified_diff(
            masked(recorded, block),
            masked(fresh, block),
            "recorded (masked)",
            "printed now (masked)",
            lineterm="",
        )
    )


# ------------------------------------------------------------------------ updating
def selected_blocks(files: Iterable[Path], bench: bool, only: str | None = None) -> Iterator[Block]:
    """Blocks that a run regenerates: console-bench ones with ``bench``, the others
    without; with ``only``, just those with a command that the regex ``only`` matches
    (one benchmark of a page re-run without the others)."""
    for path in files:
        for block in find_blocks(path):
            if (block.kind == "console-bench") != bench:
                continue
            if only is None or any(re.search(only, c) for c in block.commands):
                yield block


def update(
    files: Iterable[Path], bench: bool, log=None, only: str | None = None, jobs: int = 1
) -> list[Path]:
    """Rewrite the selected blocks of ``files``; returns the files that changed. ``jobs``
    blocks run at once, but benchmarks always one at a time (their figures are timings)."""
    pages = [(path, list(selected_blocks([path], bench, only))) for path in files]
    texts = fresh_texts([b for _, blocks in pages for b in blocks], log, 1 if bench else jobs)
    changed = []
    for path, blocks in pages:
        if not blocks:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        new = [(block, _kept_or_fresh(block, next(texts))) for block in blocks]
        # Replace from the end so earlier blocks' line numbers stay valid.
        for block, text in reversed(new):
            lines[block.start : block.end] = text.split("\n") if text else []
        text = "\n".join(lines) + "\n"
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def fresh_texts(blocks: list[Block], log=None, jobs: int = 1) -> Iterator[str]:
    """`fresh_text` of each of ``blocks``, in order, with ``jobs`` blocks running at once
    (each console block runs in a folder of its own); the first error stops the rest."""
    if jobs <= 1:
        yield from (fresh_text(block, log) for block in blocks)
        return
    pool = ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(fresh_text, block, log) for block in blocks]
        for future in futures:
            yield future.result()
    finally:
        pool.shutdown(cancel_futures=True)


def _kept_or_fresh(block: Block, fresh: str) -> str:
    """The recorded text when it differs from ``fresh`` only in what is masked (a console
    block, not a benchmark), so that regenerating changes a page only where a command's
    output changed; else ``fresh``."""
    if block.kind == "console" and same_output(block.recorded, fresh, block):
        return block.recorded
    return fresh


def check(files: Iterable[Path], log=None, jobs: int = 1) -> list[str]:
    """Problems with the non-bench blocks of ``files``: console blocks that no marker
    produces, then stale blocks (with a diff); ``jobs`` blocks run at once."""
    files = list(files)
    problems = [
        f"{shown(path)}:{line}: ```console block without a marker"
        for path in files
        for line in unmarked_console_blocks(path)
    ]
    blocks = list(selected_blocks(files, bench=False))
    for block, fresh in zip(blocks, fresh_texts(blocks, log, jobs), strict=True):
        if not same_output(block.recorded, fresh, block):
            problems.append(f"{block.where}: stale\n{difference(block.recorded, fresh, block)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: all)")
    parser.add_argument("--bench", action="store_true", help="regenerate the benchmark blocks")
    parser.add_argument("--check", action="store_true", help="report stale blocks, exit 1 if any")
    parser.add_argument(
        "--only", metavar="REGEX", help="regenerate only blocks with a command matching REGEX"
    )
    parser.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=1,
        metavar="N",
        help="run N console blocks at once (benchmarks still run one at a time)",
    )
    args = parser.parse_args(argv)
    files = [p.resolve() for p in args.files] or doc_files()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        if args.check:
            problems = check(files, log, args.jobs)
            for problem in problems:
                print(problem)
            return 1 if problems else 0
        changed = update(files, args.bench, log, args.only, args.jobs)
    except DocsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"updated {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
