"""`lockgate serve --replicas`: how many replicas `auto` chooses (no process started for that),
each replica's arguments, and gRPC through the router in front of them."""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from lockgate.backends.base import LLM_BACKEND
from lockgate.cli import _replica_count, _replicas
from lockgate.router.replicas import _cgroup_cpus, auto_replicas, replica_argv, usable_cores
from tests.conftest import RunningServer, free_port, start_server
from tests.router.test_router import repository

CLASSIC = """\
backend: python
max_batch_size: 4
inputs: [{name: x, datatype: FP32, dims: [2]}]
outputs: [{name: y, datatype: FP32, dims: [2]}]
"""


def model(repo: Path, name: str, config: str) -> None:
    (repo / name).mkdir(parents=True)
    (repo / name / "config.yaml").write_text(config)


@pytest.fixture
def classic(tmp_path: Path) -> Path:
    repo = tmp_path / "classic"
    model(repo, "a", CLASSIC)
    model(repo, "b", CLASSIC.replace("python", "onnxruntime"))
    return repo


@pytest.fixture
def with_llm(tmp_path: Path) -> Path:
    repo = tmp_path / "with-llm"
    model(repo, "a", CLASSIC)
    model(repo, "chat", f"backend: {LLM_BACKEND}\n")
    return repo


def test_auto_is_one_replica_per_core_for_classic_models(classic: Path) -> None:
    assert auto_replicas(classic, cores=6, llm_backend=LLM_BACKEND) == 6
    assert auto_replicas(classic, cores=1, llm_backend=LLM_BACKEND) == 1
    model(classic, "broken", "backend: [not, a, name]\n")  # the replicas report it
    model(classic, ".hidden", f"backend: {LLM_BACKEND}\n")  # not a model folder
    assert auto_replicas(classic, cores=6, llm_backend=LLM_BACKEND) == 6


def test_auto_is_one_replica_with_a_language_model(with_llm: Path) -> None:
    assert auto_replicas(with_llm, cores=6, llm_backend=LLM_BACKEND) == 1
    # --no-llm: the language model is not started, so one replica per core again
    assert auto_replicas(with_llm, cores=6, llm_backend=LLM_BACKEND, language_models=False) == 6


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=_replicas, default=1)
    parser.add_argument("--model-control-mode", default="none")
    parser.add_argument("--no-llm", action="store_true")
    return parser.parse_args(flags)


def test_the_replicas_flag(classic: Path, with_llm: Path) -> None:
    assert _replica_count(serve_args(), classic) == 1  # the default: one process
    assert _replica_count(serve_args("--replicas", "3"), with_llm) == 3  # as asked
    assert _replica_count(serve_args("--replicas", "auto"), classic) == usable_cores()
    assert _replica_count(serve_args("--replicas", "auto"), with_llm) == 1
    assert _replica_count(serve_args("--replicas", "auto", "--no-llm"), with_llm) == (
        usable_cores()
    )
    # models loaded and unloaded by API: every call must reach the one process
    explicit = serve_args("--replicas", "auto", "--model-control-mode", "explicit")
    assert _replica_count(explicit, classic) == 1
    for bad in ("0", "-2", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            _replicas(bad)


def test_cgroup_quota_caps_the_cores(tmp_path: Path) -> None:
    limit = tmp_path / "cpu.max"
    limit.write_text("150000 100000\n")  # 1.5 CPUs: two replicas
    assert _cgroup_cpus(limit) == 2
    limit.write_text("max 100000\n")
    assert _cgroup_cpus(limit) is None
    assert _cgroup_cpus(tmp_path / "absent") is None
    assert usable_cores() >= 1


def test_each_replica_gets_its_own_address_and_one_process() -> None:
    argv = ["serve", "models", "--replicas", "auto", "--port=8000", "--grpc-port", "8001"]
    argv += ["--replica-base-port", "9000", "--no-llm"]
    assert replica_argv(argv, 9001, 9003) == [
        "serve",
        "models",
        "--no-llm",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--grpc-port",
        "9003",
        "--replicas",
        "1",  # a replica never starts replicas of its own
    ]
    assert replica_argv(["serve"], 9001)[-3:] == ["off", "--replicas", "1"]


def _free_run(count: int) -> int:
    """A port whose next `count - 1` ports are free too."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def replicas_of(server: RunningServer) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = httpx.get(server.url + "/router/replicas").json()["replicas"]
    return replicas


def test_serve_with_replicas_serves_grpc_through_the_router(tmp_path: Path) -> None:
    base = _free_run(4)  # two replicas: HTTP on base and base+1, gRPC on base+2 and base+3
    server = start_server(
        repository(tmp_path, 0),
        tmp_path,
        "--replicas",
        "2",
        "--replica-base-port",
        str(base),
        grpc_port=free_port(),
    )
    try:
        deadline = time.monotonic() + 60
        while not all(r["usable"] for r in replicas_of(server)):  # the router is ready on one
            assert time.monotonic() < deadline, replicas_of(server)
            time.sleep(0.1)
        client = grpcclient.InferenceServerClient(server.grpc_address)
        x = grpcclient.InferInput("x", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([[1000.0, 1.0]], dtype=np.float32))
        for _ in range(40):
            result = client.infer("who", [x], client_timeout=30)
            np.testing.assert_array_equal(result.as_numpy("y"), [[1000.0, 1.0]])
        listed = replicas_of(server)
        assert [r["url"] for r in listed] == [f"http://127.0.0.1:{base + i}" for i in range(2)]
        assert all(r["answered"] > 0 for r in listed), listed  # both took gRPC calls
    finally:
        assert server.stop() == 0, server.log()[-2000:]
