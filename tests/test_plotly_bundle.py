"""Which plotly.js the dashboard serves (`knapformer.dashboard.plotly_bundle`): the pinned
cartesian bundle once fetched and checked, else the full one, from the URL Dash's graphs
load it from; and the trace types of the dashboard's figures are all in that bundle."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dash")
from knapformer.dashboard import plotly_bundle
from knapformer.dashboard.page_index import PLOTLY_PATH
from knapformer.visualization.run_figures import MAX_MARKERS, run_verdicts_figure

VERSION = plotly_bundle.plotly_js_version()
HEADER = "/**\n* plotly.js (cartesian - minified) v{}\n* Copyright 2012-2026, Plotly, Inc.\n*/\n"


def _tarball(script: bytes, member: str = plotly_bundle.MEMBER) -> bytes:
    """An npm tarball (gzipped tar) holding ``script`` as ``member``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        info = tarfile.TarInfo(member)
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script))
    return out.getvalue()


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def test_the_installed_plotly_js_version_has_a_pinned_tarball():
    # a plotly upgrade that ships another plotly.js must pin that version's bundle, or
    # the dashboard falls back to the full one without anyone noticing
    assert plotly_bundle.INTEGRITY[VERSION].startswith("sha512-")


def test_a_tarball_is_taken_only_with_the_pinned_integrity_and_version():
    script = HEADER.format("9.9.9").encode() + b"window.Plotly = {};\n"
    tarball = _tarball(script)
    assert plotly_bundle.bundle_of(tarball, "9.9.9", _integrity(tarball)) == script
    tampered = tarball[:-1] + bytes([tarball[-1] ^ 1])
    with pytest.raises(plotly_bundle.BundleError, match="sha512"):
        plotly_bundle.bundle_of(tampered, "9.9.9", _integrity(tarball))
    with pytest.raises(plotly_bundle.BundleError, match=r"not plotly\.js v9\.9\.8"):
        plotly_bundle.bundle_of(tarball, "9.9.8", _integrity(tarball))
    other = _tarball(script, "package/plotly.min.js")
    with pytest.raises(plotly_bundle.BundleError, match="holds no"):
        plotly_bundle.bundle_of(other, "9.9.9", _integrity(other))


def test_the_full_bundle_is_served_until_the_cartesian_one_of_this_version_is_there(tmp_path):
    assert plotly_bundle.served(tmp_path).name == "full"
    assert plotly_bundle.served(tmp_path).path.read_bytes()[:40].find(b"plotly.js v") > 0
    path = plotly_bundle.bundle_path(VERSION, tmp_path)
    path.write_text(HEADER.format("0.0.1"))  # another version's: not taken
    assert plotly_bundle.served(tmp_path).name == "full"
    path.write_text(HEADER.format(VERSION))
    kept = plotly_bundle.served(tmp_path)
    assert (kept.name, kept.path, kept.version) == ("cartesian", path, VERSION)
    assert (
        "cartesian bundle" in kept.describe()
        and "full bundle" in plotly_bundle.served(tmp_path / "none").describe()
    )


@pytest.mark.parametrize("fetched", [True, False])
def test_dashs_plotly_js_url_serves_the_bundle_named(tmp_path, monkeypatch, fetched):
    from knapformer.dashboard.server import start_server

    folder = tmp_path / "plotly_js"
    if fetched:
        folder.mkdir()
        plotly_bundle.bundle_path(VERSION, folder).write_text(HEADER.format(VERSION))
    monkeypatch.setattr(plotly_bundle, "FOLDER", folder)
    (tmp_path / "plans.jsonl").write_text("")
    with (
        start_server(tmp_path / "plans.jsonl", port=0) as handle,
        urllib.request.urlopen(handle.url + PLOTLY_PATH, timeout=30) as resp,
    ):
        said, body = resp.headers["X-Plotly-Bundle"], resp.read()
    expected = plotly_bundle.served(folder)
    assert said == f"{expected.name} {VERSION}"
    assert expected.name == ("cartesian" if fetched else "full")
    assert body == expected.path.read_bytes()


