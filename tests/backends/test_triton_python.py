"""Triton Python models served as they are: `model.py` with `TritonPythonModel` importing
`triton_python_backend_utils`, and Triton's `config.pbtxt`, called with tritonclient over HTTP
and gRPC."""

from __future__ import annotations

import functools
import json
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lockgate.backends import pb_utils
from tests.conftest import RunningServer, free_port, start_server

T = TypeVar("T")

# Triton's own example (python_backend/examples/add_sub), unchanged but for the marker files
ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"

input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
parameters: { key: "offset" value: { string_value: "0.5" } }
instance_group [{ kind: KIND_CPU }]
"""

ADD_SUB_MODEL = """
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])
        self.offset = float(model_config["parameters"]["offset"]["string_value"])
        self.marks = Path(args["model_repository"]) / "marks"
        self.marks.mkdir(exist_ok=True)
        (self.marks / "initialize").write_text(json.dumps(
            {k: v for k, v in args.items() if k != "model_config"}))

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            if (in_0.as_numpy() < -1000).any():
                error = pb_utils.TritonError(
                    "INPUT0 is far too small", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            out_0 = in_0.as_numpy() + in_1.as_numpy() + self.offset
            out_1 = in_0.as_numpy() - in_1.as_numpy()
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1])
            )
        return responses

    def finalize(self):
        (self.marks / "finalize").write_text("cleaned up")
"""

# a batching model on text, the requests of its execute() counted in a second output
UPPER_CONFIG = """
name: "upper"
backend: "python"
max_batch_size: 16
input [{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

UPPER_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            if any(item == b"refuse" for item in text.flat):
                raise pb_utils.TritonError(
                    "this text is refused", pb_utils.TritonError.INVALID_ARG
                )
            upper = np.array([[item.upper()] for item in text[:, 0]], dtype=object)
            count = np.full((len(text), 1), len(requests), dtype=np.int32)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("REQUESTS", count)]))
        return responses
"""

# requests of different lengths in one execute(): each scaled by its own parameter, refused
# by it with the error code it names, and told how many requests shared its execute()
# (`full_batch` waits up to a second for 8 requests: a batch leaves when they are all in)
PER_REQUEST_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [{{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }}]
output [
  {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
"""

PER_REQUEST_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            parameters = json.loads(request.parameters())
            if "fail" in parameters:
                code = getattr(pb_utils.TritonError, parameters["fail"])
                message = f"request {request.request_id()} refused, one of {len(requests)}"
                error = pb_utils.TritonError(message, code)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            seen = json.dumps([request.request_id(), parameters, x.shape[1]], sort_keys=True)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x * parameters.get("scale", 1.0)),
                pb_utils.Tensor("REQUESTS", np.array([[len(requests)]], dtype=np.int32)),
                pb_utils.Tensor("SEEN", np.array([[seen.encode()]], dtype=object)),
            ]))
        return responses
"""

# a model that takes [2, 2] where clients send [4] (Triton's reshape), request by request
TRANSPOSE_CONFIG = """
name: "transpose"
backend: "python"
max_batch_size: 8
input [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } }]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 100000 }
"""

TRANSPOSE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()  # [1, 2, 2]
            count = np.array([[len(requests)]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", np.ascontiguousarray(x.transpose(0, 2, 1))),
                pb_utils.Tensor("REQUESTS", count),
            ]))
        return responses
"""

# a model that gets its responses wrong when a request asks it to; a batch leaves when it
# holds 4 requests (or after a second)
SLOPPY_CONFIG = """
name: "sloppy"
backend: "python"
max_batch_size: 4
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 1000000 }
"""

SLOPPY_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        asked = [json.loads(request.parameters()).get("answer") for request in requests]
        count = pb_utils.Tensor("REQUESTS", np.array([[len(requests)]], dtype=np.int32))
        responses = [
            None if answer == "none" else pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(request, "X").as_numpy()),
                count,
            ])
            for request, answer in zip(requests, asked)
        ]
        if "twice" in asked:
            responses.append(responses[-1])
        return responses
