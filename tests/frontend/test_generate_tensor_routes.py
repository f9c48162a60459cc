"""Triton's generate extension on models of named tensors (`frontend/generate_tensor_routes.py`):
a decoupled Triton Python model streamed over /generate_stream with httpx, as Triton's vLLM
and TensorRT-LLM Python models are used, and a model that answers once over both routes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.frontend.generate_tensor_routes import ONE_RESPONSE
from tests.backends.test_triton_python import triton_repository
from tests.conftest import RunningServer, start_server

# for a text and a count N, N responses "<text> <i><suffix>" (the suffix a request parameter),
# then the final flag alone; the parameter fail_at makes that response an error. It stops
# early once its client has gone, and notes how many it sent and whether it was cancelled
CHATTER_CONFIG = """
name: "chatter"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "count" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "index" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [{ count: 2 kind: KIND_CPU }]
"""

CHATTER_MODEL = """
import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = Path(args["model_repository"]) / "marks"
        self.marks.mkdir(exist_ok=True)

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            text = text.decode()
            count = int(pb_utils.get_input_tensor_by_name(request, "count").as_numpy()[0])
            parameters = json.loads(request.parameters())
            suffix, delay = parameters.get("suffix", ""), parameters.get("delay", 0)
            sender = request.get_response_sender()
            sent = 0
            for i in range(count):
                if sender.is_cancelled():
                    break
                if i == parameters.get("fail_at"):
                    code = pb_utils.TritonError.INVALID_ARG
                    error = pb_utils.TritonError(f"response {i} failed", code)
                    sender.send(pb_utils.InferenceResponse(error=error))
                else:
                    sender.send(pb_utils.InferenceResponse([
                        pb_utils.Tensor("text_output", np.array([f"{text} {i}{suffix}"], object)),
                        pb_utils.Tensor("index", np.array([i], dtype=np.int32)),
                    ]))
                sent += 1
                time.sleep(delay)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if request.request_id():
                mark = self.marks / request.request_id()
                mark.write_text(f"{sent} {sender.is_cancelled()}")
        return None
"""

# a model that answers once, batched: the text upper-cased and its length
UPPER_CONFIG = """
name: "upper"
backend: "python"
max_batch_size: 8
dynamic_batching {}
input [{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "length" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

UPPER_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            upper = np.array([[t[0].decode().upper()] for t in texts], dtype=object)
            length = np.array([[len(t[0])] for t in texts], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", upper), pb_utils.Tensor("length", length)
            ]))
        return responses
"""


# an ensemble may not run a decoupled model
ENSEMBLE_CONFIG = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "N" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }]
ensemble_scheduling { step [{
  model_name: "chatter"
  model_version: -1
  input_map { key: "text_input" value: "TEXT" }
  input_map { key: "count" value: "N" }
  output_map { key: "text_output" value: "OUT" }
}] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = triton_repository(
        tmp_path_factory.mktemp("generate-tensors-repo"),
        ("chatter", CHATTER_CONFIG, CHATTER_MODEL),
        ("upper", UPPER_CONFIG, UPPER_MODEL),
    )
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(repo, tmp_path_factory.mktemp("generate-tensors-logs"), "--no-llm")
    yield running
    running.stop()


def events(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, in order."""
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


def marked(repo: Path, request_id: str) -> list[str]:
    """What chatter noted of a request once done: responses sent, and whether cancelled."""
    mark = repo / "chatter" / "marks" / request_id
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = mark.read_text() if mark.exists() else ""
        if text:  # written whole (write_text creates the file first)
            return text.split()
        time.sleep(0.02)
    raise AssertionError(f"chatter noted nothing of request {request_id}")


def cancelled(server: RunningServer) -> float:
    """The requests to chatter that ended cancelled, from /metrics (0 before the first)."""
    series = 'lockgate_requests_total{model="chatter",outcome="cancelled",version="1"} '
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series):
            return float(line.removeprefix(series))
    return 0.0


