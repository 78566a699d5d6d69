"""Rows of a chunk table (`ChunkRows`) and the source a derived table is made from (`ChunkSource`).

A rank's router reads only the chunks its own sequences become and those its bag
receives: a few hundred of the million chunks of a 4,096-GPU step. So a plan the planner
has just made holds its chunk table as a `ChunkSource` (knapformer.planning.chunks) and
makes the whole table only when a reader asks for a column (docs/concepts.md, "Chunks
are derived"); `RoutingPlan.rank_chunks` and the router ask for rows instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np

#: The chunk table's columns, in the order of `knapformer.contract.plan.Chunks`.
CHUNK_COLUMNS = ("seq", "src_gpu", "dst_gpu", "offset", "length")


@dataclass(frozen=True)
class ChunkRows:
    """Rows of a chunk table, in chunk-id order: each row's chunk ``id`` and its columns
    (each (m,) int64, GPU ranks as in the plan)."""

    id: np.ndarray
    seq: np.ndarray
    src_gpu: np.ndarray
    dst_gpu: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.id)

    def where(self, keep: np.ndarray) -> ChunkRows:
        """The rows ``keep`` (a boolean mask or indices) selects, in their order."""
        return ChunkRows(*(getattr(self, f.name)[keep] for f in fields(self)))

    def union(self, other: ChunkRows) -> ChunkRows:
        """The rows of either (each once), in chunk-id order."""
        both = ChunkRows(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)])
                           for f in fields(self)))  # fmt: skip
        _, first = np.unique(both.id, return_index=True)
        return both.where(first)

    @classmethod
    def of_table(cls, columns, ids: np.ndarray) -> ChunkRows:
        """Rows ``ids`` of a table whose `CHUNK_COLUMNS` are attributes of ``columns``."""
        return cls(ids, *(np.asarray(getattr(columns, name))[ids] for name in CHUNK_COLUMNS))


class ChunkSource(Protocol):
    """What a derived chunk table is made from: the whole table, its size, or the rows of
    some sequences, each byte-identical to the rows of the whole table."""

    def count(self) -> int:
        """The number of chunks (rows of the whole table)."""

    def table(self) -> dict[str, np.ndarray]:
        """The whole table: `CHUNK_COLUMNS` -> (num_chunks,) int64, chunk-id order."""

    def rows_of(self, seqs: np.ndarray) -> ChunkRows:
        """Every chunk of the sequences ``seqs`` (ascending ids), in chunk-id order."""


def seq_rows(table_seq: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Chunk ids of the sequences ``seqs`` (ascending) in a table whose ``seq`` column is
    ordered (the canonical order: by sequence, then offset), in chunk-id order."""
    seqs = np.asarray(seqs, dtype=np.int64)
    first = np.searchsorted(table_seq, seqs, side="left")
    end = np.searchsorted(table_seq, seqs, side="right")
    return token_ranges(first, end - first)


def token_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every (s, l), vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    begin = np.cumsum(lengths) - lengths  # where each range starts in the output
    return np.repeat(np.asarray(starts, dtype=np.int64) - begin, lengths) + np.arange(total)
