"""Output files of the readers (videos, reports): checked writable before the work.

Rendering a video takes seconds to minutes; finding out afterwards that ``-o`` names a
folder, sits under a file or in a read-only place wastes all of it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from knapformer.errors import KnapformerError


def check_output_file(out: str | Path, suffix: str) -> Path:
    """``out`` as a Path once a file with ``suffix`` can be written there; else a
    `KnapformerError` naming the path and what is wrong."""
    out = Path(out)
    if out.suffix.lower() != suffix:
        raise KnapformerError(f"output must be an {suffix} file, not {str(out)!r}")
    if out.is_dir():
        raise KnapformerError(f"output {str(out)!r} is a directory")
    parent = out.parent
    if not parent.exists():
        raise KnapformerError(f"output directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise KnapformerError(f"output {str(out)!r}: {str(parent)!r} is not a directory")
    try:
        # A real write, not os.access: access checks say yes to root on read-only mounts.
        with tempfile.TemporaryFile(dir=parent):
            pass
        if out.exists():
            with out.open("ab"):
                pass
    except OSError as err:
        raise KnapformerError(f"cannot write {str(out)!r}: {err.strerror or err}") from None
    return out
