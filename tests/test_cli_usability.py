"""CLI behaviour a new user runs into: files that are not plans, run folders, PDF reports,
mistyped mix names, a Chromium override that points nowhere, fits that are not usable.
Each runs the real command line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from knapformer.visualization.browser import find_chromium

from knapformer.cli import main
from knapformer.contract.plan_io import read_plans, write_jsonl
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.tools.calibrate import calibrate_file

EXE = shutil.which("knapformer") or str(Path(sys.executable).parent / "knapformer")
needs_chromium = pytest.mark.skipif(find_chromium() is None, reason="no Chromium")


def run(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environ = None
    if env:
        import os

        environ = {**os.environ, **env}
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, timeout=timeout, env=environ
    )


@pytest.fixture
def notes(tmp_path) -> Path:
    """A markdown file of 300 lines: what `validate README.md` is given."""
    path = tmp_path / "NOTES.md"
    path.write_text("".join(f"line {i} of some notes\n\n" for i in range(300)))
    return path


# ------------------------------------------------------------ not a plan file
def test_validate_stops_after_a_few_lines_of_a_file_that_is_not_plans(notes):
    done = run("validate", str(notes))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout  # three problems, then the verdict
    assert (
        lines[-1] == f"{notes}: this does not look like a plan file: its first 3 lines are "
        "not JSON objects; stopped reading"
    )


def test_calibrate_says_the_file_is_not_plans_in_one_line(notes):
    done = run("calibrate", str(notes))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "this does not look like a plan file" in done.stderr
    assert "skipped" not in done.stderr


def test_a_plan_file_with_broken_records_is_still_read_to_the_end(tmp_path, steps50_path):
    # Lines that are JSON objects but not valid plans: a damaged recording, not a stranger.
    good = steps50_path.read_text().splitlines()[:2]
    bad = tmp_path / "plans.jsonl"
    bad.write_text("\n".join(['{"step": 1}'] * 5 + good) + "\n")
    result = read_plans(bad)
    assert len(result.records) == 2 and len(result.problems) == 5
    assert not any("does not look like" in p.message for p in result.problems)


# ------------------------------------------------------------ run folders
@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A recording's folder (plans.jsonl inside) of a small 4-GPU run."""
    folder = tmp_path / "runs" / "small"
    folder.mkdir(parents=True)
    model = WorkloadModel(256)
    plans = [
        plan_routing([[300, 20], [900], [50], [40 + s]], "g1n2+g2n1", model, step=s, run="small")
        for s in range(2)
    ]
    write_jsonl(folder / "plans.jsonl", plans)
    return folder


