"""The dashboard server against hostile requests, over real HTTP: other Host names (DNS
rebinding) are refused, malformed callback payloads are answered 400 without a
traceback, and well-formed ones still work."""

from __future__ import annotations

import http.client
import json
import logging

import pytest

from dashboard.app import CALLBACK_SHAPES
from dashboard.guard import allowed_hosts
from dashboard.server import start_server


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
        "localhost:{port},evil.example",  # two Host headers, as werkzeug joins them
        "localhost:{port}/x",
    ],
)
def test_other_host_names_are_refused(server, host):
    for path in ("/", "/api/status", "/_dash-layout", "/_dash-dependencies"):
        status, text = _request(server, "GET", path, host=host.format(port=server.port))
        assert status == 403, (path, status)
        assert "plans" not in text and "joint32" not in text


def test_binding_elsewhere_on_purpose_answers_every_name():
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("192.168.1.7") is None
    assert allowed_hosts("::") is None and allowed_hosts("gpu-node-3") is None
    assert allowed_hosts("127.0.0.2") == {"127.0.0.1", "localhost", "[::1]", "127.0.0.2"}
    assert allowed_hosts("::1") == {"127.0.0.1", "localhost", "[::1]"}


# ------------------------------------------------------------------ callback bodies
@pytest.fixture(scope="module")
def callbacks(server) -> dict[str, dict]:
    """Each callback by its first output, with a payload the browser would send."""
    status, text = _request(server, "GET", "/_dash-dependencies")
    assert status == 200
    out = {}
    for dep in json.loads(text):
        outputs = [
            dict(zip(("id", "property"), name.split("."), strict=True))
            for name in dep["output"].strip(".").split("...")
        ]
        out[outputs[0]["id"]] = {
            "output": dep["output"],
            "outputs": outputs,
            "inputs": [{**i, "value": None} for i in dep["inputs"]],
            "state": [{**s, "value": None} for s in dep["state"]],
            "changedPropIds": [],
        }
    return out


def _with(payload: dict, key: str, name: str, value) -> dict:
    payload = json.loads(json.dumps(payload))
    for item in payload[key]:
        if f"{item['id']}.{item['property']}" == name:
            item["value"] = value
            return payload
    raise KeyError(name)


def _tick(callbacks, **values) -> dict:
    payload = _with(
        callbacks["stat-run"], "state", "client.data", {"run": None, "reset": None, "count": 0}
    )
    for name, value in values.items():
        key = "state" if name in ("client.data", "selection.data") else "inputs"
        payload = _with(payload, key, name, value)
    return payload


def _post(server, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _request(server, "POST", "/_dash-update-component", data)


def test_well_formed_callbacks_are_answered(server, callbacks):
    status, text = _post(server, _tick(callbacks))
    assert status == 200 and "stat-steps" in text
    selection = {"run": "plans", "reset": 0, "index": 1}
    details = _with(callbacks["bag-load"], "inputs", "selection.data", selection)
    details["changedPropIds"] = ["selection.data"]
    status, text = _post(server, details)
    assert status == 200 and "seq-table" in text


def _malformed(callbacks) -> dict[str, object]:
    tick, details = _tick(callbacks), callbacks["bag-load"]
    return {
        "not json": b"{nope",
        "nested": b"[" * 100_000,
        "array": [],
        "empty object": {},
        "unknown output": {**tick, "output": "nope.children"},
        "inputs not a list": {**tick, "inputs": "x"},
        "an input missing": {**tick, "inputs": tick["inputs"][1:]},
        "inputs out of order": {**tick, "inputs": tick["inputs"][::-1]},
        "outputs not matching": {**tick, "outputs": tick["outputs"][:2]},
        "state missing": {k: v for k, v in tick.items() if k != "state"},
        "changed not an input": {**tick, "changedPropIds": ["client.data"]},
        "changed not strings": {**tick, "changedPropIds": [3]},
        "client a string": _tick(callbacks, **{"client.data": "x"}),
        "client none": _tick(callbacks, **{"client.data": None}),
        "client count a string": _tick(callbacks, **{"client.data": {"count": "3"}}),
        "follow an int": _tick(callbacks, **{"follow.value": 5}),
        "run a list": _tick(callbacks, **{"run-picker.value": ["a"]}),
        "slider nan": json.dumps(_tick(callbacks, **{"step-slider.value": 1.5}))
        .replace("1.5", "NaN")
        .encode(),
        "click points a string": _tick(callbacks, **{"timeline.clickData": {"points": "x"}}),
        "click customdata text": _tick(
            callbacks, **{"timeline.clickData": {"points": [{"customdata": "abc"}]}}
        ),
        "click no points": _tick(callbacks, **{"timeline.clickData": {"points": []}}),
        "click infinite": json.dumps(
            _tick(callbacks, **{"timeline.clickData": {"points": [{"customdata": 1.5}]}})
        )
        .replace("1.5", "Infinity")
        .encode(),
        "selection a list": _with(details, "inputs", "selection.data", [1]),
        "selection index text": _with(
            details, "inputs", "selection.data", {"run": "plans", "reset": 0, "index": "y"}
        ),
        "selection without run": _with(
            details, "inputs", "selection.data", {"reset": 0, "index": 0}
        ),
        "row ids text": _with(details, "inputs", "seq-table.selected_row_ids", ["zz"]),
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
    assert _post(server, _tick(callbacks))[0] == 200


def test_every_callback_input_has_a_declared_shape(tmp_path):
    from dashboard.app import create_app

    app = create_app(tmp_path / "plans.jsonl")
    try:
        names = {
            (d["id"], d["property"])
            for callback in app.callback_map.values()
            for d in [*callback["inputs"], *callback["state"]]
        }
    finally:
        app.server.config["KNAPFORMER_RUNS"].close()
    assert names - set(CALLBACK_SHAPES) == set()


def test_oversized_bodies_are_refused(server, callbacks):
    body = json.dumps({**_tick(callbacks), "padding": "x" * (17 << 20)}).encode()
    status, _ = _post(server, body)
    assert status == 413
