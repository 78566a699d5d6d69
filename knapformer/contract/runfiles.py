"""Where plan files live: the names a recording writes and the layout of a folder of runs.

- A recording writes ``plans.jsonl`` (`PLANS_FILE`) in its output folder (`plans_file`).
- Size-based rotation renames it to ``plans.1.jsonl``, ``plans.2.jsonl``, ... (`rotated_file`,
  newest first); readers skip those names when they list runs (`is_rotated`).
- With several balance groups, group k writes its own file: the path's ``{group}``
  template filled in, or else ``plans.group<k>.jsonl`` next to it (group 0 keeps the path)
  (`group_file`). Those rotate the same way (``plans.group1.2.jsonl``).
- A folder of runs holds one ``<run>/plans.jsonl`` per run (`run_file`), and may hold plan
  files directly; `find_runs` lists them the way the dashboard offers them, `every_run`
  the same for a command that reads them all, and `single_run` picks the one run a
  command that reads one plan file is given. A loose ``.json``/``.jsonl`` file counts only
  when it looks like plans (`looks_like_plans`): an export written next to a run (a trace,
  a figure's JSON) does not make the folder hold two runs.
- A name read from a file (a plan's ``run``) becomes a file or folder name only through
  `safe_name`, so no plan can make a writer leave the folder it was given.

The recorder, the demo, the simulator and the dashboard all name files through here.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from knapformer.contract.legacy import LEGACY_KEYS
from knapformer.contract.plan import RoutingPlan
from knapformer.errors import KnapformerError, OptionError

PLANS_FILE = "plans.jsonl"
#: How a folder of runs is laid out, for help texts and messages.
RUNS_LAYOUT = f"<run>/{PLANS_FILE}"
GROUP_TEMPLATE = "{group}"
_PLAN_SUFFIXES = (".json", ".jsonl")
_ROTATED = re.compile(r".+\.\d+\.jsonl")
#: Bytes of a loose file `looks_like_plans` reads: a plan's first key comes first.
SNIFF_BYTES = 4096
#: The first key of a plan file's first object: a field of `RoutingPlan` (ours write
#: ``schema_version`` first) or of a legacy summary.
_PLAN_KEYS = frozenset(RoutingPlan.model_fields) | frozenset(LEGACY_KEYS)
_FIRST_KEY = re.compile(rb'\s*\[?\s*\{\s*"([A-Za-z0-9_]{1,64})"\s*:')
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=@-]+")
#: Longest name `safe_name` makes (file systems allow 255 bytes; room for a suffix).
MAX_NAME = 120


def safe_name(name: str, default: str = "run") -> str:
    """``name`` (e.g. a plan's ``run``, read from a file) as one file name that stays in
    its folder: runs of characters other than letters, digits and ``._+=@-`` become
    ``_``, leading dots go (no ``..``, no hidden file), at most `MAX_NAME` characters;
    ``default`` when nothing is left: ``../../x`` becomes ``_.._x``, ``/etc`` ``_etc``."""
    safe = _UNSAFE.sub("_", name).lstrip(".")[:MAX_NAME]
    return safe if safe.strip("_") else default


def looks_like_plans(path: str | Path) -> bool:
    """Whether the regular file ``path`` looks like a plan file: empty (a recording about
    to start), or a JSON object (or a list of them, or JSONL) whose first key is a plan's
    (``schema_version``, ``topology``, ..., or a legacy summary's ``balance_gpu_ids``).
    A trace (``traceEvents``), a figure (``data``) or any other JSON does not, nor does an
    unreadable file."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    except OSError:
        return False
    text = head.removeprefix(b"\xef\xbb\xbf")
    if not text.strip():
        return True
    first = _FIRST_KEY.match(text)
    return first is not None and first.group(1).decode() in _PLAN_KEYS


def plans_file(folder: str | Path) -> Path:
    """The file a recording in ``folder`` writes: ``folder/plans.jsonl``."""
    return Path(folder) / PLANS_FILE


def run_file(folder: str | Path, run: str) -> Path:
    """The file of run ``run`` in a folder of runs: ``folder/<run>/plans.jsonl``, the run
    name made a `safe_name`."""
    return Path(folder) / safe_name(run) / PLANS_FILE


def group_file(path: str | Path, group: int) -> Path:
    """The file balance group ``group`` writes when asked to record to ``path``.

    ``{group}`` in the path is replaced by the group index; without it group 0 writes
    ``path`` itself and group k > 0 ``<stem>.group<k><suffix>`` next to it.
    """
    text = str(path)
    if GROUP_TEMPLATE in text:
        return Path(text.replace(GROUP_TEMPLATE, str(group)))
    path = Path(path)
    if group == 0:
        return path
    return path.with_name(f"{path.stem}.group{group}{path.suffix}")


def rotated_file(path: str | Path, k: int) -> Path:
    """The k-th rotated copy of ``path`` (1 = the newest): ``plans.<k>.jsonl``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{k}{path.suffix}")


def rotated_copies(path: str | Path) -> dict[int, Path]:
    """The rotated copies of ``path`` that exist, by number k (``plans.<k>.jsonl``)."""
    path = Path(path)
    numbered = re.compile(rf"{re.escape(path.stem)}\.(\d+){re.escape(path.suffix)}")
    if not path.parent.is_dir():
        return {}
    found = (numbered.fullmatch(p.name) for p in path.parent.iterdir())
    return {int(m.group(1)): path.with_name(m.group(0)) for m in found if m}


def is_rotated(path: str | Path) -> bool:
    """Whether ``path`` is named as a rotated copy (``<stem>.<k>.jsonl``)."""
    return _ROTATED.fullmatch(Path(path).name) is not None


def recording_files(path: str | Path) -> list[Path]:
    """The files an earlier recording to ``path`` may have left: ``path`` itself, its
    rotated copies and every group's file and rotated copies (those that exist)."""
    path = Path(path)
    stem, suffix = re.escape(path.stem), re.escape(path.suffix)
    pattern = re.compile(rf"{stem}(\.group\d+)?(\.\d+)?{suffix}")
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p.is_file())


def remove_recording(path: str | Path) -> list[Path]:
    """Remove the `recording_files` of ``path`` (a run that restarts its step numbers
    starts fresh); returns what was removed."""
    removed = recording_files(path)
    for old in removed:
        old.unlink()
    return removed


def find_runs(path: str | Path) -> dict[str, Path]:
    """Run name -> plan file of the runs behind ``path``, in name order.

    A file is one run named after its stem. A folder offers its own ``plans.jsonl`` (named
    after the folder), each ``<run>/plans.jsonl`` (named ``<run>``) and every other
    ``.json``/``.jsonl`` file directly in it that `looks_like_plans` (named by file name),
    rotated copies excepted. An unreadable folder offers what was found before the error.
    """
    path = Path(path)
    if not path.is_dir():
        return {path.stem or str(path): path}
    found: dict[str, Path] = {}
    if plans_file(path).is_file():
        found[path.name] = plans_file(path)
    try:
        entries = sorted(path.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.is_dir() and plans_file(entry).is_file():
            found[entry.name] = plans_file(entry)
        elif (
            entry.is_file()
            and entry.suffix in _PLAN_SUFFIXES
            and entry.name != PLANS_FILE
            and not is_rotated(entry)
            and looks_like_plans(entry)
        ):
            found[entry.name] = entry
    return found


def every_run(path: str | Path) -> dict[str, Path]:
    """`find_runs` of ``path``, refusing a folder without any (`KnapformerError`)."""
    runs = find_runs(path)
    if not runs:
        raise KnapformerError(
            f"{path}: cannot read: a folder without plan files (a run folder holds "
            f"{PLANS_FILE}, a folder of runs {RUNS_LAYOUT} or .json/.jsonl files)"
        )
    return runs


def single_run(path: str | Path) -> Path:
    """The plan file behind ``path`` for a command that reads one: ``path`` itself unless it
    is a folder; a recording's folder (``plans.jsonl`` inside) or a folder holding exactly
    one run gives that run's file. A folder of several runs, or of none, is a
    `KnapformerError` naming what it holds."""
    path = Path(path)
    if not path.is_dir():
        return path
    runs = every_run(path)
    if len(runs) == 1:
        return next(iter(runs.values()))
    names = list(runs)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    first = runs[names[0]]
    raise KnapformerError(
        f"{path} holds {len(runs)} runs ({shown}): give one of their files, e.g. {first}"
    )


def writable_folder(folder: str | Path, option: str = "") -> Path:
    """``folder`` as a Path once files can be written in it (created with its parents);
    else an `OptionError` naming the option (e.g. "`out`", shown as its flag on the
    command line), the folder and what is wrong: checked before long work, not after."""
    folder = Path(folder)
    what = f"the {option} folder {str(folder)!r}" if option else repr(str(folder))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OptionError(f"{what} exists and is not a folder") from None
    except OSError as err:
        raise OptionError(f"cannot create {what}: {err.strerror or err}") from None
    try:
        # A real write, not os.access: access checks say yes to root on read-only mounts.
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise OptionError(f"cannot write in {what}: {err.strerror or err}") from None
    return folder
