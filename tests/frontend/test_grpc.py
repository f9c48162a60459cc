"""KServe v2 over gRPC: Triton's own client (tritonclient.grpc) and plain grpcio stubs against a
real server, the proto checked field by field against Triton's."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import descriptor_pool, json_format
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service
from tritonclient.utils import InferenceServerException

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.grpc import inference_pb2_grpc as pb_grpc
from lockgate.protocol.v2_codec import tensor_bytes
from tests.conftest import (
    PERF_ANALYZER,
    RunningServer,
    _write_python_model,
    digits_rows,
    free_port,
    start_server,
)

TEXT = np.array([[b"the weather is lovely today"], ["caf\u00e9 cr\u00e8me".encode()]], dtype=object)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_address) as triton:
        yield triton


@pytest.fixture(scope="module")
def rest(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.address)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def grpc_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def rest_input(name: str, array: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def metric(server: RunningServer, name: str, **labels: str) -> float:
    """The value of one sample of the server's /metrics (0 when absent)."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def expect_error(code: grpc.StatusCode, match: str, call: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    assert caught.value.status() == str(code), caught.value
    assert re.search(match, caught.value.message() or ""), caught.value.message()


# -- the proto ---------------------------------------------------------------------------


def _fields(message: Any) -> dict[str, tuple[str, int, int, str]]:
    return {
        f.name: (f.name, f.number, f.type, (f.message_type or f.enum_type or f).full_name)
        for f in message.fields
    }


def test_proto_is_wire_compatible_with_triton() -> None:
    """Every message, field and method of lockgate's proto exists in Triton's with the same
    number, type and name, and the service has the same full name."""
    ours = pb.DESCRIPTOR
    theirs = descriptor_pool.Default()
    assert triton_service.DESCRIPTOR.package == ours.package == "inference"
    assert triton_config.DESCRIPTOR.package == "inference"
    stack = list(ours.message_types_by_name.values())
    checked = 0
    while stack:
        message = stack.pop()
        stack.extend(message.nested_types)
        triton = theirs.FindMessageTypeByName(message.full_name)
        for name, field in _fields(message).items():
            assert _fields(triton).get(name) == field, f"{message.full_name}.{name}"
            assert (field_is_repeated(message, name)) == field_is_repeated(triton, name)
            checked += 1
    assert checked > 100
    for enum in ours.enum_types_by_name.values():
        values = {v.name: v.number for v in theirs.FindEnumTypeByName(enum.full_name).values}
        assert {v.name: v.number for v in enum.values} == values
    service = ours.services_by_name["GRPCInferenceService"]
    triton_methods = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == triton_methods.full_name
    for method in service.methods:
        other = triton_methods.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming,
            other.server_streaming,
        )


def field_is_repeated(message: Any, name: str) -> bool:
    field = message.fields_by_name[name]
    return bool(field.label == field.LABEL_REPEATED)


# -- health, metadata, configuration -------------------------------------------------------


