"""`knapformer trace PLANS --merge DIR` reads torch.profiler traces as foreign input: each
hostile trace of the red-team pass (issue 35) is one `error:` line naming the file and the
field, exit 1, within bounded memory, and no output file is left behind (nor an earlier
one clobbered)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from knapformer.cli import main
from knapformer.contract import limits
from knapformer.contract.plan_io import write_jsonl
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

BASE_NS = 1_700_000_000_000_000_000


def _event(**fields) -> dict:
    return {"ph": "X", "name": "aten::mm", "pid": 7, "tid": 7, "ts": 10.0, "dur": 2.0,
            "args": {"External id": 1}, **fields}  # fmt: skip


def _trace(*events, **top) -> dict:
    return {"traceEvents": list(events) or [_event()], "baseTimeNanoseconds": BASE_NS, **top}


@pytest.fixture
def run(tmp_path) -> Path:
    """A recording of 8 GPUs (ranks 0..7), two steps."""
    lengths = [[40, 3], [9], [17, 5], [2], [30], [8, 8], [12], [4]]
    plans = [plan_routing(lengths, "g1n8", WorkloadModel(64), step=s) for s in range(2)]
    write_jsonl(tmp_path / "plans.jsonl", plans)
    return tmp_path / "plans.jsonl"


def _merge(run: Path, files: dict[str, str | bytes], capsys) -> tuple[int, str, Path]:
    folder = run.parent / "prof"
    folder.mkdir(exist_ok=True)
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        (folder / name).write_bytes(data)
    out = run.parent / "out" / "trace.json"
    out.parent.mkdir(exist_ok=True)
    code = main(["trace", str(run), "-o", str(out), "--merge", str(folder)])
    return code, capsys.readouterr().err, out


DEEP = '{"traceEvents": [{"ph": "X", "ts": 1, "args": ' + "[" * 100_000 + "]" * 100_000 + "}]}"
HOSTILE = {
    "ts-string": (json.dumps(_trace(_event(ts="abc"))), "traceEvents[0].ts is 'abc'"),
    "ts-null": (json.dumps(_trace(_event(ts=None))), "traceEvents[0].ts is None"),
    "ts-list": (json.dumps(_trace(_event(ts=[1]))), "traceEvents[0].ts is a list"),
    "ts-10^330": (json.dumps(_trace(_event(ts=10**330))), "traceEvents[0].ts is 1,000,000,000"),
    "ts-1e400": (
        json.dumps(_trace()).replace('"ts": 10.0', '"ts": 1e400'),
        "traceEvents[0].ts is inf",
    ),
    "ts-nan": (json.dumps(_trace(_event(ts=float("nan")))), "NaN is not a JSON number"),
    "args-list": (
        json.dumps(_trace({"ph": "M", "name": "process_name", "pid": 7, "args": ["x"]})),
        "traceEvents[0].args is a list; it must be an object",
    ),
    "event-not-object": (json.dumps(_trace(_event(), [1, 2])), "traceEvents[1] is a list"),
    "pid-list": (json.dumps(_trace(_event(pid=[7]))), "traceEvents[0].pid is a list"),
    "args-1e400": (
        json.dumps(_trace(_event(args={"flops": [1, 2.5]}))).replace("2.5", "-1e999"),
        "traceEvents[0].args.flops[1] is -inf; a number must be finite",
    ),
    "pid-bool": (json.dumps(_trace(_event(pid=True))), "traceEvents[0].pid is True"),
    "dur-negative": (json.dumps(_trace(_event(dur=-5))), "traceEvents[0].dur is -5 µs"),
    "args-deep": (DEEP, "nested too deeply to read (100,00"),
    "base-infinite": (
        json.dumps(_trace()).replace(str(BASE_NS), "1e400"),
        "baseTimeNanoseconds is inf",
    ),
    "base-huge": (
        json.dumps(_trace()).replace(str(BASE_NS), "9" * 30),
        "baseTimeNanoseconds is 999,999,999",
    ),
    "base-string": (json.dumps(_trace(baseTimeNanoseconds="now")), "baseTimeNanoseconds is 'now'"),
    "rank-string": (
        json.dumps(_trace(distributedInfo={"rank": "3"})),
        "distributedInfo.rank is '3'; it must be a whole number",
    ),
    "rank-100": (
        json.dumps(_trace(distributedInfo={"rank": 100})),
        "rank 100 (distributedInfo.rank) is not a GPU of the plans (ranks 0..7)",
    ),
    "rank-minus-3": (
        json.dumps(_trace(distributedInfo={"rank": -3})),
        "rank -3 (distributedInfo.rank) is not a GPU of the plans",
    ),
    "not-json": ("{'traceEvents': []}", "not valid JSON"),
    "not-utf8": (b'{"traceEvents": [], "x": "\xff"}', "not UTF-8 text"),
    "key-twice": ('{"traceEvents": [], "traceEvents": []}', "appears twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_each_hostile_trace_is_one_line_naming_the_file_and_field(run, capsys, case):
    content, expected = HOSTILE[case]
    name = "job.json" if case.startswith("rank") else "rank0.json"
    out_dir = run.parent / "out"
    out_dir.mkdir()
    (out_dir / "trace.json").write_text("EARLIER")
    code, err, out = _merge(run, {name: content}, capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"prof/{name}" in err and expected in err, err
    assert "Traceback" not in err and len(err) < 600
    # no partial output, and the earlier file is as it was
    assert out.read_text() == "EARLIER" and sorted(p.name for p in out_dir.iterdir()) == [
        "trace.json"
    ]


def test_a_rank_number_too_long_in_a_file_name_is_refused(run, capsys):
    code, err, out = _merge(run, {f"rank{'9' * 200}.json": json.dumps(_trace())}, capsys)
    assert code == 1 and "at most 2,147,483,647" in err and not out.exists()


def test_a_bad_trace_after_a_good_one_leaves_no_partial_output(run, capsys):
    good = json.dumps(_trace(distributedInfo={"rank": 0}))
    bad = json.dumps(_trace(_event(ts="late"), distributedInfo={"rank": 1}))
    code, err, out = _merge(run, {"a.json": good, "b.json": bad}, capsys)
    assert code == 1 and "b.json: traceEvents[0].ts is 'late'" in err
    assert list(out.parent.iterdir()) == []  # the first trace's events were written, then removed


def test_valid_traces_of_the_plans_ranks_are_merged(run, capsys):
    nameless = {"ph": "M", "name": "process_name", "pid": 7, "args": None}  # null: no name
    files = {
        f"r{rank}.json.gz": gzip.compress(
            json.dumps(
                _trace(nameless, _event(ts=5.0 + rank), distributedInfo={"rank": rank})
            ).encode()
        )
        for rank in (0, 7)
    }
    code, err, out = _merge(run, files, capsys)
    assert code == 0, err
    events = json.loads(out.read_text())["traceEvents"]
    merged = [e for e in events if e.get("name") == "aten::mm"]
    assert sorted(e["pid"] - 1000 for e in merged) == [0, 7]
    assert sorted(e["ts"] for e in merged) == [BASE_NS / 1e3 + 5.0, BASE_NS / 1e3 + 12.0]


def _zeros_gz(path: Path, inflated: int) -> None:
    """A gzip file of ``inflated`` zero bytes, written without holding them."""
    chunk = bytes(2**20)
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(inflated // len(chunk)):
            f.write(chunk)


def test_a_compressed_trace_is_bounded_by_what_it_inflates_to(run, capsys):
    folder = run.parent / "prof"
    folder.mkdir()
    _zeros_gz(folder / "rank0.json.gz", limits.MAX_TRACE_BYTES + 2**21)  # 66 MiB -> ~70 KB
    assert (folder / "rank0.json.gz").stat().st_size < 2**20
    (folder / "rank1.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])  # cut short
    code, err, _ = _merge(run, {}, capsys)
    assert code == 1 and f"inflates to more than {limits.MAX_TRACE_BYTES:,} bytes" in err, err
    (folder / "rank0.json.gz").unlink()
    code, err, _ = _merge(run, {}, capsys)
    assert code == 1 and "rank1.json.gz: not a gzip file" in err, err
    (folder / "rank1.json.gz").write_bytes(zlib.compress(b"{}"))  # zlib, not gzip
    code, err, _ = _merge(run, {}, capsys)
    assert code == 1 and "rank1.json.gz: not a gzip file" in err, err


_MERGE_PEAK = (
    "import re, sys; from knapformer.cli import main; "
    "c = main(['trace', sys.argv[1], '-o', sys.argv[2], '--merge', sys.argv[3]]); "
    "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()); "
    "print('rss', int(hwm.group(1)) // 1024); sys.exit(c)"
)


def _merge_in_subprocess(run: Path, folder: Path) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in MiB) of a merge run in its own process."""
    out = run.parent / "big.json"
    done = subprocess.run(
        [sys.executable, "-c", _MERGE_PEAK, str(run), str(out), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stderr, int(done.stdout.split()[-1])


@pytest.mark.timeout(300)
def test_traces_beyond_the_bounds_are_refused_in_bounded_memory(run, tmp_path):
    folder = tmp_path / "prof"
    folder.mkdir()
    huge = folder / "rank0.json"  # 200 MB (sparse: refused on its size, before parsing)
    with huge.open("wb") as f:
        f.truncate(200 * 10**6)
    code, err, rss = _merge_in_subprocess(run, folder)
    assert code == 1 and f"holds more than {limits.MAX_TRACE_BYTES:,} bytes" in err, err
    assert rss < 512, rss  # before: MemoryError, 2.1 GB without a limit
    huge.unlink()
    # just under the byte bound, but objects a parse would turn into gigabytes
    with (folder / "rank0.json").open("w") as f:
        f.write('{"traceEvents": [' + "{}," * (limits.MAX_TRACE_BYTES // 3 - 20) + "{}]}")
    code, err, rss = _merge_in_subprocess(run, folder)
    assert code == 1 and "objects and arrays; a profiler trace holds at most" in err, err
    assert rss < 512, rss


@pytest.mark.timeout(300)
def test_the_largest_trace_the_bounds_admit_merges_in_bounded_memory(run, tmp_path):
    """As many events as the container bound admits (an event is 2 containers), each of 14
    values, as many numbers as the byte bound leaves room for: about the most Python
    objects a trace within the bounds can make."""
    folder = tmp_path / "prof"
    folder.mkdir()
    n = limits.MAX_TRACE_CONTAINERS // 2 - 8
    with (folder / "rank3.json").open("w") as f:
        f.write(f'{{"baseTimeNanoseconds": {BASE_NS}, "traceEvents": [')
        f.write(",".join(
            f'{{"ph":"X","ts":{i}.5,"dur":1.5,"pid":1,"tid":{i % 64},'
            f'"args":{{"a":{i},"b":0.5,"c":0.5,"d":0.5,"e":0.5,"f":0.5,"g":0.5}}}}'
            for i in range(n)
        ))  # fmt: skip
        f.write("]}")
    assert (folder / "rank3.json").stat().st_size <= limits.MAX_TRACE_BYTES
    code, err, rss = _merge_in_subprocess(run, folder)
    assert code == 0, err
    assert rss < 1200, rss  # within the red team's 1.5 GB address-space limit
    merged = json.loads((run.parent / "big.json").read_text())["traceEvents"]
    assert sum(1 for e in merged if e.get("pid") == 1003 and e["ph"] == "X") == n
