"""Triton's logging and trace extensions through a real server, with tritonclient over HTTP and
gRPC: the settings read and change as Triton's do, a change really changes the log (DEBUG
records appear, INFO ones stop, ISO 8601 stamps) and which requests the OTLP collector
receives (rate, count, a model's own settings and their clearing), and every misuse is a
4xx or INVALID_ARGUMENT / NOT_FOUND that names it."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.grpc import inference_pb2_grpc as pb_grpc
from tests.conftest import RunningServer, _write_python_model, free_port, start_server

pytest.importorskip("opentelemetry.sdk", reason="needs lockgate[otel]")
from tests.frontend.otlp_receiver import Receiver, receiving

DEFAULT_LOG = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}
ON = {"trace_level": ["TIMESTAMPS"]}
DEBUG_BATCH = re.compile(r" DEBUG lockgate\.batcher: model (\w+):1 ran a batch of")
CLEARED = {"trace_level": None, "trace_rate": None, "trace_count": None}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("settings-repo")
    _write_python_model(repo, "echo", {})
    _write_python_model(repo, "other", {})
    running = start_server(
        repo,
        tmp_path_factory.mktemp("settings"),
        "--otel-endpoint",
        receiver.url,
        "--trace-level",
        "OFF",  # until a test turns it on
        env={"OTEL_BSP_SCHEDULE_DELAY": "20"},  # ms between exports
        grpc_port=free_port(),
    )
    yield running
    running.stop()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server.address)
    yield client
    # every test leaves the settings as the server started
    client.update_log_settings({k: v for k, v in DEFAULT_LOG.items() if k != "log_file"})
    for model in ("", "echo", "other"):
        client.update_trace_settings(model, CLEARED)
    client.close()


@pytest.fixture
def grpc_client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        yield client


def infer(client: httpclient.InferenceServerClient, model: str, request_id: str) -> None:
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    client.infer(model, [tensor], headers={"x-request-id": request_id})  # the span's id


def traced_of(receiver: Receiver, ids: list[str], expected: int) -> set[str]:
    """The ids among `ids` whose requests reached the collector: once `expected` have, and
    the exporter has had time to send any more (it sends every 20 ms)."""
    deadline = time.monotonic() + 10
    while len(receiver.request_ids() & set(ids)) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    return receiver.request_ids() & set(ids)


def ids(prefix: str, count: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"{prefix}-{tag}-{i}" for i in range(count)]


def log_lines_after(server: RunningServer, mark: int, pattern: str, timeout: float = 5.0) -> str:
    """The log written after `mark` (a length of it), once it holds `pattern` (or after
    `timeout`, for a check that it does not)."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.log()[mark:]
        if re.search(pattern, text) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# -- logging -------------------------------------------------------------------------------


