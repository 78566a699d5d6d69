"""The dashboard server against hostile requests, over real HTTP: other Host names (DNS
rebinding) are refused, malformed callback payloads are answered 400 without a
traceback, and well-formed ones still work."""

from __future__ import annotations

import http.client
import json
import logging

import pytest
from knapformer.dashboard import whole_run
from knapformer.dashboard.app import CALLBACK_SHAPES
from knapformer.dashboard.guard import allowed_hosts
from knapformer.dashboard.server import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, steps50_lines):
    path = tmp_path_factory.mktemp("guard") / "plans.jsonl"
    path.write_text("\n".join(steps50_lines[:3]) + "\n")
    handle = start_server(path, port=0)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def steps50_lines():
    from conftest import SAMPLES

    return (SAMPLES / "joint32_50steps.jsonl").read_text().splitlines()


def _request(handle, method: str, path: str, body: bytes | None = None, host: str | None = None):
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=30)
    try:
        headers = {"Host": f"{handle.host}:{handle.port}" if host is None else host}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# ---------------------------------------------------------------------------- Host
@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LOCALHOST", "localhost:9"]
)
def test_loopback_names_are_answered_with_any_port(server, host):
    status, page = _request(server, "GET", "/", host=host.format(port=server.port))
    assert status == 200 and "KnapFormer dashboard" in page


@pytest.mark.parametrize(
    "host",
    [
        "evil.example:{port}",  # a page whose domain now resolves to 127.0.0.1
        "localhost.evil.example:{port}",
        "127.0.0.1.nip.io:{port}",
        "[::2]:{port}",
        "",
    ],
)
def test_other_host_names_are_refused(server, host):
    for path in ("/", "/api/status", "/_dash-layout", "/_dash-dependencies"):
        status, text = _request(server, "GET", path, host=host.format(port=server.port))
        assert status == 403, (path, status)
        assert "plans" not in text and "joint32" not in text


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:99999",  # before: answered 200
        "localhost:0",
        "127.0.0.1:65536",
        "localhost:{port},evil.example",  # two Host headers, as werkzeug joins them
        "localhost:{port}/x",
        "localhost:",
    ],
)
def test_a_host_that_is_not_a_name_and_a_valid_port_is_answered_400(server, host):
    for path in ("/", "/api/status"):
        status, text = _request(server, "GET", path, host=host.format(port=server.port))
        assert status == 400 and "port in 1..65535" in text, (path, status, text)
        assert "joint32" not in text


def test_binding_elsewhere_on_purpose_answers_every_name():
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("192.168.1.7") is None
    assert allowed_hosts("::") is None and allowed_hosts("gpu-node-3") is None
    assert allowed_hosts("127.0.0.2") == {"127.0.0.1", "localhost", "[::1]", "127.0.0.2"}
    assert allowed_hosts("::1") == {"127.0.0.1", "localhost", "[::1]"}


# ------------------------------------------------------------------ callback bodies
#: Values the page itself would send where None is not one (the rest start as None).
_VALID = {"client.data": {"run": None, "reset": None, "count": 0}}


@pytest.fixture(scope="module")
def callbacks(server) -> list[dict]:
    """A payload the browser would send for each callback of the app, from the app's own
    description of its callbacks."""
    status, text = _request(server, "GET", "/_dash-dependencies")
    assert status == 200
    out = []
    for dep in json.loads(text):
        if dep.get("clientside_function"):
            continue  # run by the browser: never posted to the server
        outputs = [
            dict(zip(("id", "property"), name.split("@")[0].split("."), strict=True))
            for name in dep["output"].strip(".").split("...")
        ]

        def items(specs):
            return [{**d, "value": _VALID.get(f"{d['id']}.{d['property']}")} for d in specs]

        out.append(
            {
                "output": dep["output"],
                "outputs": outputs,
                "inputs": items(dep["inputs"]),
                "state": items(dep["state"]),
                "changedPropIds": [],
            }
        )
    return out


def _names(payload: dict) -> list[str]:
    return [f"{i['id']}.{i['property']}" for i in payload["inputs"] + payload["state"]]


def _payload(callbacks: list[dict], name: str, value=None, also: dict | None = None) -> dict:
    """The payload of the callback that takes ``name`` (an input or state), with ``name``
    set to ``value`` and the names in ``also`` to theirs."""
    values = {name: value, **(also or {})}
    payload = json.loads(json.dumps(next(c for c in callbacks if name in _names(c))))
    for item in payload["inputs"] + payload["state"]:
        key = f"{item['id']}.{item['property']}"
        if key in values:
            item["value"] = values[key]
    return payload


