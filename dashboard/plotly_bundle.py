"""Which plotly.js the dashboard serves: plotly.js's own cartesian bundle when it has been
fetched, else the full one that the Python ``plotly`` package ships.

Chromium spends most of a cold page's first draw compiling and running plotly.js (docs/
performance.md, "The dashboard's first draw"): its full bundle is 4.8 MB and registers
every trace type there is, where the dashboard draws only ``scatter``, ``bar`` and
``heatmap``. The ``plotly.js-cartesian-dist-min`` package of the same plotly.js version
holds those (and a few more) in 1.5 MB. It is not in git: ``make setup`` and ``make
test`` fetch it (``python -m knapformer.dashboard.plotly_bundle``) with npm, check the
tarball against the integrity pinned here for that version, and keep the one script in
``plotly_js/`` beside this module. Without it, or when the installed ``plotly`` ships
another plotly.js version than the pinned one, the dashboard serves the full bundle and
says so (`served`): it draws the same, a few tenths of a second later.

Dash's graphs load plotly.js from one URL (``page_index.PLOTLY_PATH``, the page
preloads it); `install` answers that URL with the bundle `served` names.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from knapformer.dashboard.page_index import PLOTLY_PATH

#: npm's package of plotly.js's cartesian bundle: traces bar, box, contour, heatmap,
#: histogram(2d, 2dcontour), image, pie, scatter, scatterternary and violin.
PACKAGE = "plotly.js-cartesian-dist-min"
MEMBER = "package/plotly-cartesian.min.js"
#: The npm registry's ``dist.integrity`` of PACKAGE's tarball, per plotly.js version
#: (``npm view plotly.js-cartesian-dist-min@VERSION dist.integrity``). A version of the
#: Python ``plotly`` that ships another plotly.js needs its line here first.
INTEGRITY = {
    "4.1.1": "sha512-o8GrFeusncwBIxbBynRJpY4pkgVB6caM+JLpwrLYbbsO7dZ8FJ+SVN2Fr+L7kiG/"
    "Z6w4P5O0Jus/Qr5EefHVeg==",
}
#: Where the fetched bundle is kept (ignored by git).
FOLDER = Path(__file__).resolve().parent / "plotly_js"
#: The longest an ``npm pack`` may take (it fetches 0.5 MB).
NPM_TIMEOUT_S = 90
#: The trace types the cartesian bundle draws and the dashboard's figures use.
TRACE_TYPES = frozenset({"bar", "heatmap", "scatter"})


class BundleError(Exception):
    """A fetched bundle that is not the pinned one (the message says how it differs)."""


@dataclass(frozen=True)
class Served:
    """The plotly.js file the dashboard serves: ``name`` is ``cartesian`` or ``full``."""

    name: str
    version: str
    path: Path

    def describe(self) -> str:
        if self.name == "cartesian":
            return f"plotly.js {self.version}, cartesian bundle ({_shown(self.path)})"
        return (
            f"plotly.js {self.version}, full bundle (the smaller cartesian one is not "
            f"fetched: python -m knapformer.dashboard.plotly_bundle)"
        )


def _shown(path: Path) -> str:
    """``path`` as a user would type it: relative to the working folder when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def plotly_js_version() -> str:
    """The plotly.js version the installed Python ``plotly`` ships (and Dash serves)."""
    from plotly.offline import get_plotlyjs_version

    return get_plotlyjs_version()


def full_bundle() -> Path:
    """The Python ``plotly`` package's own plotly.min.js (Dash's, unless `install`ed)."""
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


def bundle_path(version: str, folder: Path | None = None) -> Path:
    """Where the cartesian bundle of ``version`` is kept (in `FOLDER` by default)."""
    return (folder or FOLDER) / f"plotly-cartesian-{version}.min.js"


def served(folder: Path | None = None) -> Served:
    """The cartesian bundle of the installed plotly.js version when it is in ``folder``
    (`FOLDER`) and says it is that version; else the full bundle."""
    version = plotly_js_version()
    path = bundle_path(version, folder)
    if path.is_file() and _header_version(path.read_bytes()[:200]) == version:
        return Served("cartesian", version, path)
    return Served("full", version, full_bundle())


def _header_version(head: bytes) -> str | None:
    """``4.1.1`` from a bundle's first comment (``* plotly.js (cartesian - minified)
    v4.1.1``); None when it is not a cartesian plotly.js bundle."""
    line = head.decode("utf-8", "replace").split("\n")[1:2]
    if not line or "plotly.js (cartesian" not in line[0]:
        return None
    return line[0].rsplit(" v", 1)[-1].strip()


