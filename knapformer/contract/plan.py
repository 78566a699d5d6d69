"""`RoutingPlan`: the typed, validated contract between the balancer and every reader.

Tables are stored as columns (numpy arrays) rather than one object per row: a plan of a
1024-GPU job holds ~30,000 sequences and more chunks, and one is made every step. In
JSON the columns are plain arrays. Sequence id = index in ``sequences``; chunk id =
index in ``chunks``; bag id = index in ``bags``.

The training hot path builds plans with ``RoutingPlan.build`` (no validation); readers
call ``RoutingPlan.model_validate`` / ``model_validate_json``, which check every
invariant in docs/concepts.md (Invariants) and name the offending ids when one is broken.
Files are read with ``strict=True`` (`knapformer.contract.plan_io`): a boolean or a string
where a number belongs is refused, not converted. Every text field is printable and every
float figure lies within the bounds of `knapformer.contract.limits`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from knapformer.contract.alignment import (
    DEFAULT_NODE_SIZE,
    auto_layout_problem,
    fixed_layout_problem,
)
from knapformer.contract.chunk_rows import CHUNK_COLUMNS, ChunkRows, ChunkSource, seq_rows
from knapformer.contract.limits import (
    MAX_CHUNKS,
    MAX_GAMMA,
    MAX_GPU_SPEED,
    MAX_GPUS,
    MAX_MEASURED_MS,
    MAX_PHASES,
    MAX_RANK,
    MAX_SCALE,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    MAX_STEP,
    MAX_TOKEN_DIM,
    MAX_UNIX_TIME,
    MAX_WORKLOAD,
    MIN_GPU_SPEED,
    MIN_SCALE,
    abbreviate,
    figure_problem,
    text_problem,
)
from knapformer.contract.phases import compute_phase
from knapformer.contract.positions import GpuPositions, gpu_positions
from knapformer.contract.probe import LinkProbe
from knapformer.contract.solver_options import SolverOptions
from knapformer.contract.stats import PlanStats, compute_stats
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError

SCHEMA_VERSION = 2
#: Versions this reader understands: 1 had no ``planner_version`` and no ``policy``.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: Fields a schema-1 record cannot carry (written only by schema 2's writers).
SCHEMA_2_FIELDS = ("planner_version", "policy")
_MAX_IDS_IN_MESSAGE = 5
_INT64 = (-(2**63), 2**63 - 1)


def _as_column(kind: str):
    def convert(value: Any) -> np.ndarray:
        # numpy reads [1, true] as integers: a boolean in a list is refused first.
        if isinstance(value, list) and bool in set(map(type, value)):
            raise ValueError(_first_bad_value(value, kind))
        try:
            arr = np.asarray(value)
        except (TypeError, OverflowError, RecursionError) as err:
            raise ValueError(f"expected a flat array of {kind}s ({err})") from None
        if arr.ndim != 1:
            if arr.size == 0:
                arr = arr.reshape(0)
            else:
                raise ValueError(f"expected a flat array of {kind}s, got shape {arr.shape}")
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64 if kind == "integer" else np.float64)
        if kind == "integer":
            # numpy turns ints beyond int64 into uint64, float64 or objects: name the value
            # rather than report a wrapped-around or "float" one.
            if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.max() > _INT64[1]):
                raise ValueError(_first_bad_value(value, kind))
            return arr.astype(np.int64, copy=False)
        if arr.dtype.kind not in "iuf":
            raise ValueError(_first_bad_value(value, kind))
        return arr.astype(np.float64, copy=False)

    return convert


def _first_bad_value(values: Any, kind: str) -> str:
    """Why ``values`` is not a column of ``kind``, naming the first offending value."""
    article, wanted = ("an", int) if kind == "integer" else ("a", int | float)
    for index, v in enumerate(values if isinstance(values, list | tuple) else []):
        if isinstance(v, bool) or not isinstance(v, wanted):
            return f"value {abbreviate(repr(v))} at index {index} is not {article} {kind}"
        if isinstance(v, int) and not _INT64[0] <= v <= _INT64[1]:
            return (
                f"value {abbreviate(f'{v:,}')} at index {index} is outside the 64-bit integer range"
            )
    return f"expected an array of {kind}s"


def _to_list(arr: np.ndarray) -> list:
    return np.asarray(arr).tolist()


def _check_text(text: str) -> str:
    problem = text_problem(text, "text")
    if problem is not None:
        raise ValueError(problem)
    return text


def _exact_int(value: Any) -> Any:
    """Refuse a boolean where an integer belongs (``true`` is not version 1; pydantic's
    ``Literal[1, 2]`` accepts it even when strict)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


