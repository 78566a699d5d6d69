"""Run the dashboard: in a background thread (tests, benches, the demo) or blocking (CLI)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from knapformer.errors import KnapformerError

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerHandle:
    """A running dashboard. ``url`` is where to point a browser; ``stop()`` shuts it down."""

    url: str
    host: str
    port: int
    _server: object
    _thread: threading.Thread
    _runs: object

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)
        self._server.server_close()
        self._runs.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _warn_if_public(host: str) -> None:
    if host not in _LOCAL_HOSTS:
        print(
            f"warning: the dashboard binds to {host}, so anyone who can reach this machine "
            "can read your plans; use --host 127.0.0.1 to keep it local",
            file=sys.stderr,
        )


def check_free(host: str, port: int) -> None:
    """Fail with one clear line before werkzeug would print its own advice and exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise KnapformerError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug does
        try:
            probe.bind(address)
        except OSError as err:
            raise KnapformerError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err


def _make(path: str | Path, host: str, port: int):
    # Imported here so `import dashboard.server` stays cheap.
    from knapformer.dashboard.app import create_app
    from knapformer.dashboard.guard import HostGuard, allowed_hosts
    from knapformer.dashboard.plotly_bundle import install
    from werkzeug.serving import make_server

    if not 0 <= port <= 65535:
        raise KnapformerError(f"port {port} is not in 0..65535")
    _warn_if_public(host)
    # One log line per request (a tick a second) would drown the console.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    check_free(host, port)
    app = create_app(path)
    app.server.config["KNAPFORMER_PLOTLY_JS"] = install(app, app.config.requests_pathname_prefix)
    app.server.wsgi_app = HostGuard(app.server.wsgi_app, allowed_hosts(host))
    try:
        server = make_server(host, port, app.server, threaded=True)
    except SystemExit as err:  # werkzeug prints and exits when it cannot bind
        raise KnapformerError(f"cannot listen on {host}:{port}") from err
    return app, server


def start_server(path: str | Path, host: str = "127.0.0.1", port: int = 8050) -> ServerHandle:
    """Serve the dashboard of PATH in a daemon thread (port 0 picks a free port)."""
    app, server = _make(path, host, port)
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    actual = server.server_port
    shown = f"[{host}]" if ":" in host else host
    return ServerHandle(
        f"http://{shown}:{actual}/",
        host,
        actual,
        server,
        thread,
        app.server.config["KNAPFORMER_RUNS"],
    )


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8050) -> None:
    """Serve the dashboard of PATH until Ctrl-C, which raises KeyboardInterrupt as usual
    (the command line then exits 130). Dash debug stays off."""
    app, server = _make(path, host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard of {path} at http://{shown}:{server.server_port}/  (Ctrl-C stops)")
    print(f"serving {app.server.config['KNAPFORMER_PLOTLY_JS'].describe()}")
    try:
        server.serve_forever()
    finally:
        server.server_close()
        app.server.config["KNAPFORMER_RUNS"].close()
    # werkzeug's serve_forever swallows the KeyboardInterrupt, and nothing else ends it here.
    raise KeyboardInterrupt
