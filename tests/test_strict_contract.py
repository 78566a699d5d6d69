"""The plan contract refuses what it should, in bounded memory (issue 24, items 2-6): each
case was accepted on the code before, or printed a traceback, or took gigabytes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.cli import main
from knapformer.contract import limits
from knapformer.contract.plan_io import PlanFormatError, Problem, parse_plan_line

SAMPLES = Path(__file__).resolve().parent.parent / "sample_plans"
PLAN8 = json.loads((SAMPLES / "mixed8_g1n2+g2n1+g4n1.json").read_text())
LEGACY = json.loads((SAMPLES / "legacy_mixed8.json").read_text())
MEASURED = json.loads((SAMPLES / "demo.jsonl").read_text().splitlines()[3])


def edited(base: dict, edit) -> dict:
    record = copy.deepcopy(base)
    edit(record)
    return record


def refused(record: dict | str, *fragments: str) -> str:
    """The one-line message the parser gives ``record``; asserts it names ``fragments``."""
    text = record if isinstance(record, str) else json.dumps(record)
    with pytest.raises(PlanFormatError) as err:
        parse_plan_line(text)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out, out.err


# ------------------------------------------------------------ item 2: unprintable text
@pytest.mark.parametrize("text", ["\ud800", "a\x00b", "run\nname", "\x1b[31mred", "\x85"])
@pytest.mark.parametrize("field", ["run", "solver", "topology", "planner_version", "phase"])
def test_text_that_cannot_be_printed_is_refused_in_every_text_field(field, text):
    if field == "phase":
        record = edited(
            MEASURED, lambda r: r["measurements"]["per_rank_ms"].update({text: [1.0] * 8})
        )
    else:
        record = edited(PLAN8, lambda r: r.update({field: text}))
    first = next(c for c in text if not c.isprintable())
    message = refused(record, "cannot be printed", f"U+{ord(first):04X}")
    message.encode("utf-8")  # escaped: a UTF-8 terminal prints it


def test_lone_surrogate_run_no_longer_breaks_show(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(edited(PLAN8, lambda r: r.update(run="\ud800"))))
    code, out, _ = cli(capsys, "validate", str(path))
    assert (
        code == 1
        and out
        == f"{path}:1: run: text '\\ud800' holds a character that cannot be printed "
        "(U+D800 at index 0)\n"
    )
    code, out, err = cli(capsys, "show", str(path))
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1


def test_long_text_and_problem_lines_with_odd_paths_print():
    refused(edited(PLAN8, lambda r: r.update(run="x" * 5000)), "longer than 1,024 characters")
    # A path with undecodable bytes (read as lone surrogates) is escaped in the problem line.
    line = str(Problem("plans-\udcff.jsonl", 3, "bad"))
    assert line == "plans-\\udcff.jsonl:3: bad"
    line.encode("utf-8")


# ------------------------------------------------------------ item 3: no coercion
@pytest.mark.parametrize(
    "edit, fragments",
    [
        (lambda r: r.update(schema_version=True), ["schema_version True is not supported"]),
        (
            lambda r: r.update(gpus=[str(g) for g in r["gpus"]]),
            ["gpus.0: Input should be a valid integer, got '0'"],
        ),
        (lambda r: r.update(schema_version=1), ["planner_version is a field of schema 2"]),
        (
            lambda r: r.update(schema_version=1, planner_version=None, policy="fixed"),
            ["policy is a field of schema 2, but the record says schema_version 1"],
        ),
        (lambda r: r.update(step=True), ["step: Input should be a valid integer, got True"]),
        (lambda r: r.update(step="3"), ["step: Input should be a valid integer, got '3'"]),
        (lambda r: r.update(gamma=False), ["gamma: Input should be a valid number, got False"]),
        (
            lambda r: r.update(token_dim=3072.0),
            ["token_dim: Input should be a valid integer, got 3072.0"],
        ),
        (
            lambda r: r["sequences"].update(length=[True, *r["sequences"]["length"][1:]]),
            ["value True at index 0 is not an integer"],
        ),
        (
            lambda r: r["sequences"].update(workload=[1] * 31 + [False]),
            ["value False at index 31 is not a number"],
        ),
        (lambda r: r["bags"][0].__setitem__(0, "0"), ["bags.0.0: Input should be a valid integer"]),
        (
            lambda r: r["measurements"].update(plan_ms="1.5"),
            ["plan_ms: Input should be a valid number, got '1.5'"],
        ),
        (lambda r: r.update(solver_options={"max_tokens_per_gpu": "7"}), ["max_tokens_per_gpu"]),
        (
            lambda r: r.update(solver_options={"depth": {"a": [[]]}}),
            ["solver_options.depth: Extra inputs are not permitted"],
        ),
        (
            lambda r: r["sequences"].update(
                length=r["sequences"]["workload"], workload=r["sequences"]["length"]
            ),
            ["sequences.length", "is not an integer"],
        ),
        (
            lambda r: r["chunks"].update(
                offset=r["chunks"]["length"], length=r["chunks"]["offset"]
            ),
            ["chunk(s)"],
        ),
    ],
)
def test_the_reader_refuses_what_it_used_to_coerce(edit, fragments):
    refused(edited(PLAN8, edit), *fragments)


@pytest.mark.parametrize(
    "literal, fragment",
    [
        ("NaN", "NaN is not a JSON number"),
        ("Infinity", "Infinity is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
    ],
)
def test_nan_and_infinity_literals_are_not_json(literal, fragment):
    text = json.dumps(PLAN8).replace('"gamma": 0.4', f'"gamma": {literal}')
    assert literal in text
    refused(text, fragment)


def test_a_key_given_twice_is_refused():
    text = json.dumps(PLAN8).replace('"run": ', '"run": "first", "run": ', 1)
    refused(text, "key 'run' appears twice")


def test_negative_zero_reads_as_zero_and_huge_literals_are_named():
    plan = parse_plan_line(json.dumps(PLAN8).replace('"gamma": 0.4', '"gamma": -0.0'))
    assert plan.gamma == 0
    refused(
        json.dumps(PLAN8).replace('"gamma": 0.4', '"gamma": 1e400'),
        "gamma is inf",
        "beyond ±1.8e308",
    )
    refused(edited(PLAN8, lambda r: r.update(gamma=10**400)), "gamma")


# ------------------------------------------------------------ item 4: bounded figures
def _probe(last_ms: float) -> dict:
    """A link probe of PLAN8's 8 GPUs, one round, GPU 7's time ``last_ms``."""
    return {"bytes": 1024, "rounds": [0], "ms": [[1.5] * 7 + [last_ms]], "node": [0] * 8}


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (
            lambda r: r.update(gpu_speed=[5e-324] * 8),
            ["gpu_speed[0] is 4.94066e-324; it must lie in 0.001..1000"],
        ),
        (lambda r: r.update(gpu_speed=[1.0] * 7 + [1e9]), ["gpu_speed[7] is 1e+09"]),
        (
            lambda r: r["sequences"]["workload"].__setitem__(2, 5e-324),
            ["sequences.workload[2] is 4.94e-324: a non-zero figure below 1e-30 is noise"],
        ),
        (
            lambda r: r["sequences"]["workload"].__setitem__(2, 1e200),
            ["sequences.workload[2] is 1e+200; it must lie in 0..1e+30"],
        ),
        (lambda r: r.update(gamma=1e300), ["gamma is 1e+300"]),
        (lambda r: r.update(scale=1e-320), ["scale is 9.99989e-321; it must lie in 1e-12..1e+12"]),
        (lambda r: r.update(time=-1.0), ["time is -1"]),
        (lambda r: r["measurements"].update(plan_ms=-2.0), ["measurements.plan_ms is -2 ms"]),
        (
            lambda r: r["measurements"].update(link_probe=_probe(5e-324)),
            ["measurements.link_probe.ms[0][7] is 4.94e-324 ms: a non-zero figure below 1e-30"],
        ),
        (
            lambda r: r["measurements"].update(link_probe=_probe(1e-300)),
            ["measurements.link_probe.ms[0][7] is 1e-300 ms: a non-zero figure below 1e-30"],
        ),
    ],
)
def test_figures_beyond_their_bounds_are_refused(edit, fragments):
    refused(edited(PLAN8, edit), *fragments)


@pytest.mark.parametrize("value", [-152.5, 1e12, 5e-324])
def test_hostile_measurements_are_refused_not_read_as_no_straggler(tmp_path, capsys, value):
    lines = (SAMPLES / "demo.jsonl").read_text().splitlines()
    hostile = []
    for line in lines:
        record = json.loads(line)
        record["measurements"]["per_rank_ms"]["compute"][3] = value
        hostile.append(json.dumps(record))
    path = tmp_path / "plans.jsonl"
    path.write_text("\n".join(hostile) + "\n")
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 1 and len(out.splitlines()) == len(lines)
    assert out.splitlines()[0].startswith(f"{path}:1: measurements.per_rank_ms['compute'][3] is ")
    code, out, err = cli(capsys, "stragglers", str(path))
    assert code == 1 and "no straggler" not in out and err.count("\n") == 1


def test_many_phases_are_refused():
    phases = {f"p{i}": [1.0] * 8 for i in range(limits.MAX_PHASES + 1)}
    refused(edited(PLAN8, lambda r: r["measurements"].update(per_rank_ms=phases)), "65 phases")


# ------------------------------------------------------------ item 5: bounded memory
def _validate_in_subprocess(path: Path) -> tuple[int, str, int]:
    """(exit code, output, peak RSS in MiB) of ``knapformer validate path``."""
    # VmHWM is the peak of this process's own memory since its exec; ru_maxrss is not: Linux
    # carries into it the RSS of the parent that spawned it (here: a large pytest process).
    code = (
        "import re, sys; from knapformer.cli import main; "
        "c = main(['validate', sys.argv[1]]); "
        "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()); "
        "print('rss', int(hwm.group(1)) // 1024); sys.exit(c)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300
    )
    *lines, rss = done.stdout.splitlines()
    return done.returncode, "\n".join(lines) + done.stderr, int(rss.split()[1])


def test_small_files_that_would_parse_to_gigabytes_are_refused_in_bounded_memory(tmp_path):
    base = json.dumps(PLAN8)
    empties = tmp_path / "empties.json"  # 34 M empty objects in an unknown key: 102 MB
    with empties.open("w") as f:
        f.write(base[:-1] + ', "extra": [' + "{}," * 34_000_000 + "{}]}")
    options = tmp_path / "options.jsonl"  # 60 MB of nested empties in solver_options
    with options.open("w") as f:
        f.write(
            base.replace(
                '"solver_options": {}', '"solver_options": {"x": [' + "[]," * 20_000_000 + "[]]}"
            )
            + "\n"
        )
    for path, count in ((empties, "34,000,"), (options, "20,000,")):
        code, out, rss = _validate_in_subprocess(path)
        assert code == 1 and "Traceback" not in out, out[-2000:]
        assert out.strip().count("\n") == 0 and f"holds {count}" in out, out
        assert f"at most {limits.MAX_RECORD_CONTAINERS:,}" in out
        assert rss < 1024, f"{path.name}: {rss} MiB"  # before: 2.6 GB and 1.6 GB


def test_the_shape_limits_admit_the_largest_plan_and_count_outside_strings():
    from knapformer.contract.record_shape import shape_problem

    # The largest plan's values and containers, as the bounds allow them, fit.
    largest = 4 * limits.MAX_SEQUENCES + 5 * limits.MAX_CHUNKS + 3 * limits.MAX_GPUS
    assert largest < limits.MAX_RECORD_VALUES
    assert 2 * limits.MAX_GPUS + 2 * limits.MAX_PHASES < limits.MAX_RECORD_CONTAINERS
    # Brackets and commas inside strings are not structure.
    assert shape_problem(json.dumps({"run": "[" * 100 + "," * 10**6}).encode()) is None
    assert "nested too deeply" in shape_problem(b'{"a": [[[[[[[[[[1]]]]]]]]]]}')
    assert shape_problem(b'"\\' + b'"' * 10**6) is None  # linear on unterminated strings


# ------------------------------------------------------------ item 6: legacy contradictions
@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda r: r["gpu_id2bag_id"].update({"2": 3}),
            "gpu_id2bag_id puts GPU 2 in bag 3, bag_id2gpu_ids in bag 2",
        ),
        (
            lambda r: r["gpu_id2bag_id"].update({"9": 3}),
            "gpu_id2bag_id puts GPU 9 in bag 3, but no bag of bag_id2gpu_ids holds it",
        ),
        (
            lambda r: r["gpu_id2seq_lens"]["0"].__setitem__(0, 999),
            "gpu_id2seq_lens of GPU 0 says 999 for id 0, seq_id2seq_len says 307",
        ),
        (
            lambda r: r["gpu_id2chunk_lens"]["0"].__setitem__(0, 999),
            "gpu_id2chunk_lens of GPU 0 says 999 for id 0, balance_chunk_id2chunk_len says 307",
        ),
        (
            lambda r: r["gpu_id2seq_workloads"]["0"].__setitem__(0, 9.0),
            "gpu_id2seq_workloads of GPU 0 says 9.0 for id 0",
        ),
        (
            lambda r: (
                r["seq_id2seq_len"].update({"0": 308}),
                r["gpu_id2seq_lens"]["0"].__setitem__(0, 308),
            ),
            "sequence 0 is 308 tokens in seq_id2seq_len, but its chunks in "
            "balance_chunk_id2chunk_len sum to 307",
        ),
        (
            lambda r: r["seq_id2seq_len"].update({"00": 5}),
            "seq_id2seq_len key '00' is not an integer",
        ),
        (
            lambda r: r["bag_id2gpu_ids"].update({"+1": [1]}),
            "bag_id2gpu_ids key '+1' is not an integer",
        ),
        (
            lambda r: r["gpu_id2seq_ids"]["1"].append(0),
            "sequence 0 is listed on GPUs 0 and 1 in gpu_id2seq_ids",
        ),
        (
            lambda r: r["gpu_id2chunk_ids"]["1"].append(0),
            "chunk 0 is listed on GPUs 0 and 1 in gpu_id2chunk_ids",
        ),
        (
            lambda r: r["chunk_id2seq_id"].update({"999": 0}),
            "chunk 999 is described in chunk_id2seq_id but listed on no GPU",
        ),
        (
            lambda r: r["gpu_id2seq_ids"].update({"9": [40]}),
            "gpu_id2seq_ids lists sequences on GPU 9, which is not in balance_gpu_ids",
        ),
    ],
)
def test_legacy_summaries_that_contradict_themselves_are_refused(edit, message):
    refused(edited(LEGACY, edit), "legacy plan: " + message)


def test_legacy_keys_that_alias_in_python_are_refused():
    from knapformer.contract.legacy import plan_from_legacy, plan_to_legacy

    summary = plan_to_legacy(parse_plan_line(json.dumps(PLAN8)), json_keys=False)
    summary["seq_id2seq_len"]["0"] = summary["seq_id2seq_len"][0] + 1  # int 0 and "0"
    with pytest.raises(ValueError, match=r"seq_id2seq_len names id 0 twice \(0 and '0'\)"):
        plan_from_legacy(summary)
    text = json.dumps(LEGACY).replace('"seq_id2seq_len": {', '"seq_id2seq_len": {"0": 1, ', 1)
    refused(text, "key '0' appears twice")