#: Every text field of a plan: printable, at most `MAX_TEXT_CHARS` characters.
Text = Annotated[str, AfterValidator(_check_text)]


IntColumn = Annotated[
    np.ndarray,
    BeforeValidator(_as_column("integer")),
    PlainSerializer(_to_list),
    WithJsonSchema({"type": "array", "items": {"type": "integer"}}),
]
FloatColumn = Annotated[
    np.ndarray,
    BeforeValidator(_as_column("number")),
    PlainSerializer(_to_list),
    WithJsonSchema({"type": "array", "items": {"type": "number"}}),
]


def _ids(mask_or_ids: np.ndarray) -> str:
    """Format offending ids for a message: ``3, 7, 9 (and 12 more)``."""
    ids = np.flatnonzero(mask_or_ids) if mask_or_ids.dtype == bool else mask_or_ids
    ids = np.unique(ids)
    shown = ", ".join(str(int(i)) for i in ids[:_MAX_IDS_IN_MESSAGE])
    more = len(ids) - _MAX_IDS_IN_MESSAGE
    return shown + (f" (and {more} more)" if more > 0 else "")


class _Columns(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    def __len__(self) -> int:
        first = next(iter(type(self).model_fields))
        return len(getattr(self, first))

    def columns(self) -> dict[str, Any]:
        """Column name -> column, in field order (a derived chunk table is made)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, name), getattr(other, name))
            for name in type(self).model_fields
        )

    __hash__ = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _same_length(self):
        lengths = {name: len(getattr(self, name)) for name in type(self).model_fields}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{type(self).__name__.lower()} columns differ in length: {lengths}")
        return self


class Sequences(_Columns):
    """One row per sequence; sequence id = row index."""

    src_gpu: IntColumn = Field(description="GPU rank that holds the sequence before routing")
    length: IntColumn = Field(description="tokens")
    workload: FloatColumn = Field(description="modelled cost (see WorkloadModel)")
    bag: IntColumn = Field(description="bag id the sequence is assigned to")


class Chunks(_Columns):
    """One row per chunk; chunk id = row index."""

    # (The docstring is the JSON schema's description.) A plan the planner made derives
    # its table (`derived`): the columns are made on first read, or when the plan is
    # written, compared or pickled, byte-identical to a table given whole; `rows_of`
    # gives some sequences' rows without making them.

    seq: IntColumn = Field(description="sequence id")
    src_gpu: IntColumn = Field(description="GPU rank the chunk starts on")
    dst_gpu: IntColumn = Field(description="GPU rank the chunk is routed to")
    offset: IntColumn = Field(description="first token of the chunk within its sequence")
    length: IntColumn = Field(description="tokens")

    _source: ChunkSource | None = PrivateAttr(default=None)

    @classmethod
    def derived(cls, source: ChunkSource) -> Chunks:
        """A table made from ``source`` when first read (not validated: the hot path)."""
        chunks = cls.model_construct(_fields_set=set(cls.model_fields))
        chunks._source = source
        return chunks

    @property
    def made(self) -> bool:
        """Whether the columns exist (False: a derived table no reader has read yet)."""
        return self._pending() is None

    def rows_of(self, seqs: np.ndarray) -> ChunkRows:
        """Every chunk of the sequences ``seqs`` (ascending ids), in chunk-id order,
        without making a derived table whole."""
        source = self._pending()
        if source is not None:
            return source.rows_of(seqs)
        return ChunkRows.of_table(self, seq_rows(self.seq, seqs))

    def _pending(self) -> ChunkSource | None:
        """The source of a derived table not made yet (None: the columns are here)."""
        private = self.__pydantic_private__
        return None if private is None else private.get("_source")

    def _make(self) -> None:
        """Make a derived table's columns (a no-op once made). Columns go in before the
        source goes, so a thread that finds no source finds them."""
        source = self._pending()
        if source is not None:
            self.__dict__.update(source.table())
            self.__pydantic_private__["_source"] = None

    def __getattr__(self, name: str) -> Any:
        if name in CHUNK_COLUMNS:
            self._make()
            if name in self.__dict__:
                return self.__dict__[name]
        return super().__getattr__(name)

    def __len__(self) -> int:
        source = self._pending()
        return super().__len__() if source is None else source.count()

    def __getstate__(self) -> dict[Any, Any]:
        self._make()
        return super().__getstate__()

    def __repr_args__(self):
        self._make()
        return super().__repr_args__()

    def __iter__(self):  # dict(chunks) reads the fields' values
        self._make()
        return super().__iter__()

    # Written whole. No return type: the serialisation schema stays the columns'.
    @model_serializer(mode="wrap")
    def _whole(self, handler: SerializerFunctionWrapHandler):
        self._make()
        return handler(self)


class Measurements(BaseModel):
    """Measured times of the step. ``per_rank_ms[phase][i]`` is for GPU ``gpus[i]``."""

    # Fields of newer writers travel through (the recorder writes them back); their names
    # and text are checked like every text field (`_check_extra`).
    model_config = ConfigDict(extra="allow")

    plan_ms: float | None = Field(None, description="time to plan this step (ms)")
    per_rank_ms: dict[Text, list[float]] = Field(
        default_factory=dict,
        description="phase name (e.g. route, forward_backward, step) -> ms per GPU of `gpus`",
    )
    link_probe: LinkProbe | None = Field(
        None,
        description="the step's pairwise link timings (knapformer.contract.probe)",
        exclude_if=lambda value: value is None,  # plans without a probe read as before
    )

    @model_validator(mode="after")
    def _check_extra(self) -> Measurements:
        for name, value in (self.model_extra or {}).items():
            for text in (name, value) if isinstance(value, str) else (name,):
                problem = text_problem(text, "text")
                if problem is not None:
                    raise ValueError(f"{abbreviate(repr(name))}: {problem}")
        return self

    def compute_phase(self) -> str | None:
        """The measured phase that stands for each GPU's compute (in the order of
        `knapformer.contract.phases.COMPUTE_PHASES`); None when none was measured."""
        return compute_phase(self.per_rank_ms)


class RoutingPlan(BaseModel):
    """Where every token chunk of one training step goes. See docs/concepts.md."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    schema_version: Annotated[Literal[1, 2], BeforeValidator(_exact_int)] = SCHEMA_VERSION
    planner_version: Text | None = Field(
        None,
        description="version of the knapformer package whose planner made the plan (with "
        "`solver`, what a replay must match); None when unknown (schema 1, legacy plans)",
    )
    step: int | None = None
    time: float | None = Field(None, description="wall-clock time (unix seconds)")
    run: Text | None = None
    topology: Text
    gpus: list[int] = Field(description="ranks of the balance group, in order")
    bags: list[list[int]] = Field(description="GPU ranks of each bag; bag id = index")
    token_dim: int | None = None
    gamma: float | None = None
    scale: float | None = Field(
        None, description="the workload model's scale (None: 1, or unknown for legacy plans)"
    )
    workload_unit: Literal["model", "ms"] = Field(
        "model",
        description='"ms" when workloads are calibrated milliseconds, else modelled units',
    )
    gpu_speed: list[float] | None = Field(
        None,
        description="relative speed of each GPU of `gpus` the planner assumed (1 = nominal; "
        "the history cost model learns it); None: every GPU nominal",
    )
    solver: Text
    # Left out of the JSON while None, so plans of fixed bags read the same as before it
    # existed (and in readers that predate it).
    policy: Literal["fixed", "auto"] | None = Field(
        None,
        description='what chose the bags: "auto" (the planner, each step) or fixed',
        exclude_if=lambda value: value is None,
    )
    solver_options: SolverOptions = Field(default_factory=dict)  # type: ignore[arg-type]
    sequences: Sequences
    chunks: Chunks
    measurements: Measurements | None = None

    _stats: PlanStats | None = PrivateAttr(default=None)

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, **fields: Any) -> RoutingPlan:
        """Construct without validation (hot path). Columns may be numpy arrays;
        ``chunks`` may be a `Chunks` (e.g. `Chunks.derived`)."""
        fields["sequences"] = Sequences.model_construct(**fields["sequences"])
        chunks = fields["chunks"]
        fields["chunks"] = (
            chunks if isinstance(chunks, Chunks) else Chunks.model_construct(**chunks)
        )
        fields.setdefault("schema_version", SCHEMA_VERSION)
        fields.setdefault("solver_options", {})
        for name in (
            "planner_version",
            "step",
            "time",
            "run",
            "token_dim",
            "gamma",
            "scale",
            "gpu_speed",
            "measurements",
        ):
            fields.setdefault(name, None)
        fields.setdefault("workload_unit", "model")
        return cls.model_construct(**fields)

    def validated(self) -> RoutingPlan:
        """A validated copy (raises ``ValidationError`` naming the ids when broken)."""
        return type(self).model_validate(self.model_dump())

    # ----------------------------------------------------------------- derived
    @property
    def stats(self) -> PlanStats:
        """Derived loads, imbalance, traffic, lower bound (computed once, cached)."""
        if self._stats is None:
            self._stats = compute_stats(self)
        return self._stats

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    # ------------------------------------------------------- one rank's chunks
    # What a rank's router reads, without making a derived chunk table whole. Each is
    # exactly the rows of `chunks` it names (sequences' chunks are contiguous rows).
    def bag_of(self, rank: int) -> int:
        """The id of the bag GPU ``rank`` belongs to (`KnapformerError`: none)."""
        for bag, members in enumerate(self.bags):
            if rank in members:
                return bag
        raise KnapformerError(f"GPU {rank} belongs to no bag of this plan (gpus {self.gpus})")

    def chunks_from(self, rank: int) -> ChunkRows:
        """The chunks GPU ``rank`` sends (its sequences', to itself too), chunk-id order."""
        return self.chunks.rows_of(np.flatnonzero(np.asarray(self.sequences.src_gpu) == rank))

    def chunks_into_bag(self, bag: int) -> ChunkRows:
        """The chunks the GPUs of ``bag`` receive (its sequences'), chunk-id order."""
        return self.chunks.rows_of(np.flatnonzero(np.asarray(self.sequences.bag) == bag))

    def chunks_to(self, rank: int) -> ChunkRows:
        """The chunks GPU ``rank`` receives (from itself too), chunk-id order."""
        into_bag = self.chunks_into_bag(self.bag_of(rank))
        return into_bag.where(into_bag.dst_gpu == rank)

    def rank_chunks(self, rank: int) -> ChunkRows:
        """Every chunk GPU ``rank`` sends or receives, in chunk-id order: the rows of
        `chunks` whose source or destination is ``rank``."""
        return self.chunks_from(rank).union(self.chunks_to(rank))

    def bag_label(self, bag_id: int, sep: str = " · ") -> str:
        """How readers name a bag: ``bag 3 · 4 GPUs``."""
        size = len(self.bags[bag_id])
        return f"bag {bag_id}{sep}{size} GPU{'s' if size != 1 else ''}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingPlan):
            return NotImplemented
        return json.loads(self.model_dump_json()) == json.loads(other.model_dump_json())

    __hash__ = None  # type: ignore[assignment]

    # -------------------------------------------------------------- invariants
    @model_validator(mode="after")
    def _check_invariants(self) -> RoutingPlan:
        for problem in _invariant_problems(self):
            raise ValueError(problem)
        return self


