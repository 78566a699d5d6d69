"""Which process records a balance group's plans, and to which file.

In a process group one rank per balance group writes (`writes`: the rank at a given
position of the group), to its group's own file (`group_path`: ``{group}`` in the path
is the group's index, else group k > 0 writes ``<stem>.group<k><suffix>``). A path
with any other ``{...}`` placeholder is refused when the recorder is made
(`check_template`), not on the training thread at the first plan.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from knapformer.contract.runfiles import GROUP_TEMPLATE, group_file
from knapformer.errors import KnapformerError

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


def dist_rank() -> int | None:
    """This process's rank when a ``torch.distributed`` process group is initialised, else
    ``None``: looked up in ``sys.modules`` so that recording without torch never imports it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def writes(gpus: list[int], writer: int) -> bool:
    """Whether this process writes the group of ranks ``gpus``: any process outside a
    process group, else the rank at position ``writer`` of ``gpus``."""
    rank = dist_rank()
    return rank is None or (writer < len(gpus) and gpus[writer] == rank)


def group_path(path: Path, group_ranks: list[int]) -> Path:
    """The group's file (or folder) for ``path``: groups are consecutive blocks of
    ranks, index = first // size."""
    return group_file(path, min(group_ranks) // len(group_ranks))


def check_template(path: str) -> None:
    """Refuse a path template with a placeholder other than ``{group}`` (it would be
    written literally, or fail later on the training thread); lone braces are literal."""
    unknown = [p for p in _PLACEHOLDER.findall(path) if p != GROUP_TEMPLATE]
    if unknown:
        raise KnapformerError(
            f"PlanRecorder path {path!r} has placeholder(s) {', '.join(unknown)}: only "
            f"{GROUP_TEMPLATE} is filled in (with the balance group's index); fill in the rest "
            "before passing the path, e.g. with an f-string"
        )