def test_log_settings_read_as_tritons(
    http: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    assert http.get_log_settings() == DEFAULT_LOG
    answer = grpc_client.get_log_settings(as_json=True)["settings"]
    assert answer == {
        "log_file": {"string_param": ""},
        "log_info": {"bool_param": True},
        "log_warning": {"bool_param": True},
        "log_error": {"bool_param": True},
        "log_verbose_level": {"uint32_param": 0},
        "log_format": {"string_param": "default"},
    }
    metadata = http.get_server_metadata()
    assert {"logging", "trace"} <= set(metadata["extensions"])


def test_verbose_level_turns_debug_records_on_and_off(
    server: RunningServer,
    http: httpclient.InferenceServerClient,
    grpc_client: grpcclient.InferenceServerClient,
) -> None:
    mark = len(server.log())
    infer(http, "echo", "quiet-1")
    assert not DEBUG_BATCH.search(log_lines_after(server, mark, DEBUG_BATCH.pattern, 0.3))
    answer = http.update_log_settings({"log_verbose_level": 1})
    assert answer == {**DEFAULT_LOG, "log_verbose_level": 1}
    mark = len(server.log())
    infer(http, "echo", "verbose-1")
    assert DEBUG_BATCH.search(log_lines_after(server, mark, DEBUG_BATCH.pattern))
    answer = grpc_client.update_log_settings({"log_verbose_level": 0}, as_json=True)
    assert answer["settings"]["log_verbose_level"] == {"uint32_param": 0}
    mark = len(server.log())
    infer(http, "echo", "quiet-2")
    assert not DEBUG_BATCH.search(log_lines_after(server, mark, DEBUG_BATCH.pattern, 0.3))


def test_info_off_stops_info_records_and_iso8601_stamps_lines(
    server: RunningServer,
    http: httpclient.InferenceServerClient,
    grpc_client: grpcclient.InferenceServerClient,
) -> None:
    changed = " INFO lockgate.frontend: trace settings of echo changed"
    grpc_client.update_log_settings({"log_info": False})
    mark = len(server.log())
    http.update_trace_settings("echo", {"trace_rate": "5"})  # an INFO record, dropped
    http.update_log_settings({"log_info": True, "log_format": "ISO8601"})
    http.update_trace_settings("echo", {"trace_rate": "6"})
    text = log_lines_after(server, mark, changed)
    lines = [line for line in text.splitlines() if changed in line]
    assert len(lines) == 1 and "'trace_rate': ['6']" in lines[0], text
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO ", lines[0]), lines[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"log_file": "/tmp/lockgate.log"}, "log_file cannot be changed at run time"),
        ({"log_info": "yes"}, "log_info must be true or false"),
        ({"log_verbose_level": -1}, "log_verbose_level must be 0 to 4294967295"),
        ({"log_format": "json"}, "log_format must be one of default, ISO8601"),
        ({"log_warnings": True}, "unknown log setting 'log_warnings'"),
    ],
)
def test_log_refusals_over_http(
    server: RunningServer,
    http: httpclient.InferenceServerClient,
    change: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(InferenceServerException, match=message):
        http.update_log_settings({"log_info": False, **change})
    answer = httpx.post(server.url + "/v2/logging", json=change)
    assert answer.status_code == 400 and message in answer.json()["error"]
    assert http.get_log_settings() == DEFAULT_LOG  # nothing applied


def test_log_refusals_over_grpc(
    server: RunningServer, grpc_client: grpcclient.InferenceServerClient
) -> None:
    for change, message in [
        ({"log_file": "/tmp/lockgate.log"}, "log_file cannot be changed"),
        ({"log_format": "json"}, "log_format must be one of"),
        ({"log_warnings": True}, "unknown log setting"),
    ]:
        with pytest.raises(InferenceServerException, match=message) as caught:
            grpc_client.update_log_settings(change)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    wrong = pb.LogSettingsRequest()
    wrong.settings["log_info"].string_param = "yes"  # a type tritonclient would not send
    with grpc.insecure_channel(server.grpc_address) as channel, pytest.raises(grpc.RpcError) as raw:
        pb_grpc.GRPCInferenceServiceStub(channel).LogSettings(wrong)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "log_info must be true or false" in (raw.value.details() or "")


# -- tracing -------------------------------------------------------------------------------


def test_trace_settings_read_as_tritons(
    http: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    expected = {
        "trace_level": ["OFF"],  # --trace-level
        "trace_rate": "1",
        "trace_count": "-1",
        "trace_mode": "opentelemetry",
    }
    assert http.get_trace_settings() == expected
    assert http.get_trace_settings("echo") == expected
    answer = grpc_client.get_trace_settings(as_json=True)["settings"]
    assert answer == {k: {"value": v if isinstance(v, list) else [v]} for k, v in expected.items()}


def test_tracing_turned_on_at_run_time_closes_the_lane(
    server: RunningServer, http: httpclient.InferenceServerClient, receiver: Receiver
) -> None:
    lane = "lockgate_http_lane_requests_total"
    before = server.metric(lane)
    quiet = ids("lane", 3)
    for request_id in quiet:
        infer(http, "echo", request_id)  # no trace to write: answered below ASGI
    assert server.metric(lane) == before + 3
    http.update_trace_settings(settings=ON)
    traced = ids("traced", 3)
    for request_id in traced:
        infer(http, "echo", request_id)
    assert server.metric(lane) == before + 3  # the ASGI path, which writes the trace
    assert traced_of(receiver, quiet + traced, 3) == set(traced)


def test_trace_rate_samples_one_request_in_n(
    http: httpclient.InferenceServerClient, receiver: Receiver
) -> None:
    assert http.update_trace_settings(settings={**ON, "trace_rate": "3"})["trace_rate"] == "3"
    sent = ids("rate", 9)
    for request_id in sent:
        infer(http, "echo", request_id)
    assert traced_of(receiver, sent, 3) == {sent[2], sent[5], sent[8]}


def test_trace_count_stops_after_n(
    http: httpclient.InferenceServerClient,
    grpc_client: grpcclient.InferenceServerClient,
    receiver: Receiver,
) -> None:
    answer = grpc_client.update_trace_settings(settings={**ON, "trace_count": "2"}, as_json=True)
    assert answer["settings"]["trace_count"] == {"value": ["2"]}
    sent = ids("count", 5)
    for request_id in sent:
        infer(http, "echo", request_id)
    assert traced_of(receiver, sent, 2) == set(sent[:2])
    assert http.get_trace_settings()["trace_count"] == "0"  # what is left


def test_a_model_setting_overrides_the_global_one_until_cleared(
    http: httpclient.InferenceServerClient,
    grpc_client: grpcclient.InferenceServerClient,
    receiver: Receiver,
) -> None:
    http.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "2"})
    answer = grpc_client.update_trace_settings(
        "other", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, as_json=True
    )
    assert answer["settings"]["trace_level"] == {"value": ["TIMESTAMPS"]}
    assert http.get_trace_settings("echo")["trace_level"] == ["OFF"]  # the global one
    echo, other = ids("echo-off", 3), ids("other-on", 3)
    for a, b in zip(echo, other, strict=True):
        infer(http, "echo", a)
        infer(http, "other", b)
    assert traced_of(receiver, echo + other, 3) == set(other)
    # cleared: the model's level follows the global OFF again, its rate is still its own
    cleared = http.update_trace_settings("other", {"trace_level": None})
    assert cleared["trace_level"] == ["OFF"] and cleared["trace_rate"] == "1"
    after = ids("other-off", 2)
    for request_id in after:
        infer(http, "other", request_id)
    assert traced_of(receiver, after, 0) == set()
    cleared = grpc_client.update_trace_settings("other", {"trace_rate": None}, as_json=True)
    assert cleared["settings"]["trace_rate"] == {"value": ["2"]}  # all global now