def _invariant_problems(plan: RoutingPlan) -> Iterator[str]:
    """Yield the first broken invariant as a message naming the ids (checked in order).

    Values and sizes are bounded (`knapformer.contract.limits`) before any array is built from
    them, so no check below allocates by a value or overflows int64.
    """
    problem = _field_problem(plan) or _group_problem(plan)
    if problem is None:
        positions = gpu_positions(plan.gpus)
        problem = (
            layout_problem(plan, positions)
            or _sequence_problem(plan, positions)
            or _chunk_problem(plan, positions)
            or _speed_problem(plan)
            or _measurement_problem(plan)
        )
    if problem is not None:
        yield problem


def layout_problem(plan: RoutingPlan, positions: GpuPositions | None = None) -> str | None:
    """Why the plan's bags could not run (None when they can), naming the field: checked
    against the plan's own policy (`knapformer.contract.alignment`): fixed bags as the
    topology lays them; the planner's (``policy: "auto"``) by their group sizes, bag sizes
    and alignment. ``positions``: `gpu_positions` of ``plan.gpus``, when known. The GPUs,
    bags and topology are consistent (`_group_problem`)."""
    if plan.policy != "auto":
        return fixed_layout_problem(Topology.parse(plan.topology), plan.gpus, plan.bags)
    positions = gpu_positions(plan.gpus) if positions is None else positions
    options = plan.solver_options
    node_size = (options.get("comm") or {}).get("node_size", DEFAULT_NODE_SIZE)
    sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    members = positions[np.fromiter(itertools.chain.from_iterable(plan.bags), dtype=np.int64)]
    return auto_layout_problem(
        members, sizes, len(plan.gpus), options.get("group_sizes"), int(node_size)
    )


