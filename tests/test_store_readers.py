"""The readers on a run store: the same verdicts and figures as on the plans of the same
run, reading only the window asked for. The store is written by the real writer
(`knapformer.runtime.store_writer`) from a measured run; tests/test_stragglers_run.py
checks a real demo run's store."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import write_jsonl
from knapformer.runtime.store_writer import StoreWriter
from knapformer.testing.measured_plans import measured_run

SLOW_RANK = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """24 measured steps of 8 ranks, rank 5 twice as slow: every plan in plans.jsonl and
    every step in the store, in segments of 8 steps."""
    folder = tmp_path_factory.mktemp("store-run")
    plans = measured_run(24, slow_rank=SLOW_RANK, slow_factor=2.0, seed=2)
    write_jsonl(folder / "plans.jsonl", plans)
    writer = StoreWriter(folder / "store", segment_steps=8)
    for plan in plans:
        writer.put(plan)
    writer.close()
    return folder


def _json(capsys, *args: str) -> list[dict]:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _verdicts(ranks: list[dict]) -> dict[int, str]:
    return {r["rank"]: r["verdict"] for r in ranks}


@pytest.mark.parametrize("window", [[], ["--steps", "3:17"], ["--window", "0"]])
def test_stragglers_on_the_store_say_what_the_plans_say(run, capsys, window):
    on_plans = _json(capsys, "stragglers", str(run), "--source", "plans", *window)
    on_store = _json(capsys, "stragglers", str(run), "--source", "store", *window)
    assert _verdicts(on_store) == _verdicts(on_plans)
    assert _verdicts(on_store)[SLOW_RANK] == "slow_gpu"
    for a, b in zip(on_plans, on_store, strict=True):
        # the store keeps ms to 1/128 ms: the figures agree to that
        assert b["ratio"] == pytest.approx(a["ratio"], abs=1e-3)
        assert b["measured_ms"] == pytest.approx(a["measured_ms"], abs=0.01)
        assert b["steps"] == a["steps"]


def test_auto_prefers_the_store_and_a_step_window_reads_only_its_steps(run, capsys):
    assert main(["stragglers", str(run), "--steps", "16:23"]) == 0
    out = capsys.readouterr().out
    assert "stragglers over steps 16..23 (8 measured" in out
    losses = _json(capsys, "stragglers", str(run), "--steps", "20:", "--loss")
    assert [x["step"] for x in losses] == [20, 21, 22, 23]


def test_a_run_without_a_store_is_one_line_for_source_store(tmp_path, capsys):
    write_jsonl(tmp_path / "plans.jsonl", measured_run(3, seed=1))
    assert main(["stragglers", str(tmp_path), "--source", "store"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no run store" in err and err.count("\n") == 1
    assert main(["stragglers", str(tmp_path), "--source", "sideways"]) == 1
    assert "--source must be one of auto, store, plans" in capsys.readouterr().err


def test_tensorboard_on_the_store_writes_the_plans_scalars(run, tmp_path, capsys):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
        (folder,) = [p for p in logdir.iterdir() if p.is_dir()]
        acc = accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    for source in ("plans", "store"):
        args = ["tensorboard", str(run), "--logdir", str(tmp_path / source), "--source", source]
        assert main(args) == 0
        assert "of 24 steps in 1 run" in capsys.readouterr().out
    on_plans, on_store = scalars(tmp_path / "plans"), scalars(tmp_path / "store")
    assert sorted(on_store) == sorted(on_plans)
    for tag, values in on_plans.items():
        assert [s for s, _ in on_store[tag]] == [s for s, _ in values]
        expected = [v for _, v in values]
        assert [v for _, v in on_store[tag]] == pytest.approx(expected, rel=1e-3, abs=0.01), tag


#: The table each hostile case damages (`knapformer.testing.hostile_stores.CASES`).
DAMAGED = {"truncated segment": "ranks", "not parquet": "rank_windows", "bad run.json": "all"}


def _cases() -> list[str]:
    from knapformer.testing.hostile_stores import CASES

    return list(CASES)


@pytest.mark.parametrize("case", _cases())
def test_a_hostile_store_is_one_line_from_every_store_reader(run, tmp_path, capsys, case):
    """Each reader refuses the tables it reads (a reader that never opens the damaged
    table answers as on a good store)."""
    from knapformer.dashboard.whole_run import draw

    from knapformer.contract.run_store import StoreError, store_folder
    from knapformer.testing.hostile_stores import hostile_copy

    bad = hostile_copy(run, tmp_path / "run", case)
    damaged = DAMAGED.get(case, "steps")
    readers = [  # (command, the tables it reads)
        (["stragglers", str(bad), "--source", "store", "--window", "0"], "ranks steps"),
        (["tensorboard", str(bad), "--source", "store", "--logdir", str(tmp_path)], "ranks steps"),
    ]
    for args, tables in readers:
        refuses = damaged == "all" or damaged in tables.split()
        assert main(args) == (1 if refuses else 0), args
        captured = capsys.readouterr()
        if refuses:
            assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured
    if damaged in ("all", "steps", "rank_windows"):  # the dashboard's whole-run tables
        with pytest.raises(StoreError) as refused:
            draw(store_folder(bad))
        assert "\n" not in str(refused.value)


def test_trace_on_the_store_lays_out_the_plans_phases(run, tmp_path, capsys):
    traces = {}
    for source in ("plans", "store"):
        out = tmp_path / f"{source}.json"
        assert main(["trace", str(run), "--source", source, "-o", str(out)]) == 0
        assert "24 steps of 1 run" in capsys.readouterr().out
        traces[source] = json.loads(out.read_text())["traceEvents"]
    plans, store = traces["plans"], traces["store"]
    assert [(e["ph"], e["name"], e.get("tid")) for e in store] == [
        (e["ph"], e["name"], e.get("tid")) for e in plans
    ]
    for a, b in zip(plans, store, strict=True):
        if a["ph"] == "X":  # slices: where and how long, to the store's 1/128 ms
            assert b["ts"] == pytest.approx(a["ts"], abs=100)
            assert b["dur"] == pytest.approx(a["dur"], abs=20)
        if a["ph"] == "C":
            assert b["args"] == pytest.approx(a["args"], rel=1e-3, abs=0.01)
    window = tmp_path / "window.json"
    assert main(["trace", str(run), "--steps", "20:", "-o", str(window)]) == 0
    assert "4 steps of 1 run (run store, steps 20..23)" in capsys.readouterr().out


def test_report_takes_its_straggler_views_from_the_store(run, tmp_path, capsys):
    pages = {}
    for source in ("plans", "store"):
        out = tmp_path / f"{source}.html"
        assert (
            main(["report", str(run), "--steps", "20:21", "--source", source, "-o", str(out)]) == 0
        )
        assert "(13 figures)" in capsys.readouterr().out
        pages[source] = out.read_text()
    lines = {s: re.findall(r"straggler: [^<]*", page) for s, page in pages.items()}
    assert lines["store"] == lines["plans"] and len(lines["store"]) == 2
    assert "slow_gpu: rank 5" in lines["store"][0]


def _timeline(page: str) -> tuple[list[dict], dict]:
    """The data and layout of the report's timeline figure."""
    at = page.index("Plotly.newPlot(", page.index("data-name='timeline'"))
    decoder = json.JSONDecoder()
    rest = page[page.index("[", at) :]
    data, end = decoder.raw_decode(rest)
    layout, _ = decoder.raw_decode(rest[end:].lstrip(", \n"))
    return data, layout


