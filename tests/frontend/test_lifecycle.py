"""Server lifecycle through a real process: hot unload and load, and the drain on SIGTERM."""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server

DRAIN = 20.0
ECHO = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def slow_body(delay: float) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [delay]},
        ]
    }


@pytest.fixture(scope="module")
def small_repo(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the python test models: the server starts in a few seconds."""
    repo = tmp_path_factory.mktemp("lifecycle-repo")
    for name in ("echo", "slow"):
        shutil.copytree(test_repo / name, repo / name)
    return repo


def start(repo: Path, tmp_path_factory: pytest.TempPathFactory, drain: float) -> RunningServer:
    tmp = tmp_path_factory.mktemp("lifecycle-server")
    return start_server(
        repo,
        tmp,
        "--no-llm",
        "--drain-timeout",
        str(drain),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )


def post_slow(url: str, delay: float) -> int:
    try:
        return httpx.post(
            url + "/v2/models/slow/infer", json=slow_body(delay), timeout=60
        ).status_code
    except httpx.TransportError:
        return -1


def wait_in_flight(server: RunningServer, model: str, count: int, timeout: float = 10.0) -> None:
    """Wait until `count` requests to `model` are admitted, as /metrics reports."""
    pattern = re.compile(rf'lockgate_inflight_requests\{{[^}}]*model="{model}"[^}}]*\}} (\S+)')
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(httpx.get(server.url + "/metrics").text)
        if match is not None and float(match.group(1)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests to {model} were not in flight within {timeout} s")


@pytest.fixture(scope="module")
def server(small_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Serves the hot-reload test, then the SIGTERM test stops it."""
    running = start(small_repo, tmp_path_factory, drain=DRAIN)
    yield running
    running.stop()


def test_unload_then_load(server: RunningServer) -> None:
    infer = server.url + "/v2/models/echo/infer"
    assert httpx.post(infer, json=ECHO).status_code == 200
    r = httpx.post(server.url + "/v2/repository/models/echo/unload")
    assert r.status_code == 200, r.text
    assert httpx.post(infer, json=ECHO).status_code in (404, 503)
    assert httpx.get(server.url + "/v2/models/echo/ready").status_code in (404, 503)
    assert httpx.post(server.url + "/v2/models/slow/infer", json=slow_body(0)).status_code == 200
    # a model of the repository that is not loaded: nothing to do, as in Triton
    assert httpx.post(server.url + "/v2/repository/models/echo/unload").status_code == 200
    assert httpx.post(server.url + "/v2/repository/models/nosuch/unload").status_code == 404
    r = httpx.post(server.url + "/v2/repository/models/echo/load", timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/v2/models/echo/ready").status_code == 200
    r = httpx.post(infer, json=ECHO)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    r = httpx.post(server.url + "/v2/repository/models/slow/load", timeout=60)  # reload
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/v2/models/slow/infer", json=slow_body(0)).status_code == 200


def test_reload_under_traffic_loses_nothing(server: RunningServer) -> None:
    """While echo reloads, the loaded version serves: every request of a steady stream gets 200."""
    infer = server.url + "/v2/models/echo/infer"
    stop = time.monotonic() + 60

    def stream() -> list[int]:
        statuses = []
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < stop and len(statuses) < 400:
                statuses.append(client.post(infer, json=ECHO).status_code)
        return statuses

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream) for _ in range(2)]
        time.sleep(0.2)
        for _ in range(3):
            r = httpx.post(server.url + "/v2/repository/models/echo/load", timeout=60)
            assert r.status_code == 200, r.text
        statuses = [s for f in streams for s in f.result()]
    assert statuses and set(statuses) == {200}, sorted(set(statuses))


def test_failed_reload_keeps_the_loaded_version_serving(
    server: RunningServer, small_repo: Path
) -> None:
    config = small_repo / "echo" / "config.yaml"
    good = config.read_text()
    config.write_text(good.replace("max_batch_size:", "max_batch_size: -7\nx_max_batch_size:"))
    try:
        r = httpx.post(server.url + "/v2/repository/models/echo/load", timeout=60)
    finally:
        config.write_text(good)
    assert r.status_code == 400, r.text
    assert "failed to load" in r.json()["error"]
    assert httpx.get(server.url + "/v2/models/echo/ready").status_code == 200
    assert server.metric("lockgate_model_ready", 'model="echo",version="1"') == 1
    r = httpx.post(server.url + "/v2/models/echo/infer", json=ECHO)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]


