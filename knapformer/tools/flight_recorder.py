"""Read PyTorch flight-recorder dumps of a job and say, for each collective a rank had not
finished, which step, phase and bag of the balancer it served.

torch keeps a ring buffer of every collective per rank when a job sets
``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL) and dumps it, per rank,
as JSON (``torch._C._distributed_c10d._dump_fr_trace_json``, what the balancer writes
beside a failed run's incident under ``flight_recorder/``) or as a pickle (NCCL's dump on
timeout, ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``). Each entry names its process group, its
sequence number in that group, its op and sizes and when it was created; it knows nothing
of what the collective was for. The balancer's step journals (``journal/rank<r>.json``,
`knapformer.runtime.journal`) do: they list the balancer's process groups by name and
every collective's step, phase, bag and the times it entered and left. A pending entry is
matched to the journal entry of the same rank that was running when it was created.

What a dump set lacks is said, not fatal: a rank without a dump, a buffer that wrapped
(its oldest record is not the first, so earlier collectives are gone), a rank without a
journal (its entries stay unmapped), a dump that cannot be read. Pickles are read with an
unpickler that builds nothing but plain containers, numbers and strings, after a size
check: a dump is data, never code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from knapformer.contract.incident import FLIGHT_RECORDER_FOLDER, JOURNAL_FOLDER
from knapformer.errors import KnapformerError

#: Bytes of one dump read at most (a buffer of 20,000 entries with stack frames is far less).
MAX_DUMP_BYTES = 256 * 2**20
#: Seconds a flight-recorder entry may seem created before its journal entry: both read the
#: process's wall clock, the journal just before calling torch (a float's rounding only).
_SLACK_S = 1e-4
_RANK = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


@dataclass
class Dump:
    """One rank's flight-recorder buffer: its entries (oldest first), its process
    groups' status (``pg_status``), and what is wrong with it (``notes``)."""

    rank: int
    entries: list[dict[str, Any]]
    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def wrapped(self) -> bool:
        """Whether older entries were overwritten (the oldest kept is not record 0)."""
        return bool(self.entries) and int(self.entries[0].get("record_id", 0)) > 0


@dataclass
class Pending:
    """A collective a rank had not finished when it dumped, and what the balancer's journal
    says it was for (``None`` fields: not a collective of the balancer, or no journal)."""

    rank: int
    group: str  # the process group's name
    role: str | None  # the balancer's name for that group ("balance", "bag [2, 3]", ...)
    seq: int  # its sequence number in the group
    op: str
    sizes: list
    step: int | None = None
    phase: str | None = None
    bag: int | None = None
    backward: bool = False


@dataclass
class Report:
    """What a set of dumps says: the pending collectives, the ranks that never entered the
    latest of each group, and the notes on missing or wrapped buffers."""

    pending: list[Pending]
    missing: dict[tuple[str, int], list[int]]  # (group, seq) -> ranks that never entered it
    notes: list[str]
    roles: dict[str, str] = field(default_factory=dict)  # group name -> the balancer's name