def _post(server, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _request(server, "POST", "/_dash-update-component", data)


def _nan(payload: dict, placeholder: float, token: str) -> bytes:
    """``payload`` as JSON with ``placeholder`` written as ``NaN``/``Infinity`` (Python's
    JSON reader accepts those)."""
    return json.dumps(payload).replace(repr(placeholder), token).encode()


def test_well_formed_callbacks_are_answered(server, callbacks):
    for payload in callbacks:  # 204: the callback had nothing to update
        assert _post(server, payload)[0] in (200, 204), payload["output"]
    selection = {"run": "plans", "reset": 0, "index": 1}
    details = _payload(callbacks, "seq-table.page_current", None, also={"frame.data": selection})
    details["changedPropIds"] = ["frame.data"]
    status, text = _post(server, details)
    assert status == 200 and "seq-table" in text


def _malformed(callbacks) -> dict[str, object]:
    some = _payload(callbacks, "timeline.clickData")
    return {
        "not json": b"{nope",
        "nested": b"[" * 100_000,
        "array": [],
        "empty object": {},
        "unknown output": {**some, "output": "nope.children"},
        "inputs not a list": {**some, "inputs": "x"},
        "an input missing": {**some, "inputs": some["inputs"][1:]},
        "inputs out of order": {**some, "inputs": some["inputs"][::-1]},
        "outputs not matching": {**some, "outputs": some["outputs"][:1]},
        "state missing": {k: v for k, v in some.items() if k != "state"},
        "changed not an input": {**some, "changedPropIds": ["nope.value"]},
        "changed not strings": {**some, "changedPropIds": [3]},
        "client a string": _payload(callbacks, "client.data", "x"),
        "client none": _payload(callbacks, "client.data", None),
        "client count a string": _payload(callbacks, "client.data", {"count": "3"}),
        "follow an int": _payload(callbacks, "follow.value", 5),
        "run a list": _payload(callbacks, "run-picker.value", ["a"]),
        "slider nan": _nan(_payload(callbacks, "step-slider.value", 1.5), 1.5, "NaN"),
        "click points a string": _payload(callbacks, "timeline.clickData", {"points": "x"}),
        "click customdata text": _payload(
            callbacks, "timeline.clickData", {"points": [{"customdata": "abc"}]}
        ),
        "click no points": _payload(callbacks, "timeline.clickData", {"points": []}),
        "click infinite": _nan(
            _payload(callbacks, "timeline.clickData", {"points": [{"customdata": 1.5}]}),
            1.5,
            "Infinity",
        ),
        "frame a list": _payload(callbacks, "seq-table.page_current", also={"frame.data": [1]}),
        "frame index text": _payload(
            callbacks,
            "seq-table.page_current",
            also={"frame.data": {"run": "plans", "reset": 0, "index": "y"}},
        ),
        "frame run a list": _payload(
            callbacks,
            "seq-table.page_current",
            also={"frame.data": {"run": ["plans"], "reset": 0, "index": 0}},
        ),
        "selection a list": _payload(callbacks, "highlight.data", also={"selection.data": [1]}),
        "row ids text": _payload(callbacks, "seq-table.selected_rows", ["zz"]),
    }


def test_malformed_callback_requests_are_answered_400_without_a_traceback(
    server, callbacks, caplog, capfd
):
    cases = _malformed(callbacks)
    with caplog.at_level(logging.WARNING):
        answers = {name: _post(server, body) for name, body in cases.items()}
    wrong = {name: status for name, (status, _) in answers.items() if status != 400}
    assert wrong == {}, wrong
    assert all("Traceback" not in text for _, text in answers.values())
    assert "malformed callback request: client.data cannot hold" in answers["client a string"][1]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert "Traceback" not in capfd.readouterr().err
    # ... and the server still answers well-formed requests.
    assert _post(server, callbacks[0])[0] in (200, 204)


def test_every_callback_input_has_a_declared_shape(tmp_path):
    from knapformer.dashboard.app import create_app

    app = create_app(tmp_path / "plans.jsonl")
    try:
        names = {
            (d["id"], d["property"])
            for callback in app.callback_map.values()
            for d in [*callback["inputs"], *callback["state"]]
        }
    finally:
        app.server.config["KNAPFORMER_RUNS"].close()
    # the guard checks every callback against the page's shapes and the whole-run views'
    assert names - set(CALLBACK_SHAPES | whole_run.SHAPES) == set()


def test_oversized_bodies_are_refused(server, callbacks):
    body = json.dumps({**callbacks[0], "padding": "x" * (17 << 20)}).encode()
    status, _ = _post(server, body)
    assert status == 413


# ------------------------------------------------- bodies of unknown length, origins
def _raw(server, request: bytes, timeout: float = 30) -> str:
    """Send ``request`` as written; the status line of the answer."""
    import socket

    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(request)
        return sock.makefile("rb").readline().decode()


def test_a_chunked_body_is_refused_before_it_is_read(server, callbacks):
    # Before: a chunked body skipped the 16 MiB limit (64 MiB grew the server by 426 MB).
    host = f"{server.host}:{server.port}"
    head = (
        f"POST /_dash-update-component HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"x" * (1 << 20)
    # Only the head and one chunk are sent: the answer comes without the rest.
    status = _raw(server, head + b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    assert status.startswith("HTTP/1.1 411"), status
    # A well-formed callback with a length is still answered.
    assert _post(server, callbacks[0])[0] in (200, 204)


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://evil.example:443"]
)
def test_a_cross_origin_post_runs_no_callback(server, callbacks, origin):
    host = f"{server.host}:{server.port}"
    body = json.dumps(callbacks[0]).encode()
    for content_type in ("text/plain", "application/json"):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            conn.request(
                "POST",
                "/_dash-update-component",
                body=body,
                headers={"Host": host, "Origin": origin, "Content-Type": content_type},
            )
            resp = conn.getresponse()
            assert resp.status == 403, (origin, content_type)
            assert "not answered" in resp.read().decode()
        finally:
            conn.close()


def test_a_same_origin_post_or_one_without_origin_is_answered(server, callbacks):
    host = f"{server.host}:{server.port}"
    for headers in ({"Origin": f"http://{host}"}, {}):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            conn.request(
                "POST",
                "/_dash-update-component",
                body=json.dumps(callbacks[0]).encode(),
                headers={"Host": host, "Content-Type": "application/json", **headers},
            )
            assert conn.getresponse().status in (200, 204), headers
        finally:
            conn.close()
