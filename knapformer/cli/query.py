"""``knapformer query RUN "SQL"``: SQL over a run's store with DuckDB (the ``query`` extra).

The store's tables (`knapformer.contract.store_schema`: ``ranks``, ``steps``,
``rank_windows``) are views over their segments, each segment checked first
(`knapformer.contract.run_store.check_segment`), so a hostile file is one line and exit 1
before DuckDB reads it. docs/recording.md ("Run store") has examples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError
from knapformer.cli.extras import require

if TYPE_CHECKING:
    import pyarrow as pa

#: Rows printed unless ``--rows`` says otherwise.
ROWS = 50
_MAX_WIDTH = 40  # characters of a printed value


def register(app: typer.Typer) -> None:
    app.command()(query)


def query(
    run: Path = typer.Argument(
        ..., metavar="RUN", help="a run folder (with store/), its plans.jsonl or store"
    ),
    sql: str = typer.Argument(
        ..., metavar="SQL", help="SQL over the tables ranks, steps, rank_windows"
    ),
    rows: int = typer.Option(ROWS, help="rows printed (0: all)", callback=bounded),
    csv: bool = typer.Option(False, "--csv", help="print CSV (every row) instead of a table"),
) -> None:
    """Run SQL on a run's store (every step of every rank) with DuckDB.

    Tables: ranks (one row per rank per step), steps (one per step), rank_windows (one
    per rank per segment); docs/recording.md lists their columns. E.g. the slowest rank of
    every step: knapformer query runs/demo "SELECT step, slowest_rank, slowest_rate FROM
    steps ORDER BY step"."""
    require("query", "knapformer query", "duckdb")
    import duckdb

    from knapformer.contract.run_store import existing_store, one_line  # pyarrow: not at start-up

    connection = duckdb.connect()
    _create_views(connection, existing_store(run))
    try:
        relation = connection.sql(sql)
        if relation is None:  # a statement without rows (CREATE, SET ...)
            return
        # duckdb 2 names it to_arrow_table; 1.x's arrow() returns the table
        to_arrow = getattr(relation, "to_arrow_table", None) or relation.arrow
        result = to_arrow()
    except duckdb.Error as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"query: {one_line(first) or type(err).__name__}") from None
    if csv:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(result, sink)
        sys.stdout.write(sink.getvalue().to_pybytes().decode())
    else:
        print(format_table(result, rows))


def _create_views(connection, store: Path) -> None:
    """One view per table over its checked segments (an empty one without segments)."""
    from knapformer.contract.run_store import check_segment, list_segments, run_id
    from knapformer.contract.store_schema import TABLES  # pyarrow: not at start-up

    run = run_id(store)
    for table, schema in TABLES.items():
        segments = list_segments(store, table)
        for seg in segments:
            check_segment(seg, run)
        files = [str(seg.path) for seg in segments]
        if files:
            listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
            # by name: a segment from before a `LATER_COLUMNS` column reads it as null
            reader = f"read_parquet([{listed}], union_by_name = true)"
            connection.execute(f"CREATE VIEW {table} AS SELECT * FROM {reader}")
        else:
            connection.register(table, schema.empty_table())


def format_table(table: pa.Table, rows: int = ROWS) -> str:
    """``table`` as aligned text: a header, up to ``rows`` rows (0: all), then how many
    more there were."""
    shown = table if rows == 0 else table.slice(0, rows)
    columns = [[_text(v) for v in column.to_pylist()] for column in shown.columns]
    header = shown.column_names
    widths = [max([len(h), *map(len, c)]) for h, c in zip(header, columns, strict=True)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += [
        "  ".join(c[i].rjust(w) for c, w in zip(columns, widths, strict=True))
        for i in range(shown.num_rows)
    ]
    more = table.num_rows - shown.num_rows
    lines.append(f"({table.num_rows:,} rows{f', {more:,} not shown (--rows)' if more else ''})")
    return "\n".join(lines)


def _text(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.6g}"
    text = str(value).replace("\n", " ")
    return text if len(text) <= _MAX_WIDTH else text[: _MAX_WIDTH - 1] + "…"
