"""The router's gRPC front (`lockgate route --grpc-port`) in front of three real replicas, driven
by Triton's own client (tritonclient.grpc)."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.router.grpc_proxy import SERVICE, ReplicaGrpcPort
from tests.conftest import RunningServer, free_port, launch_server, start_servers
from tests.router.test_router import metric, repository, start_router


class GrpcRouter:
    """A router with its gRPC front, and the replicas behind it."""

    def __init__(self, router: RunningServer, grpc_port: int) -> None:
        self.router = router
        self.address = f"127.0.0.1:{grpc_port}"

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.address)


def start_grpc_router(tmp: Path, replicas: list[RunningServer], *extra: str) -> GrpcRouter:
    port = free_port()
    args = [a for r in replicas for a in ("--replica", f"{r.url}?grpc={r.grpc_port}")]
    router = start_router(tmp, *args, "--grpc-port", str(port), *extra)
    return GrpcRouter(router, port)


ECHO = """
class Model:
    def load(self, config, version_dir):
        pass

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


def with_echo(repo: Path) -> Path:
    """`repo` plus `echo`: y = x for x of any length, to send large messages."""
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "1" / "model.py").write_text(ECHO)
    (repo / "echo" / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 0\n"
        "inputs: [{name: x, datatype: FP32, dims: [-1]}]\n"
        "outputs: [{name: y, datatype: FP32, dims: [-1]}]\n"
    )
    return repo


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("grpc-replicas")
    servers = start_servers(
        *(
            launch_server(with_echo(repository(root, i)), root, grpc_port=free_port())
            for i in range(3)
        )
    )
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def front(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcRouter]:
    tmp = tmp_path_factory.mktemp("grpc-router")
    running = start_grpc_router(tmp, replicas, "--no-hedge", "--probe-interval", "0.2")
    yield running
    running.router.stop()


def x_input(value: float = 1000.0) -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[value, 1.0]], dtype=np.float32))
    return [x]


def who(client: grpcclient.InferenceServerClient, model: str = "who") -> int:
    result = client.infer(model, x_input(), client_timeout=30)
    np.testing.assert_array_equal(result.as_numpy("y"), [[1000.0, 1.0]])
    return int(result.as_numpy("replica")[0, 0])


def test_infer_is_balanced_over_the_replicas(front: GrpcRouter) -> None:
    client = front.client()
    answered = Counter(who(client) for _ in range(90))
    assert set(answered) == {0, 1, 2}, answered
    attempts = metric(front.router.url, "lockgate_router_attempts_total")
    assert attempts >= 90  # the router's own books count gRPC calls too


def test_metadata_health_and_repository_pass_through(front: GrpcRouter) -> None:
    client = front.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("who")
    meta = client.get_model_metadata("who", as_json=True)
    assert meta["name"] == "who" and [i["name"] for i in meta["inputs"]] == ["x"]
    config = client.get_model_config("who", as_json=True)["config"]
    assert config["max_batch_size"] == 8
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in index} == {"who", "slow", "echo"}
    stats = client.get_inference_statistics("who", as_json=True)["model_stats"]
    assert stats[0]["name"] == "who"
    with grpc.insecure_channel(front.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
        assert health.Check(health_pb2.HealthCheckRequest(service="who")).status == serving
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_log_and_trace_settings_are_refused_as_each_replicas_own(front: GrpcRouter) -> None:
    http = httpclient.InferenceServerClient(front.router.address)
    with pytest.raises(InferenceServerException, match="belong to each replica"):
        http.update_log_settings({"log_verbose_level": 1})
    with pytest.raises(InferenceServerException, match="belong to each replica"):
        http.get_trace_settings("who")
    for path in ("/v2/logging", "/v2/trace/setting", "/v2/models/who/trace/setting"):
        answer = httpx.post(front.router.url + path, json={})
        assert answer.status_code == 501 and "each replica" in answer.json()["error"]
    client = front.client()
    for call in (client.get_log_settings, client.get_trace_settings):
        with pytest.raises(InferenceServerException, match="belong to each replica") as caught:
            call()
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert client.get_model_metadata("who")  # the replicas' other methods still pass


def test_the_replicas_errors_pass_through(front: GrpcRouter) -> None:
    client = front.client()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", x_input())
    assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)
    assert "unknown model 'nope'" in (caught.value.message() or "")
    bad = grpcclient.InferInput("x", [1, 3], "FP32")
    bad.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("who", [bad])
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    # answers the replicas gave are not retried: the retry counter did not move
    assert metric(front.router.url, "lockgate_router_retries_total") == 0
    timed = [
        line
        for line in httpx.get(front.router.url + "/metrics").text.splitlines()
        if line.startswith("lockgate_router_grpc_request_duration_seconds_count")
        and 'method="ModelInfer"' in line
        and 'code="NOT_FOUND"' in line
    ]
    assert timed and float(timed[0].rsplit(" ", 1)[1]) >= 1, timed


