"""`Incident`: the record of a failed balanced step, written into the run like a plan: which
collective failed (step, phase, bag and its ranks), which ranks were to blame and why, and
the one-line message every surviving rank raised.

The balancer writes it to ``incident.json`` beside the run's plans (`INCIDENT_FILE`), with
every live rank's step journal under ``journal/`` (`journal_file`); ``knapformer validate``
checks it, and ``knapformer stragglers``, the dashboard's header and the report show it
(`read_incident`). A culprit is a rank that raised an exception of its own (``raised``),
never entered the collective (``never_entered``: alive, elsewhere in its step, or stalled
before it), was in another collective (``elsewhere``), did not answer (``no_answer``:
its process gone or frozen), closed its balancer (``closed``) or had finished training
(``finished``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from knapformer.contract.limits import MAX_GPUS, MAX_RANK, MAX_STEP, MAX_TEXT_CHARS
from knapformer.contract.phases import JOURNAL_PHASES
from knapformer.errors import KnapformerError, file_error

INCIDENT_FILE = "incident.json"
JOURNAL_FOLDER = "journal"
FLIGHT_RECORDER_FOLDER = "flight_recorder"
#: The first key of an incident record (a plan's is ``schema_version``).
INCIDENT_KEY = "incident_version"
#: Bytes of an incident file a reader accepts: a record of `MAX_GPUS` culprits with
#: their texts is well below it.
MAX_INCIDENT_BYTES = 64 * 2**20
#: Characters of a message (one line per culprit, each a few hundred characters).
MAX_MESSAGE_CHARS = 64 * MAX_TEXT_CHARS

CULPRIT_KINDS = ("raised", "never_entered", "elsewhere", "no_answer", "closed", "finished")

_Rank = Field(ge=0, le=MAX_RANK)


class Culprit(BaseModel):
    """One rank to blame and why; ``last_*``: its latest collective as it last reported it
    (``seconds_ago`` from when it left it or, still inside, entered it)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = _Rank
    kind: Literal[CULPRIT_KINDS]  # type: ignore[valid-type]
    says: str = Field(max_length=MAX_MESSAGE_CHARS)  # the clause naming it, as raised
    error: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    last_step: int | None = Field(default=None, ge=-1, le=MAX_STEP)
    last_phase: str | None = None
    last_bag: int | None = Field(default=None, ge=-1, le=MAX_GPUS)
    seconds_ago: float | None = None

    @field_validator("last_phase")
    @classmethod
    def _known_phase(cls, phase: str | None) -> str | None:
        return phase if phase is None else _check_phase(phase)

    @field_validator("seconds_ago")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"seconds_ago must be a finite number >= 0, got {value}")
        return value


class Incident(BaseModel):
    """A failed balanced step (the module doc)."""

    model_config = ConfigDict(extra="forbid")

    incident_version: Literal[1] = 1
    run: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    time: float  # wall clock (s since the epoch) when it was named
    step: int = Field(ge=-1, le=MAX_STEP)
    phase: str
    backward: bool = False
    bag: int | None = Field(default=None, ge=0, le=MAX_GPUS)  # the plan's bag, if one
    ranks: list[int] = Field(max_length=MAX_GPUS)  # the failed collective's ranks
    reporter: int = _Rank  # the rank that wrote the record
    culprits: list[Culprit] = Field(max_length=MAX_GPUS)
    earlier: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)
    cause: str = Field(max_length=MAX_MESSAGE_CHARS)  # what the backend said
    message: str = Field(max_length=MAX_MESSAGE_CHARS)  # what every survivor raised

    @field_validator("phase")
    @classmethod
    def _known_phase(cls, phase: str) -> str:
        return _check_phase(phase)

    @model_validator(mode="after")
    def _check(self) -> Incident:
        if not math.isfinite(self.time):
            raise ValueError(f"time must be a finite number of seconds, got {self.time}")
        problem = _ranks_problem(self.ranks)
        if problem:
            raise ValueError(problem)
        blamed = [c.rank for c in self.culprits]
        if len(set(blamed)) != len(blamed):
            raise ValueError(f"culprits name a rank twice: {blamed}")
        return self

    @property
    def culprit_ranks(self) -> list[int]:
        return [c.rank for c in self.culprits]

    def headline(self) -> str:
        """One line for a reader's header: the step, phase and who is to blame."""
        return f"incident: {self.message}"


def _check_phase(phase: str) -> str:
    if phase not in JOURNAL_PHASES:
        raise ValueError(f"unknown phase {phase!r}; a journal phase is one of {JOURNAL_PHASES}")
    return phase


def _ranks_problem(ranks: list[int]) -> str | None:
    if any(r < 0 or r > MAX_RANK for r in ranks):
        return f"ranks must lie in 0..{MAX_RANK}, got {ranks[:8]}"
    if len(set(ranks)) != len(ranks):
        return f"ranks repeat a rank: {ranks[:16]}"
    return None


def incident_file(folder: str | Path) -> Path:
    """Where a run in ``folder`` keeps its incident: ``folder/incident.json``."""
    return Path(folder) / INCIDENT_FILE


def journal_file(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a run in ``folder`` dumps its journal."""
    return Path(folder) / JOURNAL_FOLDER / f"rank{int(rank)}.json"


def looks_like_incident(text: bytes) -> bool:
    """Whether a JSON document's first key is an incident's."""
    return text.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b'{"' + INCIDENT_KEY.encode())


def parse_incident(text: bytes | str, source: str = "incident") -> Incident:
    """An `Incident` from JSON text; a `KnapformerError` naming ``source`` and the
    problem otherwise."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > MAX_INCIDENT_BYTES:
        raise KnapformerError(
            f"{source}: {len(raw):,} bytes, more than an incident may hold ({MAX_INCIDENT_BYTES:,})"
        )
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise KnapformerError(f"{source}: not JSON ({err})") from None
    if not isinstance(values, dict):
        raise KnapformerError(f"{source}: an incident is a JSON object")
    try:
        return Incident.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise KnapformerError(f"{source}: invalid incident: {where}: {first['msg']}") from None


def read_incident(path: str | Path) -> Incident:
    """The incident in the file ``path``; a `KnapformerError` when it cannot be read or is
    not a valid one."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_INCIDENT_BYTES + 1)
    except OSError as err:
        raise file_error(path, err) from err
    return parse_incident(text, str(path))


def run_incident(plans: str | Path) -> Incident | None:
    """The incident of the run whose plan file is ``plans`` (``incident.json`` beside it),
    None when it has none; an unreadable or invalid one is a `KnapformerError`."""
    path = incident_file(Path(plans).parent)
    if not path.is_file():
        return None
    return read_incident(path)


def remove_incident(folder: str | Path) -> None:
    """Remove what a failed run left in ``folder``: its incident, the ranks' journals and
    flight-recorder dumps (a new run in the same folder starts without them)."""
    folder = Path(folder)
    incident_file(folder).unlink(missing_ok=True)
    for name in (JOURNAL_FOLDER, FLIGHT_RECORDER_FOLDER):
        sub = folder / name
        if sub.is_dir():
            for dump in sub.glob("rank*.json"):
                dump.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                sub.rmdir()


def write_incident(incident: Incident, folder: str | Path) -> Path:
    """Write ``incident`` to ``folder/incident.json`` atomically; returns the path."""
    path = incident_file(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(incident.model_dump_json() + "\n")
    scratch.replace(path)
    return path
