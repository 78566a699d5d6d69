"""A run's store in your own analysis: pyarrow, pandas and DuckDB, a few lines each.

Run: ``python docs/examples/store_analysis.py RUN [--streak K]`` (docs/recording.md,
"Run store"). RUN is a run folder (``store/`` inside). Prints which rank was the slowest
of each step (pyarrow, from the ``steps`` table), then the ranks whose rate stayed at
1.3x or more for K steps in a row (pandas on ``ranks``; the same in SQL with DuckDB when
the ``query`` extra is installed).
"""

from __future__ import annotations

import argparse
from collections import Counter

import pyarrow.compute as pc

from knapformer.contract.run_store import read_table

SLOW = 1.3


def slowest_rank_per_step(run: str) -> Counter:
    """pyarrow: the slowest rank of every step, counted by rank."""
    steps = read_table(run, "steps", columns=["step", "slowest_rank"])
    return Counter(pc.drop_null(steps["slowest_rank"]).to_pylist())


def slow_streaks(run: str, streak: int):
    """pandas: each rank's longest run of consecutive steps at a rate >= `SLOW`, for the
    ranks whose run reaches ``streak`` steps."""
    df = read_table(run, "ranks", columns=["step", "rank", "rate"]).to_pandas()
    df = df.sort_values(["rank", "step"])
    df["slow"] = df["rate"] >= SLOW
    # a new block starts where a rank's slow flag changes; count each slow block's steps
    block = (df["slow"] != df.groupby("rank")["slow"].shift()).cumsum()
    runs = df[df["slow"]].groupby(["rank", block]).size().groupby("rank").max()
    return runs[runs >= streak]


def slow_streaks_sql(run: str, streak: int) -> list[tuple] | None:
    """DuckDB: the same, in SQL over the store's Parquet files (None: duckdb missing)."""
    try:
        import duckdb
    except ImportError:
        return None
    files = f"'{run}/store/ranks-*.parquet'"
    return duckdb.sql(f"""
        WITH flagged AS (
            SELECT rank, step - row_number() OVER (PARTITION BY rank ORDER BY step) AS block
            FROM read_parquet({files}) WHERE rate >= {SLOW})
        SELECT rank, max(n) FROM (SELECT rank, block, count(*) AS n FROM flagged
                                  GROUP BY rank, block)
        GROUP BY rank HAVING max(n) >= {streak} ORDER BY rank""").fetchall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (with store/ inside)")
    parser.add_argument("--streak", type=int, default=1000, help="steps in a row (K)")
    args = parser.parse_args()
    counts = slowest_rank_per_step(args.run)
    total = sum(counts.values())
    for rank, n in counts.most_common(3):
        print(f"slowest rank of the step: rank {rank} in {n} of {total} steps")
    for rank, n in slow_streaks(args.run, args.streak).items():
        print(f"pandas: rank {rank} at >= {SLOW}x for {n} steps in a row")
    sql = slow_streaks_sql(args.run, args.streak)
    for rank, n in sql or []:
        print(f"DuckDB: rank {rank} at >= {SLOW}x for {n} steps in a row")


if __name__ == "__main__":
    main()