def test_a_stream_is_pinned_to_one_replica(front: GrpcRouter) -> None:
    client = front.client()
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(12):
            client.async_stream_infer("who", x_input(), request_id=f"s{i}")
        client.async_stream_infer("nope", x_input(), request_id="bad")
        got = [answers.get(timeout=30) for _ in range(13)]
    finally:
        client.stop_stream()
    errors = [error.message() for _, error in got if error is not None]
    assert len(errors) == 1 and "unknown model 'nope'" in errors[0], errors
    results = [result for result, error in got if error is None]
    assert sorted(r.get_response().id for r in results) == sorted(f"s{i}" for i in range(12))
    served_by = {int(r.as_numpy("replica")[0, 0]) for r in results}
    assert len(served_by) == 1, served_by  # one replica: never spread, retried or hedged


def test_a_stream_whose_client_never_reads_is_held_back(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("grpc-window")
    one = start_grpc_router(tmp, replicas[:1], "--grpc-max-stream-inflight", "2")
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[65536])
    request.raw_input_contents.append(np.ones(65536, dtype=np.float32).tobytes())  # 256 KiB
    message = request.SerializeToString()

    def answered() -> float:
        text = httpx.get(replicas[0].url + "/metrics").text
        name = 'lockgate_grpc_request_duration_seconds_count{code="OK",method="ModelStreamInfer"}'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if name in line)

    async def write_and_never_read() -> int:
        # (no BDP probe: the client's windows stay at their default, and so do its buffers)
        options = [("grpc.max_receive_message_length", -1), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(one.address, options=options) as channel:
            call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")()
            written = 0
            try:
                while written < 200:
                    await asyncio.wait_for(call.write(message), 1.0)
                    written += 1
            except TimeoutError:
                pass  # held back: the write waits for the router to read on
            await asyncio.sleep(0.5)
            call.cancel()
            return written

    before = answered()
    try:
        written = asyncio.run(write_and_never_read())
        served = answered() - before
    finally:
        one.router.stop()
    assert written < 200  # backpressure reached the client
    # at most 2 unanswered on the replica, plus what HTTP/2 windows hold (about 16 messages
    # of 256 KiB here); without the router's bound the replica answers its own 64 and more
    assert 0 < served <= 2 + 32, (written, served)


def test_the_deadline_is_passed_on(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    one = start_grpc_router(tmp_path_factory.mktemp("grpc-deadline"), replicas[:1])
    replica = replicas[0]

    def outcomes() -> dict[str, float]:
        text = httpx.get(replica.url + "/metrics").text
        counted: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("lockgate_requests_total{") and 'model="slow"' in line:
                outcome = line.split('outcome="')[1].split('"')[0]
                counted[outcome] += float(line.rsplit(" ", 1)[1])
        return counted

    def running() -> float:
        text = httpx.get(replica.url + "/metrics").text
        name = 'lockgate_inflight_requests{model="slow"'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if name in line)

    try:
        client = one.client()
        for _ in range(2):  # the replica measures what `slow` costs (its warmup never sleeps)
            client.infer("slow", x_input(), client_timeout=30)
        before = outcomes()
        for _ in range(2):
            busy = threading.Thread(target=client.infer, args=("slow", x_input()))
            busy.start()  # the slow model runs 300 ms and queues one request at most
            waited = time.monotonic() + 5
            while running() < 1 and time.monotonic() < waited:
                time.sleep(0.01)  # the busy call has reached the replica
            with pytest.raises(InferenceServerException) as caught:
                client.infer("slow", x_input(), client_timeout=0.1)
            status = caught.value.status()
            assert status in (str(grpc.StatusCode.DEADLINE_EXCEEDED), "StatusCode.UNAVAILABLE")
            busy.join()
        time.sleep(0.3)
        after = outcomes()
    finally:
        one.router.stop()
    counted = {name: after[name] - before.get(name, 0) for name in after}
    # the replica knew the deadline: it refused or expired the request itself at least once
    # (without the deadline it would only have seen the router cancel the call)
    assert counted.get("deadline_exceeded", 0) + counted.get("unavailable", 0) >= 1, counted


def test_replica_grpc_ports() -> None:
    assert ReplicaGrpcPort.parse("+1").target("http://10.0.0.5:8000") == "10.0.0.5:8001"
    assert ReplicaGrpcPort.parse("9000").target("http://10.0.0.5:8000") == "10.0.0.5:9000"
    own = ReplicaGrpcPort.parse("+1", ["http://127.0.0.1:8101?grpc=9101"])
    assert own.target("http://127.0.0.1:8101") == "127.0.0.1:9101"
    assert own.target("http://127.0.0.1:8102") == "127.0.0.1:8103"
    assert ReplicaGrpcPort.parse("+1").target("http://[::1]:8000") == "[::1]:8001"
    for bad in ("x", "70000", "0"):
        with pytest.raises(ValueError):
            ReplicaGrpcPort.parse(bad)
    with pytest.raises(ValueError, match="grpc="):
        ReplicaGrpcPort.parse("+1", ["http://127.0.0.1:8101?grpc=x"])


# last in the module: it kills one of the module's replicas
def test_a_killed_replicas_calls_go_to_the_others(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    codes: Counter[str] = Counter()
    stop = time.monotonic() + 3.0

    def worker() -> None:
        client = front.client()
        while time.monotonic() < stop:
            try:
                who(client)
                codes["OK"] += 1
            except InferenceServerException as exc:
                codes[str(exc.status())] += 1

    before = metric(front.router.url, "lockgate_router_retries_total")
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(replicas[1].process.pid, signal.SIGKILL)
    for t in threads:
        t.join()
    retries = metric(front.router.url, "lockgate_router_retries_total") - before
    answered = sum(codes.values())
    assert set(codes) == {"OK"}, codes  # every call answered by a replica still alive
    assert 0 < retries <= 0.1 * answered + 10  # the calls in flight went elsewhere, in budget
    listed = httpx.get(front.router.url + "/router/replicas").json()["replicas"]
    dead = [r for r in listed if r["url"] == replicas[1].url]
    assert dead and not dead[0]["usable"]


def test_server_ready_with_no_ready_replica_is_false(tmp_path: Path) -> None:
    """As REST's readiness answers 503: tritonclient's is_server_ready() is False, not an
    error (the usual polling loop raised)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "lockgate.cli", "route", "--port", str(port)]
    command += ["--grpc-port", str(grpc_port), "--replica", f"http://127.0.0.1:{free_port()}"]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + 20
        while True:
            try:
                live = client.is_server_live()
                break
            except InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert live is True  # the router's own liveness
        assert client.is_server_ready() is False
    finally:
        process.terminate()
        process.wait(10)
