"""What the dashboard server answers, and what it refuses before any of its code runs.

- **Host names.** Bound to a loopback address (the default), the server answers only
  requests whose ``Host`` header names this machine's loopback interface: ``127.0.0.1``,
  ``localhost``, ``[::1]`` or the bound address itself, with any port (an SSH tunnel may
  use another one). A web page that points its own domain at 127.0.0.1 (DNS rebinding)
  is refused with 403, so it cannot read the plans. Bound elsewhere on purpose
  (``--host 0.0.0.0``, already warned about), any name is answered. A ``Host`` that is
  not a name with an optional port in 1..65535 (``127.0.0.1:99999``) is answered 400.
- **Callback payloads.** A POST to Dash's callback endpoint must be a JSON object naming
  a registered callback, listing exactly that callback's inputs and state, each holding a
  value of the shape the app declares for it (`callback_shapes`); anything else is
  answered 400 with a one-line reason, instead of an exception inside Dash or a callback
  (HTTP 500 and a traceback in the console). Bodies over `MAX_BODY_BYTES` are answered
  413 before they are read, and a body without a ``Content-Length`` (chunked transfer
  encoding, which no size check sees in advance) 411: the browser always sends the length.
- **Origins.** A request that changes state (any method but GET, HEAD, OPTIONS) from a
  browser page must come from the dashboard's own origin: an ``Origin`` header naming
  another site, or ``null``, is answered 403, so a page elsewhere cannot run callbacks
  with a "simple" cross-origin POST (``text/plain`` needs no preflight). Requests without
  ``Origin`` (curl, scripts, old browsers on same-origin requests) are answered.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

#: How the loopback interface is named in a ``Host`` header (hostnames are lower-cased).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
#: Largest callback body read (the run picker sends its options back: ~40 bytes a run).
MAX_BODY_BYTES = 16 << 20
_CALLBACK_PATH = "/_dash-update-component"
_HOST_HEADER = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::([0-9]{1,5}))?")
_PORTS = range(1, 65536)

Shape = Callable[[Any], bool]


# ---------------------------------------------------------------------- host names
def allowed_hosts(bind_host: str) -> frozenset[str] | None:
    """``Host`` names answered when bound to ``bind_host``; ``None``: every name."""
    if not _is_loopback(bind_host):
        return None
    return frozenset({*LOOPBACK_NAMES, _host_name(_as_host_header(bind_host))})


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _as_host_header(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _host_name(header: str) -> str:
    """The name of a ``Host`` header without its port, lower-cased ("" if malformed: not
    a name, or a port outside 1..65535)."""
    match = _HOST_HEADER.fullmatch(header.strip().lower())
    if match is None or (match.group(2) is not None and int(match.group(2)) not in _PORTS):
        return ""
    return match.group(1)


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class HostGuard:
    """WSGI middleware in front of the app: 403 to a request for a name not in
    ``allowed`` or, for a method that changes state, from another origin; 411 to a body
    without a length and 413 to one over `MAX_BODY_BYTES` (nothing of it is read)."""

    def __init__(self, app: Callable, allowed: Iterable[str] | None):
        self.app = app
        self.allowed = None if allowed is None else frozenset(allowed)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        header = environ.get("HTTP_HOST", "")
        if header and not _host_name(header):
            return _refuse(
                start_response,
                "400 Bad Request",
                f"Host {header[:100]!r} is not a host name with a port in 1..65535",
            )
        if self.allowed is not None and _host_name(header) not in self.allowed:
            names = ", ".join(sorted(self.allowed))
            return _refuse(
                start_response,
                "403 Forbidden",
                f"this dashboard answers requests for {names} only, not for Host {header[:100]!r}",
            )
        if environ.get("REQUEST_METHOD", "GET").upper() not in _SAFE_METHODS:
            problem = request_problem(environ)
            if problem is not None:
                return _refuse(start_response, *problem)
        return self.app(environ, start_response)


def request_problem(environ: dict) -> tuple[str, str] | None:
    """(status, reason) for a state-changing request to refuse before its body is read:
    from another origin, a body of unknown length (chunked) or one too large."""
    origin = environ.get("HTTP_ORIGIN")
    if origin is not None and not same_origin(origin, environ.get("HTTP_HOST", "")):
        return "403 Forbidden", f"requests from origin {origin[:100]!r} are not answered"
    if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        return "411 Length Required", "a request body must state its Content-Length"
    length = environ.get("CONTENT_LENGTH") or "0"
    if not (length.isascii() and length.isdigit()):
        return "400 Bad Request", "Content-Length is not a number"
    if len(length) > 12 or int(length) > MAX_BODY_BYTES:
        return "413 Request Entity Too Large", f"a body holds at most {MAX_BODY_BYTES:,} bytes"
    return None


def same_origin(origin: str, host_header: str) -> bool:
    """Whether the ``Origin`` header names the server the ``Host`` header names (scheme
    http or https (behind a proxy), same host and port; ``null`` never is)."""
    try:
        parts = urlsplit(origin.strip())
        netloc = parts.netloc.lower()
    except ValueError:
        return False
    same = bool(netloc) and netloc == host_header.strip().lower()
    return same and parts.scheme in ("http", "https")


def _refuse(start_response: Callable, status: str, reason: str) -> list[bytes]:
    body = f"{status}: {reason}\n".encode()
    start_response(
        status,
        [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
    )
    return [body]


# ------------------------------------------------------------------- value shapes
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (JSON as Python reads it also has NaN and Infinity)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_list(value: Any) -> bool:
    return isinstance(value, list)


def optional(shape: Shape) -> Shape:
    return lambda value: value is None or shape(value)


def list_of(shape: Shape, nonempty: bool = False) -> Shape:
    return lambda value: (
        isinstance(value, list) and (bool(value) or not nonempty) and all(map(shape, value))
    )


def record(required: bool = True, **fields: Shape) -> Shape:
    """A JSON object whose listed keys hold these shapes (all present unless
    ``required=False``); other keys are not looked at."""

    def check(value: Any) -> bool:
        if not isinstance(value, dict):
            return False
        return all(
            shape(value[key]) if key in value else not required for key, shape in fields.items()
        )

    return check


# -------------------------------------------------------------- callback payloads
def callback_problem(
    body: Any, callback_map: dict, shapes: dict[tuple[str, str], Shape]
) -> str | None:
    """Why ``body`` is not a callback request this app can run (``None`` if it is)."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    output = body.get("output")
    if not isinstance(output, str) or output not in callback_map:
        return f"no callback has the output {str(output)[:80]!r}"
    callback = callback_map[output]
    declared = callback["output"]
    expected = [(o.component_id, o.component_property) for o in _as_list(declared)]
    outputs = body.get("outputs")
    sent = outputs if isinstance(declared, list) else [outputs]
    if not _names_match(sent, expected):
        return "outputs do not match the callback's outputs"
    for key in ("inputs", "state"):
        items = body.get(key, [])
        expected = [(d["id"], d["property"]) for d in callback.get(key, [])]
        if not _names_match(items, expected):
            return f"{key} do not match the callback's {key}"
        for item, name in zip(items, expected, strict=True):
            shape = shapes.get(name)
            value = item.get("value")
            if shape is not None and not shape(value):
                return f"{name[0]}.{name[1]} cannot hold {_short(value)}"
    changed = body.get("changedPropIds", [])
    if not list_of(is_str)(changed):
        return "changedPropIds must be a list of strings"
    inputs = {f"{d['id']}.{d['property']}" for d in callback.get("inputs", [])}
    if not set(changed) <= inputs:
        return "changedPropIds names something that is not an input of the callback"
    return None