def test_a_callers_trace_is_followed_past_the_rate(
    http: httpclient.InferenceServerClient, receiver: Receiver
) -> None:
    http.update_trace_settings(settings={**ON, "trace_rate": "1000"})
    trace_id = uuid.uuid4().hex
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    http.infer("echo", [tensor], headers=headers)
    receiver.of_trace(trace_id, 1)


@pytest.mark.parametrize(
    ("path", "change", "status", "message"),
    [
        ("", {"trace_level": ["TENSORS"]}, 400, "trace level TENSORS is not supported"),
        ("", {"trace_rate": "0"}, 400, "trace_rate must be an integer from 1 to 4294967295"),
        ("", {"trace_rate": "-5"}, 400, "trace_rate must be an integer"),
        ("", {"trace_rate": 5}, 400, "trace_rate must be a string"),
        ("", {"trace_count": "-2"}, 400, "trace_count must be an integer from -1"),
        ("", {"trace_file": "/tmp/trace.json"}, 400, "trace_file cannot be set"),
        ("", {"log_frequency": "10"}, 400, "log_frequency is not supported"),
        ("", {"trace_sample": "1"}, 400, "unknown trace setting 'trace_sample'"),
        ("models/nope/", {"trace_rate": "2"}, 404, "unknown model 'nope'"),
    ],
)
def test_trace_refusals_over_http(
    server: RunningServer,
    http: httpclient.InferenceServerClient,
    path: str,
    change: dict[str, Any],
    status: int,
    message: str,
) -> None:
    answer = httpx.post(f"{server.url}/v2/{path}trace/setting", json={"trace_rate": "7", **change})
    assert answer.status_code == status and message in answer.json()["error"], answer.text
    assert http.get_trace_settings()["trace_rate"] == "1"  # nothing applied
    with pytest.raises(InferenceServerException, match=message):
        http.update_trace_settings(path.removeprefix("models/").rstrip("/"), change)


def test_trace_refusals_over_grpc(grpc_client: grpcclient.InferenceServerClient) -> None:
    for model, change, code, message in [
        ("", {"trace_level": ["TENSORS"]}, "INVALID_ARGUMENT", "TENSORS is not supported"),
        ("", {"trace_rate": ["1", "2"]}, "INVALID_ARGUMENT", "trace_rate takes one value"),
        ("", {"trace_count": "-9"}, "INVALID_ARGUMENT", "trace_count must be an integer"),
        ("", {"trace_file": "/tmp/t"}, "INVALID_ARGUMENT", "trace_file cannot be set"),
        ("nope", {"trace_rate": "2"}, "NOT_FOUND", "unknown model 'nope'"),
    ]:
        with pytest.raises(InferenceServerException, match=message) as caught:
            grpc_client.update_trace_settings(model, change)
        assert caught.value.status() == f"StatusCode.{code}"
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.get_trace_settings("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_a_version_has_no_trace_settings(server: RunningServer) -> None:
    answer = httpx.get(server.url + "/v2/models/echo/versions/1/trace/setting")
    assert answer.status_code == 404
    answer = httpx.put(server.url + "/v2/trace/setting", json={})
    assert answer.status_code == 405


def test_a_server_without_an_exporter_refuses_to_trace(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _write_python_model(repo, "echo", {})
    running = start_server(repo, tmp_path)
    try:
        client = httpclient.InferenceServerClient(running.address)
        assert client.get_trace_settings()["trace_level"] == ["OFF"]
        with pytest.raises(InferenceServerException, match="--otel-endpoint"):
            client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    finally:
        running.stop()
