"""The lane (`frontend/lane.py`): v2 inference requests answered from the HTTP protocol,
below ASGI. Each request is sent both ways to one server, through raw sockets: in one write
(its head whole in one read: the lane) and with its head split over two writes (the
parser and the ASGI app), and the answers must be the same. The server's
`lockgate_http_lane_requests_total` tells which way each went. A body that stops coming on
the lane gets 408: `test_hostile_input.py::test_slow_body_gets_408_and_the_connection_closes`
sends its head whole, so it runs there."""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import RunningServer, digits_rows, models_of, start_server
from tests.frontend.test_hostile_input import RawResponse, read_response, read_responses

INFER = "/v2/models/digits_onnx/infer"
PAUSE = 0.05  # between writes, so the server reads them apart
# digits_onnx's deadline is its 50 ms SLO from the first byte: a head sent in two writes
# takes the pause out of it, so requests that must succeed give a deadline of their own
LONG = "Request-Timeout: 30"
# headers whose value differs from one answer to the next
VARYING = {"date", "x-request-id", "x-lockgate-inflight"}


def head_and_body(path: str, body: bytes, *extra: str) -> tuple[bytes, bytes]:
    head = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), body


def send(sock: socket.socket, *writes: bytes) -> None:
    for i, data in enumerate(writes):
        if i:
            time.sleep(PAUSE)
        sock.sendall(data)


def connect(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def lane_count(server: RunningServer) -> float:
    return server.metric("lockgate_http_lane_requests_total")


def digits_body(row: int, request_id: str = "") -> bytes:
    data = digits_rows(row + 1)[row : row + 1]
    request: dict[str, object] = {
        "inputs": [
            {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": data.ravel().tolist()}
        ]
    }
    if request_id:
        request["id"] = request_id
    return json.dumps(request).encode()


def binary_body() -> tuple[bytes, str]:
    """A request whose tensor is binary after its JSON (Inference-Header-Content-Length),
    asking for a binary output."""
    tensor = digits_rows(1).astype(np.float32).tobytes()
    header = {
        "inputs": [
            {
                "name": "input",
                "shape": [1, 64],
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(tensor)},
            }
        ],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
    }
    encoded = json.dumps(header).encode()
    return encoded + tensor, f"Inference-Header-Content-Length: {len(encoded)}"


CASES: dict[str, tuple[str, bytes, tuple[str, ...]]] = {
    "ok": (INFER, digits_body(3, "a-1"), (LONG,)),
    "versioned": ("/v2/models/digits_onnx/versions/1/infer", digits_body(5), (LONG,)),
    "client request id": (INFER, digits_body(1), ("X-Request-Id: mine-42", LONG)),
    "malformed JSON": (INFER, b"{nope", ()),
    "wrong shape": (
        INFER,
        json.dumps(
            {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
        ).encode(),
        (),
    ),
    "unknown model": ("/v2/models/no_such_model/infer", digits_body(0), ()),
    "unknown version": ("/v2/models/digits_onnx/versions/9/infer", digits_body(0), ()),
    "bad Request-Timeout": (INFER, digits_body(0), ("Request-Timeout: soon",)),
    "python model": (
        "/v2/models/echo/infer",
        json.dumps(
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
        ).encode(),
        (),
    ),
}


def comparable(response: RawResponse) -> tuple[int, dict[str, str], bytes]:
    headers = {k: ("*" if k in VARYING else v) for k, v in response.headers.items()}
    return response.status, headers, response.body


def test_the_lane_answers_as_the_asgi_path(server: RunningServer) -> None:
    cases = dict(CASES)
    body, length_header = binary_body()
    cases["binary tensors"] = (INFER, body, (length_header, LONG))
    for name, (path, body, extra) in cases.items():
        head, body = head_and_body(path, body, *extra)
        split = head.index(b"\r\n") + 2  # the request line alone, then the headers and body
        before = lane_count(server)
        with connect(server) as sock:
            send(sock, head + body)
            lane = read_response(sock)
        assert lane_count(server) == before + 1, name
        with connect(server) as sock:
            send(sock, head[:split], head[split:] + body)
            asgi = read_response(sock)
        assert lane_count(server) == before + 1, f"{name}: a split head took the lane"
        assert comparable(lane) == comparable(asgi), name
        assert lane.status < 500, (name, lane.body[:300])
        if name == "client request id":
            assert lane.headers["x-request-id"] == "mine-42"
    ok = json.loads(read_ok(server, *CASES["ok"]).body)
    assert ok["id"] == "a-1" and ok["outputs"][0]["data"] == [
        int(np.argmax(ok["outputs"][1]["data"]))
    ]


def read_ok(server: RunningServer, path: str, body: bytes, extra: tuple[str, ...]) -> RawResponse:
    with connect(server) as sock:
        send(sock, b"".join(head_and_body(path, body, *extra)))
        response = read_response(sock)
    assert response.status == 200, response.body[:300]
    return response


def test_a_body_in_pieces_and_pipelined_requests_keep_their_order(
    server: RunningServer,
) -> None:
    head, body = head_and_body(INFER, digits_body(2, "pieces"), LONG)
    before = lane_count(server)
    with connect(server) as sock:
        send(sock, head + body[:7], body[7:40], body[40:])  # the head whole, the body in pieces
        first = read_response(sock)
        assert first.status == 200 and json.loads(first.body)["id"] == "pieces"
        # five requests in one write, then two more while those run: answered in order
        ids = [f"p{i}" for i in range(7)]
        requests = [
            b"".join(head_and_body(INFER, digits_body(i, rid), LONG)) for i, rid in enumerate(ids)
        ]
        sock.sendall(b"".join(requests[:5]))
        sock.sendall(b"".join(requests[5:]))
        answers = read_responses(sock, len(ids))
    assert [a.status for a in answers] == [200] * len(ids), [a.body[:200] for a in answers]
    assert [json.loads(a.body)["id"] for a in answers] == ids
    assert lane_count(server) == before + 1 + len(ids)


def test_a_disconnect_cancels_the_running_request(server: RunningServer) -> None:
    """The sleeping model holds a request; its client goes away; the batcher counts it
    cancelled and the server answers the next one."""
    x = struct.unpack("<4f", struct.pack("<4f", 1, 2, 3, 4))
    request = {
        "inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": list(x)},
            {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [1.0]},
        ]
    }
    labels = 'model="slow",outcome="cancelled",version="1"'
    before = _metric_or_zero(server, "lockgate_requests_total", labels)
    blocker = b"".join(head_and_body("/v2/models/slow/infer", json.dumps(request).encode()))
    with connect(server) as holding:  # takes the model for 1 s
        holding.sendall(blocker)
        time.sleep(0.2)
        with connect(server) as leaving:  # queued behind it, then gone
            leaving.sendall(blocker)
            time.sleep(0.2)
        assert read_response(holding).status == 200
    deadline = time.monotonic() + 5
    while _metric_or_zero(server, "lockgate_requests_total", labels) < before + 1:
        assert time.monotonic() < deadline, "the request left behind was not cancelled"
        time.sleep(0.1)


