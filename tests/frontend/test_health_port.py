"""`--health-port`: probes answered from a thread of their own, through a real server, and
the state they report (the loop's heartbeat and readiness)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lockgate.frontend.health_port import HealthState
from tests.conftest import RunningServer, free_port, start_server
from tests.frontend.test_arrival_refusal import FREE_CONFIG, SLEEPER


def _repository(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "free" / "1").mkdir(parents=True)
    (repo / "free" / "1" / "model.py").write_text(SLEEPER)
    (repo / "free" / "config.yaml").write_text(FREE_CONFIG)
    return repo


def test_probes_on_the_health_port(tmp_path: Path) -> None:
    port = free_port()
    server = start_server(_repository(tmp_path), tmp_path, "--no-llm", "--health-port", str(port))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            live = client.get("/v2/health/live")
            assert live.status_code == 200 and live.json() == {"live": True}
            assert client.get("/health").status_code == 200
            # readiness there is the loop's, recomputed every 0.1 s: it follows the main port's
            deadline = time.monotonic() + 5.0
            ready = client.get("/v2/health/ready")
            while ready.status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
                ready = client.get("/v2/health/ready")
            assert ready.status_code == 200 and ready.json() == {"ready": True}
            head = client.head("/v2/health/ready")
            assert head.status_code == 200 and head.content == b""
            post = client.post("/v2/health/live", content=b"{}")
            assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
            assert "POST" in post.json()["error"]
            other = client.get("/v2/models/free/infer")  # only probes are served here
            assert other.status_code == 404 and "health port" in other.json()["error"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"nonsense\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")
        # the main port answers as before
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200
        main_port_probes(server)
    finally:
        assert server.stop() == 0


def probe_answer(server: RunningServer, request: bytes) -> tuple[bytes, bytes]:
    """(head, body) of the answer to a raw `request` that closes its connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def main_port_probes(server: RunningServer) -> None:
    """Probes on the main port: closing their connection (the kubelet's), answered by the
    accepting thread; kept alive, by the protocol; both as the routes answer them, and
    counted in the latency histogram."""
    labels = 'route="health",status="200"'
    before = server.metric("lockgate_http_request_duration_seconds_count", labels)
    for method, path, body in (
        ("GET", "/v2/health/ready", b'{"ready":true}'),
        ("HEAD", "/v2/health/ready", b""),
        ("GET", "/v2/health/live", b'{"live":true}'),
        ("GET", "/health", b'{"live":true}'),
    ):
        request = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        head, answer = probe_answer(server, request.encode())
        assert head.startswith(b"HTTP/1.1 200 ") and answer == body, (method, path, head)
        length = b"content-length: %d" % (len(body) if body else len(b'{"ready":true}'))
        assert length in head.lower(), head
    with httpx.Client(base_url=server.url, timeout=5) as client:  # kept alive
        for _ in range(3):
            live = client.get("/v2/health/live")
            assert live.json() == {"live": True} and live.headers["x-request-id"]
        head = client.head("/v2/health/ready")
        assert head.status_code == 200 and head.content == b""
        assert client.post("/v2/health/live", content=b"{}").status_code == 405
    deadline = time.monotonic() + 5.0  # the thread's answers are counted on the loop
    while server.metric("lockgate_http_request_duration_seconds_count", labels) < before + 8:
        assert time.monotonic() < deadline, "probes not counted"
        time.sleep(0.05)


def _serve(tmp: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "lockgate.cli", "serve", str(_repository(tmp)), *flags]


def test_health_port_is_for_one_process(tmp_path: Path) -> None:
    done = subprocess.run(
        _serve(tmp_path, "--replicas", "2", "--health-port", "0", "--no-llm"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--health-port serves one process" in done.stderr


def test_liveness_follows_the_loop_and_readiness_the_server() -> None:
    state = HealthState(stale_s=2.0)
    assert state.answer("GET", "/v2/health/live", 100.0)[0] == 503  # no heartbeat yet
    reasons = iter(["loading models", None, "draining"])
    state.refresh(100.0, lambda: next(reasons))
    assert state.answer("GET", "/v2/health/live", 100.5) == (200, b'{"live":true}')
    status, body = state.answer("GET", "/v2/health/ready", 100.5)
    assert status == 503 and b"loading models" in body
    state.refresh(100.05, lambda: next(reasons))  # within 0.1 s: readiness not recomputed
    assert state.answer("GET", "/v2/health/ready", 100.1)[0] == 503
    state.refresh(100.2, lambda: next(reasons))
    assert state.answer("GET", "/v2/health/ready", 100.2) == (200, b'{"ready":true}')
    state.refresh(100.4, lambda: next(reasons))
    status, body = state.answer("HEAD", "/v2/health/ready", 100.4)
    assert status == 503 and b"draining" in body
    assert state.answer("GET", "/v2/health/live", 100.4)[0] == 200  # draining, still live
    status, body = state.answer("GET", "/v2/health/live", 103.0)  # 2.6 s without a beat
    assert status == 503 and b"event loop stalled" in body
    assert state.answer("GET", "/v2/health/ready", 103.0)[0] == 503
    assert state.answer("GET", "/metrics", 100.4)[0] == 404
    assert state.answer("DELETE", "/health", 100.4)[0] == 405


@pytest.mark.parametrize("stale", ["0", "-1"])
def test_stale_bound_is_checked(tmp_path: Path, stale: str) -> None:
    done = subprocess.run(
        _serve(tmp_path, "--health-stale-s", stale, "--no-llm"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--health-stale-s must be > 0" in done.stderr
