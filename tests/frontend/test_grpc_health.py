"""The gRPC health service through a real server and grpcio's own health stub: the server and
each model report their readiness, an unload flips the model, Watch streams the change."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import RunningServer, free_port, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def health_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("health-repo")
    for name in ("echo", "slow"):
        shutil.copytree(test_repo / name, repo / name)
    server = start_server(
        repo,
        tmp_path_factory.mktemp("health"),
        "--no-llm",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        grpc_port=free_port(),
    )
    yield server
    server.stop()


@pytest.fixture()
def stub(health_server: RunningServer) -> Iterator[health_pb2_grpc.HealthStub]:
    with grpc.insecure_channel(health_server.grpc_address) as channel:
        yield health_pb2_grpc.HealthStub(channel)


def check(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return int(stub.Check(request, timeout=10).status)


def test_the_server_and_each_model_are_serving(stub: health_pb2_grpc.HealthStub) -> None:
    assert check(stub, "") == SERVING
    assert check(stub, "echo") == SERVING
    assert check(stub, "slow") == SERVING


def test_an_unknown_service_is_not_found(stub: health_pb2_grpc.HealthStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        check(stub, "no-such-model")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_unload_flips_the_model_and_watch_sees_it(
    stub: health_pb2_grpc.HealthStub, health_server: RunningServer
) -> None:
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="slow"), timeout=30)
    assert next(watch).status == SERVING
    r = httpx.post(health_server.url + "/v2/repository/models/slow/unload", timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(grpc.RpcError) as caught:  # unloaded: no longer a service lockgate has
        check(stub, "slow")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    assert check(stub, "") == SERVING  # echo still serves
    r = httpx.post(health_server.url + "/v2/repository/models/slow/load", timeout=60)
    assert r.status_code == 200, r.text
    assert next(watch).status == SERVING
    assert check(stub, "slow") == SERVING
    watch.cancel()
