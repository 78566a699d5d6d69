"""User errors print one line and exit 1; anything else is a bug and keeps its traceback.

The library raises `KnapformerError` and names options by their argument names; only the
command line turns those into its flags."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from knapformer.cli import main
from knapformer.contract.plan_io import PlanFormatError, parse_step_range
from knapformer.errors import KnapformerError, OptionError
from knapformer.tools import calibrate as calibrate_module
from knapformer.tools.replay import check_options
from knapformer.tools.simulate import run_files


def _run_cli(prelude: str, *args: str) -> subprocess.CompletedProcess:
    """``knapformer ARGS`` in a fresh interpreter after running ``prelude``."""
    code = textwrap.dedent(prelude) + (
        "\nfrom knapformer.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_library_messages_name_arguments_and_the_cli_names_flags(plan8_path, capsys):
    from knapformer.contract.plan_io import read_plans

    plan = read_plans(plan8_path, on_error="raise").plans[0]
    with pytest.raises(OptionError) as caught:
        check_options(plan, dim=12, heads=8)
    assert str(caught.value) == "dim 12 must be a positive multiple of heads 8"
    assert caught.value.options == ["dim", "heads"]
    assert main(["replay", str(plan8_path), "--heads", "8", "--dim", "12"]) == 1
    assert capsys.readouterr().err == "error: --dim 12 must be a positive multiple of --heads 8\n"
    with pytest.raises(KnapformerError, match=r"^steps must look like A:B"):
        parse_step_range("5")


def test_an_option_the_command_does_not_have_keeps_its_plain_name(capsys):
    # the planner's partition rule names its own field; the command's flag is --node-size.
    assert main(["simulate", "--data-codes", "joint", "-t", "auto", "--node-size", "6"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: node_size must be a positive power of two") and err.count("\n") == 1
    )


def test_unusable_files_the_user_names_are_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "nope.csv"
    assert main(["calibrate", str(missing), "--token-dim", "64"]) == 1
    assert capsys.readouterr().err == f"error: {missing}: cannot read: No such file or directory\n"
    assert main(["calibrate", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: cannot read: a folder without plan files")
    assert err.count("\n") == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KnapformerError, match="exists and is not a folder"):
        run_files(blocker, ["g8n4-greedy"])


def test_plan_format_errors_are_user_errors():
    assert issubclass(PlanFormatError, KnapformerError)
    assert issubclass(KnapformerError, ValueError)  # existing `except ValueError` still works


# OSError is not here: what the machine does to a command (a failing disk, a name too
# long) is one line (tests/test_cli_safety.py).
@pytest.mark.parametrize("error", [RuntimeError, ValueError, TypeError])
def test_an_unexpected_exception_is_not_turned_into_one_line(monkeypatch, tmp_path, error):
    def broken(*args, **kwargs):
        raise error("a bug in calibrate_file")

    monkeypatch.setattr(calibrate_module, "calibrate_file", broken)
    with pytest.raises(error, match="a bug in calibrate_file"):
        main(["calibrate", str(tmp_path / "m.csv"), "--token-dim", "64"])


def test_a_bug_shows_its_traceback_and_a_user_error_does_not(tmp_path):
    bug = _run_cli(
        """
        import knapformer.tools.calibrate as calibrate
        def broken(*args, **kwargs):
            raise ValueError("a bug in calibrate_file")
        calibrate.calibrate_file = broken
        """,
        "calibrate",
        str(tmp_path / "m.csv"),
        "--token-dim",
        "64",
    )
    assert bug.returncode == 1
    assert "Traceback (most recent call last)" in bug.stderr
    assert "ValueError: a bug in calibrate_file" in bug.stderr
    user = _run_cli("", "calibrate", str(tmp_path / "m.csv"), "--token-dim", "64")
    assert user.returncode == 1
    assert user.stderr == f"error: {tmp_path / 'm.csv'}: cannot read: No such file or directory\n"