def test_health_and_metadata_match_rest(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits_onnx")
    assert not client.is_model_ready("broken")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata == httpx.get(server.url + "/v2").json()
    for model in ("digits_onnx", "digits_sklearn", "minilm"):
        ours = client.get_model_metadata(model, as_json=True)
        rest = httpx.get(f"{server.url}/v2/models/{model}").json()
        for tensor in rest["inputs"] + rest["outputs"]:
            tensor["shape"] = [str(dim) for dim in tensor["shape"]]  # int64 in proto JSON
        assert ours == rest


@pytest.mark.parametrize("model", ["digits_onnx", "digits_sklearn", "minilm", "slow"])
def test_model_config_is_the_rest_config(
    client: grpcclient.InferenceServerClient, server: RunningServer, model: str
) -> None:
    """Read with Triton's full ModelConfig message, the gRPC config is the REST one."""
    config = client.get_model_config(model).config
    rest = httpx.get(f"{server.url}/v2/models/{model}/config").content
    expected = json_format.Parse(rest, triton_config.ModelConfig(), ignore_unknown_fields=True)
    assert config == expected
    assert config.max_batch_size == json_format.MessageToDict(expected)["maxBatchSize"]


def test_statistics_and_repository_index(client: grpcclient.InferenceServerClient) -> None:
    stats = client.get_inference_statistics("digits_onnx").model_stats
    assert [s.name for s in stats] == ["digits_onnx"]
    everything = client.get_inference_statistics().model_stats
    assert {"digits_onnx", "minilm", "slow"} <= {s.name for s in everything}
    index = client.get_model_repository_index().models
    states = {m.name: m.state for m in index}
    assert states["digits_onnx"] == "READY"
    assert states["broken"] == "UNAVAILABLE"
    assert next(m.reason for m in index if m.name == "broken")
    expect_error(grpc.StatusCode.NOT_FOUND, "unknown model", client.get_model_config, "nope")


def test_model_ready_of_an_unknown_model_or_version_is_false(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient
) -> None:
    """As Triton's ModelReady: not ready, not an error; as tritonclient.http says over REST."""
    for name, version in (("nope", ""), ("digits_onnx", "2"), ("digits_onnx", "x")):
        assert client.is_model_ready(name, version) is False
        assert rest.is_model_ready(name, version) is False
    assert client.is_model_ready("digits_onnx", "1") is True


def test_statistics_of_an_unknown_model_or_version_is_not_found(
    client: grpcclient.InferenceServerClient,
) -> None:
    stats = client.get_inference_statistics
    expect_error(grpc.StatusCode.NOT_FOUND, "unknown version 2", stats, "digits_onnx", "2")
    expect_error(grpc.StatusCode.NOT_FOUND, "unknown model 'nope'", stats, "nope")
    assert [s.version for s in stats("digits_onnx", "1").model_stats] == ["1"]


def test_batch_statistics_are_the_rest_ones(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    """InferBatchStatistics: per batch size that ran, sorted, as REST's batch_stats."""
    for rows in (3, 1, 3):
        client.infer("digits_sklearn", [grpc_input("input", digits_rows(rows), "FP32")])
    (ours,) = client.get_inference_statistics("digits_sklearn").model_stats
    rest = httpx.get(f"{server.url}/v2/models/digits_sklearn/stats").json()["model_stats"][0]
    phases = ("compute_input", "compute_infer", "compute_output")
    got = [
        (b.batch_size, *((getattr(b, p).count, getattr(b, p).ns) for p in phases))
        for b in ours.batch_stats
    ]
    expected = [
        (b["batch_size"], *((b[p]["count"], b[p]["ns"]) for p in phases))
        for b in rest["batch_stats"]
    ]
    assert got == expected
    sizes = [b.batch_size for b in ours.batch_stats]
    assert {1, 3} <= set(sizes) and sizes == sorted(set(sizes))
    assert sum(b.compute_infer.count for b in ours.batch_stats) == ours.execution_count
    rows = sum(b.batch_size * b.compute_infer.count for b in ours.batch_stats)
    assert rows == ours.inference_count


# -- inference ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["digits_onnx", "digits_sklearn"])
def test_digits_equal_rest(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient, model: str
) -> None:
    from sklearn.datasets import load_digits

    x = digits_rows(16)
    ours = client.infer(model, [grpc_input("input", x, "FP32")])
    theirs = rest.infer(model, [rest_input("input", x, "FP32")])
    labels = ours.as_numpy("label")
    assert labels is not None and (labels.ravel() == load_digits().target[:16]).mean() > 0.9
    np.testing.assert_array_equal(labels, theirs.as_numpy("label"))
    probs = ours.as_numpy("probabilities")
    assert probs is not None and probs.shape == (16, 10) and probs.dtype == np.float32
    np.testing.assert_allclose(probs, theirs.as_numpy("probabilities"), rtol=1e-5, atol=1e-7)
    assert ours.get_response().model_version == "1"


def test_minilm_bytes_equal_rest(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient
) -> None:
    ours = client.infer("minilm", [grpc_input("text", TEXT, "BYTES")]).as_numpy("embedding")
    theirs = rest.infer("minilm", [rest_input("text", TEXT, "BYTES")]).as_numpy("embedding")
    assert ours is not None and ours.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-3)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def test_output_selection_and_classification(client: grpcclient.InferenceServerClient) -> None:
    x = digits_rows(4)
    only = [grpcclient.InferRequestedOutput("probabilities")]
    result = client.infer("digits_onnx", [grpc_input("input", x, "FP32")], outputs=only)
    assert [o.name for o in result.get_response().outputs] == ["probabilities"]
    assert result.as_numpy("label") is None
    top = [grpcclient.InferRequestedOutput("probabilities", class_count=3)]
    result = client.infer("digits_onnx", [grpc_input("input", x, "FP32")], outputs=top)
    classes = result.as_numpy("probabilities")
    assert classes is not None and classes.shape == (4, 3)
    assert re.fullmatch(rb"[0-9.]+:[0-9]", classes[0, 0])
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        "output",
        client.infer,
        "digits_onnx",
        [grpc_input("input", x, "FP32")],
        outputs=[grpcclient.InferRequestedOutput("nope")],
    )