def test_show_validate_report_and_replay_take_a_run_folder(run_folder, tmp_path):
    done = run("show", str(run_folder))
    assert done.returncode == 0, done.stderr
    assert "small step 1 · g1n2+g2n1" in done.stdout
    done = run("validate", str(run_folder))
    assert done.returncode == 0 and f"{run_folder / 'plans.jsonl'}: 2 plan(s) OK" in done.stdout
    done = run("report", str(run_folder), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "Step 1" in (tmp_path / "r.html").read_text()
    done = run("replay", str(run_folder), "--step", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: OK" in done.stdout
    # The folder of runs above it holds one run: that is the one taken.
    done = run("show", str(run_folder.parent), "--step", "0")
    assert done.returncode == 0 and "small step 0" in done.stdout


@pytest.mark.slow
def test_animate_takes_a_run_folder(run_folder, tmp_path):
    out = tmp_path / "small.mp4"
    done = run("animate", str(run_folder), "-o", str(out), "--quality", "low")
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 10_000


def test_a_folder_of_several_runs_names_them(run_folder, tmp_path, capsys):
    other = run_folder.parent / "other"
    shutil.copytree(run_folder, other)
    assert main(["show", str(run_folder.parent)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "holds 2 runs (other, small)" in err and str(other / "plans.jsonl") in err
    # validate checks every run of the folder.
    assert main(["validate", str(run_folder.parent)]) == 0
    assert capsys.readouterr().out.count("2 plan(s) OK") == 2


def test_calibrate_takes_a_run_folder(sample_dir, tmp_path):
    folder = tmp_path / "demo"
    folder.mkdir()
    shutil.copy(sample_dir / "demo.jsonl", folder / "plans.jsonl")
    assert (
        calibrate_file(folder).measured.size
        == calibrate_file(sample_dir / "demo.jsonl").measured.size
    )


# ------------------------------------------------------------ PDF reports
@pytest.mark.browser
@needs_chromium
def test_report_to_pdf_writes_a_pdf_with_the_figures(sample_dir, tmp_path):
    out = tmp_path / "report.pdf"
    done = run("report", str(sample_dir / "demo.jsonl"), "--steps", "3:4", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "PDF" in done.stdout
    data = out.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")
    pages = len(re.findall(rb"/Type\s*/Page(?!s)", data))
    assert pages >= 3  # a timeline, two steps of figures: more than a page of HTML text
    assert b"<html" not in data and not list(tmp_path.glob("*.html"))
    if shutil.which("pdftoppm"):  # Debian's poppler: the first page is not blank
        subprocess.run(["pdftoppm", "-r", "30", "-png", "-f", "1", "-l", "1", str(out),
                        str(tmp_path / "page")], check=True)  # fmt: skip
        from PIL import Image

        page = Image.open(next(tmp_path.glob("page*.png"))).convert("L")
        assert page.getextrema()[0] < 128  # something dark is printed on it


def test_pdf_without_chromium_is_refused_before_anything_is_written(sample_dir, tmp_path):
    out = tmp_path / "report.pdf"
    done = run(
        "report", str(sample_dir / "demo.jsonl"), "-o", str(out), KNAPFORMER_CHROMIUM="/nope"
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "KNAPFORMER_CHROMIUM=/nope: that path was not found" in done.stderr
    assert "none was found" not in done.stderr  # PATH was not what failed
    assert f"-o {tmp_path / 'report.html'}" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_png_export_names_the_chromium_override_that_points_nowhere(plan8_path, tmp_path):
    done = run(
        "report", str(plan8_path), "-o", str(tmp_path / "r.html"), "--png", str(tmp_path / "p"),
        KNAPFORMER_CHROMIUM="/nope",
    )  # fmt: skip
    assert done.returncode == 1
    assert "KNAPFORMER_CHROMIUM=/nope: that path was not found" in done.stderr


def test_report_refuses_an_output_that_is_neither_html_nor_pdf(plan8_path, tmp_path, capsys):
    assert main(["report", str(plan8_path), "-o", str(tmp_path / "r.docx")]) == 1
    assert "output must be an .html or .pdf file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------ data mixes
@pytest.mark.parametrize(
    ("command", "typo", "meant"),
    [
        (["simulate", "--topology", "g8n4"], "jiont", "joint"),
        (["suggest", "--gpus", "32"], "lowrse", "lowres"),
        (["demo", "--no-dashboard"], "mixre", "mixres"),
    ],
)
def test_a_mistyped_mix_name_gets_the_closest_name(capsys, command, typo, meant):
    assert main([*command, "--data-codes", typo]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(f"did you mean {meant!r}?"), err


def test_a_word_far_from_every_mix_gets_no_guess(capsys):
    assert main(["simulate", "--topology", "g8n4", "--data-codes", "textures"]) == 1
    err = capsys.readouterr().err
    assert (
        "not a mix name (lowres, mixres, joint, video, seqheavy)" in err
        and "did you mean" not in err
    )


# ------------------------------------------------------------ calibration
def test_calibrate_says_plainly_that_a_poor_fit_is_not_usable(sample_dir, tmp_path):
    plot = tmp_path / "fit.html"
    done = run("calibrate", str(sample_dir / "demo.jsonl"), "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    cal = calibrate_file(sample_dir / "demo.jsonl")
    assert cal.r2 < 0.5
    assert "use: WorkloadModel" not in done.stdout
    assert re.search(r"not usable: R² = -?\d\.\d\d < 0\.5", done.stdout), done.stdout
    assert "NOT USABLE" in plot.read_text()


def test_calibration_plot_has_log_axes_and_a_usable_fit_keeps_its_use_line(tmp_path):
    from knapformer.visualization.calibration import calibration_figure

    lengths = [256, 512, 1024, 4096, 16384, 65536]
    model = WorkloadModel(512, gamma=0.6, scale=80.0)
    csv = tmp_path / "latency.csv"
    noise = (1.05, 0.97, 1.0, 1.02, 0.99, 1.01)
    rows = [f"{n},{model.workload(n) * f}\n" for n, f in zip(lengths, noise, strict=True)]
    csv.write_text("length,latency\n" + "".join(rows))
    done = run("calibrate", str(csv), "--token-dim", "512")
    assert done.returncode == 0 and "use: WorkloadModel(token_dim=512" in done.stdout
    assert "not usable" not in done.stdout
    fig = calibration_figure(calibrate_file(csv, 512))
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    ideal = next(t for t in fig.data if t.name.startswith("perfect model"))
    assert min(ideal.x) > 0  # a y = x line that a log axis can draw


def test_help_wraps_each_paragraph_to_the_terminal_not_to_the_docstring():
    # The docstring of replay breaks "runs route →" / "pre_attn" across source lines; on a
    # wide terminal the paragraph must read as one line, on a narrow one wrap at its width.
    wide = run("replay", "--help", COLUMNS="200")
    assert wide.returncode == 0
    assert "then runs route → pre_attn → post_attn → reverse_route" in wide.stdout
    narrow = run("replay", "--help", COLUMNS="60")
    lines = [line for line in narrow.stdout.splitlines() if line.strip()]
    assert max(len(line) for line in lines) <= 60
    prose = [line for line in lines if "Re-plans" in line]
    assert prose and len(prose[0].rstrip()) > 40  # filled to the width, not cut short


def test_the_command_alone_prints_its_commands_and_no_error():
    done = run()
    assert done.returncode == 0
    assert "Commands" in done.stdout and "stragglers" in done.stdout
    assert "error" not in done.stderr


def test_every_command_writes_its_arguments_in_one_placeholder_style(capsys):
    """Upper-case names; {NAME} required, [NAME] optional, ... for several. (The help
    texts are asked for in this process: one start-up per command would cost more than
    all of them; the tests around this one start the real one.)"""
    import typer.main

    from knapformer.cli import app

    names = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    usage = {}
    for name in names:
        assert main([name, "--help"]) == 0, name
        usage[name] = capsys.readouterr().out
    placeholder = re.compile(r"^(\{[A-Z]+\}|\[[A-Z]+\])(\.\.\.)?$")
    for name, text in usage.items():
        line = next(line for line in text.splitlines() if "Usage:" in line)
        arguments = line.split("[OPTIONS]", 1)[1].split()
        assert all(placeholder.match(a) for a in arguments), (name, line)
    assert "{PLAN}" in usage["animate"] and "{FILE}..." in usage["validate"]
    assert "[TOPOLOGY]..." in usage["simulate"]
