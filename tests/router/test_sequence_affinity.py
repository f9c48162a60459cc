"""Stateful models (Triton's sequence batching) behind `lockgate route` over two real replicas:
every request of a sequence reaches the replica that holds its state, over REST (JSON and
binary) and gRPC, with hedging on; a sequence whose replica is gone gets a clear 503."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.backends.test_triton_python import triton_repository
from tests.conftest import RunningServer, free_port, launch_server, start_servers
from tests.frontend.test_sequence_batching import ACCUMULATOR, config
from tests.router.test_grpc_proxy import GrpcRouter, start_grpc_router

ACC = config(
    name="acc",
    max_batch_size=8,
    corrid="TYPE_UINT64",
    idle_us=30_000_000,
    strategy="oldest { max_candidate_sequences: 16 }",
)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("sequence-affinity")
    servers = []
    for i in range(2):
        repo = triton_repository(root / f"replica-{i}", ("acc", ACC, ACCUMULATOR))
        servers.append(
            launch_server(
                repo,
                root,
                "--no-llm",
                *("--model-control-mode", "explicit", "--load-model", "acc"),
                grpc_port=free_port(),
            )
        )
    start_servers(*servers)
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def front(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcRouter]:
    """Hedging on after 1 ms: a request of a sequence would be copied to the other replica
    were it not exempt."""
    tmp = tmp_path_factory.mktemp("sequence-affinity-router")
    extra = ("--hedge-delay-ms", "1", "--hedge-budget", "1", "--probe-interval", "0.2")
    running = start_grpc_router(tmp, replicas, *extra)
    yield running
    running.router.stop()


def step(
    client: Any, module: Any, value: int, sequence_id: int, binary: bool, **flags: bool
) -> int:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    data = np.full([1, 1], value, dtype=np.int32)
    if module is httpclient:
        tensor.set_data_from_numpy(data, binary_data=binary)
    else:
        tensor.set_data_from_numpy(data)
    result = client.infer("acc", [tensor], sequence_id=sequence_id, **flags)
    return int(result.as_numpy("OUTPUT")[0, 0])


def run_sequence(
    address: str, module: Any, sequence_id: int, values: list[int], sums: dict[int, list[int]]
) -> None:
    client = module.InferenceServerClient(address)  # one per thread
    binary = sequence_id % 4 == 0  # REST: half binary tensors, half JSON
    got = sums[sequence_id] = []
    for index, value in enumerate(values):
        first, last = index == 0, index == len(values) - 1
        try:
            got.append(
                step(
                    client,
                    module,
                    value,
                    sequence_id,
                    binary,
                    sequence_start=first,
                    sequence_end=last,
                )
            )
        except InferenceServerException as exc:
            got.append(-1)
            got.append(str(exc))  # type: ignore[arg-type]
            return


def served(server: RunningServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_inference_request_success{") and 'model="acc"' in line
    )


def test_interleaved_sequences_keep_their_own_running_sums(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    """Twelve sequences at once, half over REST and half over gRPC, each with its own values:
    each gets the running sum of its own values, though requests are balanced and hedged;
    the sequences spread over both replicas, and each request ran once."""
    before = [served(r) for r in replicas]
    values = {sequence_id: [sequence_id % 7 + k for k in range(5)] for sequence_id in range(1, 13)}
    sums: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=run_sequence,
            args=(
                front.address if sequence_id % 2 else front.router.address,
                grpcclient if sequence_id % 2 else httpclient,
                sequence_id,
                own,
                sums,
            ),
        )
        for sequence_id, own in values.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for sequence_id, own in values.items():
        assert sums[sequence_id] == [sum(own[: i + 1]) for i in range(len(own))], sequence_id
    ran = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(ran) == 5 * len(values)  # no copy: each request ran once
    assert all(n >= 5 for n in ran), ran  # both replicas hold sequences


def test_sequences_interleaved_on_one_grpc_stream_each_reach_their_replica(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    """Twelve sequences on one ModelStreamInfer stream, their requests interleaved: the router
    sends each to its sequence's replica (a call on each), and every answer comes back on the
    one stream with its sequence's running sum."""
    before = [served(r) for r in replicas]
    values = {100 + s: [s + k for k in range(4)] for s in range(12)}
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = front.client()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for index in range(4):
            for sequence_id, own in values.items():
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(np.full([1, 1], own[index], dtype=np.int32))
                client.async_stream_infer(
                    "acc",
                    [tensor],
                    request_id=f"{sequence_id}-{index}",
                    sequence_id=sequence_id,
                    sequence_start=index == 0,
                    sequence_end=index == 3,
                )
        got = {}
        for _ in range(4 * len(values)):
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            got[response.id] = int(result.as_numpy("OUTPUT")[0, 0])
    finally:
        client.stop_stream()
    for sequence_id, own in values.items():
        for index in range(4):
            assert got[f"{sequence_id}-{index}"] == sum(own[: index + 1]), (sequence_id, index)
    ran = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(ran) == 4 * len(values) and all(ran), ran  # one stream, both replicas


def test_a_sequence_whose_replica_is_gone_gets_a_clear_503(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    """(Last in the module: it stops a replica.) A sequence started on a replica that then
    stops is refused with a message naming that replica, over REST and gRPC; a new sequence
    goes to the replica left."""
    http = httpclient.InferenceServerClient(front.router.address)
    grpc = front.client()
    before = [served(r) for r in replicas]
    assert step(http, httpclient, 5, 777, False, sequence_start=True) == 5
    assert step(grpc, grpcclient, 1, 777, False) == 6
    [holder] = [r for r, b in zip(replicas, before, strict=True) if served(r) - b == 2]
    holder.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the router's probe sees it gone
        state = httpx.get(front.router.url + "/router/replicas").json()["replicas"]
        if not all(r["usable"] for r in state):
            break
        time.sleep(0.1)
    answer = httpx.post(
        front.router.url + "/v2/models/acc/infer",
        json={
            "parameters": {"sequence_id": 777},
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [2]}],
        },
    )
    assert answer.status_code == 503, answer.text
    assert "sequence 777 lives on replica " + holder.url in answer.json()["error"]
    with pytest.raises(InferenceServerException, match="sequence 777 lives on replica"):
        step(grpc, grpcclient, 2, 777, False)
    assert step(http, httpclient, 4, 777, True, sequence_start=True, sequence_end=True) == 4