def _field_problem(plan: RoutingPlan) -> str | None:
    """Scalars and table sizes within the bounds of `knapformer.contract.limits`."""
    for name in SCHEMA_2_FIELDS:
        if plan.schema_version == 1 and getattr(plan, name) is not None:
            return (
                f"{name} is a field of schema 2, but the record says schema_version 1: "
                f"set schema_version to 2 or drop {name}"
            )
    if plan.step is not None and abs(plan.step) > MAX_STEP:
        step = abbreviate(f"{plan.step:,}")
        return f"step {step} is beyond ±{MAX_STEP:,} (knapformer.contract.limits)"
    if plan.token_dim is not None and not 1 <= plan.token_dim <= MAX_TOKEN_DIM:
        return (
            f"token_dim {abbreviate(f'{plan.token_dim:,}')} is outside 1..{MAX_TOKEN_DIM:,} "
            "(knapformer.contract.limits)"
        )
    for name, low, high, zero in (
        ("gamma", 0.0, MAX_GAMMA, True),
        ("time", 0.0, MAX_UNIX_TIME, True),
        ("scale", MIN_SCALE, MAX_SCALE, False),
    ):
        value = getattr(plan, name)
        if value is not None:
            problem = figure_problem(value, name, low, high, zero)
            if problem is not None:
                return problem
    for name, count, bound in (
        ("gpus", len(plan.gpus), MAX_GPUS),
        ("sequences", len(plan.sequences), MAX_SEQUENCES),
        ("chunks", len(plan.chunks), MAX_CHUNKS),
    ):
        if count > bound:
            return (
                f"{name}: {count:,} {name}; a plan holds at most {bound:,} "
                "(knapformer.contract.limits)"
            )
    return None


