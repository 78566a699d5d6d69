"""What the ``knapformer`` command line imports before a command runs: every process of it
(and the suite starts hundreds) pays for that, so pyarrow and the run store's modules wait
for a command that reads a store. Each check runs a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from knapformer.contract.plan_io import write_jsonl
from knapformer.runtime.store_writer import StoreWriter
from knapformer.testing.measured_plans import measured_run

#: Modules a command that reads no store never needs.
STORE_MODULES = (
    "pyarrow",
    "knapformer.contract.run_store",
    "knapformer.contract.store_schema",
    "knapformer.diagnosis.store_source",
)
_REPORT = "import sys; print('loaded:', *[m for m in {mods!r} if m in sys.modules])"


def _run(code: str) -> tuple[str, list[str]]:
    """What ``code`` printed in a fresh interpreter, and the `STORE_MODULES` it then held."""
    script = f"{code}\n" + _REPORT.format(mods=STORE_MODULES)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    printed, _, loaded = done.stdout.rpartition("loaded:")
    return printed, loaded.split()


def test_importing_the_command_line_and_its_app_leaves_pyarrow_out():
    code = "import typer.main, knapformer.cli; typer.main.get_command(knapformer.cli.app)"
    assert _run(code)[1] == []


def test_help_and_a_command_on_plans_leave_pyarrow_out(tmp_path):
    plans = tmp_path / "plans.jsonl"
    write_jsonl(plans, measured_run(3, seed=1))
    code = (
        "from knapformer.cli import main\n"
        "assert main(['--help']) == 0\n"
        "assert main(['stragglers', '--help']) == 0\n"
        f"assert main(['show', {str(plans)!r}]) == 0\n"
        f"assert main(['validate', {str(plans)!r}]) == 0"
    )
    printed, loaded = _run(code)
    assert "Usage: knapformer" in printed and loaded == []


def test_a_store_command_in_a_fresh_process_imports_the_store_and_works(tmp_path):
    # In-process tests (tests/test_store_readers.py) may find pyarrow loaded already.
    plans = measured_run(8, slow_rank=3, slow_factor=2.0, seed=2)
    write_jsonl(tmp_path / "plans.jsonl", plans)
    writer = StoreWriter(tmp_path / "store", segment_steps=4)
    for plan in plans:
        writer.put(plan)
    writer.close()
    code = (
        "from knapformer.cli import main\n"
        f"assert main(['stragglers', {str(tmp_path)!r}, '--source', 'store', '--json']) == 0"
    )
    printed, loaded = _run(code)
    verdicts = {r["rank"]: r["verdict"] for r in json.loads(printed)}
    assert verdicts[3] == "slow_gpu" and loaded == list(STORE_MODULES)
