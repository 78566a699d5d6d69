"""``knapformer flight-recorder DUMPS``: PyTorch flight-recorder dumps of a job, each
collective a rank had not finished mapped to the balancer's step, phase and bag."""

from __future__ import annotations

from pathlib import Path

import typer

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError
from knapformer.errors import KnapformerError
from knapformer.tools.flight_recorder import analyse, describe, dump_files, read_dump, read_journals


def register(app: typer.Typer) -> None:
    app.command("flight-recorder")(flight_recorder)


def flight_recorder(
    dumps: list[Path] = typer.Argument(
        ...,
        metavar="DUMPS",
        help="dump files (JSON, or NCCL's pickles; the rank is the number a name ends with) "
        "or folders of them; a run folder: the flight_recorder/ the balancer wrote beside "
        "its incident",
    ),
    journals: Path | None = typer.Option(
        None,
        help="the run folder whose journal/ maps collectives to steps (default: the run "
        "folder given, if one was)",
    ),
    world: int | None = typer.Option(
        None, callback=bounded, help="ranks of the job (default: the highest rank seen, plus one)"
    ),
) -> None:
    """For each rank, the collectives it had not finished (group, sequence number, op) and
    which step, phase and bag of the balancer each served; which ranks of a group never
    entered its latest collective; and which dumps are missing or wrapped."""
    files = dump_files(dumps)
    if not files:
        raise UserError(f"no flight-recorder dump in {', '.join(map(str, dumps))}")
    folder = journals or next((p for p in dumps if p.is_dir()), None)
    loaded, notes = {}, []
    for rank, path in sorted(files.items()):
        try:
            loaded[rank] = read_dump(path, rank)
        except KnapformerError as err:  # unreadable: said, not fatal
            notes.append(f"rank {rank}: {err}")
    report = analyse(loaded, read_journals(folder), world)
    for item in report.pending:
        print(describe(item))
    if not report.pending:
        print("no rank had a collective pending")
    for (group, seq), ranks in sorted(report.missing.items()):
        role = f" ({report.roles[group]})" if group in report.roles else ""
        said = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        print(f"never entered collective #{seq} of group {group}{role}: {said}")
    for note in notes + report.notes:
        print(f"note: {note}")