def _rank_problem(name: str, ranks: Iterable[int]) -> str | None:
    """The first rank of ``ranks`` (Python ints, from a file) beyond ±`MAX_RANK` (small
    negative ranks are left to the check that names their ids)."""
    for rank in ranks:
        if not -MAX_RANK <= rank <= MAX_RANK:
            return (
                f"{name} holds rank {abbreviate(f'{rank:,}')}; ranks are 0..{MAX_RANK:,} "
                "(knapformer.contract.limits)"
            )
    return None


def _group_problem(plan: RoutingPlan) -> str | None:
    """The GPUs, the bags and the topology agree."""
    if not plan.gpus:
        return "gpus is empty: a plan needs at least one GPU"
    members = sum(map(len, plan.bags))
    problem = _rank_problem("gpus", plan.gpus) or _rank_problem(
        "bags", itertools.chain.from_iterable(plan.bags)
    )
    if problem is not None:
        return problem
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    if (gpus < 0).any():
        return f"gpus holds negative rank(s) {_ids(gpus[gpus < 0])}"
    uniq, counts = np.unique(gpus, return_counts=True)
    if (counts > 1).any():
        return f"gpus lists GPU(s) {_ids(uniq[counts > 1])} more than once"
    bag_sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    bag_members = np.fromiter(
        itertools.chain.from_iterable(plan.bags), dtype=np.int64, count=members
    )
    if (bag_sizes == 0).any():
        return f"bag(s) {_ids(bag_sizes == 0)} have no GPUs"
    positions = gpu_positions(gpus)
    foreign = ~positions.contains(bag_members)
    if foreign.any():
        return f"bags hold GPU(s) {_ids(bag_members[foreign])} that are not in gpus"
    member_ranks, member_counts = np.unique(bag_members, return_counts=True)
    if (member_counts > 1).any():
        return f"GPU(s) {_ids(member_ranks[member_counts > 1])} belong to more than one bag"
    if len(bag_members) < len(gpus):  # members are distinct GPUs of the plan
        in_a_bag = np.zeros(len(gpus), dtype=bool)
        in_a_bag[positions[bag_members]] = True
        return f"GPU(s) {_ids(gpus[~in_a_bag])} belong to no bag"
    return _topology_problem(plan.topology, bag_sizes)


