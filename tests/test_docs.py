"""The docs cannot go stale: every generated block of README.md and docs/*.md still shows
what its command prints (timings masked), every console block is generated, and every
link and every page the code cites exists. Also checks the generator itself on small
markdown files of its own."""

from __future__ import annotations

import io
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from knapformer.testing.doc_blocks import make_docs, run_of

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = make_docs.doc_files()
BLOCKS = [b for path in DOC_FILES for b in make_docs.find_blocks(path)]


def _param(block):
    """The block as a test case, marked with what its commands need (``needs=browser``)."""
    needs = [n for n in block.options.get("needs", "").split(",") if n]
    return pytest.param(block, id=block.where, marks=[getattr(pytest.mark, n) for n in needs])


CONSOLE = [_param(b) for b in BLOCKS if b.kind == "console"]
STALE_HINT = "run `make docs` and commit the pages (docs/development.md)"


# ------------------------------------------------------------------- the real docs
@pytest.mark.parametrize("block", CONSOLE)
def test_console_block_shows_what_its_command_prints(block):
    # A block's run is shared with the behaviour tests that need the same processes
    # (knapformer/testing/doc_blocks.py): whichever asks first runs it.
    fresh = run_of(block).text
    assert make_docs.same_output(block.recorded, fresh, block), (
        f"{block.where} is stale; {STALE_HINT}\n"
        + make_docs.difference(block.recorded, fresh, block)
    )


def test_included_files_and_page_indexes_are_current():
    stale = [
        b.where
        for b in BLOCKS
        if b.kind in ("include", "docs-index") and b.recorded != make_docs.fresh_text(b)
    ]
    assert not stale, f"out of date: {', '.join(stale)}; {STALE_HINT}"


def test_every_console_block_is_generated():
    unmarked = [
        f"{make_docs.shown(path)}:{line}"
        for path in DOC_FILES
        for line in make_docs.unmarked_console_blocks(path)
    ]
    assert not unmarked, f"console blocks typed by hand (give them a marker): {unmarked}"
    assert any(b.kind == "console-bench" for b in BLOCKS), "the benchmark tables lost their markers"


def test_readme_stays_short_and_shows_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    broken = []
    for path in DOC_FILES:
        for target in _LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{make_docs.shown(path)}: {target}")
    assert not broken, f"links to missing files: {broken}"


def test_pages_cited_by_the_code_exist():
    """A comment or docstring that names a .md file names one in the repository."""
    cited = re.compile(r"(?<![\w/.-])([\w-]+(?:/[\w-]+)*\.md)\b")
    missing = []
    for folder in ("knapformer", "dashboard", "visualization", "bench", "examples", "docs"):
        for py in (ROOT / folder).rglob("*.py"):
            for name in cited.findall(py.read_text(encoding="utf-8")):
                if not any((base / name).exists() for base in (ROOT, ROOT / "docs", py.parent)):
                    missing.append(f"{py.relative_to(ROOT)}: {name}")
    assert not missing, f"the code cites pages that do not exist: {missing}"


# ------------------------------------------------------------- the generator itself
def _page(tmp_path: Path, body: str) -> Path:
    tmp_path.mkdir(exist_ok=True)
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\nA page.\n\n{body}\n", encoding="utf-8")
    return page


def _console(commands: list[str], options: str = "", recorded: str = "") -> str:
    lines = "\n".join(f"$ {c}" for c in commands)
    return f"<!-- console {options}\n{lines}\n-->\n```console\n{recorded}\n```"


def _only_block(page: Path):
    (block,) = make_docs.find_blocks(page)
    return block


def test_generator_writes_output_and_check_catches_edits(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("moved 42 tokens in 12.5 ms\n", encoding="utf-8")
    page = _page(tmp_path, _console([f"cat {data}"]))

    assert make_docs.update([page], bench=False) == [page]
    assert f"$ cat {data}\nmoved 42 tokens in 12.5 ms\n```" in page.read_text(encoding="utf-8")
    assert make_docs.check([page]) == []
    assert make_docs.update([page], bench=False) == []  # regenerating changes nothing

    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("12.5 ms", "980.1 ms"), encoding="utf-8")
    assert make_docs.check([page]) == [], "a different timing is not a change"
    assert make_docs.update([page], bench=False) == [], "nor a reason to rewrite the page"

    page.write_text(text.replace("moved 42", "moved 43"), encoding="utf-8")
    (problem,) = make_docs.check([page])
    assert "stale" in problem and "-moved 43 tokens" in problem and "+moved 42 tokens" in problem

    page.write_text(text, encoding="utf-8")
    data.write_text("moved 7 tokens in 12.5 ms\n", encoding="utf-8")  # the "code" changed
    (problem,) = make_docs.check([page])
    assert "+moved 7 tokens" in problem


def test_only_regenerates_the_blocks_whose_command_matches(tmp_path):
    page = _page(
        tmp_path,
        _console(["echo first"], recorded="old")
        + "\n\n"
        + _console(["echo second"], recorded="old"),
    )
    assert make_docs.update([page], bench=False, only=r"echo s") == [page]
    text = page.read_text(encoding="utf-8")
    assert "$ echo second\nsecond" in text, "the matching block is rewritten"
    assert "$ echo first\n" not in text.split("```console")[1], "the other is left alone"
    assert text.split("```console")[1].strip().startswith("old")


