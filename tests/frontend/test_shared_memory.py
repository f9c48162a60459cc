"""Triton's system shared memory extension through a real server, with tritonclient's own
shared memory utilities over HTTP and gRPC: inputs read from a region, outputs written to
one, the same answers as sent inline, and every misuse a 400 (an unknown region's status:
404)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from tests.conftest import RunningServer, digits_rows

ROWS = 8
IN_BYTES = ROWS * 64 * 4
OUT_BYTES = ROWS * 10 * 4


@pytest.fixture
def regions() -> Iterator[tuple[str, Any, Any]]:
    """An input region holding digits rows and an output region, both created here."""
    tag = uuid.uuid4().hex[:8]
    inputs = shm.create_shared_memory_region(f"in-{tag}", f"/lg_in_{tag}", IN_BYTES)
    outputs = shm.create_shared_memory_region(f"out-{tag}", f"/lg_out_{tag}", OUT_BYTES)
    shm.set_shared_memory_region(inputs, [digits_rows(ROWS)])
    yield tag, inputs, outputs
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)


def expected(server: RunningServer) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.address)
    inp = httpclient.InferInput("input", [ROWS, 64], "FP32")
    inp.set_data_from_numpy(digits_rows(ROWS))
    answer = client.infer("digits_onnx", [inp], headers={"Request-Timeout": "30"})
    probabilities = answer.as_numpy("probabilities")
    assert probabilities is not None
    return probabilities


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_pass_through_shared_memory(
    server: RunningServer, regions: tuple[str, Any, Any], protocol: str
) -> None:
    tag, _, outputs = regions
    kit: Any = httpclient if protocol == "http" else grpcclient
    address = server.address if protocol == "http" else server.grpc_address
    client = kit.InferenceServerClient(address)
    client.register_system_shared_memory(f"in-{tag}", f"/lg_in_{tag}", IN_BYTES)
    client.register_system_shared_memory(f"out-{tag}", f"/lg_out_{tag}", OUT_BYTES)
    try:
        status = client.get_system_shared_memory_status()
        names = {r["name"] for r in status} if protocol == "http" else set(status.regions)
        assert {f"in-{tag}", f"out-{tag}"} <= names
        inp = kit.InferInput("input", [ROWS, 64], "FP32")
        inp.set_shared_memory(f"in-{tag}", IN_BYTES)
        out = kit.InferRequestedOutput("probabilities")
        out.set_shared_memory(f"out-{tag}", OUT_BYTES)
        headers = {"Request-Timeout": "30"} if protocol == "http" else {"request-timeout": "30"}
        client.infer("digits_onnx", [inp], outputs=[out], headers=headers)
        written = shm.get_contents_as_numpy(outputs, np.float32, [ROWS, 10])
        np.testing.assert_array_equal(written, expected(server))
    finally:
        client.unregister_system_shared_memory()
    status = client.get_system_shared_memory_status()
    assert (status if protocol == "http" else list(status.regions)) == []


def test_misuse_is_a_400_with_a_message(
    server: RunningServer, regions: tuple[str, Any, Any]
) -> None:
    tag = regions[0]
    base = server.url + "/v2/systemsharedmemory"

    def register(name: str, **body: object) -> httpx.Response:
        return httpx.post(f"{base}/region/{name}/register", json=body)

    def infer(region: str, size: int, output: str | None = None) -> httpx.Response:
        tensor = {"name": "input", "shape": [ROWS, 64], "datatype": "FP32"}
        tensor["parameters"] = {"shared_memory_region": region, "shared_memory_byte_size": size}
        body: dict[str, Any] = {"inputs": [tensor]}
        if output is not None:
            params = {"shared_memory_region": output, "shared_memory_byte_size": 8}
            body["outputs"] = [{"name": "probabilities", "parameters": params}]
        return httpx.post(server.url + "/v2/models/digits_onnx/infer", json=body)

    def says(answer: httpx.Response, text: str) -> None:
        assert answer.status_code == 400, answer.text
        assert text in answer.json()["error"], answer.json()["error"]

    says(register("x", key="/lg_no_such_object", byte_size=64), "cannot open shared memory")
    says(register("x", key="../etc/passwd", byte_size=64), "is not the name of an object")
    says(register("x", key=f"/lg_in_{tag}", byte_size=IN_BYTES * 2), "fewer than offset")
    says(register("x", key=f"/lg_in_{tag}", byte_size=0), "byte_size > 0")
    assert register("in", key=f"/lg_in_{tag}", byte_size=IN_BYTES).status_code == 200
    try:
        says(register("in", key=f"/lg_in_{tag}", byte_size=IN_BYTES), "already registered")
        says(infer("nowhere", IN_BYTES), "no shared memory region 'nowhere'")
        says(infer("in", IN_BYTES - 4), "does not match shape")
        assert register("small", key=f"/lg_out_{tag}", byte_size=8).status_code == 200
        says(infer("in", IN_BYTES, output="small"), "needs 320 bytes")
        assert infer("in", IN_BYTES).status_code == 200  # the output inline
        unknown = httpx.get(f"{base}/region/none/status")
        assert unknown.status_code == 404 and "no shared memory region" in unknown.text
        assert httpx.get(f"{base}/status").json()[0]["byte_size"] == IN_BYTES
    finally:
        assert httpx.post(f"{base}/unregister").status_code == 200
    assert httpx.post(f"{base}/region/in/unregister").status_code == 200  # unknown: no error
    cuda = httpx.get(server.url + "/v2/cudasharedmemory/status")
    assert cuda.status_code == 400 and "CUDA" in cuda.json()["error"]
    assert "system_shared_memory" in httpx.get(server.url + "/v2").json()["extensions"]