def test_classification_has_a_row_per_batch_row(client: grpcclient.InferenceServerClient) -> None:
    """Triton's classification of a batching model: BYTES [batch, count], row by row."""
    x = [grpc_input("input", digits_rows(3), "FP32")]
    plain = client.infer("digits_sklearn", x)
    labels, probs = plain.as_numpy("label"), plain.as_numpy("probabilities")
    assert labels is not None and probs is not None
    top = [
        grpcclient.InferRequestedOutput("label", class_count=1),
        grpcclient.InferRequestedOutput("probabilities", class_count=1),
    ]
    result = client.infer("digits_sklearn", x, outputs=top)
    label_classes, prob_classes = result.as_numpy("label"), result.as_numpy("probabilities")
    assert label_classes is not None and label_classes.shape == (3, 1)
    assert label_classes[:, 0].tolist() == [f"{float(v):f}:0".encode() for v in labels]
    assert prob_classes is not None and prob_classes.shape == (3, 1)
    assert [int(c.split(b":")[1]) for c in prob_classes[:, 0]] == probs.argmax(axis=1).tolist()


def test_request_id_and_parameters(client: grpcclient.InferenceServerClient) -> None:
    x = digits_rows(1)
    result = client.infer(
        "digits_onnx", [grpc_input("input", x, "FP32")], request_id="r-7", priority=1
    )
    assert result.get_response().id == "r-7"


def test_an_error_that_echoes_a_long_name_keeps_its_status(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    """The status message names the model; a 100 KB name is cut in it, so the client gets
    NOT_FOUND, not a trailer over its metadata limit (RESOURCE_EXHAUSTED)."""
    name = "m" * 100_000
    tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, 64])
    request = pb.ModelInferRequest(model_name=name, inputs=[tensor])
    request.raw_input_contents.append(bytes(256))
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    assert "unknown model 'mmm" in caught.value.details()
    assert "more characters" in caught.value.details()


@pytest.mark.parametrize("field", ["inputs", "outputs", "parameters"])
def test_repeated_fields_past_the_most_a_request_holds_are_refused(
    stub: pb_grpc.GRPCInferenceServiceStub, field: str
) -> None:
    """Counted before any item is read (half a million inputs held the event loop for
    seconds)."""
    request = pb.ModelInferRequest(model_name="digits_onnx")
    for index in range(100_000):
        if field == "inputs":
            request.inputs.add(name=f"in{index}", datatype="FP32", shape=[1])
        elif field == "outputs":
            request.outputs.add(name="label")
        else:
            request.parameters[f"p{index}"].int64_param = index
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"100000 {field}, more than the 1024" in caught.value.details()


def test_client_errors(client: grpcclient.InferenceServerClient) -> None:
    x = digits_rows(2)
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        "unknown model 'nope'",
        client.infer,
        "nope",
        [grpc_input("input", x, "FP32")],
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        "shape",
        client.infer,
        "digits_onnx",
        [grpc_input("input", x[:, :10].copy(), "FP32")],
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        "datatype|INT32",
        client.infer,
        "digits_onnx",
        [grpc_input("input", x.astype(np.int32), "INT32")],
    )
    expect_error(
        grpc.StatusCode.UNAVAILABLE,
        "not ready",
        client.infer,
        "broken",
        [grpc_input("input", x, "FP32")],
    )