def _metric_or_zero(server: RunningServer, name: str, labels: str) -> float:
    try:
        return server.metric(name, labels)
    except AssertionError:
        return 0.0


def test_access_log_keeps_requests_on_the_asgi_path(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each request leaves a line in the access log, which the ASGI path writes: the lane is
    closed while it is on."""
    repo = models_of(test_repo, tmp_path_factory.mktemp("lane-log-repo"), "digits_onnx")
    server = start_server(repo, tmp_path_factory.mktemp("lane-log"), "--no-llm", "--access-log")
    try:
        read_ok(server, *CASES["ok"])
        assert lane_count(server) == 0
        assert '"path":"/v2/models/digits_onnx/infer"' in server.log().replace(" ", "")
    finally:
        server.stop()


def test_a_kept_alive_connection_closes_after_the_idle_timeout_not_before(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The keep-alive timeout counts from the last answer: a request within it keeps the
    connection open past the first answer's timeout; idle for the whole of it, it closes."""
    repo = models_of(test_repo, tmp_path_factory.mktemp("lane-idle-repo"), "digits_onnx")
    tmp = tmp_path_factory.mktemp("lane-idle")
    server = start_server(repo, tmp, "--no-llm", "--keep-alive-timeout", "1")
    try:
        with connect(server) as sock:
            for row, pause in enumerate((0.0, 0.6, 0.7)):  # past 1 s from the first answer
                time.sleep(pause)
                send(sock, b"".join(head_and_body(INFER, digits_body(row), LONG)))
                assert read_response(sock).status == 200
            idle = time.monotonic()
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
            waited = time.monotonic() - idle
            assert 0.9 <= waited < 3.0, f"closed after {waited:.2f} s idle"
        assert lane_count(server) == 3
    finally:
        server.stop()