"""

# a default (non-decoupled) model that answers through each request's response sender, as the
# request's parameter "how" says; a batch leaves when it holds 4 requests (or after a second)
SENDER_CONFIG = SLOPPY_CONFIG.replace('"sloppy"', '"sender"')

SENDER_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        hows = [json.loads(request.parameters()).get("how", "send") for request in requests]
        count = pb_utils.Tensor("REQUESTS", np.array([[len(requests)]], dtype=np.int32))
        returned, late = [], []
        for request, how in zip(requests, hows):
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), count])
            sender = request.get_response_sender()
            returned.append(response if how == "return" else None)
            if how in ("send", "twice"):
                sender.send(response, flags=FINAL)
            elif how == "then_final":
                sender.send(response)
                sender.send(flags=FINAL)
            elif how == "no_final":
                sender.send(response)
            if how == "twice":
                late.append(lambda sender=sender, response=response: sender.send(response))
            elif how == "final_first":
                late.append(lambda sender=sender: sender.send(flags=FINAL))
        for send in late:  # after the others are answered: raises Triton's error
            send()
        return returned if "return" in hows else None
"""

# Triton's business logic scripting: a model that calls two others for each request, from
# a synchronous execute (exec) and from an async one (async_exec, both calls at once)
PIPELINE_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 16
input [{{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }}]
output [
  {{ name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] }}
]
"""

PIPELINE_MODEL = """
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def calls(request):
    text = pb_utils.get_input_tensor_by_name(request, "TEXT")
    model = json.loads(request.parameters()).get("call", "upper")  # the client's parameter
    rows = len(text.as_numpy())
    ones = pb_utils.Tensor("INPUT0", np.ones(4, dtype=np.float32) * rows)
    return (
        pb_utils.InferenceRequest(
            model_name=model, requested_output_names=["UPPER"], inputs=[text]
        ),
        pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT0"],
            inputs=[ones, pb_utils.Tensor("INPUT1", ones.as_numpy())],
        ),
    )


def answer(upper, added):
    for response in (upper, added):
        if response.has_error():
            return pb_utils.InferenceResponse(error=response.error())
    sum_ = pb_utils.get_output_tensor_by_name(added, "OUTPUT0").as_numpy()
    rows = len(pb_utils.get_output_tensor_by_name(upper, "UPPER").as_numpy())
    return pb_utils.InferenceResponse([
        pb_utils.Tensor("UPPER", pb_utils.get_output_tensor_by_name(upper, "UPPER").as_numpy()),
        pb_utils.Tensor("SUM", np.tile(sum_, (rows, 1))),
    ])


class TritonPythonModel:
    {execute}
"""

SYNC_EXECUTE = """def execute(self, requests):
        responses = []
        for request in requests:
            upper, added = calls(request)
            responses.append(answer(upper.exec(), added.exec()))
        return responses
"""

ASYNC_EXECUTE = """async def execute(self, requests):
        responses = []
        for request in requests:
            upper, added = calls(request)
            done = await asyncio.gather(upper.async_exec(), added.async_exec())
            responses.append(answer(*done))
        return responses