def test_concurrent_requests_are_batched(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    """While `slow` runs a long batch, single-row requests queue and leave as one batch."""
    before = client.get_inference_statistics("slow").model_stats[0]
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    hold = [grpc_input("x", np.ones((1, 4), np.float32), "FP32")]
    hold.append(grpc_input("delay", np.full((1, 1), 0.5, np.float32), "FP32"))
    client.async_infer("slow", hold, lambda result, error: done.put((result, error)))
    time.sleep(0.15)
    for i in range(3):
        rows = [grpc_input("x", np.full((1, 4), i, np.float32), "FP32")]
        client.async_infer("slow", rows, lambda result, error: done.put((result, error)))
    answers = [done.get(timeout=10) for _ in range(4)]
    assert all(error is None for _, error in answers), answers
    doubled = sorted(float(r.as_numpy("y")[0, 0]) for r, _ in answers)
    assert doubled == [0.0, 2.0, 2.0, 4.0]
    after = client.get_inference_statistics("slow").model_stats[0]
    assert after.inference_count - before.inference_count == 4
    assert after.execution_count - before.execution_count == 2
    assert metric(server, "lockgate_grpc_request_duration_seconds_count", method="ModelInfer")


# -- deadlines and cancellation ------------------------------------------------------------


def _hold_slow(client: grpcclient.InferenceServerClient, seconds: float) -> queue.Queue[Any]:
    """Keep the `slow` model's one instance busy; the queue gets (result, error)."""
    done: queue.Queue[Any] = queue.Queue()
    hold = [grpc_input("x", np.ones((1, 4), np.float32), "FP32")]
    hold.append(grpc_input("delay", np.full((1, 1), seconds, np.float32), "FP32"))
    client.async_infer("slow", hold, lambda result, error: done.put((result, error)))
    time.sleep(0.15)
    return done


def test_deadlines(client: grpcclient.InferenceServerClient, server: RunningServer) -> None:
    x = [grpc_input("x", np.ones((1, 4), np.float32), "FP32")]

    def outcome(name: str) -> float:
        return metric(server, "lockgate_requests_total", model="slow", outcome=name)

    before = {name: outcome(name) for name in ("deadline_exceeded", "cancelled", "unavailable")}
    held = _hold_slow(client, 1.0)
    late = (str(grpc.StatusCode.DEADLINE_EXCEEDED), str(grpc.StatusCode.UNAVAILABLE))
    # the client's deadline becomes the request's: the server drops it from the queue at the
    # deadline or, once its profile has measured the slow batches, refuses it at once
    with pytest.raises(InferenceServerException) as caught:
        client.infer("slow", x, client_timeout=0.3)
    assert caught.value.status() in late, caught.value
    # the `timeout` parameter (µs): the server answers DEADLINE_EXCEEDED itself at the
    # deadline, or refuses it at once (UNAVAILABLE)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("slow", x, timeout=200_000)
    status, message = caught.value.status(), caught.value.message() or ""
    assert status in late
    assert "deadline" in message, message
    _, error = held.get(timeout=10)
    assert error is None
    # the server's deadline timer and the call's cancellation at the same deadline race: the
    # first request counts as either; the second expired or was refused on the server
    counted = {name: outcome(name) - value for name, value in before.items()}
    assert sum(counted.values()) == 2, counted
    assert counted["deadline_exceeded"] + counted["unavailable"] >= 1, counted


def test_cancelled_rpc_leaves_the_queue(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    labels = {"model": "slow", "outcome": "cancelled"}
    cancelled = metric(server, "lockgate_requests_total", **labels)
    held = _hold_slow(client, 0.8)
    x = [grpc_input("x", np.ones((1, 4), np.float32), "FP32")]
    done: queue.Queue[Any] = queue.Queue()
    call = client.async_infer("slow", x, lambda result, error: done.put(error))
    time.sleep(0.2)
    call.cancel()
    assert held.get(timeout=10)[1] is None
    deadline = time.monotonic() + 5
    while metric(server, "lockgate_requests_total", **labels) == cancelled:
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.05)


# -- streaming ---------------------------------------------------------------------------


def test_stream_infer(client: grpcclient.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    x = digits_rows(6)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(5):
            rows = [grpc_input("input", x[i : i + 1], "FP32")]
            client.async_stream_infer("digits_onnx", rows, request_id=f"s{i}")
        client.async_stream_infer("nope", [grpc_input("input", x[:1], "FP32")], request_id="bad")
        got = [answers.get(timeout=10) for _ in range(6)]
    finally:
        client.stop_stream()
    errors = [error for _, error in got if error is not None]
    assert len(errors) == 1 and "unknown model 'nope'" in errors[0].message()
    results = {r.get_response().id: r for r, error in got if error is None}
    assert sorted(results) == [f"s{i}" for i in range(5)]
    whole = client.infer("digits_onnx", [grpc_input("input", x[:5], "FP32")])
    streamed = np.concatenate([results[f"s{i}"].as_numpy("probabilities") for i in range(5)])
    np.testing.assert_allclose(streamed, whole.as_numpy("probabilities"), rtol=1e-5, atol=1e-7)


# -- plain grpcio: raw and typed contents ----------------------------------------------------


def _digits_request(x: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="digits_onnx")
    request.inputs.add(name="input", datatype="FP32", shape=x.shape)
    return request


def _expect(code: grpc.StatusCode, match: str, call: Any, request: Any) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=10)
    assert caught.value.code() == code, caught.value
    assert re.search(match, caught.value.details()), caught.value.details()


def test_raw_and_typed_contents_agree(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    x = digits_rows(3)
    raw = _digits_request(x)
    raw.raw_input_contents.append(x.tobytes())
    typed = _digits_request(x)
    typed.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    a, b = stub.ModelInfer(raw, timeout=10), stub.ModelInfer(typed, timeout=10)
    assert [o.name for o in a.outputs] == ["label", "probabilities"]
    assert list(a.outputs[1].shape) == [3, 10] and a.outputs[1].datatype == "FP32"
    assert a.raw_output_contents == b.raw_output_contents
    text = pb.ModelInferRequest(model_name="minilm")
    text.inputs.add(name="text", datatype="BYTES", shape=[2, 1])
    text.inputs[0].contents.bytes_contents.extend(TEXT.ravel().tolist())
    by_contents = stub.ModelInfer(text, timeout=10)
    del text.inputs[0].contents.bytes_contents[:]
    text.inputs[0].ClearField("contents")
    text.raw_input_contents.append(tensor_bytes(TEXT, "BYTES"))
    assert stub.ModelInfer(text, timeout=10).raw_output_contents == by_contents.raw_output_contents


def test_raw_content_errors(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    x = digits_rows(1)
    short = _digits_request(x)
    short.raw_input_contents.append(x.tobytes()[:-1])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "255 bytes.*needs 256", stub.ModelInfer, short)
    extra = _digits_request(x)
    extra.raw_input_contents.extend([x.tobytes(), x.tobytes()])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "2 entries for 1 inputs", stub.ModelInfer, extra)
    count = _digits_request(x)
    count.inputs[0].contents.fp32_contents.extend([0.0] * 63)
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "64 elements.*63", stub.ModelInfer, count)
    truncated = pb.ModelInferRequest(
        model_name="minilm", raw_input_contents=[b"\x05\x00\x00\x00ab"]
    )
    truncated.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "claims 5 bytes", stub.ModelInfer, truncated)
    priority = _digits_request(x)
    priority.raw_input_contents.append(x.tobytes())
    priority.parameters["priority"].string_param = "high"
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "priority", stub.ModelInfer, priority)
    half = _digits_request(x)
    half.inputs[0].datatype = "FP16"
    half.inputs[0].contents.fp32_contents.extend([0.0] * 64)
    # the model's config is checked before the data: FP16 is refused as the wrong datatype
    _expect(grpc.StatusCode.INVALID_ARGUMENT, "datatype FP32, got FP16", stub.ModelInfer, half)


