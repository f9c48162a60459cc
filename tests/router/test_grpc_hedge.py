"""Hedged ModelInfer on the router's gRPC front, through tritonclient.grpc: replica 0 stalls,
replica 1 answers at once."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.router.grpc_model import model_of
from tests.conftest import RunningServer, free_port, launch_server, start_servers
from tests.router.test_grpc_proxy import start_grpc_router, x_input
from tests.router.test_router import metric, repository

STALL_S = 1.5


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    """Replica 0's `who` stalls 1.5 s on every call of values >= 1000; replica 1's never."""
    root = tmp_path_factory.mktemp("grpc-hedge-replicas")
    stall = {"stall_every": "1", "stall": str(STALL_S)}
    servers = start_servers(
        *(
            launch_server(
                repository(root, i, **(stall if i == 0 else {})), root, grpc_port=free_port()
            )
            for i in range(2)
        )
    )
    yield servers
    for server in servers:
        server.stop()


def infer(client: grpcclient.InferenceServerClient, model: str, value: float) -> int:
    """The replica that answered."""
    result = client.infer(model, x_input(value), client_timeout=30)
    np.testing.assert_array_equal(result.as_numpy("y"), [[value, 1.0]])
    return int(result.as_numpy("replica")[0, 0])


def hedges(url: str, winner: str) -> float:
    return metric(url, f'lockgate_router_hedges_total{{winner="{winner}"}}')


def test_model_infer_is_hedged_after_the_models_p95_and_the_fast_copy_wins(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the default policy: after the model's observed 95th percentile latency
    front = start_grpc_router(
        tmp_path_factory.mktemp("grpc-hedge"), replicas, "--hedge-budget", "1"
    )
    try:
        client = front.client()
        for _ in range(30):  # values below 1000 never stall: `who`'s p95 is a few ms
            infer(client, "who", 1.0)
        before = hedges(front.router.url, "second")
        took = []
        for _ in range(12):
            started = time.monotonic()
            assert infer(client, "who", 1000.0) == 1  # replica 1's answer, never the stalled one
            took.append(time.monotonic() - started)
        second = hedges(front.router.url, "second") - before
    finally:
        front.router.stop()
    assert max(took) < STALL_S / 2, took
    # each call that went to replica 0 first was answered by its second copy
    assert second >= 1


def test_a_stream_is_never_hedged(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # every call not answered in 50 ms is hedged; `slow` takes 300 ms on each replica
    tmp = tmp_path_factory.mktemp("grpc-hedge-stream")
    front = start_grpc_router(tmp, replicas, "--hedge-delay-ms", "50", "--hedge-budget", "1")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        client = front.client()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            got = []
            for i in range(3):  # one at a time: `slow` queues one request at most
                client.async_stream_infer("slow", x_input(), request_id=f"s{i}")
                got.append(answers.get(timeout=30))
        finally:
            client.stop_stream()
        streamed = metric(front.router.url, "lockgate_router_hedges_total")
        infer(client, "slow", 1.0)  # unary: the model's first answer says it is no LLM
        infer(client, "slow", 1000.0)  # the same call, unary: hedged
        unary = metric(front.router.url, "lockgate_router_hedges_total")
    finally:
        front.router.stop()
    assert [error for _, error in got] == [None] * 3
    assert len({int(r.as_numpy("replica")[0, 0]) for r, _ in got}) == 1
    assert streamed == 0
    assert unary == 1


def test_the_model_is_read_off_the_requests_bytes() -> None:
    request = pb.ModelInferRequest(model_name="who", model_version="2", id="r1")
    request.parameters["priority"].int64_param = 1
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.ones(2, dtype=np.float32).tobytes())
    message = request.SerializeToString()
    assert model_of(message) == "who"
    # field order is the serializer's: the model found after other fields too
    assert model_of(message[message.index(b"\x12") :] + message[: message.index(b"\x12")]) == "who"
    assert model_of(pb.ModelInferRequest(id="r1").SerializeToString()) is None
    assert model_of(message[:3]) is None  # cut short
    assert model_of(b"\xff" * 12) is None  # not a message
