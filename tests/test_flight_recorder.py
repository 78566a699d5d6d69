"""``knapformer flight-recorder`` on dumps in the formats torch writes, built here: JSON (as
``_dump_fr_trace_json`` writes on gloo and NCCL) and the pickle of NCCL's dump on timeout,
with the balancer's journals beside them. (Dumps of a real gloo job are read in
tests/fault_suite.py; no NCCL job could run where these tests were written.)

A missing dump, a wrapped buffer, a rank without a journal are notes, not failures; a
pickle that names any global is refused before anything is built."""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import pytest

from knapformer.errors import KnapformerError
from knapformer.testing.processes import CLI, ROOT
from knapformer.tools.flight_recorder import (
    MAX_DUMP_BYTES,
    analyse,
    describe,
    dump_files,
    read_dump,
    read_journals,
)

T0 = 1_700_000_000.0


def _entry(record: int, seq: int, group: str, created: float, retired: bool = True) -> dict:
    return {
        "record_id": record, "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
        "pg_id": int(group), "process_group": [group, "undefined"],
        "profiling_name": "nccl:all_to_all", "time_created_ns": int(created * 1e9),
        "input_sizes": [[64, 32]], "output_sizes": [[64, 32]], "state": "scheduled",
        "retired": retired, "timeout_ms": 20000, "frames": [],
    }  # fmt: skip


def _journal(rank: int, entries: list[tuple], bag_group: str = "2") -> dict:
    groups = [{"role": "balance", "ranks": [0, 1, 2, 3], "name": "1"}]
    groups.append({"role": "bag [2, 3]", "ranks": [2, 3], "name": bag_group})
    keys = ("seq", "step", "phase", "bag", "plan", "backward", "side", "entered", "left")
    rows = [dict(zip(keys, (i, *row), strict=True)) for i, row in enumerate(entries)]
    return {"journal_version": 1, "rank": rank, "groups": groups, "entries": rows}


@pytest.fixture
def run(tmp_path):
    """Ranks 0 and 2 of a 4-rank job dumped (rank 3 stalled before pre_attn of bag 2, rank
    1's dump is missing); rank 2's buffer wrapped; rank 0 has no journal."""
    fr, journal = tmp_path / "flight_recorder", tmp_path / "journal"
    fr.mkdir()
    journal.mkdir()
    rank0 = [_entry(0, 1, "1", T0 + 0.1), _entry(1, 2, "1", T0 + 1.1, retired=False)]
    (fr / "rank0.json").write_text(json.dumps({"version": "2.10", "entries": rank0}))
    rank2 = [_entry(7, 8, "1", T0 + 0.1), _entry(8, 3, "2", T0 + 1.2)]
    status = {"1": {"last_completed_collective": "8"}, "2": {"last_completed_collective": "2"}}
    dump = {"version": "2.10", "pg_status": status, "entries": rank2}
    (fr / "rank2.pkl").write_bytes(pickle.dumps(dump))  # NCCL's dump on timeout: a pickle
    (journal / "rank2.json").write_text(json.dumps(_journal(2, [
        (3, "route", -1, 77, False, False, T0 + 0.05, T0 + 0.2),
        (3, "pre_attn", 2, 77, False, False, T0 + 1.15, None),
    ])))  # fmt: skip
    (journal / "rank3.json").write_text(json.dumps(_journal(3, [
        (3, "route", -1, 77, False, False, T0 + 0.05, T0 + 0.2),
    ])))  # fmt: skip
    return tmp_path


def test_pending_collectives_map_to_the_step_phase_and_bag_they_served(run):
    files = dump_files([run])
    assert sorted(files) == [0, 2]
    report = analyse({r: read_dump(p, r) for r, p in files.items()}, read_journals(run), 4)
    lines = [describe(p) for p in report.pending]
    assert lines == [
        "rank 0: nccl:all_to_all #2 on group 1 -> not mapped to a balancer collective",
        "rank 2: nccl:all_to_all #3 on group 2 (bag [2, 3]) -> step 3, pre_attn of bag 2",
    ]
    assert "no dump from ranks 1, 3: what it was doing is unknown" in report.notes
    assert "rank 2's buffer wrapped: records before 7 were overwritten" in report.notes
    assert "no journal from rank 0: its collectives are not mapped" in report.notes


def test_a_collective_the_journal_saw_finish_is_not_pending_though_torchs_status_lags(tmp_path):
    """Under load torch's watchdog may not yet count a finished collective as completed
    (its status says #1 where the rank finished #2 and entered #3): the journal, which
    saw the rank leave #2's phase, decides; #3, whose phase it never left, is pending."""
    fr, journal = tmp_path / "flight_recorder", tmp_path / "journal"
    fr.mkdir()
    journal.mkdir()
    entries = [_entry(1, 2, "1", T0 + 0.1), _entry(2, 3, "1", T0 + 1.1, retired=False)]
    status = {"1": {"last_completed_collective": "1"}}
    dump = {"version": "2.10", "pg_status": status, "entries": entries}
    (fr / "rank1.json").write_text(json.dumps(dump))
    (journal / "rank1.json").write_text(json.dumps(_journal(1, [
        (3, "gather", -1, 77, False, False, T0 + 0.05, T0 + 0.2),
        (3, "route", -1, 77, False, False, T0 + 1.05, None),
    ])))  # fmt: skip
    files = dump_files([tmp_path])
    report = analyse({r: read_dump(p, r) for r, p in files.items()}, read_journals(tmp_path), 2)
    assert [describe(p) for p in report.pending] == [
        "rank 1: nccl:all_to_all #3 on group 1 (balance) -> step 3, route"
    ]
    without_journal = analyse({r: read_dump(p, r) for r, p in files.items()}, {}, 2)
    assert [p.seq for p in without_journal.pending] == [2, 3]  # torch's status alone


def test_the_command_prints_the_same_and_never_fails_on_what_is_missing(run):
    done = subprocess.run([*CLI, "flight-recorder", str(run), "--world", "4"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert (
        out[1] == "rank 2: nccl:all_to_all #3 on group 2 (bag [2, 3]) -> step 3, pre_attn of bag 2"
    )
    assert "note: no dump from ranks 1, 3: what it was doing is unknown" in out


def test_a_pickle_that_names_a_global_is_refused_before_it_runs(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    path = tmp_path / "rank0.pkl"
    path.write_bytes(pickle.dumps({"entries": [Evil()]}))
    with pytest.raises(KnapformerError, match="a dump holds data only; it names"):
        read_dump(path, 0)
    assert not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"{nope", "not a flight-recorder dump"),
        (b'{"entries": 3}', "no list of entries"),
        (b"\x80\x05K\x01.", "no list of entries"),  # a pickled 1
        (b" " * (MAX_DUMP_BYTES + 1), "not a dump"),
    ],
)
def test_an_unreadable_dump_is_one_clear_error(tmp_path, data, says):
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    with pytest.raises(KnapformerError, match=says):
        read_dump(path, 0)


def test_an_unreadable_dump_among_good_ones_is_a_note(run):
    (run / "flight_recorder" / "rank1.json").write_text("{nope")
    done = subprocess.run([*CLI, "flight-recorder", str(run)], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "note: rank 1: " in done.stdout and "not a flight-recorder dump" in done.stdout


def test_no_dump_at_all_is_one_line_error(tmp_path):
    done = subprocess.run([*CLI, "flight-recorder", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: no flight-recorder dump in {tmp_path}"