def guard_callbacks(app: Any, shapes: dict[tuple[str, str], Shape]) -> None:
    """Answer malformed requests to the callbacks of Dash ``app`` with 400 (see above)."""
    import flask

    server = app.server
    if server.config.get("MAX_CONTENT_LENGTH") is None:
        server.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

    @server.before_request
    def _check_callback_request():
        request = flask.request
        if request.method != "POST" or not request.path.endswith(_CALLBACK_PATH):
            return None
        try:  # cached: Dash reads the same parsed body
            body = request.get_json(force=True, cache=True)
        except RecursionError:
            flask.abort(400, description="the body is nested too deeply")
        except ValueError:
            flask.abort(400, description="the body is not valid JSON")
        problem = callback_problem(body, app.callback_map, shapes)
        if problem is not None:
            flask.abort(400, description=f"malformed callback request: {problem}")
        return None


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _names_match(items: Any, expected: list[tuple[Any, str]]) -> bool:
    return (
        isinstance(items, list)
        and len(items) == len(expected)
        and all(
            isinstance(item, dict) and (item.get("id"), _property(item)) == name
            for item, name in zip(items, expected, strict=True)
        )
    )


def _property(item: dict) -> Any:
    """An item's property, without the ``@…`` mark Dash gives a second callback's output
    of the same property (``allow_duplicate``)."""
    prop = item.get("property")
    return prop.split("@")[0] if isinstance(prop, str) else prop


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
