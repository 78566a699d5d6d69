"""Output files are written whole or not at all (`knapformer.contract.output_file`): a
command that fails half-way leaves neither a truncated file nor a temporary one, and an
earlier good file stays as it was (issue 35: a non-finite number in a profiler trace
left a truncated, invalid ``trace.json`` behind)."""

from __future__ import annotations

import os

import pytest

from knapformer.cli import main
from knapformer.contract.output_file import output_file
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.errors import KnapformerError


def test_a_file_is_written_with_the_permissions_open_gives(tmp_path):
    target = tmp_path / "out.txt"
    with output_file(target) as f:
        f.write("done\n")
    assert target.read_text() == "done\n"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    with output_file(target, binary=True) as f:
        f.write(b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01" and os.listdir(tmp_path) == ["out.txt"]


def test_a_failure_half_way_leaves_the_earlier_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("earlier, good\n")
    with pytest.raises(RuntimeError, match="half-way"), output_file(target) as f:
        f.write("half of it")
        raise RuntimeError("half-way")
    assert target.read_text() == "earlier, good\n" and os.listdir(tmp_path) == ["out.txt"]
    with pytest.raises(KeyboardInterrupt), output_file(tmp_path / "new.txt") as f:
        f.write("x")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["out.txt"]


def test_a_target_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    missing = r"nowhere/out\.txt: cannot write: No such file"
    with pytest.raises(KnapformerError, match=missing), output_file(tmp_path / "nowhere/out.txt"):
        pass
    (tmp_path / "taken").mkdir()
    refused = r"taken: cannot write: Is a directory"
    with pytest.raises(KnapformerError, match=refused), output_file(tmp_path / "taken") as f:
        f.write("x")
    assert sorted(os.listdir(tmp_path)) == ["taken"] and os.listdir(tmp_path / "taken") == []


def test_commands_write_their_files_whole(tmp_path, plan8_path, capsys):
    plans = read_plans(plan8_path, on_error="raise").plans
    write_jsonl(tmp_path / "plans.jsonl", plans)
    (tmp_path / "trace.json").mkdir()  # a folder where the trace would go
    assert main(["trace", str(tmp_path / "plans.jsonl"), "-o", str(tmp_path / "trace.json")]) == 1
    assert "trace.json: cannot write: Is a directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["plans.jsonl", "trace.json"]
    assert main(["trace", str(tmp_path / "plans.jsonl"), "-o", str(tmp_path / "t.json")]) == 0
    assert sorted(os.listdir(tmp_path)) == ["plans.jsonl", "t.json", "trace.json"]