def test_report_timeline_has_every_stored_step_when_plans_are_thinned(run, tmp_path, capsys):
    thinned = tmp_path / "thinned"
    thinned.mkdir()
    (thinned / "store").symlink_to(run / "store")
    kept = [
        line for i, line in enumerate((run / "plans.jsonl").read_text().splitlines()) if i % 8 == 0
    ]
    (thinned / "plans.jsonl").write_text("\n".join(kept) + "\n")
    timelines = {}
    for source in ("plans", "store"):
        out = tmp_path / f"{source}.html"
        assert main(["report", str(thinned), "--source", source, "-o", str(out)]) == 0
        capsys.readouterr()
        timelines[source] = _timeline(out.read_text())
    (plans_data, plans_layout), (store_data, store_layout) = timelines["plans"], timelines["store"]
    assert plans_data[0]["x"] == [0, 8, 16]
    assert store_data[0]["x"] == list(range(24))
    # The shown step (the last kept plan) is marked on both, at its step.
    assert [s["x0"] for s in plans_layout["shapes"]] == [16]
    assert [s["x0"] for s in store_layout["shapes"]] == [16]
    # Both say the same for the steps they share: the store's figures are the plans'.
    for trace_p, trace_s in zip(plans_data, store_data, strict=True):
        assert trace_p["name"] == trace_s["name"]
        shared = [trace_s["y"][x] for x in trace_p["x"]]
        assert shared == pytest.approx(trace_p["y"], rel=1e-3, abs=0.01)


