"""Benchmark: rank → position lookups of `knapformer.contract.positions.GpuPositions`
against the dense table indexed by the largest rank that it replaced (memory by rank
value: 8 GB for a rank of 10⁹).

The router looks up the source and destination of every chunk of every step, so the
common layouts must stay as fast as the old table. Each row looks up 60 random member
ranks per GPU (about two chunks per sequence of a 30-sequences-per-GPU step); times are
the best of 15 repeats.

    .venv/bin/python bench/gpu_lookup.py
"""

from __future__ import annotations

import timeit

import numpy as np
from rich.console import Console
from rich.table import Table

from knapformer.contract.positions import gpu_positions

ROWS = [  # (what, GPU ranks)
    ("8 GPUs, ranks 0..7", np.arange(8)),
    ("1,024 GPUs, ranks 0..1023", np.arange(1024)),
    ("4,096 GPUs, ranks 0..4095", np.arange(4096)),
    ("1,024 GPUs, group 16 of a 17,408-rank world", np.arange(16 * 1024, 17 * 1024)),
    ("1,024 GPUs, group 99 of a 102,400-rank world", np.arange(99 * 1024, 100 * 1024)),
    ("1,024 GPUs, sparse ranks up to 2·10⁹", np.arange(1024) * 2_000_000),
]
_MAX_BASELINE_BYTES = 2**30  # the replaced table is not built beyond this (16 GB above)


def dense_by_largest_rank(gpus: np.ndarray) -> np.ndarray:
    """The replaced lookup: a table of max(gpus) + 1 entries."""
    table = np.full(int(gpus.max()) + 1, -1, dtype=np.int64)
    table[gpus] = np.arange(len(gpus))
    return table


def best_us(fn) -> float:
    return min(timeit.repeat(fn, number=20, repeat=15)) / 20 * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    table = Table(title="rank → position lookups (µs, best of 15)", title_justify="left")
    for name in ("GPUs", "lookups", "table by max rank", "GpuPositions", "ratio", "old table MB"):
        table.add_column(name, justify="left" if name == "GPUs" else "right")
    for what, gpus in ROWS:
        ranks = rng.choice(gpus, size=60 * len(gpus))
        new = gpu_positions(gpus)
        t_new = best_us(lambda new=new, ranks=ranks: new[ranks])
        table_bytes = (int(gpus.max()) + 1) * 8
        if table_bytes > _MAX_BASELINE_BYTES:
            old_cells = ["not built", "—"]
        else:
            old = dense_by_largest_rank(gpus)
            assert np.array_equal(old[ranks], new[ranks])
            t_old = best_us(lambda old=old, ranks=ranks: old[ranks])
            old_cells = [f"{t_old:.0f}", f"{t_new / t_old:.2f}"]
        table.add_row(
            what, f"{len(ranks):,}", old_cells[0], f"{t_new:.0f}", old_cells[1],
            f"{table_bytes / 1e6:,.2f}",
        )  # fmt: skip
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