def test_a_blocks_run_is_shared_with_its_outputs_and_files(tmp_path):
    runs = tmp_path / "runs.txt"
    write = f"echo run >> {runs}; mkdir -p runs/docs/out; echo kept > runs/docs/out/f.txt"
    page = _page(tmp_path, _console([write, "echo second"]))
    shared = run_of(_only_block(page))
    assert run_of(_only_block(page)) is shared  # the same block asked for again: not rerun
    assert runs.read_text(encoding="utf-8") == "run\n"
    assert shared.text == f"$ {write}\n$ echo second\nsecond"
    assert shared.output("echo second") == "second" and shared.output("mkdir") == ""
    # what the commands wrote outlives the block's folder, removed after the run
    assert shared.path("runs/docs/out/f.txt").read_text(encoding="utf-8") == "kept\n"

    failing = _only_block(_page(tmp_path / "sub", _console([f"echo run >> {runs}; exit 3"])))
    for _ in range(2):  # a failed run is reported to every test that shares it, not rerun
        with pytest.raises(make_docs.DocsError, match="exited with 3"):
            run_of(failing)
    assert runs.read_text(encoding="utf-8") == "run\nrun\n"


def test_hand_typed_console_block_is_reported(tmp_path):
    page = _page(tmp_path, "```console\n$ knapformer show x.json\npasted\n```")
    (problem,) = make_docs.check([page])
    assert "without a marker" in problem and ":5:" in problem


def test_marker_inside_a_code_example_is_not_run(tmp_path):
    page = _page(tmp_path, "````\n" + _console(["false"]) + "\n````")
    assert make_docs.find_blocks(page) == []


def test_unexpected_exit_status_stops_the_generator(tmp_path):
    page = _page(tmp_path, _console(["echo oops; exit 3"]))
    with pytest.raises(make_docs.DocsError, match="exited with 3, expected 0"):
        make_docs.update([page], bench=False)
    page = _page(tmp_path, _console(["echo refused; exit 1"], options="exit=1"))
    make_docs.update([page], bench=False)
    assert "$ echo refused; exit 1\nrefused" in page.read_text(encoding="utf-8")
    with pytest.raises(make_docs.DocsError, match="exited with 0, expected 1"):
        make_docs.update([_page(tmp_path, _console(["true"], options="exit=1"))], bench=False)
    for status in (0, 1):  # a benchmark that may miss a target: any status is taken
        page = _page(tmp_path, _console([f"echo table; exit {status}"], options="exit=any"))
        make_docs.update([page], bench=False)
        assert f"$ echo table; exit {status}\ntable" in page.read_text(encoding="utf-8")


def test_commands_see_a_fixed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "33")
    monkeypatch.setenv("KNAPFORMER_CHROMIUM", "/somewhere")
    page = _page(
        tmp_path,
        _console(['echo "$COLUMNS ${KNAPFORMER_CHROMIUM:-unset} $TZ"'], "columns=77"),
    )
    output = make_docs.run_block(_only_block(page))
    assert output.splitlines()[1] == "77 unset UTC"


def test_commands_run_in_a_tree_of_their_own_that_shows_the_repository(tmp_path):
    name = f"{tmp_path.name}.txt"  # a scratch file no other run writes
    commands = [
        "pwd",
        "ls -A runs/docs | wc -l",
        f"echo mine > runs/docs/{name}",
        "python -c 'import pathlib; print(pathlib.Path(\"knapformer\").resolve())'",
        "ls sample_plans/mixed8_g1n2+g2n1+g4n1.json",
        "ls -A | grep -vx runs | sort",
    ]
    run = run_of(_only_block(_page(tmp_path, _console(commands))))
    tree = Path(run.output("pwd"))
    assert tree != ROOT and not tree.exists(), "a temporary folder, removed after the run"
    assert run.output("wc -l") == "0", "runs/docs/ starts empty"
    assert run.path(f"runs/docs/{name}").read_text(encoding="utf-8") == "mine\n"
    assert not (ROOT / "runs" / "docs" / name).exists(), "the repository's runs/ is not used"
    # relative paths resolve as from the repository's root, to the repository's files
    assert run.output("resolve") == str(ROOT / "knapformer")
    assert run.output("ls sample_plans") == "sample_plans/mixed8_g1n2+g2n1+g4n1.json"
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "runs")
    assert run.output("sort").splitlines() == entries


def _meeting_page(folder: Path, me: str, other: str, kind: str = "console", tries: int = 600):
    """A page whose block writes ``me`` to its scratch folder, then waits (up to ``tries``
    tenths of a second) for the block that writes ``other``, says whether they met, and
    shows what its scratch file holds."""
    meet = (
        f"echo {me} > runs/docs/who.txt; touch {folder}/{me}; "
        f"for _ in $(seq {tries}); do [ -e {folder}/{other} ] && break; sleep 0.1; done; "
        f"[ -e {folder}/{other} ] && echo met {other}; cat runs/docs/who.txt"
    )
    block = _console([meet], "timeout=120").replace("<!-- console", f"<!-- {kind}")
    return _page(folder / f"page_{me}", block)