def test_fetching_with_npm_keeps_the_checked_bundle(tmp_path, monkeypatch):
    # npm stands in here (no network in the tests): what it packs is checked as npm's is
    script = HEADER.format(VERSION).encode() + b"window.Plotly = {};\n"
    tarball = _tarball(script)
    monkeypatch.setitem(plotly_bundle.INTEGRITY, VERSION, _integrity(tarball))
    monkeypatch.setattr(plotly_bundle.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(plotly_bundle, "_npm_pack", lambda version, into: tarball)
    assert "fetched" in plotly_bundle.fetch(tmp_path)
    assert plotly_bundle.bundle_path(VERSION, tmp_path).read_bytes() == script
    assert "serves" in plotly_bundle.fetch(tmp_path)  # there: nothing fetched again
    monkeypatch.setattr(plotly_bundle, "_npm_pack", lambda version, into: tarball + b"x")
    with pytest.raises(plotly_bundle.BundleError):
        plotly_bundle.fetch(tmp_path / "again")
    assert not (tmp_path / "again").exists()


def _verdicts(slow_ranks: int, segments: int):
    ranks = np.arange(1024)
    lo = np.arange(segments) * 1000
    named = np.zeros((1024, segments), bool)
    named[:slow_ranks, segments // 2 :] = True
    rate = np.where(named, 1.6, 1.0)
    return run_verdicts_figure(ranks, lo, lo + 999, named, rate, validate=True)


def test_verdicts_are_markers_up_to_the_cap_then_a_binned_heatmap():
    few = _verdicts(slow_ranks=3, segments=100)  # 150 named cells
    assert few.data[0].type == "scatter" and len(few.data[0].x) == 150
    many = _verdicts(slow_ranks=300, segments=100)  # 15,000 named cells
    assert MAX_MARKERS < 300 * 50
    trace = many.data[0]
    assert trace.type == "heatmap" and trace.showscale is False
    z = np.asarray(trace.customdata, np.float64)
    assert z.shape[0] <= 256 and z.shape[1] == 100
    rows = np.asarray(trace.y)
    assert np.all(np.isnan(z[:, :50])) and np.allclose(z[rows < 299, 50:], 1.6)
    assert np.all(np.isnan(z[rows > 300, :]))


def test_every_whole_run_figure_uses_trace_types_of_the_cartesian_bundle(tmp_path):
    from knapformer.dashboard.whole_run import draw

    from knapformer.runtime.recorder import PlanRecorder
    from knapformer.testing.measured_plans import measured_run

    with PlanRecorder(tmp_path / "plans.jsonl", every=8, store_segment_steps=4) as rec:
        for plan in measured_run(16, slow_rank=2, slow_factor=2.0, seed=1):
            rec.record(plan)
    figures = draw(Path(tmp_path / "store"))
    types = {t.type for name in ("heatmap", "verdicts", "steps") for t in figures[name].data}
    assert types and types <= plotly_bundle.TRACE_TYPES


def test_without_npms_registry_the_fetch_says_so_and_exits_0_a_wrong_tarball_1(
    tmp_path, monkeypatch, capsys
):
    import subprocess

    monkeypatch.setattr(plotly_bundle, "FOLDER", tmp_path)
    monkeypatch.setattr(plotly_bundle.shutil, "which", lambda name: "/usr/bin/" + name)
    refused = subprocess.CompletedProcess(
        ["npm"], 1, '{"error": {"code": "ECONNREFUSED", "summary": "FetchError: refused"}}', ""
    )
    assert plotly_bundle._npm_error(refused) == "FetchError: refused"

    def offline(version, into):
        raise OSError(f"npm pack failed: {plotly_bundle._npm_error(refused)}")

    monkeypatch.setattr(plotly_bundle, "_npm_pack", offline)
    assert plotly_bundle.main() == 0
    err = capsys.readouterr().err
    assert "FetchError: refused" in err and "serves plotly.js's full bundle" in err
    monkeypatch.setattr(plotly_bundle, "_npm_pack", lambda version, into: b"not a tarball")
    assert plotly_bundle.main() == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


def test_the_bundle_is_named_as_a_user_would_type_it(tmp_path, monkeypatch):
    """Inside the working folder the served file is shown relative to it (the server's
    start-up line, the bench's table); elsewhere whole."""
    path = plotly_bundle.bundle_path(VERSION, tmp_path / "js")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER.format(VERSION))
    kept = plotly_bundle.served(tmp_path / "js")
    monkeypatch.chdir(tmp_path)
    assert kept.describe().endswith(f"cartesian bundle ({Path('js') / path.name})")
    monkeypatch.chdir(tmp_path / "js")
    assert kept.describe().endswith(f"({path.name})")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert kept.describe().endswith(f"({path})")
