"""`ScalarsLog`: the recorder's live TensorBoard logging, on its writer thread only.

Each plan the recorder writes goes to TensorBoard as its per-step scalars
(`knapformer.contract.scalars`), never from the training thread. A failure there (no
writable folder, an error in the TensorBoard writer) logs one warning and stops the
TensorBoard logging only: the JSONL goes on.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from knapformer.contract.plan import RoutingPlan

# Its warnings are the recorder's: a user silences or collects them under that name.
log = logging.getLogger("knapformer.runtime.recorder")


class ScalarsLog:
    """Log plans' scalars to TensorBoard in ``folder`` (opened at the first plan)."""

    def __init__(self, folder: Path):
        self.folder = folder
        #: plans whose scalars were written
        self.written = 0
        self.stopped = False
        self._writer: Any = None

    def write(self, plan: RoutingPlan) -> None:
        """Log ``plan``'s scalars; on any failure one warning and no more logging."""
        # Looked up at each call: the TensorBoard extra is imported only when used.
        from knapformer.contract.scalars import open_writer, write_step

        if self.stopped:
            return
        try:
            if self._writer is None:
                self._writer = open_writer(self.folder)
            write_step(self._writer, plan)
        except Exception as err:
            log.warning("PlanRecorder stopped logging to TensorBoard at %s: %s", self.folder, err)
            self.stopped = True
            return
        self.written += 1

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):  # what it could not flush is lost, no more
                self._writer.close()