def _topology_problem(topology: str, bag_sizes: np.ndarray) -> str | None:
    """The topology string describes the bags (replay and the planner rebuild from it)."""
    try:
        topo = Topology.parse(topology)
    except KnapformerError as err:
        return str(err)
    if topo.bag_sizes != tuple(sorted(bag_sizes.tolist())):
        actual = Topology.from_bag_sizes(bag_sizes.tolist())
        return (
            f"topology {abbreviate(repr(topology))} does not match the bags, which make "
            f"{actual} ({actual.num_gpus:,} GPUs in {actual.num_bags:,} bags)"
        )
    return None


def _sequence_problem(plan: RoutingPlan, positions: GpuPositions) -> str | None:
    seqs, n_bags = plan.sequences, len(plan.bags)
    src_position = positions[seqs.src_gpu]
    bad = src_position < 0
    if bad.any():
        return f"sequence(s) {_ids(bad)} have a source GPU outside gpus"
    # Canonical order (the router relies on it): sequences grouped by source GPU in the
    # order of `gpus`, chunks by sequence then offset.
    bad = np.flatnonzero(np.diff(src_position) < 0) + 1
    if bad.size:
        return (
            f"sequence(s) {_ids(bad)} are out of order: sequences must be grouped by source "
            "GPU in the order of gpus"
        )
    if (seqs.length < 0).any():
        return f"sequence(s) {_ids(seqs.length < 0)} have a negative length"
    bad = seqs.length > MAX_SEQ_LENGTH
    if bad.any():
        return (
            f"sequence(s) {_ids(bad)} are longer than {MAX_SEQ_LENGTH:,} tokens "
            f"(knapformer.contract.limits): {int(seqs.length[bad][0]):,}"
        )
    bad = ~np.isfinite(seqs.workload) | (seqs.workload < 0)
    if bad.any():
        return f"sequence(s) {_ids(bad)} have a workload that is negative or not finite"
    problem = figure_problem(seqs.workload, "sequences.workload", 0.0, MAX_WORKLOAD)
    if problem is not None:
        return problem
    bad = (seqs.bag < 0) | (seqs.bag >= n_bags)
    if bad.any():
        return f"sequence(s) {_ids(bad)} are assigned to a bag id outside 0..{n_bags - 1}"
    return None


def _chunk_problem(plan: RoutingPlan, positions: GpuPositions) -> str | None:
    seqs, chunks = plan.sequences, plan.chunks
    n_seq = len(seqs)
    bad = (chunks.seq < 0) | (chunks.seq >= n_seq)
    if bad.any():
        return f"chunk(s) {_ids(bad)} name a sequence id outside 0..{n_seq - 1}"
    bad = (chunks.length < 0) | (chunks.offset < 0)
    if bad.any():
        return f"chunk(s) {_ids(bad)} have a negative length or offset"
    bad = (chunks.length > MAX_SEQ_LENGTH) | (chunks.offset > MAX_SEQ_LENGTH)
    if bad.any():
        return (
            f"chunk(s) {_ids(bad)} have a length or offset beyond {MAX_SEQ_LENGTH:,} tokens "
            "(knapformer.contract.limits)"
        )
    src_position, dst_position = positions[chunks.src_gpu], positions[chunks.dst_gpu]
    bad = (src_position < 0) | (dst_position < 0)
    if bad.any():
        return f"chunk(s) {_ids(bad)} have a source or destination GPU outside gpus"
    bad = chunks.src_gpu != seqs.src_gpu[chunks.seq]
    if bad.any():
        return f"chunk(s) {_ids(bad)} start on a GPU other than their sequence's source GPU"

    n = len(plan.gpus)
    bag_sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    bag_of_position = np.empty(n, dtype=np.int64)  # every GPU is in exactly one bag
    bag_of_position[positions[list(itertools.chain.from_iterable(plan.bags))]] = np.repeat(
        np.arange(len(plan.bags)), bag_sizes
    )
    bad = bag_of_position[dst_position] != seqs.bag[chunks.seq]
    if bad.any():
        return (
            f"chunk(s) {_ids(bad)} go to a GPU outside their sequence's bag "
            f"(sequence(s) {_ids(chunks.seq[bad])})"
        )
    pair = chunks.seq * (n + 1) + dst_position  # < 2**20 * 2**14: no overflow
    _, first, pair_counts = np.unique(pair, return_index=True, return_counts=True)
    if (pair_counts > 1).any():
        dup_seq = chunks.seq[first[pair_counts > 1]]
        return f"sequence(s) {_ids(dup_seq)} send more than one chunk to the same GPU"
    return _tiling_problem(plan)


