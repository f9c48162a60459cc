"""Slow and saturating clients through a real server: partial heads, connection caps, and
refusal before the body is read when the event loop falls behind. Health probes answer
throughout."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, digits_rows, models_of, start_server
from tests.frontend.test_hostile_input import exchange, read_response, request_bytes

HEAD_TIMEOUT = 1.5
PARTIAL = b"POST /v2/models/digits_onnx/infer HTTP/1.1\r\nHost: t\r\nContent-Le"
# each case: the peak RSS of its server grows less than RSS_GROWTH_BOUND_MIB
pytestmark = pytest.mark.usefixtures("bounded_rss")


@pytest.fixture(scope="module")
def digits_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_onnx alone: the only model these tests send to."""
    return models_of(demo_repo, tmp_path_factory.mktemp("digits-repo"), "digits_onnx")


@pytest.fixture(scope="module")
def gated(digits_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        digits_repo,
        tmp_path_factory.mktemp("gated"),
        "--no-llm",
        "--head-timeout",
        str(HEAD_TIMEOUT),
        "--max-connections-per-client",
        "1100",
        "--max-loop-lag-ms",
        "10",
        "--queue-target-ms",
        "5",
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def saturable(
    digits_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A short body timeout, so a request the gate lets through is answered soon (408)."""
    running = start_server(
        digits_repo,
        tmp_path_factory.mktemp("saturable"),
        "--no-llm",
        "--body-timeout",
        "1",
        "--max-loop-lag-ms",
        "5",
    )
    yield running
    running.stop()


def probe_ms(server: RunningServer) -> float:
    started = time.monotonic()
    response = exchange(server, request_bytes("GET", "/v2/health/live"))
    assert response.status == 200
    return (time.monotonic() - started) * 1000


def infer_digits(server: RunningServer) -> httpx.Response:
    x = digits_rows(1)
    body = {
        "inputs": [
            {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    return httpx.post(server.url + "/v2/models/digits_onnx/infer", json=body, timeout=30)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closes the connection (or answers and closes) within `within` s."""
    sock.settimeout(within)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


RSS_BOUND_MIB = 64  # growth allowed while a thousand partial heads are held


def test_a_thousand_partial_heads_leave_probes_and_requests_served(gated: RunningServer) -> None:
    holders = []
    before = rss_mib(gated.process.pid)
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", gated.port), timeout=10)
            sock.sendall(PARTIAL)
            holders.append(sock)
        latencies = [probe_ms(gated) for _ in range(30)]
        grown = rss_mib(gated.process.pid) - before
        assert grown < RSS_BOUND_MIB, f"RSS grew {grown:.1f} MiB for 1,000 partial heads"
        # served, not stuck behind them (a loaded machine may delay one probe, not the rest)
        assert statistics.median(latencies) < 50 and max(latencies) < 1000, latencies
        assert infer_digits(gated).status_code == 200
        # past the head timeout the server has closed every one of them
        deadline = time.monotonic() + HEAD_TIMEOUT + 10
        for sock in holders:
            assert closed_by_server(sock, max(0.1, deadline - time.monotonic()))
    finally:
        for sock in holders:
            sock.close()
    assert infer_digits(gated).status_code == 200


def test_a_stalled_head_gets_408_and_an_idle_connection_is_closed(gated: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", gated.port), timeout=10) as sock:
        sock.sendall(PARTIAL)
        response = read_response(sock)
        assert response.status == 408 and "head" in response.error()
    with socket.create_connection(("127.0.0.1", gated.port), timeout=10) as idle:
        started = time.monotonic()
        assert closed_by_server(idle, HEAD_TIMEOUT + 10)  # never sent a byte
        assert time.monotonic() - started >= HEAD_TIMEOUT * 0.9


def test_connections_past_the_per_client_cap_are_closed(digits_repo: Path, tmp_path: Path) -> None:
    server = start_server(digits_repo, tmp_path, "--no-llm", "--max-connections-per-client", "20")
    holders = []
    try:
        holders = [
            socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)
        ]
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        assert closed_by_server(extra, 5)
        extra.close()
        for sock in holders:
            sock.close()
        holders = []
        time.sleep(0.3)
        assert probe_ms(server) < 1000
        assert "client_connections" in httpx.get(server.url + "/metrics").text
    finally:
        for sock in holders:
            sock.close()
        server.stop()


def heavy_body() -> bytes:
    """A body the loop spends tens of milliseconds parsing before it refuses it (400): data
    the model would refuse is never decoded, but tens of thousands of inputs are parsed."""
    inputs = [
        {"name": f"x{i}", "shape": [1], "datatype": "FP32", "data": [0.5]} for i in range(60_000)
    ]
    return json.dumps({"inputs": inputs}).encode()


def test_a_saturated_loop_refuses_before_the_body_and_keeps_answering_probes(
    saturable: RunningServer,
) -> None:
    """Threads keep the loop busy decoding large bodies; a request whose body has not all
    arrived is answered 503 with Retry-After and its connection closed, its body unread.

    The request gives itself a long `Request-Timeout`: with the model's 50 ms SLO, the
    model's admission may refuse it first (also before the body) for the loop work queued
    ahead of it, and this test is about the loop's own signal."""
    body = heavy_body()
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.post(saturable.url + "/v2/models/digits_onnx/infer", content=body)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for thread in threads:
        thread.start()
    refused = None
    try:
        time.sleep(1.0)
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", saturable.port), timeout=30) as sock:
                sock.sendall(
                    b"POST /v2/models/digits_onnx/infer HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Type: application/json\r\nRequest-Timeout: 60\r\n"
                    b"Content-Length: 1000000\r\n\r\n{"
                )
                response = read_response(sock)
                if response.status == 503:
                    refused = response
                    assert closed_by_server(sock, 5)  # the rest of the body is never awaited
                    break
                assert response.status in (400, 408), response.status
            time.sleep(0.05)
        assert refused is not None, "the loop never looked saturated"
        assert int(refused.headers["retry-after"]) >= 1
        assert "saturated" in refused.error()
        assert probe_ms(saturable) < 1000
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    metrics = httpx.get(saturable.url + "/metrics").text
    assert 'lockgate_http_refused_total{reason="loop_lag"}' in metrics


def test_light_load_is_never_refused(gated: RunningServer) -> None:
    time.sleep(0.5)  # after the flood above: the loop's average lag settles
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.1] * 64}]}
    refusals = []
    with httpx.Client(timeout=30) as client:
        for _ in range(300):
            r = client.post(gated.url + "/v2/models/digits_onnx/infer", json=body)
            if r.status_code != 200:
                refusals.append((r.status_code, r.text))
    assert not refusals