# -- a small server: API keys, limits, drain ------------------------------------------------


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("echo-repo")
    _write_python_model(repo, "echo", {})
    return repo


def _start_echo(repo: Path, tmp: Path, *extra: str) -> RunningServer:
    env = {"LOCKGATE_API_KEYS": "k1,k2", "LOCKGATE_ADMIN_KEYS": "admin"}
    return start_server(repo, tmp, "--no-llm", *extra, env=env, grpc_port=free_port())


def _echo_inputs(delay: float = 0.0) -> list[grpcclient.InferInput]:
    inputs = [grpc_input("x", np.arange(4, dtype=np.float32).reshape(1, 4), "FP32")]
    if delay:
        inputs.append(grpc_input("delay", np.full((1, 1), delay, np.float32), "FP32"))
    return inputs


def test_api_keys_and_limits(echo_repo: Path, tmp_path: Path) -> None:
    server = _start_echo(
        echo_repo, tmp_path, "--max-body-mb", "1", "--grpc-max-concurrent-rpcs", "2"
    )
    try:
        with grpcclient.InferenceServerClient(server.grpc_address) as client:
            assert client.is_server_live() and client.is_server_ready()  # public
            unauthenticated = grpc.StatusCode.UNAUTHENTICATED
            expect_error(unauthenticated, "Bearer", client.infer, "echo", _echo_inputs())
            bad = {"authorization": "Bearer nope"}
            expect_error(
                grpc.StatusCode.PERMISSION_DENIED,
                "not accepted",
                client.infer,
                "echo",
                _echo_inputs(),
                headers=bad,
            )
            key = {"authorization": "Bearer k2"}
            result = client.infer("echo", _echo_inputs(), headers=key)
            np.testing.assert_array_equal(result.as_numpy("y"), [[0, 2, 4, 6]])
            # the log and trace settings: read with an API key, changed with the admin key
            assert client.get_log_settings(headers=key).settings["log_info"].bool_param
            denied = grpc.StatusCode.PERMISSION_DENIED
            change = {"trace_rate": "2"}
            log_change = {"log_info": True}
            expect_error(denied, "log and trace", client.update_log_settings, log_change, key)
            expect_error(
                denied, "log and trace", client.update_trace_settings, "", change, headers=key
            )
            admin = {"authorization": "Bearer admin"}
            changed = client.update_trace_settings("", change, headers=admin)
            assert list(changed.settings["trace_rate"].value) == ["2"]
            big = [grpc_input("x", np.zeros((1, 300_000), np.float32), "FP32")]
            expect_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "", client.infer, "echo", big, headers=key
            )
            _check_concurrency_limit(client, key)
    finally:
        assert server.stop() == 0, server.log()[-2000:]


