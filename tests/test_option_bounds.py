"""Every numeric option of every command is bounded where it is parsed (one table,
`knapformer.contract.limits.OPTION_BOUNDS`): integers at ±2⁶³ and beyond, floats at
±1e308, 1e-308, NaN and infinity end in one ``error:`` line naming the flag, exit 1,
before the command does any work (issue 35: 11 commands ended in tracebacks, others
printed inf)."""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path

import pytest
import typer.main

from knapformer.cli import app, main
from knapformer.contract.limits import OPTION_BOUNDS, check_option
from knapformer.errors import OptionError

SAMPLES = Path(__file__).resolve().parents[1] / "sample_plans"
PLAN = str(SAMPLES / "plan8_g1n2+g2n1+g4n1.json")
#: What each command needs besides the option under test (valid values).
BASE = {
    "show": ["show", PLAN],
    "animate": ["animate", PLAN],
    "replay": ["replay", PLAN],
    "dashboard": ["dashboard", PLAN],
    "stragglers": ["stragglers", str(SAMPLES / "demo.jsonl")],
    "simulate": ["simulate", "--data-codes", "lowres", "-t", "g8n4"],
    "suggest": ["suggest", "--data-codes", "lowres", "--gpus", "32"],
    "calibrate": ["calibrate", "--benchmark"],
    "flight-recorder": ["flight-recorder", str(SAMPLES)],
    "query": ["query", str(SAMPLES), "SELECT 1"],
}
#: demo's options are the fields of `knapformer.local.config.DemoConfig`, which checks
#: itself where it is made (tests/test_demo.py).
CHECKED_ELSEWHERE = {"demo"}
INTS = [str(2**63), str(-(2**63)), "9" * 400]
FLOATS = ["1e308", "-1e308", "1e-308", "nan", "inf", "-inf"]


def _numeric(annotation: object) -> type | None:
    """int or float when ``annotation`` is one (optional or Annotated), else None."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else None
    return annotation if annotation in (int, float) else None


def numeric_options() -> list[tuple[str, str, str, type]]:
    """(command, parameter name, flag, int or float) of every numeric option."""
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    found = []
    for info in app.registered_commands:
        name = info.name or info.callback.__name__
        if name in CHECKED_ELSEWHERE:
            continue
        hints = typing.get_type_hints(info.callback, include_extras=True)
        flags = {
            p.name: max(p.opts, key=len)
            for p in commands[name].params
            if p.param_type_name == "option"
        }
        for param in inspect.signature(info.callback).parameters:
            kind = _numeric(hints.get(param))
            if kind is not None and param in flags:
                found.append((name, param, flags[param], kind))
    return found


OPTIONS = numeric_options()


def test_the_commands_numeric_options_are_found():
    names = {(command, param) for command, param, _, _ in OPTIONS}
    assert {("suggest", "intra_gbs"), ("simulate", "dtype_bytes"), ("calibrate", "tokens"),
            ("stragglers", "window"), ("dashboard", "port")} <= names  # fmt: skip
    assert len(OPTIONS) >= 29


@pytest.mark.parametrize(("command", "param", "flag", "kind"), OPTIONS, ids=lambda v: str(v))
def test_every_numeric_option_is_bounded_where_it_is_parsed(capsys, command, param, flag, kind):
    assert command in BASE, f"add the arguments {command} needs to BASE"
    for value in INTS + (FLOATS if kind is float else []):
        code = main([*BASE[command], flag, value])
        out, err = capsys.readouterr()
        assert code == 1, (flag, value, out[-500:], err[-1500:])
        assert err.startswith(f"error: {flag} ") and err.count("\n") == 1, (flag, value, err)
        assert "Traceback" not in err and "inf ms" not in out


def test_the_table_refuses_what_no_option_may_be():
    with pytest.raises(OptionError, match=r"^gamma is 1e-308: a non-zero figure below 1e-30"):
        check_option("gamma", 1e-308)
    with pytest.raises(OptionError, match="must be a whole number"):
        check_option("layers", 57.0)
    with pytest.raises(OptionError, match="must be a number"):
        check_option("tflops", True)
    assert check_option("tflops", None) is None
    for name, bound in OPTION_BOUNDS.items():  # each bound admits its own ends
        for end in (bound.low, bound.high):
            value = int(end) if bound.whole else float(end)
            assert check_option(name, value) == value


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--lengths", ",".join(map(str, range(1, 5001)))],
            "--lengths gives 5,000 lengths; at most 64",
        ),
        (["--lengths", "8," + "9" * 5000], "--lengths item is 99999"),
        (["--lengths", "8,0"], "--lengths item must be at least 1"),
        (["--token-dim", str(2**24), "--heads", "16"], "--token-dim of a benchmarked block is"),
        (["--tokens", str(2**20), "--token-dim", "4096", "--heads", "32"], "a timed batch holds"),
        (["--lengths", f"8,{2**20}", "--token-dim", "2048", "--heads", "16"], "a timed batch"),
    ],
    ids=["5000-lengths", "huge-length", "zero-length", "width", "tokens-x-width", "length-x-width"],
)
def test_the_block_benchmark_refuses_what_it_cannot_time_before_timing(capsys, args, message):
    """Before: 5,000 lengths were still timing after 120 s (each is a batch of --tokens
    tokens timed 7 times: ~2.3 s at d = 64 here, 3 h in all); widths and batches asked
    allocations of 275 GB and 3.4 PB."""
    assert main(["calibrate", "--benchmark", *args]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "timing" not in out  # refused before the first batch


def test_an_allocation_the_machine_refuses_is_one_line(capsys, monkeypatch):
    from knapformer.tools import block_benchmark

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 295279001600 bytes. Error code 12"
        )

    monkeypatch.setattr(block_benchmark, "time_block", refuse)
    assert (
        main(["calibrate", "--benchmark", "--device", "cpu", "--token-dim", "64", "--heads", "4"])
        == 1
    )
    err = capsys.readouterr().err
    assert err == (
        "error: the benchmark needs more memory than cpu has (it tried to allocate 275.0 GiB): "
        "lower --tokens, the longest of --lengths or --token-dim\n"
    )
