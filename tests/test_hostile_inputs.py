"""Hostile plan files and options (issue 17, items 4, 5, 6, 8 and the smaller ones): each
is refused with one line naming the value, in memory that does not grow with the value."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.contract import limits
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.plan_io import PlanFormatError, parse_plan_line, read_plans
from knapformer.contract.positions import gpu_positions
from knapformer.contract.stats import compute_stats
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.datamix import parse_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel

MODEL = WorkloadModel(token_dim=256, gamma=0.4)
EXE = shutil.which("knapformer") or str(Path(sys.executable).parent / "knapformer")


def sample(plan8_path: Path) -> dict:
    return json.loads(plan8_path.read_text())


def write(tmp_path: Path, name: str, record: dict | str) -> Path:
    path = tmp_path / name
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def renamed(record: dict, rename: dict[int, int]) -> dict:
    """The plan with GPU ranks renamed (positions and everything else unchanged)."""
    out = json.loads(json.dumps(record))

    def r(values):
        return [rename.get(v, v) for v in values]

    out["gpus"] = r(out["gpus"])
    out["bags"] = [r(bag) for bag in out["bags"]]
    out["sequences"]["src_gpu"] = r(out["sequences"]["src_gpu"])
    out["chunks"]["src_gpu"] = r(out["chunks"]["src_gpu"])
    out["chunks"]["dst_gpu"] = r(out["chunks"]["dst_gpu"])
    return out


def large_plan(num_gpus: int) -> RoutingPlan:
    """A real plan of ``num_gpus`` GPUs in bags of 4, two sequences per GPU."""
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 4000, size=2) for _ in range(num_gpus)]
    return plan_routing(lengths, f"g4n{num_gpus // 4}", MODEL)


# ------------------------------------------------------------ item 4: topology, sizes
@pytest.mark.parametrize(
    "text", ["g1n99999999999", "g99999999999n1", "g4096n4+g1n1", "g1n" + "9" * 5000]
)
def test_topology_beyond_the_gpu_bound_is_refused(text):
    with pytest.raises(KnapformerError, match=f"at most {limits.MAX_GPUS:,}"):
        Topology.parse(text)
    assert Topology.parse("g4096n4").num_gpus == limits.MAX_GPUS
    with pytest.raises(KnapformerError, match="at most"):
        Topology((1,) * (limits.MAX_GPUS + 1))  # built directly, as from a file


def test_validate_checks_the_topology_against_the_bags(tmp_path, plan8_path, capsys):
    huge = write(tmp_path, "huge.json", {**sample(plan8_path), "topology": "g1n99999999999"})
    other = write(tmp_path, "other.json", {**sample(plan8_path), "topology": "g2n4"})
    code, out, _ = cli(capsys, "validate", str(huge), str(other), str(plan8_path))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{huge}:1: topology") and f"{limits.MAX_GPUS:,}" in lines[0]
    assert lines[1].startswith(f"{other}:1: topology 'g2n4'")
    assert "g1n2+g2n1+g4n1" in lines[1]  # what the bags say
    assert lines[2] == f"{plan8_path}: 1 plan(s) OK"


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--data-codes", "lowres", "-t", "g1n99999999999"],
        ["simulate", "--data-codes", "g20000b1i256f1s0", "-t", "g20000n1"],
        ["suggest", "--data-codes", "lowres", "--gpus", "100000"],
        ["demo", "--topology", "g1n99999999999", "--no-dashboard", "--steps", "1"],
        ["simulate", "--data-codes", "lowres", "-t", "g1n32", "--steps", "1000000000"],
        ["suggest", "--data-codes", "lowres", "--gpus", "32", "--steps", "1000000000"],
    ],
)
def test_commands_refuse_sizes_beyond_the_bounds(capsys, args):
    code, out, err = cli(capsys, *args)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1
    assert ("at most" in err or "it must lie in" in err) and "knapformer.contract.limits" in err
    assert "│" not in out  # nothing was simulated


def test_replay_refuses_plans_and_dims_too_large_to_hold(tmp_path, plan8_path, capsys):
    from knapformer.contract.plan_io import write_json

    long = tmp_path / "long.json"
    write_json(long, plan_routing([[2**29]], "g1n1", MODEL))  # a 2 KB file
    for args in (["replay", str(long)], ["replay", str(plan8_path), "--dim", str(2**24)]):
        code, out, err = cli(capsys, *args)
        assert code == 1 and out == "" and err.count("\n") == 1
        assert f"at most {limits.MAX_REPLAY_VALUES:,}" in err


@pytest.mark.parametrize(
    "code, what",
    [
        ("g20000b1i256f1s0", "GPU count"),
        ("g1b99999999999i256f1s0", "samples per GPU"),
        ("g1b1i99999999f1s0", "tokens"),
        ("g1b1i256f" + "9" * 5000 + "s0", "frame count"),
        ("g16384b128i256f1s0", "sequences"),
    ],
)
def test_data_codes_are_bounded(code, what):
    with pytest.raises(KnapformerError, match=what):
        parse_mix(code)


def test_plan_sizes_and_values_are_bounded(plan8_path):
    record = sample(plan8_path)
    n = limits.MAX_SEQUENCES + 1
    too_many = {
        **record,
        "sequences": {
            "src_gpu": [0] * n,
            "length": [0] * n,
            "workload": [0.0] * n,
            "bag": [0] * n,
        },
        "chunks": {k: [] for k in record["chunks"]},
    }
    with pytest.raises(PlanFormatError, match=f"{n:,} sequences"):
        parse_plan_line(json.dumps(too_many))

    long = json.loads(json.dumps(record))
    long["sequences"]["length"][0] = 2**40
    with pytest.raises(PlanFormatError, match=f"{limits.MAX_SEQ_LENGTH:,}"):
        parse_plan_line(json.dumps(long))
    for field, value in (("step", 2**63), ("token_dim", 2**40)):
        with pytest.raises(PlanFormatError, match=field):
            parse_plan_line(json.dumps({**record, field: value}))


# ------------------------------------------------------------- item 5: sparse GPU ids
def test_sparse_gpu_ranks_cost_memory_by_gpu_count_not_by_rank(tmp_path, plan8_path):
    record = sample(plan8_path)
    sparse_ranks = {g: g * 2**28 + 7 for g in record["gpus"]}  # up to ~1.9e9
    sparse = renamed(record, sparse_ranks)
    tracemalloc.start()
    try:
        plan = parse_plan_line(json.dumps(sparse))
        stats = compute_stats(plan)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    dense = parse_plan_line(json.dumps(record))
    np.testing.assert_array_equal(stats.load_after, dense.stats.load_after)
    np.testing.assert_array_equal(stats.traffic, dense.stats.traffic)
    # Tokens each GPU sends and receives in route: the traffic off its diagonal.
    away = stats.traffic - np.diag(np.diag(stats.traffic))
    np.testing.assert_array_equal(stats.tokens_sent, away.sum(axis=1))
    np.testing.assert_array_equal(stats.tokens_received, away.sum(axis=0))
    assert stats.tokens_sent.sum() == stats.moved_tokens > 0

    positions = gpu_positions(sparse["gpus"])
    ranks = np.array([sparse_ranks[5], 3, sparse_ranks[0], 2**31 - 1])
    assert positions[ranks].tolist() == [5, -1, 0, -1]


@pytest.mark.parametrize(
    "gpus",
    [
        list(range(8)),  # a group of ranks 0..7: a table indexed by rank
        list(range(70_000, 70_512))[::-1],  # one group of a large world: an offset table
        [3, 2**31 - 1, 10**9, 0, 70_000],  # sparse: binary search
    ],
)
def test_gpu_positions_agree_with_a_dictionary_in_every_layout(gpus):
    expected = {g: i for i, g in enumerate(gpus)}
    probe = np.array([*gpus, -1, 1, 2, 69_999, 70_512, 2**31 - 2, 2**40], dtype=np.int64)
    positions = gpu_positions(gpus)
    assert positions[probe].tolist() == [expected.get(int(r), -1) for r in probe]
    assert positions[probe[: len(gpus)]].tolist() == list(range(len(gpus)))  # hot path
    assert positions[probe.reshape(-1, 1)].shape == (len(probe), 1)


def test_a_rank_beyond_the_bound_is_a_problem(tmp_path, plan8_path, capsys):
    path = write(tmp_path, "far.json", renamed(sample(plan8_path), {0: 4 * 10**9}))
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 1
    assert out.startswith(f"{path}:1: gpus") and "4,000,000,000" in out
    assert f"{limits.MAX_RANK:,}" in out


# --------------------------------------------------------------- item 6: large plans
def test_stats_do_not_build_the_gpu_by_gpu_traffic_matrix():
    plan = large_plan(4096)
    tracemalloc.start()
    try:
        stats = compute_stats(plan)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB (a dense traffic is 128 MiB)"
    assert stats.tokens_after.sum() == plan.sequences.length.sum()


def test_large_plan_figures_aggregate_and_say_so():
    from knapformer.visualization import figures as F

    plan = large_plan(1024)
    heat = F.traffic_figure(plan, validate=False)
    z = np.asarray(heat.data[0].customdata)
    assert z.shape[0] == z.shape[1] <= F.MAX_VIEW_GPUS
    assert z.sum() == plan.sequences.length.sum()  # every token counted once
    assert "aggregated" in heat.layout.title.text
    bars = F.bag_load_figure(plan, validate=False)
    assert len(bars.data[0].y) <= F.MAX_VIEW_GPUS
    assert "aggregated" in bars.layout.title.text
    # The largest bar is the makespan: aggregation keeps the maximum, not a mean.
    st = plan.stats  # loads shown relative to the mean GPU (not calibrated)
    assert max(bars.data[1].y) == pytest.approx(st.makespan_after / st.mean_load)

    # A highlighted sequence marks the groups of its bag and of its source GPU.
    seq = int(
        np.flatnonzero(
            plan.sequences.src_gpu
            != plan.chunks.dst_gpu[np.searchsorted(plan.chunks.seq, np.arange(len(plan.sequences)))]
        )[0]
    )
    groups = F.gpu_groups(plan)
    bag_group = groups.labels[
        int(plan.sequences.bag[seq]) // (len(plan.bags) // len(groups.labels))
    ]
    bars = F.bag_load_figure(plan, highlight_seq=seq, validate=False)
    widths = bars.data[1].marker.line.width
    assert [label for label, w in zip(groups.labels, widths, strict=True) if w] == [bag_group]
    heat = F.traffic_figure(plan, highlight_seq=seq, validate=False)
    assert set(heat.data[1].x) == {bag_group}


def test_report_of_a_large_plan_stays_small(tmp_path, capsys):
    from knapformer.contract.plan_io import write_jsonl

    path = tmp_path / "big.jsonl"
    write_jsonl(path, [large_plan(1024)])
    out = tmp_path / "report.html"
    code, printed, _ = cli(capsys, "report", str(path), "-o", str(out))
    assert code == 0, printed
    assert out.stat().st_size < 12 * 2**20  # plotly.js is ~4.6 MB of it
    assert "aggregated" in out.read_text()


def test_show_of_a_large_plan_prints_the_busiest_gpus_and_a_note(tmp_path, capsys):
    from knapformer.cli.plans import MAX_SHOWN_GPUS
    from knapformer.contract.plan_io import write_jsonl

    plan = large_plan(1024)
    path = tmp_path / "big.jsonl"
    write_jsonl(path, [plan])
    code, out, _ = cli(capsys, "show", str(path))
    assert code == 0
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == MAX_SHOWN_GPUS
    shown = {int(r[0]) for r in rows}
    busiest = np.argsort(-plan.stats.load_after, kind="stable")[:MAX_SHOWN_GPUS]
    assert shown == {plan.gpus[i] for i in busiest}
    assert f"{MAX_SHOWN_GPUS} of 1,024 GPUs" in out


# ------------------------------------------------------------------ item 8: crashes
def test_deep_nesting_is_a_one_line_problem_and_later_files_are_checked(
    tmp_path, plan8_path, capsys
):
    deep_json = write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    deep_line = write(tmp_path, "deep.jsonl", '{"a":' * 100_000 + "1" + "}" * 100_000 + "\n")
    code, out, _ = cli(capsys, "validate", str(deep_json), str(deep_line), str(plan8_path))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{deep_json}:1: ") and "nested" in lines[0]
    assert lines[1].startswith(f"{deep_line}:1: ") and "nested" in lines[1]
    assert lines[2] == f"{plan8_path}: 1 plan(s) OK"
    code, _, err = cli(capsys, "show", str(deep_json))
    assert code == 1 and "nested" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "where, value",
    [
        (lambda r, v: r["gpus"].__setitem__(0, v), 2**63),
        (lambda r, v: r["bags"][0].__setitem__(0, v), 2**64),
        (lambda r, v: r["sequences"]["src_gpu"].__setitem__(0, v), 2**63 + 200),
        (lambda r, v: r["sequences"]["bag"].__setitem__(0, v), -(2**63) - 1),
        (lambda r, v: r["chunks"]["length"].__setitem__(0, v), 2**63),
        (lambda r, v: r["chunks"]["offset"].__setitem__(3, v), 2**63 + 5),
    ],
)
def test_ints_beyond_int64_are_one_line_problems_naming_them(
    tmp_path, plan8_path, capsys, where, value
):
    record = sample(plan8_path)
    where(record, value)
    path = write(tmp_path, "big.json", record)
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 1 and out.startswith(f"{path}:1: ") and out.count("\n") == 1
    assert f"{value:,}" in out, out  # the user's value, not a wrapped-around int64


def legacy_renamed(record: dict, key: str, old: int, new: int) -> dict:
    """The legacy summary with GPU (``key="gpu"``) or chunk id ``old`` renamed ``new``."""
    out = json.loads(json.dumps(record))

    def keys(mapping: dict) -> dict:
        return {(str(new) if k == str(old) else k): v for k, v in mapping.items()}

    if key == "gpu":
        out["balance_gpu_ids"] = [new if g == old else g for g in out["balance_gpu_ids"]]
        out["bag_id2gpu_ids"] = {
            b: [new if g == old else g for g in m] for b, m in out["bag_id2gpu_ids"].items()
        }
        out["balance_chunk_id2gpu_id"] = {
            c: new if g == old else g for c, g in out["balance_chunk_id2gpu_id"].items()
        }
        for name in [k for k in out if k.startswith("gpu_id2")]:
            out[name] = keys(out[name])
    else:
        out["gpu_id2chunk_ids"] = {
            g: [new if c == old else c for c in ids] for g, ids in out["gpu_id2chunk_ids"].items()
        }
        for name in ("balance_chunk_id2gpu_id", "balance_chunk_id2chunk_len", "chunk_id2seq_id"):
            out[name] = keys(out[name])
    return out


def test_legacy_ints_beyond_int64_are_problems_naming_them(tmp_path, legacy_path, capsys):
    record = json.loads(legacy_path.read_text())
    long_chunk = json.loads(json.dumps(record))
    long_chunk["balance_chunk_id2chunk_len"]["0"] = 2**63
    for hostile, value in (
        (legacy_renamed(record, "gpu", 0, 2**63), 2**63),
        (legacy_renamed(record, "chunk", 0, 2**64), 2**64),
        (long_chunk, 2**63),
    ):
        path = write(tmp_path, "legacy.json", hostile)
        code, out, _ = cli(capsys, "validate", str(path))
        assert code == 1 and out.startswith(f"{path}:1: legacy plan"), out
        assert f"{value:,}" in out, out


def test_over_long_integers_name_the_file_and_the_rest_is_checked(tmp_path, plan8_path, capsys):
    text = plan8_path.read_text().replace('"step": 0', '"step": 1' + "0" * 5000, 1)
    assert text != plan8_path.read_text()
    long = write(tmp_path, "long.json", text)
    code, out, _ = cli(capsys, "validate", str(long), str(plan8_path))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{long}:1: ") and "digits" in lines[0]
    assert lines[1] == f"{plan8_path}: 1 plan(s) OK"


def test_memory_error_while_reading_a_record_is_a_problem(tmp_path, steps50_path, monkeypatch):
    """Fault injection: the third record's validation runs out of memory."""
    lines = steps50_path.read_text().splitlines()[:4]
    path = write(tmp_path, "four.jsonl", "\n".join(lines) + "\n")
    original = RoutingPlan.model_validate.__func__
    calls = []

    def exhausted(cls, record, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError
        return original(cls, record, *args, **kwargs)

    monkeypatch.setattr(RoutingPlan, "model_validate", classmethod(exhausted))
    result = read_plans(path)
    assert [r.line for r in result.records] == [1, 2, 4]
    assert [str(p) for p in result.problems] == [f"{path}:3: too large to hold in memory"]


def test_uint64_lengths_are_not_reported_as_negative():
    with pytest.raises(KnapformerError, match=f"{2**63 + 200:,}") as err:
        plan_routing([np.array([2**63 + 200], dtype=np.uint64)], "g1n1", MODEL)
    assert "negative" not in str(err.value)
    with pytest.raises(KnapformerError, match=f"{limits.MAX_SEQ_LENGTH:,}"):
        plan_routing([[2**40], [1]], "g1n2", MODEL)


# ---------------------------------------------------------------------- smaller ones
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_validate_of_a_fifo_does_not_hang(tmp_path, plan8_path):
    fifo = tmp_path / "plans.jsonl"
    os.mkfifo(fifo)
    done = subprocess.run(
        [EXE, "validate", str(fifo), str(plan8_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"{fifo}: not a regular file (a FIFO)",
        f"{plan8_path}: 1 plan(s) OK",
    ]


def test_json_error_messages_read_well():
    with pytest.raises(PlanFormatError) as err:
        parse_plan_line('{"topology": "g1n2')
    assert "at at" not in str(err.value)
    assert str(err.value) == "not valid JSON (Unterminated string starting at column 14)"


def test_workloads_whose_sum_overflows_are_refused(plan8_path):
    # Each workload is bounded (MAX_WORKLOAD), so that no sum of them can overflow.
    record = sample(plan8_path)
    record["sequences"]["workload"] = [1e308] * len(record["sequences"]["workload"])
    with pytest.raises(
        PlanFormatError, match=r"workload\[0\] is 1e\+308; it must lie in 0..1e\+30"
    ):
        parse_plan_line(json.dumps(record))
    assert limits.MAX_WORKLOAD * limits.MAX_SEQUENCES < 1e300


def test_calibration_csv_with_a_byte_order_mark(tmp_path, capsys):
    csv = tmp_path / "m.csv"
    rows = "".join(f"{n},{n * 0.01 + n * n * 1e-6}\n" for n in (100, 400, 900, 1600, 2500))
    csv.write_bytes(b"\xef\xbb\xbf" + f"length,latency\n{rows}".encode())
    code, out, err = cli(capsys, "calibrate", str(csv), "--token-dim", "64")
    assert code == 0, err
    assert "fitted from 5 (length, latency) pairs" in out


@pytest.mark.parametrize(
    "args, option",
    [
        (["simulate", "--data-codes", "lowres", "-t", "g1n32", "--seed", "-1"], "--seed"),
        (["suggest", "--data-codes", "lowres", "--gpus", "32", "--seed", "-1"], "--seed"),
        (["suggest", "--data-codes", "lowres", "--gpus", "32", "--top", "-3"], "--top"),
        (["suggest", "--data-codes", "lowres", "--gpus", "32", "--top", "0"], "--top"),
    ],
)
def test_negative_options_name_the_option(capsys, args, option):
    code, out, err = cli(capsys, *args)
    assert code == 1 and err.startswith(f"error: {option} ") and err.count("\n") == 1
    assert "│" not in out


def test_animate_checks_the_output_before_rendering(tmp_path, plan8_path, capsys):
    taken = tmp_path / "taken.mp4"
    taken.mkdir()
    code, _, err = cli(capsys, "animate", str(plan8_path), "-o", str(taken))
    assert code == 1 and "is a directory" in err and "rendering" not in err
    assert list(taken.iterdir()) == []
    (tmp_path / "file").write_text("")
    code, _, err = cli(capsys, "animate", str(plan8_path), "-o", str(tmp_path / "file/x.mp4"))
    assert code == 1 and "not a directory" in err and "rendering" not in err


def test_an_indented_file_that_is_not_json_is_one_problem_at_its_line(tmp_path, plan8_path):
    text = plan8_path.read_text().replace('"solver": "knapformer"', '"solver": knapformer', 1)
    path = write(tmp_path, "broken.json", text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"solver"' in t)
    problems = read_plans(path).problems
    assert [p.line for p in problems] == [line]
    assert problems[0].message.startswith("not valid JSON (Expecting value at column")


def test_an_over_long_record_is_skipped_without_being_read(tmp_path, steps50_path, monkeypatch):
    import knapformer.contract.plan_io as plan_io

    monkeypatch.setattr(plan_io, "MAX_RECORD_BYTES", 64 * 2**10)
    good = steps50_path.read_text().splitlines()[:2]
    assert all(len(line) < 64 * 2**10 for line in good)
    path = write(tmp_path, "plans.jsonl", "\n".join([good[0], "[" * 300_000, good[1]]) + "\n")
    result = read_plans(path)
    assert [r.line for r in result.records] == [1, 3]
    assert [str(p) for p in result.problems] == [
        f"{path}:2: line of 300,001 bytes skipped: a record holds at most 65,536 "
        "(knapformer.contract.limits)"
    ]


def test_plan_files_are_streamed_one_record_at_a_time(tmp_path, steps50_path):
    from knapformer.contract.plan_io import iter_plan_file

    path = write(tmp_path, "long.jsonl", steps50_path.read_text() * 4)  # 200 plans, 1.5 MB

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed = peak(lambda: sum(1 for _ in iter_plan_file(path)))
    held = peak(lambda: read_plans(path))
    assert streamed * 10 < held, (streamed, held)