"""

# Triton's auto-complete example: the config names the model alone
AUTO_CONFIG = """
name: "auto"
backend: "python"
"""

AUTO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [2]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_INT64", "dims": [2]})
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy().astype(np.int64) * 2
            )])
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return triton_repository(
        tmp_path_factory.mktemp("triton-python-repo"),
        ("add_sub", ADD_SUB_CONFIG, ADD_SUB_MODEL),
        ("upper", UPPER_CONFIG, UPPER_MODEL),
        ("pipeline", PIPELINE_CONFIG, PIPELINE_MODEL.replace("{execute}", SYNC_EXECUTE)),
        ("pipeline_async", PIPELINE_CONFIG, PIPELINE_MODEL.replace("{execute}", ASYNC_EXECUTE)),
        ("auto", AUTO_CONFIG, AUTO_MODEL),
        ("per_request", PER_REQUEST_CONFIG.replace("{delay_us}", "100000"), PER_REQUEST_MODEL),
        ("full_batch", PER_REQUEST_CONFIG.replace("{delay_us}", "1000000"), PER_REQUEST_MODEL),
        ("sloppy", SLOPPY_CONFIG, SLOPPY_MODEL),
        ("transpose", TRANSPOSE_CONFIG, TRANSPOSE_MODEL),
        ("sender", SENDER_CONFIG, SENDER_MODEL),
    )


def triton_repository(root: Path, *models: tuple[str, str, str]) -> Path:
    """`root` as a repository of Triton Python models: each (name, config.pbtxt with `{name}`
    and doubled braces, model.py), in version 1."""
    for name, config, model in models:
        config = config.replace("{name}", name).replace("{{", "{").replace("}}", "}")
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (root / name / "1" / "model.py").write_text(textwrap.dedent(model))
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        repo,
        tmp_path_factory.mktemp("triton-python-logs"),
        "--no-llm",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        grpc_port=free_port(),
    )
    yield running
    running.stop()


def add_sub_inputs(module: object, a: np.ndarray, b: np.ndarray) -> list[object]:
    inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]  # type: ignore[attr-defined]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_tritons_add_sub_example_answers_over_http_and_grpc(
    server: RunningServer, repo: Path
) -> None:
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        result = client.infer("add_sub", add_sub_inputs(module, a, b))
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b + 0.5)  # the parameter
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
    args = json.loads((repo / "add_sub" / "marks" / "initialize").read_text())
    assert args["model_name"] == "add_sub" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert Path(args["model_repository"]) == repo / "add_sub"


def test_an_error_response_is_the_clients_error_with_the_models_message(
    server: RunningServer,
) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    a = np.array([-5000, 0, 0, 0], dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        http.infer("add_sub", add_sub_inputs(httpclient, a, a))
    assert caught.value.status() == "400"
    assert "INPUT0 is far too small" in caught.value.message()


@pytest.mark.parametrize("model", ["pipeline", "pipeline_async"])
def test_a_model_that_calls_other_models_gets_their_answers_and_their_errors(
    server: RunningServer, model: str
) -> None:
    """Business logic scripting, synchronous (exec) and async (async_exec): each call goes
    through the called model; a called model's error comes back in its response, and the
    model passes it on to its client. The model reads its client's parameters."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    text = httpclient.InferInput("TEXT", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"ab"], [b"cd"]], dtype=object))
    result = http.infer(model, [text])
    assert result.as_numpy("UPPER").tolist() == [[b"AB"], [b"CD"]]
    np.testing.assert_allclose(result.as_numpy("SUM"), np.full((2, 4), 2 + 2 + 0.5))
    text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"ab"]], dtype=object))
    with pytest.raises(InferenceServerException) as caught:
        http.infer(model, [text], parameters={"call": "no_such_model"})
    assert caught.value.status() == "404", caught.value  # NOT_FOUND, as Triton answers it
    assert "no_such_model" in caught.value.message(), caught.value.message()


def at_once(calls: list[Callable[[], T]]) -> list[T | InferenceServerException]:
    """Each call on a thread of its own, all started together: its result or its error."""
    results: list[T | InferenceServerException] = [InferenceServerException("no answer")] * len(
        calls
    )
    start = threading.Barrier(len(calls))

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = calls[index]()
        except InferenceServerException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def upper_at_once(
    server: RunningServer, words: list[bytes]
) -> dict[bytes, tuple[bytes, int] | str]:
    """Each word from a client of its own, all sent at once: (UPPER, REQUESTS) or the error."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=len(words))

    def call(word: bytes) -> tuple[bytes, int]:
        text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[word]], dtype=object))
        result = client.infer("upper", [text])
        return result.as_numpy("UPPER")[0, 0], int(result.as_numpy("REQUESTS")[0, 0])

    results = at_once([functools.partial(call, word) for word in words])
    return {
        word: f"{got.status()} {got.message()}" if isinstance(got, Exception) else got
        for word, got in zip(words, results, strict=True)
    }


def test_requests_batched_together_are_answered_each_and_a_refused_one_fails_alone(
    server: RunningServer,
) -> None:
    """Clients at once: the batcher gives their requests to one execute() call, each its own
    InferenceRequest (REQUESTS counts them), and each client gets its own response. When the
    model raises on a batch, each of its requests runs alone: the one it refuses gets 400,
    the others their answers."""
    words = [f"word{i}".encode() for i in range(12)]
    answers = upper_at_once(server, words)
    assert {word: answer[0] for word, answer in answers.items()} == {w: w.upper() for w in words}
    assert max(answer[1] for answer in answers.values()) > 1  # several requests an execute()
    answers = upper_at_once(server, [*words, b"refuse"])
    refused = answers.pop(b"refuse")
    assert isinstance(refused, str) and refused.startswith("400"), refused
    assert "this text is refused" in refused
    assert {word: answer[0] for word, answer in answers.items()} == {w: w.upper() for w in words}


def scaled(
    server: RunningServer, length: int, scale: float, fail: str = "", model: str = "per_request"
) -> Callable[[], Any]:
    """A call to `model` with `length` values, its own id and parameters."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    x = httpclient.InferInput("X", [1, length], "FP32")
    x.set_data_from_numpy(np.arange(1, length + 1, dtype=np.float32)[None, :])
    parameters: dict[str, Any] = {"scale": scale, **({"fail": fail} if fail else {})}
    return functools.partial(
        client.infer, model, [x], request_id=f"r{length}", parameters=parameters
    )