def stream(server: RunningServer, model: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/generate_stream", json=body, timeout=30)


def test_each_response_of_a_decoupled_model_is_an_event_in_order(server: RunningServer) -> None:
    body = {"text_input": "hi", "count": 4, "parameters": {"suffix": "!"}}
    with httpx.stream(
        "POST", f"{server.url}/v2/models/chatter/generate_stream", json=body, timeout=30
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        got = events(reply.iter_lines())
    assert got == [
        {"model_name": "chatter", "model_version": "1", "text_output": f"hi {i}!", "index": i}
        for i in range(4)
    ]
    assert stream(server, "chatter", {"text_input": "x", "count": 0}).text == ""  # final alone


def test_generate_on_a_decoupled_model_takes_exactly_one_response(
    server: RunningServer, repo: Path
) -> None:
    url = f"{server.url}/v2/models/chatter/generate"
    one = httpx.post(url, json={"text_input": "solo", "count": 1, "id": "one"}, timeout=30)
    assert one.status_code == 200, one.text
    assert one.json() == {
        "id": "one",
        "model_name": "chatter",
        "model_version": "1",
        "text_output": "solo 0",
        "index": 0,
    }
    for count in (0, 3):
        many = httpx.post(url, json={"text_input": "x", "count": count}, timeout=30)
        assert many.status_code == 400 and many.json() == {"error": ONE_RESPONSE}
    # the second response cancels the request: the model stops sending
    body = {"text_input": "x", "count": 1000, "id": "many", "parameters": {"delay": 0.01}}
    assert httpx.post(url, json=body, timeout=30).status_code == 400
    assert marked(repo, "many")[1] == "True" and int(marked(repo, "many")[0]) < 1000


def test_an_error_response_mid_stream_is_an_error_event_and_the_stream_goes_on(
    server: RunningServer,
) -> None:
    for fail_at, status in ((1, 200), (0, 400)):  # the status is the first response's
        body = {"text_input": "fail", "count": 3, "parameters": {"fail_at": fail_at}}
        reply = stream(server, "chatter", body)
        assert reply.status_code == status
        assert reply.headers["content-type"].startswith("text/event-stream")
        got = events(iter(reply.text.splitlines()))
        texts: list[str | None] = ["fail 0", "fail 1", "fail 2"]
        texts[fail_at] = None
        assert [event.get("text_output") for event in got] == texts
        assert got[fail_at] == {"error": f"model 'chatter': response {fail_at} failed"}
    again = stream(server, "chatter", {"text_input": "after", "count": 2})
    assert [event["text_output"] for event in events(iter(again.text.splitlines()))] == [
        "after 0",
        "after 1",
    ]


def test_a_client_that_goes_away_cancels_the_request(server: RunningServer, repo: Path) -> None:
    before = cancelled(server)
    body = {"text_input": "long", "count": 1000, "id": "early", "parameters": {"delay": 0.01}}
    with httpx.stream(
        "POST", f"{server.url}/v2/models/chatter/generate_stream", json=body, timeout=30
    ) as reply:
        read = 0
        for line in reply.iter_lines():
            read += line.startswith("data: ")
            if read == 3:
                break  # and close the connection
    sent, was_cancelled = marked(repo, "early")
    assert was_cancelled == "True" and 3 <= int(sent) < 1000
    assert cancelled(server) == before + 1
    # nothing of it is left: both instances answer at once
    for text in ("a", "b"):
        assert stream(server, "chatter", {"text_input": text, "count": 1}).status_code == 200


def test_a_model_that_answers_once_answers_both_routes(server: RunningServer) -> None:
    expected = {"model_name": "upper", "model_version": "1", "text_output": "ABC", "length": 3}
    whole = httpx.post(
        f"{server.url}/v2/models/upper/generate", json={"text_input": "abc"}, timeout=30
    )
    assert whole.status_code == 200 and whole.json() == expected
    streamed = stream(server, "upper", {"text_input": "abc"})
    assert events(iter(streamed.text.splitlines())) == [expected]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "malformed JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"text_input": "x"}', "missing required input(s) ['count']"),
        (b'{"text_input": "x", "count": "three"}', "INT32 takes integers"),
        (b'{"text_input": 5, "count": 1}', "BYTES takes strings"),
        (b'{"text_input": ["a", "b"], "count": 1}', "2 value(s) cannot take its shape [1]"),
        (b'{"text_input": "x", "count": [[1]]}', "got `array`"),
        (b'{"text_input": "x", "count": 1, "parameters": 3}', "parameters must be an object"),
        (b'{"text_input": "x", "count": 1, "extra": {"a": 1}}', "parameter 'extra' must be"),
    ],
)
def test_bad_bodies_are_400_with_a_message(server: RunningServer, body: bytes, says: str) -> None:
    for route in ("generate", "generate_stream"):
        reply = httpx.post(f"{server.url}/v2/models/chatter/{route}", content=body, timeout=30)
        assert reply.status_code == 400, reply.text
        assert says in reply.json()["error"]


def test_an_ensemble_with_a_decoupled_step_is_refused_at_load(server: RunningServer) -> None:
    index = httpx.post(f"{server.url}/v2/repository/index", json={}, timeout=10).json()
    (entry,) = [e for e in index if e["name"] == "chain"]
    assert entry["state"] == "UNAVAILABLE"
    assert "its step 'chatter' is decoupled" in entry["reason"], entry
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    reply = httpx.post(f"{server.url}/v2/models/chain/infer", json=body, timeout=10)
    assert reply.status_code == 503 and "is decoupled" in reply.json()["error"]