def _probed_across_nodes(plan, slow_cross: int):
    """``plan`` with a link probe of every round over two nodes of 4 ranks: 1 ms a pair,
    8 ms a pair that joins ``slow_cross`` to a rank of the other node (its NIC is slow,
    its links inside its node are not)."""
    from knapformer.contract.probe import LinkProbe, probe_partners, probe_round_count

    n = len(plan.gpus)
    node = [i * 2 // n for i in range(n)]
    rounds = list(range(probe_round_count(n)))
    slow = plan.gpus.index(slow_cross)
    times = [
        [8.0 if slow in (i, p) and node[i] != node[p] else 1.0
         for i, p in enumerate(probe_partners(n, r))]
        for r in rounds
    ]  # fmt: skip
    probe = LinkProbe(bytes=2**20, rounds=rounds, ms=times, node=node)
    return plan.model_copy(
        update={"measurements": plan.measurements.model_copy(update={"link_probe": probe})}
    )


def test_a_slow_link_across_nodes_is_kept_apart_and_named_on_the_store(tmp_path, capsys):
    """The store keeps each rank's fastest link inside its node and across nodes apart, as
    the plans' probe does: a rank whose links to the other node are slow, and whose links
    inside its node are fast, is named ``slow_link`` on the store as on the plans."""
    from knapformer.contract.run_store import read_table

    slow = 6
    plans = [_probed_across_nodes(p, slow) for p in measured_run(12, topology="g1n8", seed=4)]
    write_jsonl(tmp_path / "plans.jsonl", plans)
    writer = StoreWriter(tmp_path / "store", segment_steps=4)
    for plan in plans:
        writer.put(plan)
    writer.close()
    ranks = read_table(tmp_path, "ranks", columns=["rank", "link_gbps", "link_cross_gbps"])
    rank, inside, cross = (ranks[c].to_numpy(zero_copy_only=False) for c in ranks.column_names)
    pair_gbps = 2**20 / 1e6  # GB/s each way of a pair that takes 1 ms
    np.testing.assert_allclose(inside, pair_gbps, rtol=1e-3)  # every link inside a node fast
    np.testing.assert_allclose(cross[rank == slow], pair_gbps / 8, rtol=1e-3)
    np.testing.assert_allclose(cross[rank != slow], pair_gbps, rtol=1e-3)  # a fast partner
    on_plans = _verdicts(_json(capsys, "stragglers", str(tmp_path), "--source", "plans"))
    on_store = _verdicts(_json(capsys, "stragglers", str(tmp_path), "--source", "store"))
    assert on_store == on_plans
    assert on_store[slow] == "slow_link"
    assert [r for r, v in on_store.items() if v == "slow_link"] == [slow]


def test_a_segment_written_before_a_later_column_reads_it_as_null(run, tmp_path, capsys):
    """A ``ranks`` segment of a writer that had no ``link_cross_gbps`` (`LATER_COLUMNS`) is
    read, checked, compacted and queried with that column null; any other missing column
    is still a wrong schema."""
    import shutil

    import pyarrow.parquet as pq

    from knapformer.contract.run_store import StoreError, read_table
    from knapformer.runtime.store_files import compact

    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    segments = sorted((folder / "store").glob("ranks-*.parquet"))
    for path in segments[:2]:  # the first two of three segments: as an older writer wrote
        old = pq.read_table(path)
        pq.write_table(old.drop_columns(["link_cross_gbps"]), path)
    ranks = read_table(folder, "ranks", columns=["step", "link_cross_gbps", "link_gbps"])
    assert ranks.num_rows == 24 * 8
    assert ranks["link_cross_gbps"].null_count == ranks.num_rows
    assert read_table(folder, "ranks").num_rows == 24 * 8  # every column, old and new
    assert main(["stragglers", str(folder), "--source", "store"]) == 0
    assert f"rank {SLOW_RANK}" in capsys.readouterr().out
    sql = "SELECT count(link_cross_gbps) AS probed, count(*) AS rows FROM ranks"
    assert main(["query", str(folder), sql, "--csv"]) == 0
    assert capsys.readouterr().out.replace('"', "").split() == ["probed,rows", f"0,{24 * 8}"]
    compact(folder / "store", "ranks", count=2, small=100)  # the two old ones
    merged = folder / "store" / "ranks-0-15.parquet"
    assert pq.read_table(merged, columns=["link_cross_gbps"])[0].null_count == 16 * 8
    assert read_table(folder, "ranks", columns=["rank"]).num_rows == 24 * 8
    broken = pq.read_table(merged)
    pq.write_table(broken.drop_columns(["tokens_in"]), merged)
    with pytest.raises(StoreError, match="wrong schema: no column 'tokens_in'"):
        read_table(folder, "ranks")