def test_each_request_of_a_batch_has_its_own_shape_parameters_id_and_error(
    server: RunningServer,
) -> None:
    """Eight requests of different lengths (`allow_ragged_batch`) in one execute() call, each
    an InferenceRequest with its own tensors, id and parameters, as under Triton; the one the
    model answers with an error response gets that error, the seven others their outputs."""
    lengths = range(1, 9)
    calls = [
        scaled(server, n, n + 0.5, "INVALID_ARG" if n == 4 else "", "full_batch") for n in lengths
    ]
    results = at_once(calls)
    refused = results[3]
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == "400", refused.message()
    assert "request r4 refused, one of 8" in refused.message()  # refused within the batch
    for n, result in zip(lengths, results, strict=True):
        if n == 4:
            continue
        assert not isinstance(result, Exception), (n, result)
        expected = np.arange(1, n + 1, dtype=np.float32)[None, :] * (n + 0.5)
        np.testing.assert_allclose(result.as_numpy("Y"), expected)
        seen = json.loads(result.as_numpy("SEEN")[0, 0])
        assert seen == [f"r{n}", {"scale": n + 0.5}, n]  # its own id, parameters and shape
        assert int(result.as_numpy("REQUESTS")[0, 0]) == 8  # the batch of eight
    config = httpclient.InferenceServerClient(server.address).get_model_config("full_batch")
    assert config["input"][0]["allow_ragged_batch"] is True


