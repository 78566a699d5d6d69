"""The help of the readers' ``--source`` option, apart from the run store's modules: the
commands that show it are defined without importing pyarrow.

`knapformer.diagnosis.store_source.SOURCES` lists the sources it names."""

from __future__ import annotations

SOURCE_HELP = (
    "where per-step figures come from: the run store (store/ beside the plans), the plans "
    "(JSONL), or auto: the store when the run has one"
)
