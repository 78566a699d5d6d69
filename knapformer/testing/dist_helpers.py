"""Run a function on a real process group of local CPU worker processes (the launcher's).

Each rank's return value comes back to the test process, so assertions (and their
messages) live in the test; a failing worker is named, with its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from knapformer.local.launcher import TRAINING_PRELOAD, launch


def run_world(fn: Callable, world: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; their results by rank."""
    return run_world_backend(fn, world, tmp_path, "gloo", *args)


def run_world_backend(
    fn: Callable, world: int, tmp_path: Path, backend: str, *args: Any
) -> list[Any]:
    """Like `run_world` on the given backend (``"nccl"`` for the CUDA path); the run's
    rendezvous and results live in a fresh folder under ``tmp_path``."""
    return launch(
        fn,
        world,
        args,
        backend=backend,
        preload=TRAINING_PRELOAD,
        group_timeout_s=60,
        workdir=tmp_path,
    )