def test_the_server_keeps_its_own_parameters_from_the_model(server: RunningServer) -> None:
    """`request.parameters()` holds the client's parameters but those the server acts on
    (priority, timeout, sequence), as in Triton."""
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = grpcclient.InferInput("X", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
    result = grpc.infer(
        "per_request",
        [x],
        request_id="g",
        priority=1,
        timeout=10_000_000,
        parameters={"scale": 2.0, "note": "kept"},
    )
    assert json.loads(result.as_numpy("SEEN")[0, 0]) == ["g", {"note": "kept", "scale": 2.0}, 3]
    np.testing.assert_allclose(result.as_numpy("Y"), np.full((1, 3), 2.0))


@pytest.mark.parametrize(
    ("code", "status", "grpc_status"),
    [
        ("INVALID_ARG", "400", "INVALID_ARGUMENT"),
        ("UNKNOWN", "400", "INVALID_ARGUMENT"),
        ("NOT_FOUND", "404", "NOT_FOUND"),
        ("INTERNAL", "500", "INTERNAL"),
        ("UNSUPPORTED", "501", "UNIMPLEMENTED"),
        ("UNAVAILABLE", "503", "UNAVAILABLE"),
    ],
)
def test_an_error_response_has_tritons_status_for_its_code(
    server: RunningServer, code: str, status: str, grpc_status: str
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        scaled(server, 2, 1.0, code)()
    assert caught.value.status() == status and "request r2 refused" in caught.value.message()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = grpcclient.InferInput("X", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("per_request", [x], request_id="r2", parameters={"fail": code})
    assert caught.value.status() == f"StatusCode.{grpc_status}", caught.value


def sloppy(server: RunningServer, answer: str = "") -> Callable[[], Any]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    x = httpclient.InferInput("X", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[1, 2]], dtype=np.float32))
    parameters = {"answer": answer} if answer else None
    return functools.partial(client.infer, "sloppy", [x], parameters=parameters)


def test_a_wrong_count_of_responses_fails_the_batch_and_a_non_response_its_request(
    server: RunningServer,
) -> None:
    """Four requests in one execute(). One response too many: the four get a 500 that says
    what the model must return. None in place of a response: that request alone gets a 500;
    the three others batched with it are answered."""
    results = at_once([sloppy(server, "twice" if i == 0 else "") for i in range(4)])
    for result in results:
        assert isinstance(result, InferenceServerException), result
        assert result.status() == "500", result.message()
        assert "got 4 requests and returned 5 responses" in result.message()
        assert "one InferenceResponse per request" in result.message()
    results = at_once([sloppy(server, "none" if i == 0 else "") for i in range(4)])
    missing = results[0]
    assert isinstance(missing, InferenceServerException), missing
    assert missing.status() == "500" and "returned None for request" in missing.message()
    assert "sent request" in missing.message() and "no response" in missing.message()
    for result in results[1:]:
        assert not isinstance(result, Exception), result
        np.testing.assert_allclose(result.as_numpy("Y"), [[1, 2]])
        assert result.as_numpy("REQUESTS")[0, 0] == 4  # batched with the one that failed


def sent(server: RunningServer, hows: list[str]) -> list[Any]:
    """A request of each `how` to the sender model, all at once (one batch of 4): each
    client's Y (X * 2) with the batch's REQUESTS, or its error as 'status message'."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=4)

    def call(index: int, how: str) -> tuple[list[float], int]:
        x = httpclient.InferInput("X", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([[index, 1]], dtype=np.float32))
        result = client.infer("sender", [x], parameters={"how": how})
        return result.as_numpy("Y").tolist()[0], int(result.as_numpy("REQUESTS")[0, 0])

    results = at_once([functools.partial(call, i, how) for i, how in enumerate(hows)])
    return [f"{r.status()} {r.message()}" if isinstance(r, Exception) else r for r in results]


def test_a_default_model_may_answer_through_each_requests_response_sender(
    server: RunningServer,
) -> None:
    """Four requests in one execute() of a non-decoupled model: two send their response with
    the final flag, one the response then the flag alone, one is returned at its index (None
    at the others'); each client gets its own answer. All sent: execute() returns None."""
    hows = ["send", "then_final", "return", "send"]
    assert sent(server, hows) == [([2.0 * i, 2.0], 4) for i in range(4)]
    assert sent(server, ["send", "then_final", "send", "send"]) == [
        ([2.0 * i, 2.0], 4) for i in range(4)
    ]


def test_a_request_unanswered_or_answered_twice_by_a_default_model_gets_an_error(
    server: RunningServer,
) -> None:
    """A request neither returned nor sent a response, or sent one without the final flag,
    fails with a 500 that says so; the requests batched with it are answered. A second
    response, or the final flag before any response, raises Triton's error in the model:
    the requests not yet answered fail with it, the others keep their answers."""
    results = sent(server, ["none", "no_final", "send", "send"])
    assert isinstance(results[0], str) and results[0].startswith("500"), results[0]
    assert "returned None and sent request" in results[0] and "no response" in results[0]
    assert isinstance(results[1], str) and results[1].startswith("500"), results[1]
    assert "without TRITONSERVER_RESPONSE_COMPLETE_FINAL" in results[1]
    assert results[2:] == [([4.0, 2.0], 4), ([6.0, 2.0], 4)]
    results = sent(server, ["twice", "send", "return", "send"])
    assert results[:2] == [([0.0, 2.0], 4), ([2.0, 2.0], 4)]  # its first response stands
    assert isinstance(results[2], str) and results[2].startswith("500"), results[2]
    assert "Non-decoupled model cannot send more than one response" in results[2]
    assert results[3] == ([6.0, 2.0], 4)
    results = sent(server, ["send", "final_first", "send", "send"])
    assert isinstance(results[1], str), results[1]
    assert "cannot send complete final before sending a response" in results[1]
    assert [results[0], *results[2:]] == [([0.0, 2.0], 4), ([4.0, 2.0], 4), ([6.0, 2.0], 4)]


def test_a_reshaped_model_gets_each_request_in_its_own_shape(server: RunningServer) -> None:
    """`reshape` applies to each request of a batch on its own: the model takes [1, 2, 2]
    per request, and each client gets its own [1, 4] back."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=6)

    def transpose(value: int) -> np.ndarray:
        x = httpclient.InferInput("X", [1, 4], "FP32")
        x.set_data_from_numpy(np.arange(4, dtype=np.float32)[None, :] + 10 * value)
        result = client.infer("transpose", [x])
        return np.concatenate([result.as_numpy("Y"), result.as_numpy("REQUESTS")], axis=1)

    results = at_once([functools.partial(transpose, value) for value in range(6)])
    for value, result in enumerate(results):
        assert not isinstance(result, Exception), result
        np.testing.assert_allclose(result[0, :4], np.array([0, 2, 1, 3]) + 10 * value)
    assert max(int(result[0, 4]) for result in results) > 1  # type: ignore[index]


def test_auto_complete_config_fills_the_config(server: RunningServer) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = http.get_model_config("auto")
    assert config["max_batch_size"] == 8 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("X", "TYPE_INT32", [2])
    ]
    assert [(t["name"], t["data_type"]) for t in config["output"]] == [("Y", "TYPE_INT64")]
    x = httpclient.InferInput("X", [3, 2], "INT32")
    x.set_data_from_numpy(np.arange(6, dtype=np.int32).reshape(3, 2))
    result = http.infer("auto", [x])
    assert result.as_numpy("Y").tolist() == [[0, 2], [4, 6], [8, 10]]


def test_finalize_runs_at_unload(server: RunningServer, repo: Path) -> None:
    marks = repo / "add_sub" / "marks"
    assert not (marks / "finalize").exists()
    unload = httpx.post(server.url + "/v2/repository/models/add_sub/unload", timeout=30)
    assert unload.status_code == 200, unload.text
    assert (marks / "finalize").read_text() == "cleaned up"
    load = httpx.post(server.url + "/v2/repository/models/add_sub/load", timeout=60)
    assert load.status_code == 200, load.text


def test_the_utilities_convert_types_and_bytes_as_triton_does() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == 11  # TRITONSERVER_TYPE_FP32
    assert pb_utils.numpy_to_triton_type(np.object_) == 13  # BYTES
    assert pb_utils.triton_to_numpy_type(8) is np.int32
    items = np.array([b"a", b"", "\u00e9"], dtype=object)
    wire = pb_utils.serialize_byte_tensor(items)
    assert wire.dtype == np.uint8 and bytes(wire[:5]) == b"\x01\x00\x00\x00a"
    assert list(pb_utils.deserialize_bytes_tensor(wire)) == [b"a", b"", "\u00e9".encode()]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.deserialize_bytes_tensor(b"\x05\x00\x00\x00ab")
    tensor = pb_utils.Tensor("T", np.arange(6, dtype=np.float32).reshape(2, 3))
    again = pb_utils.Tensor.from_dlpack("U", tensor.to_dlpack())
    assert again.name() == "U" and again.shape() == [2, 3]
    np.testing.assert_array_equal(again.as_numpy(), tensor.as_numpy())
    assert pb_utils.Tensor("S", np.array(["x"])).as_numpy()[0] == b"x"


def test_auto_complete_checks_what_the_model_sets_against_the_config() -> None:
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "name": "m",
                "max_batch_size": 16,
                "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
                "sequence_batching": {},
            }
        )
    )
    with pytest.raises(ValueError, match="max_batch_size 16"):
        config.set_max_batch_size(8)
    with pytest.raises(ValueError, match="datatype TYPE_FP32"):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="dims"):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(ValueError, match="lacks dims"):
        config.add_output({"name": "Y", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="sequence_batching"):
        config.set_dynamic_batching()
    config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})  # the same: kept
    config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
    assert len(config.as_dict()["input"]) == 1 and config.as_dict()["output"][0]["name"] == "Y"