def test_bodies_held_half_sent_do_not_make_arrivals_look_late(gated: RunningServer) -> None:
    """Requests let through and waiting for the rest of their body (lane and chunked alike)
    put no work ahead of a new request on the event loop: admission does not count them, and
    requests sent meanwhile are served, not refused as if they would miss the model's SLO."""
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.1] * 64}]}
    holders = []
    with httpx.Client(timeout=30) as client:
        for _ in range(100):  # the loop's cost per request is measured
            assert client.post(gated.url + "/v2/models/digits_onnx/infer", json=body).is_success
        head = "POST /v2/models/digits_onnx/infer HTTP/1.1\r\nHost: t\r\n"
        try:
            for index in range(280):
                sock = socket.create_connection(("127.0.0.1", gated.port), timeout=10)
                if index % 4:  # the lane: head and a part of the body in one read
                    sock.sendall(f'{head}Content-Length: 1000\r\n\r\n{{"inputs":'.encode())
                else:  # ASGI: a chunked body, one chunk sent
                    sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n".encode())
                holders.append(sock)
            time.sleep(0.2)  # every one of them let through
            statuses = [
                client.post(gated.url + "/v2/models/digits_onnx/infer", json=body).status_code
                for _ in range(50)
            ]
        finally:
            for sock in holders:
                sock.close()
    assert statuses.count(200) == 50, statuses