# ---------------------------------------------------------------------- reading
class _DataOnly(pickle.Unpickler):
    """Refuses every global: what it builds is containers, numbers and strings."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a dump holds data only; it names {module}.{name}")


def read_dump(path: Path, rank: int) -> Dump:
    """The dump in ``path`` (JSON or pickle) of rank ``rank``; a `KnapformerError` when it
    cannot be read or holds no entries list."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_DUMP_BYTES + 1)
    except OSError as err:
        raise KnapformerError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(raw) > MAX_DUMP_BYTES:
        raise KnapformerError(f"{path}: more than {MAX_DUMP_BYTES:,} bytes; not a dump")
    try:
        if raw.lstrip()[:1] in (b"{", b"["):
            data = json.loads(raw)
        else:
            data = _DataOnly(io.BytesIO(raw)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, RecursionError) as err:
        raise KnapformerError(f"{path}: not a flight-recorder dump ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
        raise KnapformerError(f"{path}: not a flight-recorder dump (no list of entries)")
    entries = [e for e in data.get("entries", []) if isinstance(e, dict)]
    status = data.get("pg_status") if isinstance(data.get("pg_status"), dict) else {}
    return Dump(rank, sorted(entries, key=lambda e: _int(e.get("record_id"))), status)


def dump_files(paths: Iterable[Path]) -> dict[int, Path]:
    """Rank -> dump file, from files and folders (a run folder: its ``flight_recorder/``):
    a file's rank is the number its name ends with (``rank3.json``, ``nccl_trace_rank_3``)."""
    found: dict[int, Path] = {}
    for path in paths:
        if path.is_dir():
            inner = path / FLIGHT_RECORDER_FOLDER
            files = sorted((inner if inner.is_dir() else path).iterdir())
        else:
            files = [path]
        for file in files:
            match = _RANK.search(file.name)
            if file.is_file() and match:
                found[int(match.group(1))] = file
    return found


def read_journals(folder: Path | None) -> dict[int, dict[str, Any]]:
    """Rank -> its journal dump, from ``folder/journal/rank<r>.json`` (unreadable ones
    are left out)."""
    if folder is None or not (folder / JOURNAL_FOLDER).is_dir():
        return {}
    journals = {}
    for file in sorted((folder / JOURNAL_FOLDER).glob("rank*.json")):
        match = _RANK.search(file.name)
        try:
            data = json.loads(file.read_bytes()[:MAX_DUMP_BYTES])
        except (OSError, ValueError):
            continue
        if match and isinstance(data, dict) and isinstance(data.get("entries"), list):
            journals[int(match.group(1))] = data
    return journals


# ---------------------------------------------------------------------- mapping
def analyse(
    dumps: dict[int, Dump], journals: dict[int, dict[str, Any]], world: int | None = None
) -> Report:
    """The pending collectives of every dump, mapped through the journals; the ranks of a
    group that never entered its latest collective; notes on what is missing."""
    notes = [note for dump in dumps.values() for note in dump.notes]
    ranks = set(dumps) | set(journals)
    world = world or (max(ranks) + 1 if ranks else 0)
    absent = [r for r in range(world) if r not in dumps]
    if absent:
        notes.append(f"no dump from rank{'s' if len(absent) > 1 else ''} "
                     f"{', '.join(map(str, absent))}: what it was doing is unknown")  # fmt: skip
    for rank, dump in sorted(dumps.items()):
        if dump.wrapped:
            oldest = _int(dump.entries[0].get("record_id"))
            notes.append(f"rank {rank}'s buffer wrapped: records before {oldest} were overwritten")
        if rank not in journals:
            notes.append(f"no journal from rank {rank}: its collectives are not mapped")
    pending = [p for rank, d in sorted(dumps.items()) for p in _pending(d, journals.get(rank))]
    roles = {g["name"]: g["role"] for j in journals.values() for g in j.get("groups", [])}
    return Report(pending, _missing(dumps, journals), notes, roles)


def _pending(dump: Dump, journal: dict[str, Any] | None) -> list[Pending]:
    roles = {g["name"]: g for g in (journal or {}).get("groups", []) if isinstance(g, dict)}
    out = []
    for entry in dump.entries:
        group = str((entry.get("process_group") or [entry.get("pg_id", "?")])[0])
        seq = _int(entry.get("collective_seq_id"))
        sizes = entry.get("input_sizes") or []
        item = Pending(dump.rank, group, roles.get(group, {}).get("role"), seq,
                       str(entry.get("profiling_name", "?")), sizes)  # fmt: skip
        left = None  # whether the journal saw the rank leave the collective's phase
        if journal is not None and group in roles:
            left = _map(item, _int(entry.get("time_created_ns")) / 1e9, journal["entries"])
        if left is False or (
            left is None and _is_pending(entry, seq, dump.status.get(str(entry.get("pg_id"))))
        ):
            out.append(item)
    return out


def _is_pending(entry: dict[str, Any], seq: int, status: dict[str, Any] | None) -> bool:
    """Whether torch says a collective had not finished: beyond its group's last completed
    one, or (without a status) not completed. (gloo counts one that failed as completed:
    the journal, whose entry of it never left, says otherwise.)"""
    if isinstance(status, dict) and "last_completed_collective" in status:
        return seq > _int(status["last_completed_collective"])
    return not entry.get("retired") and entry.get("state") != "completed"


def _map(item: Pending, created: float, entries: list[dict[str, Any]]) -> bool | None:
    """Fill ``item``'s step, phase and bag from the journal entry running at ``created``;
    whether the rank left it (False: the collective never finished on this rank); None
    when no entry was running. The journal's word outranks torch's: a watchdog's status
    of the last completed collective lags, under load, behind one that finished."""
    running = [
        e for e in entries
        if e["entered"] - _SLACK_S <= created and (e["left"] is None or created <= e["left"])
    ]  # fmt: skip
    if not running:
        return None
    e = max(running, key=lambda e: e["entered"])
    item.step, item.phase, item.backward = e["step"], e["phase"], bool(e["backward"])
    item.bag = None if e["bag"] < 0 else e["bag"]
    return e["left"] is not None


def _missing(dumps: dict[int, Dump], journals: dict[int, dict[str, Any]]) -> dict:
    """For each group of the balancer, the ranks (with a dump) that never entered the
    latest collective another rank of the group entered."""
    members: dict[str, list[int]] = {}
    for journal in journals.values():
        for g in journal.get("groups", []):
            members.setdefault(g["name"], list(g["ranks"]))
    latest: dict[tuple[str, int], int] = {}
    for rank, dump in dumps.items():
        for e in dump.entries:
            group = str((e.get("process_group") or [e.get("pg_id", "?")])[0])
            key = (group, rank)
            latest[key] = max(latest.get(key, 0), _int(e.get("collective_seq_id")))
    out = {}
    for group, ranks in members.items():
        seen = {r: latest[(group, r)] for r in ranks if (group, r) in latest}
        if not seen:
            continue
        top = max(seen.values())
        behind = [r for r, seq in seen.items() if seq < top]
        if behind:
            out[(group, top)] = sorted(behind)
    return out


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def describe(item: Pending) -> str:
    """One line: ``rank 2: gloo:all_to_all #14 on group 3 (bag [2, 3]) -> step 3,
    pre_attn of bag 1``."""
    where = f"group {item.group}" + (f" ({item.role})" if item.role else "")
    head = f"rank {item.rank}: {item.op} #{item.seq} on {where}"
    if item.phase is None:
        return head + " -> not mapped to a balancer collective"
    phase = item.phase + (" (backward)" if item.backward else "")
    bag = f" of bag {item.bag}" if item.bag is not None else ""
    return f"{head} -> step {item.step}, {phase}{bag}"