def test_reload_with_a_broken_new_version_keeps_the_loaded_ones(
    server: RunningServer, small_repo: Path
) -> None:
    """A new version that fails to load fails the reload (400 naming it, as Triton), and the
    loaded versions serve on, its good siblings included."""
    folder = small_repo / "echo"
    config = folder / "config.yaml"
    good = config.read_text()
    config.write_text(good + "version_policy: {all: {}}\n")
    shutil.copytree(folder / "1", folder / "2")
    (folder / "3").mkdir()
    (folder / "3" / "model.py").write_text("raise ImportError('a broken version')\n")
    try:
        r = httpx.post(server.url + "/v2/repository/models/echo/load", timeout=60)
    finally:
        config.write_text(good)
        shutil.rmtree(folder / "2")
        shutil.rmtree(folder / "3")
    assert r.status_code == 400, r.text
    assert "version 3" in r.json()["error"] and "a broken version" in r.json()["error"]
    assert httpx.get(server.url + "/v2/models/echo").json()["versions"] == ["1"]
    assert server.metric("lockgate_model_ready", 'model="echo",version="1"') == 1
    r = httpx.post(server.url + "/v2/models/echo/versions/1/infer", json=ECHO)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]


def test_sigterm_drains_in_flight_requests(server: RunningServer) -> None:
    """In-flight requests finish with 200; meanwhile readiness and new requests get 503."""
    drain = DRAIN
    pool = concurrent.futures.ThreadPoolExecutor(3)
    try:
        client = httpx.Client(base_url=server.url, timeout=10)
        assert client.get("/v2/health/ready").status_code == 200  # a kept-alive connection
        in_flight = [pool.submit(post_slow, server.url, 1.5) for _ in range(3)]
        wait_in_flight(server, "slow", 3)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        ready = client.get("/v2/health/ready")
        assert ready.status_code == 503
        assert ready.json()["error"] == "draining"
        assert client.get("/v2/health/live").status_code == 200
        new = client.post("/v2/models/echo/infer", json=ECHO)
        assert new.status_code == 503
        assert new.json()["error"]
        assert [f.result(timeout=30) for f in in_flight] == [200, 200, 200]
        code = server.process.wait(timeout=drain + 5)
        assert code == 0
        assert time.monotonic() - signalled < drain
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/v2/health/live", timeout=2)
        assert "lockgate stopped" in server.log()
    finally:
        pool.shutdown(wait=False)
        server.stop()


def test_drain_is_bounded_when_a_request_hangs(
    small_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    drain = 2.0
    server = start(small_repo, tmp_path_factory, drain=drain)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        stuck = pool.submit(post_slow, server.url, 30.0)
        wait_in_flight(server, "slow", 1)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = server.process.wait(timeout=drain + 10)
        assert time.monotonic() - signalled < drain + 5
        assert code == 0
        assert stuck.result(timeout=10) != 200
        assert "drain timed out" in server.log()
    finally:
        pool.shutdown(wait=False)
        server.stop()


def test_second_signal_stops_the_drain(
    small_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start(small_repo, tmp_path_factory, drain=30)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        stuck = pool.submit(post_slow, server.url, 20.0)
        wait_in_flight(server, "slow", 1)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.process.poll() is None  # draining
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.process.wait(timeout=15) == 0
        assert time.monotonic() - signalled < 5
        assert stuck.result(timeout=10) != 200
    finally:
        pool.shutdown(wait=False)
        server.stop()


def test_a_taken_port_stops_startup_at_once(demo_repo: Path) -> None:
    """The HTTP port is bound before anything else starts: taken, start-up ends with exit
    status 1 and says why. (Left to uvicorn, the bind failed once the gRPC server and the
    models' threads had started, and the process never exited.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "lockgate.cli", "serve", str(demo_repo), "--no-llm"]
        command += ["--port", str(port), "--grpc-port", "off"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot listen" in done.stderr and "in use" in done.stderr