def test_blocks_run_at_once_each_with_its_own_scratch_folder(tmp_path):
    """Two blocks started together both run, each seeing its own runs/docs/ (a lock or a
    shared folder would make the first wait for the second in vain, or mix their files)."""
    blocks = [_only_block(_meeting_page(tmp_path, *who)) for who in (("a", "b"), ("b", "a"))]
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(make_docs.run_block, blocks))
    assert [t.splitlines()[1:] for t in texts] == [["met b", "a"], ["met a", "b"]]


def test_jobs_run_pages_at_once_and_write_what_one_at_a_time_writes(tmp_path):
    pages = [_meeting_page(tmp_path, *who) for who in (("a", "b"), ("b", "a"))]
    assert make_docs.update(pages, bench=False, jobs=2) == pages
    assert "\nmet b\na\n```" in pages[0].read_text(encoding="utf-8")
    assert "\nmet a\nb\n```" in pages[1].read_text(encoding="utf-8")
    assert make_docs.check(pages, jobs=2) == []

    body = "\n\n".join(_console([f"echo {k}"]) for k in range(4))
    several, alone = _page(tmp_path / "several", body), _page(tmp_path / "alone", body)
    make_docs.update([several], bench=False, jobs=3)
    make_docs.update([alone], bench=False, jobs=1)
    assert several.read_text(encoding="utf-8") == alone.read_text(encoding="utf-8")


def test_benchmarks_run_one_at_a_time_whatever_the_jobs(tmp_path):
    folder = tmp_path / "bench"
    folder.mkdir()
    pages = [_meeting_page(folder, *who, "console-bench", tries=20) for who in ("ab", "ba")]
    make_docs.update(pages, bench=True, jobs=2)
    # the first ran alone (it never met the second); the second found the first's mark
    assert "\na\n```" in pages[0].read_text(encoding="utf-8")
    assert "\nmet a\nb\n```" in pages[1].read_text(encoding="utf-8")


def test_commands_get_ctrl_c_even_when_the_generator_ignores_it(tmp_path):
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    page = _page(tmp_path, _console([f'python -c "{probe}"']))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        output = make_docs.run_block(_only_block(page))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert output.splitlines()[1] == "True"


def test_bench_blocks_run_only_with_bench(tmp_path):
    page = _page(
        tmp_path,
        _console(["echo fast"])
        + "\n\n"
        + _console(["echo slow"]).replace("<!-- console", "<!-- console-bench"),
    )
    make_docs.update([page], bench=False)
    text = page.read_text(encoding="utf-8")
    assert "$ echo fast\nfast" in text and "\nslow\n" not in text
    make_docs.update([page], bench=True)
    assert "$ echo slow\nslow" in page.read_text(encoding="utf-8")
    assert make_docs.check([page]) == []  # bench output is never compared


def test_timing_columns_are_masked_but_other_columns_are_not(tmp_path):
    from rich.console import Console
    from rich.table import Table

    def table(plan_ms: str, moved: str) -> str:
        t = Table()
        for name in ("topology", "moved", "plan ms"):
            t.add_column(name)
        t.add_row("g8n4", moved, plan_ms)
        out = io.StringIO()
        Console(width=60, file=out).print(t)
        return out.getvalue()

    page = _page(tmp_path, _console(["true"], 'mask-columns="plan ms"'))
    block = _only_block(page)
    recorded = table("2.89", "1,000")
    assert make_docs.same_output(recorded, table("1234.56", "1,000"), block)
    assert not make_docs.same_output(recorded, table("2.89", "1,001"), block)


def test_server_is_stopped_after_the_awaited_line(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(
        "import time\nprint('booting')\nprint('serving at http://127.0.0.1:4321/', flush=True)\n"
        "time.sleep(300)\nprint('never shown')\n",
        encoding="utf-8",
    )
    page = _page(tmp_path, _console([f"python {script}"], 'stop-after="serving at" timeout=60'))
    output = make_docs.run_block(_only_block(page))
    assert output.splitlines()[1:] == ["booting", "serving at http://127.0.0.1:4321/"]


def test_include_and_index_blocks(tmp_path):
    code = tmp_path / "example.py"
    code.write_text("print('hi')\n", encoding="utf-8")
    page = _page(tmp_path, f"<!-- include {code} -->\n```python\nold\n```")
    make_docs.update([page], bench=False)
    assert "```python\nprint('hi')\n```" in page.read_text(encoding="utf-8")

    index = make_docs.index_text(
        make_docs.Block(
            path=ROOT / "README.md",
            line=1,
            kind="docs-index",
            start=0,
            end=0,
            recorded="",
            options={"order": "development concepts"},
        )
    )
    entries = index.splitlines()
    assert entries[0].startswith("- [Development](docs/development.md): ")
    assert entries[1].startswith("- [Concepts and the plan contract](docs/concepts.md): ")
    assert len(entries) == len(list((ROOT / "docs").glob("*.md")))
