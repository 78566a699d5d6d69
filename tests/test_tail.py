"""The incremental JSONL reader: partial lines, only-new-bytes, truncation, rotation, removal."""

from __future__ import annotations

import os

import knapformer.dashboard.tail as tail_module
import pytest
from knapformer.dashboard.tail import JsonlTail


def _append(path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture
def tail(tmp_path):
    t = JsonlTail(tmp_path / "plans.jsonl")
    yield t
    t.close()


def test_partial_last_line_waits_for_its_newline(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    _append(path, '{"a": 1}\n{"b": ')
    batch = tail.poll()
    assert [(ln.number, ln.text) for ln in batch.lines] == [(1, '{"a": 1}')]
    assert tail.offset == len('{"a": 1}\n')
    assert tail.poll().lines == []  # still partial
    _append(path, '2}\n{"c": 3}\n')
    batch = tail.poll()
    assert [(ln.number, ln.text) for ln in batch.lines] == [(2, '{"b": 2}'), (3, '{"c": 3}')]
    second = batch.lines[0]
    assert second.offset == len('{"a": 1}\n')
    assert tail.read_record(second.generation, second.offset, second.length) == '{"b": 2}'


def test_reads_only_new_bytes(tmp_path, tail, monkeypatch):
    path = tmp_path / "plans.jsonl"
    _append(path, "x" * 5000 + "\n")
    tail.poll()
    read = []
    real_pread = os.pread

    def counting(fd, n, offset):
        data = real_pread(fd, n, offset)
        read.append((offset, len(data)))
        return data

    monkeypatch.setattr(tail_module.os, "pread", counting)
    _append(path, "y" * 10 + "\n")
    batch = tail.poll()
    assert [ln.text for ln in batch.lines] == ["y" * 10]
    # The new line, not the 5001 bytes before it; before it only the rewrite check's
    # fingerprint (the first 64 bytes and the newline ending the last line read).
    assert sum(n for off, n in read if off >= 5001) == 11
    assert sorted((off, n) for off, n in read if off < 5001) == [(0, 64), (5000, 1)]


def test_blank_lines_and_crlf_keep_line_numbers(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    path.write_bytes(b"one\r\n\n  \nfour\n")
    batch = tail.poll()
    assert [(ln.number, ln.text) for ln in batch.lines] == [(1, "one"), (4, "four")]


def test_truncation_restarts_from_the_beginning(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    _append(path, "first\nsecond\nthird\n")
    assert len(tail.poll().lines) == 3
    with open(path, "w") as f:  # truncate in place (same inode), as `> plans.jsonl` does
        f.write("new\n")
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["truncated"]
    assert "truncated" in batch.events[0].message
    assert [(ln.number, ln.text, ln.generation) for ln in batch.lines] == [(1, "new", 1)]
    assert tail.read_record(1, batch.lines[0].offset, batch.lines[0].length) == "new"


def test_rewrite_in_place_past_the_offset_restarts(tmp_path, tail):
    # `> plans.jsonl` and a new run writing more than was read, between two polls: the
    # file never looks smaller, but what was read is gone.
    path = tmp_path / "plans.jsonl"
    _append(path, '{"step": 0, "time": 1.5}\n{"step": 1, "time": 2.5}\n')
    assert len(tail.poll().lines) == 2
    with open(path, "w") as f:
        f.write('{"step": 0, "time": 9.25, "run": "b"}\n{"step": 1, "time": 9.5, "run": "b"}\n')
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["truncated"]
    assert "rewritten" in batch.events[0].message
    assert [(ln.number, ln.generation) for ln in batch.lines] == [(1, 1), (2, 1)]
    assert batch.lines[0].text.endswith('"run": "b"}')
    _append(path, '{"step": 2}\n')  # and plain appends go on as before
    assert [(ln.number, ln.text) for ln in tail.poll().lines] == [(3, '{"step": 2}')]


def test_rotation_drains_the_old_file_then_follows_the_new_one(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    _append(path, "a1\na2\n")
    first = tail.poll().lines
    _append(path, "a3\n")  # written just before the rotation, not yet read
    os.rename(path, tmp_path / "plans.1.jsonl")
    _append(path, "b1\n")
    batch = tail.poll()
    assert [(ln.generation, ln.number, ln.text) for ln in batch.lines] == [
        (0, 3, "a3"),
        (1, 1, "b1"),
    ]
    assert [e.kind for e in batch.events] == ["rotated"]
    assert "plans.1.jsonl" in batch.events[0].message
    # Records of the rotated file stay readable.
    old = first[1]
    assert tail.read_record(old.generation, old.offset, old.length) == "a2"
    _append(path, "b2\n")
    assert [ln.text for ln in tail.poll().lines] == ["b2"]


def test_missing_file_is_reported_once_then_picked_up(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["missing"]
    assert tail.poll().events == []  # not repeated every poll
    _append(path, "hello\n")
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["appeared"]
    assert [ln.text for ln in batch.lines] == ["hello"]


def test_file_removed_while_open(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    _append(path, "one\n")
    line = tail.poll().lines[0]
    path.unlink()
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["removed"]
    assert tail.poll().events == []
    # The open handle still serves records of the removed file.
    assert tail.read_record(line.generation, line.offset, line.length) == "one"
    _append(path, "again\n")
    batch = tail.poll()
    assert [(ln.number, ln.text) for ln in batch.lines] == [(1, "again")]
    # A file that comes back is a new file: none of the old lines belong to it.
    assert [(e.kind, e.generation) for e in batch.events] == [("replaced", 1)]


def test_max_bytes_reads_in_slices(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    lines = [f"{i:04d}" + "z" * 95 for i in range(100)]  # 100 lines of 100 bytes + newline
    _append(path, "\n".join(lines) + "\n")
    seen, polls = [], 0
    while True:
        batch = tail.poll(max_bytes=1000)
        polls += 1
        seen += [ln.text for ln in batch.lines]
        if not batch.more:
            break
    assert seen == lines
    assert polls >= 10


def test_line_longer_than_one_read(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    big = "q" * (tail_module._CHUNK + 12345)
    _append(path, big)
    assert tail.poll().lines == []  # no newline yet
    _append(path, "\nsmall\n")
    assert [len(ln.text) for ln in tail.poll().lines] == [len(big), 5]


def test_an_unterminated_last_line_is_scanned_once_not_on_every_poll(tmp_path, tail, monkeypatch):
    path = tmp_path / "plans.jsonl"
    _append(path, "ok\n" + "x" * (3 * tail_module._CHUNK + 7))
    read = []
    real_pread = os.pread

    def counting(fd, n, offset):
        data = real_pread(fd, n, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(tail_module.os, "pread", counting)
    assert [ln.text for ln in tail.poll().lines] == ["ok"]
    first = sum(read)
    for _ in range(20):  # the dashboard polls 4 times a second
        assert tail.poll().lines == []
    assert first < 3.1 * tail_module._CHUNK + 100
    assert sum(read) - first < 1000  # later polls only looked for new bytes
    read.clear()
    _append(path, "y" * 10)
    assert tail.poll().lines == []
    assert sum(read) < 1000  # the 10 new bytes (and the rewrite check), not the line again
    _append(path, "\nnext\n")
    lines = tail.poll().lines
    assert [len(ln.text) for ln in lines] == [3 * tail_module._CHUNK + 17, 4]
    assert lines[0].offset == 3 and not lines[0].too_long


def test_a_line_too_long_to_read_is_reported_not_read(tmp_path, tail, monkeypatch):
    monkeypatch.setattr(tail_module, "MAX_LINE_BYTES", 2 * tail_module._CHUNK)
    path = tmp_path / "plans.jsonl"
    huge = 3 * tail_module._CHUNK
    _append(path, "a\n" + "z" * huge + "\nb\n")
    batch = tail.poll()
    assert [(ln.number, ln.too_long, ln.length, ln.text) for ln in batch.lines] == [
        (1, False, 1, "a"),
        (2, True, huge, ""),
        (3, False, 1, "b"),
    ]
    assert tail.offset == 2 + huge + 1 + 2


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/passwd", "fifo", "dangling"])
def test_a_link_or_a_device_put_in_the_files_place_is_refused_until_a_file_is_back(
    tmp_path, tail, target
):
    """Before, a symlink to /dev/zero kept a core busy for ever and the run never updated
    again, even after a regular file was put back; /etc/passwd was read as the run."""
    path = tmp_path / "plans.jsonl"
    _append(path, "old1\nold2\n")
    assert len(tail.poll().lines) == 2
    swapped = tmp_path / "swap"
    if target == "fifo":
        os.mkfifo(swapped)
        os.replace(swapped, path)
    else:
        os.symlink(tmp_path / "nowhere" if target == "dangling" else target, swapped)
        os.replace(swapped, path)
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["removed", "refused"]
    assert "replaced by another file after line 2" in batch.events[0].message
    refusal = batch.events[1].message
    what = "a FIFO" if target == "fifo" else "a symbolic link (to "
    assert f"{path} is {what}" in refusal and "reads regular files only" in refusal
    for _ in range(3):  # refused once, not re-read on every poll
        again = tail.poll()
        assert again.lines == [] and again.events == [] and not again.more
    path.unlink()
    _append(path, "new1\n")
    batch = tail.poll()
    assert [(ln.generation, ln.text) for ln in batch.lines] == [(1, "new1")]
    assert [e.kind for e in batch.events] == ["replaced"]


def test_a_file_replaced_by_rename_is_a_new_file_and_a_rotation_is_not(tmp_path, tail):
    path = tmp_path / "plans.jsonl"
    _append(path, "a1\n")
    tail.poll()
    (tmp_path / "tmp").write_text("b1\n")
    os.replace(tmp_path / "tmp", path)  # an editor's save, or a tool rewriting the file
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["removed", "replaced"]
    assert [(ln.generation, ln.text) for ln in batch.lines] == [(1, "b1")]
    os.rename(path, tmp_path / "plans.1.jsonl")
    _append(path, "c1\n")
    batch = tail.poll()
    assert [e.kind for e in batch.events] == ["rotated"]  # whether it continues: the reader's
    assert [(ln.generation, ln.text) for ln in batch.lines] == [(2, "c1")]


def test_a_link_named_on_the_command_line_is_followed_and_one_found_in_a_folder_is_not(
    tmp_path, steps50_path
):
    from knapformer.dashboard.store import Runs

    from knapformer.testing.polling import wait_until

    lines = steps50_path.read_text().splitlines()
    real = tmp_path / "real.jsonl"
    _append(real, lines[0] + "\n")
    link = tmp_path / "link.jsonl"
    os.symlink(real, link)
    runs = Runs(link)  # what `knapformer dashboard link.jsonl` follows
    try:
        store = runs.store(runs.default())  # followed by its own thread
        wait_until(lambda: len(store.snapshot().summaries) == 1, 60, "the linked file read")
    finally:
        runs.close()
    folder = tmp_path / "runs"
    (folder / "job").mkdir(parents=True)
    os.symlink(real, folder / "job" / "plans.jsonl")
    runs = Runs(folder)
    try:
        store = runs.store("job")
        wait_until(lambda: "is a symbolic link (to " in store.snapshot().notices[0], 60)
        assert store.snapshot().summaries == []
    finally:
        runs.close()