def _tiling_problem(plan: RoutingPlan) -> str | None:
    """Chunks in canonical order, each sequence covered exactly by its chunks."""
    seqs, chunks = plan.sequences, plan.chunks
    step_back = (np.diff(chunks.seq) < 0) | (
        (np.diff(chunks.seq) == 0) & (np.diff(chunks.offset) < 0)
    )
    if step_back.any():
        return (
            f"chunk(s) {_ids(np.flatnonzero(step_back) + 1)} are out of order: chunks must be "
            "ordered by sequence id, then offset"
        )
    # Tiling: sorted by (seq, offset), each chunk starts where the previous one ended.
    order = np.lexsort((chunks.offset, chunks.seq))
    s, off, ln = chunks.seq[order], chunks.offset[order], chunks.length[order]
    first_of_seq = np.ones(len(s), dtype=bool)
    first_of_seq[1:] = s[1:] != s[:-1]
    expected = np.where(first_of_seq, 0, np.concatenate([[0], off[:-1] + ln[:-1]]))
    bad = off != expected
    if bad.any():
        return (
            f"sequence(s) {_ids(s[bad])} have chunks that do not tile them: chunk(s) "
            f"{_ids(order[bad])} leave a gap or overlap"
        )
    covered = np.bincount(chunks.seq, weights=chunks.length, minlength=len(seqs))
    bad = covered.astype(np.int64) != seqs.length
    if bad.any():
        return (
            f"sequence(s) {_ids(bad)} are not covered exactly by their chunks "
            "(chunk lengths do not sum to the sequence length)"
        )
    return None


def _measurement_problem(plan: RoutingPlan) -> str | None:
    """One finite time per GPU for every phase (JSON has no infinities: a plan that held
    one would not read back what it wrote; the recorder drops such a figure)."""
    measured = plan.measurements
    if measured is None:
        return None
    if measured.plan_ms is not None and not math.isfinite(measured.plan_ms):
        return f"measurements.plan_ms is {measured.plan_ms}; times must be finite"
    if measured.plan_ms is not None:
        problem = figure_problem(
            measured.plan_ms, "measurements.plan_ms", 0.0, MAX_MEASURED_MS, unit=" ms"
        )
        if problem is not None:
            return problem
    if len(measured.per_rank_ms) > MAX_PHASES:
        return (
            f"measurements.per_rank_ms holds {len(measured.per_rank_ms):,} phases; at most "
            f"{MAX_PHASES} are supported (knapformer.contract.limits)"
        )
    for phase, values in measured.per_rank_ms.items():
        where = f"measurements.per_rank_ms[{abbreviate(repr(phase))}]"
        if len(values) != len(plan.gpus):
            return f"{where} has {len(values)} values for {len(plan.gpus)} GPUs"
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            return (
                f"{where} of GPU(s) {_ids(np.asarray(plan.gpus)[bad])} is not finite; times "
                "must be finite"
            )
        problem = figure_problem(values, where, 0.0, MAX_MEASURED_MS, unit=" ms")
        if problem is not None:
            return problem
    if measured.link_probe is not None:
        return measured.link_probe.problem(len(plan.gpus))
    return None


def _speed_problem(plan: RoutingPlan) -> str | None:
    if plan.gpu_speed is None:
        return None
    speed = np.asarray(plan.gpu_speed, dtype=np.float64)
    if speed.shape != (len(plan.gpus),):
        return f"gpu_speed has {speed.size} values for {len(plan.gpus)} GPUs"
    bad = ~np.isfinite(speed) | (speed <= 0)
    if bad.any():
        gpus = np.asarray(plan.gpus)
        return f"gpu_speed of GPU(s) {_ids(gpus[bad])} is not a finite positive number"
    return figure_problem(speed, "gpu_speed", MIN_GPU_SPEED, MAX_GPU_SPEED, zero=False)