def _check_concurrency_limit(client: grpcclient.InferenceServerClient, key: dict[str, str]) -> None:
    done: queue.Queue[Any] = queue.Queue()
    for _ in range(2):
        client.async_infer(
            "echo", _echo_inputs(0.6), lambda result, error: done.put(error), headers=key
        )
    time.sleep(0.2)
    expect_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "", client.infer, "echo", _echo_inputs(), headers=key
    )
    assert [done.get(timeout=10), done.get(timeout=10)] == [None, None]


def test_drain_finishes_inflight_rpcs(echo_repo: Path, tmp_path: Path) -> None:
    server = _start_echo(echo_repo, tmp_path, "--drain-timeout", "5")
    key = {"authorization": "Bearer k1"}
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        done: queue.Queue[Any] = queue.Queue()
        client.async_infer(
            "echo", _echo_inputs(0.8), lambda result, error: done.put((result, error)), headers=key
        )
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("echo", _echo_inputs(), headers=key, client_timeout=5)
        assert refused.value.status() == str(grpc.StatusCode.UNAVAILABLE)
        result, error = done.get(timeout=10)
        assert error is None and result.as_numpy("y") is not None
    assert server.process.wait(timeout=20) == 0, server.log()[-2000:]


def test_taken_grpc_port_stops_startup(echo_repo: Path, tmp_path: Path) -> None:
    """An explicit --grpc-port that is taken fails start-up with a message (exit status 1)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot serve gRPC"):
            start_server(echo_repo, tmp_path, "--no-llm", grpc_port=port, ready_timeout=60)


# -- perf_analyzer -------------------------------------------------------------------------


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason="perf_analyzer not installed (scripts/install-perf-analyzer.sh)",
)
def test_perf_analyzer_drives_grpc(server: RunningServer, tmp_path: Path) -> None:
    csv = tmp_path / "perf.csv"
    cmd = [
        str(PERF_ANALYZER),
        "-m",
        "digits_onnx",
        "-u",
        server.grpc_address,
        "-i",
        "grpc",
        # digits_onnx's 50 ms SLO is its default deadline; a stalled machine must not turn
        # into a 504, which ends perf_analyzer's run
        "--request-parameter",
        "timeout:10000000:int",
        "--concurrency-range",
        "1:4:3",
        "--measurement-interval",
        "1000",
        "--max-trials",
        "4",
        "--stability-percentage",
        "100",
        "-f",
        str(csv),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = csv.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency") and len(rows) == 3
    for row in rows[1:]:
        assert float(row.split(",")[1]) > 10  # inferences per second


# -- the codec, without a server -------------------------------------------------------------


def _one_input(datatype: str, shape: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="a", datatype=datatype, shape=shape)
    return request


def test_codec_typed_contents_and_ranges() -> None:
    from lockgate.errors import BadRequest
    from lockgate.protocol.grpc import codec

    request = _one_input("INT8", [2, 2])
    request.inputs[0].contents.int_contents.extend([-128, 0, 5, 127])
    array = codec.decode_infer_request(request).inputs["a"]
    assert array.dtype == np.int8 and array.tolist() == [[-128, 0], [5, 127]]
    request.inputs[0].contents.int_contents[3] = 128
    with pytest.raises(BadRequest, match="out of range for INT8"):
        codec.decode_infer_request(request)
    flags = _one_input("BOOL", [3])
    flags.raw_input_contents.append(b"\x00\x02\x01")
    assert codec.decode_infer_request(flags).inputs["a"].tolist() == [False, True, True]
    twice = _one_input("FP32", [1])
    twice.inputs.add(name="a", datatype="FP32", shape=[1])
    twice.raw_input_contents.extend([b"\x00" * 4, b"\x00" * 4])
    with pytest.raises(BadRequest, match="more than once"):
        codec.decode_infer_request(twice)
    huge = _one_input("FP32", [1 << 20, 1 << 20])
    with pytest.raises(BadRequest, match="more than the limit"):
        codec.decode_infer_request(huge)
    half = _one_input("FP16", [1])
    half.inputs[0].contents.fp32_contents.append(0.0)
    with pytest.raises(BadRequest, match="FP16 data must be sent in raw_input_contents"):
        codec.decode_infer_request(half)


def test_codec_checks_the_declaration_before_the_data() -> None:
    from lockgate.errors import BadRequest
    from lockgate.protocol.grpc import codec
    from lockgate.protocol.v2_codec import DeclaredInput

    request = _one_input("FP32", [2, 3])
    request.raw_input_contents.append(b"not 24 bytes")
    seen: list[list[DeclaredInput]] = []
    with pytest.raises(BadRequest, match="12 bytes"):
        codec.decode_infer_request(request, check=seen.append)
    assert seen == [[DeclaredInput("a", "FP32", (2, 3))]]

    def refuse(declared: list[DeclaredInput]) -> None:
        raise BadRequest("refused as declared")

    with pytest.raises(BadRequest, match="refused as declared"):
        codec.decode_infer_request(request, check=refuse)


def test_codec_response_is_raw_and_selected() -> None:
    from lockgate.protocol.grpc import codec
    from lockgate.protocol.v2_codec import RequestedOutput

    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array([b"ab"], object)}
    response = codec.encode_infer_response(
        model_name="m",
        model_version="1",
        request_id="r",
        outputs=outputs,
        requested=[RequestedOutput("t"), RequestedOutput("y", class_count=1)],
        datatypes={},
        batched=True,
    )
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("t", "BYTES", [1]),
        ("y", "BYTES", [2, 1]),
    ]
    assert response.raw_output_contents[0] == b"\x02\x00\x00\x00ab"
    assert response.raw_output_contents[1] == tensor_bytes(
        np.array([[b"2.000000:2"], [b"5.000000:2"]], object), "BYTES"
    )


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_grpc_calls_are_answered(
    client: grpcclient.InferenceServerClient, algorithm: str
) -> None:
    """tritonclient's `compression_algorithm`: gRPC's own message compression, both ways."""
    x = digits_rows(32)
    plain = client.infer("digits_onnx", [grpc_input("input", x, "FP32")])
    packed = client.infer(
        "digits_onnx", [grpc_input("input", x, "FP32")], compression_algorithm=algorithm
    )
    expected = plain.as_numpy("probabilities")
    assert expected is not None and expected.shape == (32, 10)
    np.testing.assert_array_equal(packed.as_numpy("probabilities"), expected)