def check_integrity(tarball: bytes, integrity: str) -> None:
    """Raise `BundleError` unless ``tarball``'s sha512 is npm's ``integrity``."""
    algorithm, _, expected = integrity.partition("-")
    if algorithm != "sha512":
        raise BundleError(f"unsupported integrity {integrity!r} (sha512 only)")
    actual = base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if actual != expected:
        raise BundleError(f"{PACKAGE} tarball's sha512 is {actual}, not the pinned {expected}")


def bundle_of(tarball: bytes, version: str, integrity: str) -> bytes:
    """The cartesian script in npm's ``tarball`` of ``version``, once the tarball matches
    ``integrity`` and the script says it is that version."""
    check_integrity(tarball, integrity)
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        try:
            script = tar.extractfile(MEMBER)
        except KeyError:
            script = None
        if script is None:
            raise BundleError(f"{PACKAGE}@{version} holds no {MEMBER}")
        data = script.read()
    if _header_version(data[:200]) != version:
        raise BundleError(f"{MEMBER} of {PACKAGE}@{version} is not plotly.js v{version}")
    return data


def _npm_pack(version: str, into: Path) -> bytes:
    """npm's tarball of PACKAGE@version (``npm pack``: its registry and settings). On a
    machine without a network it gives up within `NPM_TIMEOUT_S`: ``make test`` asks
    every time."""
    command = ["npm", "pack", f"{PACKAGE}@{version}", "--json", "--pack-destination", str(into)]
    try:
        done = subprocess.run(
            [*command, "--fetch-retries=1", "--fetch-timeout=20000"],
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        raise OSError(f"npm pack {PACKAGE}@{version} took over {NPM_TIMEOUT_S} s") from err
    if done.returncode != 0:
        raise OSError(f"npm pack {PACKAGE}@{version} failed: {_npm_error(done)}")
    return (into / json.loads(done.stdout)[0]["filename"]).read_bytes()


def _npm_error(done: subprocess.CompletedProcess) -> str:
    """The summary of a failed npm command (its ``--json`` error), else its first line."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(done.stdout)["error"]["summary"]
    lines = done.stderr.strip().splitlines()
    return lines[0] if lines else f"exit status {done.returncode}"


def fetch(folder: Path | None = None) -> str:
    """Fetch and keep the cartesian bundle of the installed plotly.js version (nothing to
    do when it is there); a line saying what the dashboard will serve. Raises `OSError`
    when npm cannot fetch it and `BundleError` when what it fetched is not the pinned."""
    version = plotly_js_version()
    kept = served(folder)
    if kept.name == "cartesian":
        return f"the dashboard serves {kept.describe()}"
    integrity = INTEGRITY.get(version)
    if integrity is None:
        return (
            f"no {PACKAGE} is pinned for plotly.js {version} "
            f"(dashboard/plotly_bundle.py): the dashboard serves the full bundle"
        )
    if shutil.which("npm") is None:
        raise OSError("npm is not installed")
    with tempfile.TemporaryDirectory(prefix="knapformer-plotly-js-") as scratch:
        data = bundle_of(_npm_pack(version, Path(scratch)), version, integrity)
    path = bundle_path(version, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_bytes(data)
    part.replace(path)  # whole or absent: a reader never sees half a script
    return f"fetched {PACKAGE}@{version}: the dashboard serves {served(folder).describe()}"


def install(app, prefix: str) -> Served:
    """Answer Dash's plotly.js URL under ``prefix`` with the bundle `served` names (a
    static route: Flask prefers it to Dash's own for its component suites)."""
    import flask

    bundle = served()

    def plotly_js():
        response = flask.send_file(bundle.path, mimetype="application/javascript")
        response.headers["X-Plotly-Bundle"] = f"{bundle.name} {bundle.version}"
        return response

    app.server.add_url_rule(prefix + PLOTLY_PATH, "knapformer_plotly_js", plotly_js)
    return bundle


def main() -> int:
    """``python -m knapformer.dashboard.plotly_bundle``: fetch the bundle (`fetch`). Exits
    0 without it when npm is missing or cannot reach its registry (the dashboard serves
    the full bundle), 1 when what npm gave is not the pinned tarball."""
    try:
        print(fetch())
    except OSError as err:
        print(f"{err}: the dashboard serves plotly.js's full bundle", file=sys.stderr)
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
