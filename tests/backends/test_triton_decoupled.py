"""Decoupled Triton Python models (`model_transaction_policy { decoupled: true }`): each
request answered by a stream of responses over gRPC ModelStreamInfer, driven by tritonclient's
`start_stream` and `async_stream_infer` as a Triton client drives them."""

from __future__ import annotations

import asyncio
import queue
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from lockgate.backends.python import load_composition
from lockgate.backends.response_stream import ResponseStream, StreamedResponse
from lockgate.backends.triton_decoupled import Paced
from lockgate.backends.triton_python import autocomplete
from lockgate.config import ModelConfig
from lockgate.core.config_triton import parse_pbtxt_config
from lockgate.errors import ConfigError
from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.grpc import inference_pb2_grpc as pb_grpc
from tests.backends.test_triton_python import triton_repository
from tests.conftest import RunningServer, free_port, start_server

# as Triton's repeat example (python_backend/examples/decoupled): each element of IN a
# response of its own, sent from a thread after execute has returned, then the final flag
# alone; a negative element is an error response, and the stream goes on
REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [{ count: 2 kind: KIND_CPU }]
"""

REPEAT_MODEL = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            thread = threading.Thread(target=self.respond, args=(sender, values))
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, sender, values):
        time.sleep(0.05)  # execute has returned by now
        for index, value in enumerate(values):
            if value < 0:
                error = pb_utils.TritonError(f"element {index} is negative")
                sender.send(pb_utils.InferenceResponse(error=error))
                continue
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""

# as Triton's square example: N responses of N*N for an input N, sent from execute itself,
# the final flag with the last; 13 raises; -1 sends until its client cancels
SQUARE_CONFIG = """
name: "square"
backend: "python"
model_transaction_policy { decoupled: true }
input [{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }]
output [{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }]
instance_group [{ count: 2 kind: KIND_CPU }]
"""

SQUARE_MODEL = """
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
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            if n == 13:
                raise pb_utils.TritonError("13 is unlucky", pb_utils.TritonError.INVALID_ARG)
            if n == -1:
                self.until_cancelled(request, sender)
                continue
            scale = json.loads(request.parameters()).get("scale", 1)
            for i in range(n):
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == n - 1 else 0
                out = pb_utils.Tensor("OUT", np.array([n * n * scale], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([out]), flags=flags)
            if n == 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def until_cancelled(self, request, sender):
        sent = 0
        deadline = time.monotonic() + 20
        while not request.is_cancelled() and time.monotonic() < deadline:
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([sent], dtype=np.int32))]))
            sent += 1
            time.sleep(0.01)
        sender.send(pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.array([-1], dtype=np.int32))]))  # dropped
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        (self.marks / "cancelled").write_text(f"{request.is_cancelled()} {sender.is_cancelled()}")
"""

# an async execute on the event loop; and one that forgets the final flag
COUNTDOWN_CONFIG = """
name: "{name}"
backend: "python"
model_transaction_policy {{ decoupled: true }}
input [{{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }}]
output [{{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }}]
"""

COUNTDOWN_MODEL = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n, 0, -1):
                if i % 50 == 0:  # sends between awaits: past the bound, taken all the same
                    await asyncio.sleep(0.001)
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

FORGETFUL_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.get_response_sender().send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([7], dtype=np.int32))]))
        return None
"""


# sends as fast as it can until its client cancels; notes how many sends had returned when
# one had to wait for the client (a send that took over 0.3 s)
FLOOD_CONFIG = """
name: "{name}"
backend: "python"
model_transaction_policy { decoupled: true }
parameters: {{ key: "max_buffered_responses" value: {{ string_value: "8" }} }}
input [{{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }}]
output [{{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }}]
"""

FLOOD_MODEL = """
import asyncio
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.mark = Path(args["model_repository"]) / "blocked"

    {define} execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            out = pb_utils.Tensor("OUT", np.arange(4096, dtype=np.int32))  # 16 KiB
            sent, blocked = 0, None
            while not request.is_cancelled() and sent < 5000:
                start = time.monotonic()
                sender.send(pb_utils.InferenceResponse([out]))
                {pause}
                if blocked is None and time.monotonic() - start > 0.3:
                    blocked = sent
                    self.mark.write_text(str(blocked))
                sent += 1
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return triton_repository(
        tmp_path_factory.mktemp("triton-decoupled-repo"),
        ("repeat", REPEAT_CONFIG, REPEAT_MODEL),
        ("square", SQUARE_CONFIG, SQUARE_MODEL),
        ("countdown", COUNTDOWN_CONFIG, COUNTDOWN_MODEL),
        ("forgetful", COUNTDOWN_CONFIG, FORGETFUL_MODEL),
        ("flood", FLOOD_CONFIG, FLOOD_MODEL.format(define="def", pause="pass")),
        (
            "flood_async",
            FLOOD_CONFIG,
            FLOOD_MODEL.format(define="async def", pause="await asyncio.sleep(0)"),
        ),
    )


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        repo, tmp_path_factory.mktemp("triton-decoupled-logs"), "--no-llm", grpc_port=free_port()
    )
    yield running
    running.stop()


class Stream:
    """A tritonclient stream whose callback collects (result, error) pairs."""

    def __init__(self, server: RunningServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_address)
        self.got: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(
        self,
        model: str,
        values: list[int],
        request_id: str,
        empty_final: bool,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
        tensor.set_data_from_numpy(np.array(values, dtype=np.int32))
        self.client.async_stream_infer(
            model,
            [tensor],
            request_id=request_id,
            enable_empty_final_response=empty_final,
            parameters=parameters,
        )

    def until_final(
        self, timeout: float = 10.0
    ) -> list[tuple[Any, InferenceServerException | None]]:
        """Messages up to one marked final (triton_final_response)."""
        messages = []
        while True:
            result, error = self.got.get(timeout=timeout)
            messages.append((result, error))
            if result is not None and final(result):
                return messages

    def quiet(self, seconds: float = 0.3) -> bool:
        """No further message arrives within `seconds`."""
        try:
            self.got.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def stop(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def final(result: Any) -> bool:
    parameters = result.get_response().parameters
    return bool(parameters["triton_final_response"].bool_param)


def outs(messages: list[tuple[Any, InferenceServerException | None]]) -> list[int | str]:
    """Each message's OUT, or its error's message; an empty final message left out."""
    found: list[int | str] = []
    for result, error in messages:
        if error is not None:
            found.append(error.message())
        elif result.as_numpy("OUT") is not None:
            found.append(int(result.as_numpy("OUT")[0]))
    return found


def test_responses_sent_from_a_thread_after_execute_arrive_in_order_then_the_final_flag(
    server: RunningServer,
) -> None:
    stream = Stream(server)
    try:
        stream.send("repeat", [4, 8, 15, 16], "req-1", empty_final=True)
        messages = stream.until_final()
        assert outs(messages) == [4, 8, 15, 16]
        results = [result for result, _ in messages]
        assert [int(r.as_numpy("IDX")[0]) for r in results[:-1]] == [0, 1, 2, 3]
        assert [final(r) for r in results] == [False, False, False, False, True]
        assert {r.get_response().id for r in results} == {"req-1"}
        assert results[-1].get_response().outputs == []  # the final flag alone, asked for
    finally:
        stream.stop()


def test_the_final_flag_alone_is_a_message_only_when_the_client_asks(
    server: RunningServer,
) -> None:
    stream = Stream(server)
    try:
        stream.send("repeat", [1, 2], "a", empty_final=False)
        first, second = stream.got.get(timeout=10), stream.got.get(timeout=10)
        assert outs([first, second]) == [1, 2]
        assert not final(first[0]) and not final(second[0])
        assert stream.quiet()
        stream.send("square", [3], "b", empty_final=False)  # the final flag with the last
        messages = stream.until_final()
        assert outs(messages) == [9, 9, 9]
        assert stream.quiet()
        stream.send("square", [2], "c", empty_final=False, parameters={"scale": 10})
        assert outs(stream.until_final()) == [40, 40]  # the request's parameters
    finally:
        stream.stop()


def test_an_error_response_mid_stream_is_that_requests_error_and_the_stream_goes_on(
    server: RunningServer,
) -> None:
    stream = Stream(server)
    try:
        stream.send("repeat", [1, -2, 3], "mixed", empty_final=True)
        messages = stream.until_final()
        assert outs(messages) == [1, "model 'repeat': element 1 is negative", 3]
        stream.send("square", [13], "raises", empty_final=True)  # execute raises
        (result, error), *_ = [stream.got.get(timeout=10)]
        assert result is None and error is not None
        assert "13 is unlucky" in error.message()
        stream.send("square", [2], "after", empty_final=True)
        assert outs(stream.until_final()) == [4, 4]
    finally:
        stream.stop()


def test_an_async_execute_streams_and_a_forgotten_final_flag_ends_the_stream(
    server: RunningServer,
) -> None:
    stream = Stream(server)
    try:
        stream.send("countdown", [200], "c", empty_final=True)
        assert outs(stream.until_final()) == list(range(200, 0, -1))
        stream.send("forgetful", [1], "f", empty_final=True)
        messages = stream.until_final()
        assert outs(messages) == [7] and len(messages) == 2
    finally:
        stream.stop()
    assert "dropped without TRITONSERVER_RESPONSE_COMPLETE_FINAL" in server.log()


def test_a_cancelled_stream_cancels_its_requests(server: RunningServer, repo: Path) -> None:
    mark = repo / "square" / "marks" / "cancelled"
    assert not mark.exists()
    stream = Stream(server)
    stream.send("square", [-1], "endless", empty_final=True)
    for _ in range(3):
        result, error = stream.got.get(timeout=10)
        assert error is None and not final(result)
    stream.stop(cancel=True)
    deadline = time.monotonic() + 10
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.read_text() == "True True"
    # the model's threads are free again: another request is answered at once
    again = Stream(server)
    try:
        again.send("square", [2], "again", empty_final=True)
        assert outs(again.until_final()) == [4, 4]
    finally:
        again.stop()


@pytest.mark.parametrize("model", ["flood", "flood_async"])
def test_a_client_that_does_not_read_holds_the_models_sender(
    server: RunningServer, repo: Path, model: str
) -> None:
    """Backpressure: the client reads nothing, so HTTP/2 flow control holds the server's
    writes, the stream's messages wait, then the model's responses (8 at most, its
    max_buffered_responses), and then its sender (a thread's send; an async execute at its
    next await), instead of memory growing."""
    mark = repo / model / "blocked"
    request = pb.ModelInferRequest(model_name=model, id=model)
    request.inputs.add(name="IN", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([1], dtype=np.int32).tobytes())
    hold = threading.Event()

    def requests() -> Iterator[pb.ModelInferRequest]:
        yield request
        hold.wait(30)  # the client's side stays open

    with grpc.insecure_channel(server.grpc_address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        time.sleep(1.0)  # the model's sends fill what lies between it and the client
        hold.set()
        call.cancel()  # the waiting send returns, and the model notes how long it waited
    deadline = time.monotonic() + 10
    while not (mark.exists() and mark.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)  # (the model creates the file, then writes its count)
    assert mark.exists(), "the sender never had to wait"
    assert int(mark.read_text()) < 2000  # of 5000: bounded by the windows and buffers


def test_each_finished_stream_counts_once_in_the_models_statistics(
    server: RunningServer,
) -> None:
    def counts() -> tuple[int, int]:
        stats = httpx.get(server.url + "/v2/models/countdown/stats", timeout=10).json()
        model = stats["model_stats"][0]
        return model["inference_stats"]["success"]["count"], model["execution_count"]

    before = counts()
    stream = Stream(server)
    try:
        stream.send("countdown", [2], "s", empty_final=True)
        assert outs(stream.until_final()) == [2, 1]
    finally:
        stream.stop()
    assert counts() == (before[0] + 1, before[1] + 1)


def test_http_and_unary_grpc_inference_refuse_a_decoupled_model(server: RunningServer) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [2]}]}
    reply = httpx.post(server.url + "/v2/models/square/infer", json=body, timeout=10)
    assert reply.status_code == 400, reply.text
    wording = "doesn't support models with decoupled transaction policy"
    assert f"HTTP end point {wording}" in reply.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], dtype=np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("square", [tensor])
    assert f"ModelInfer RPC {wording}" in caught.value.message()
    config = httpx.get(server.url + "/v2/models/square/config", timeout=10).json()
    assert config["model_transaction_policy"] == {"decoupled": True}


def test_only_a_triton_python_model_may_be_decoupled(tmp_path: Path) -> None:
    pbtxt = 'backend: "onnxruntime"\nmodel_transaction_policy { decoupled: true }\n'
    with pytest.raises(ConfigError, match="cannot be decoupled"):
        parse_pbtxt_config(pbtxt, path="config.pbtxt", folder="m")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("class Model:\n    def infer(self, inputs): ...\n")
    config = ModelConfig(name="m", backend="python", decoupled=True)
    with pytest.raises(ConfigError, match="only a Triton Python model"):
        load_composition(config, tmp_path / "1")


def test_a_decoupled_model_may_not_enable_the_response_cache() -> None:
    """As Triton refuses it: a stream of responses is no one answer to keep."""
    pbtxt = 'backend: "python"\nmodel_transaction_policy { decoupled: true }\n'
    parse_pbtxt_config(pbtxt, path="config.pbtxt", folder="m")
    with pytest.raises(ConfigError, match="response cache does not support decoupled models"):
        parse_pbtxt_config(
            pbtxt + "response_cache { enable: true }\n", path="config.pbtxt", folder="m"
        )


def test_auto_complete_config_may_make_the_model_decoupled(tmp_path: Path) -> None:
    """As in Triton, a model's `auto_complete_config` may set the transaction policy."""
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(
        textwrap.dedent(
            """
            class TritonPythonModel:
                @staticmethod
                def auto_complete_config(config):
                    config.set_model_transaction_policy({"decoupled": True})
                    return config

                def execute(self, requests):
                    return None
            """
        )
    )
    config = ModelConfig(name="m", backend="python")
    assert autocomplete(config, tmp_path / "1").decoupled


def test_paced_holds_a_coroutine_at_its_next_await_while_the_stream_is_full() -> None:
    """What the coroutine awaits comes back to it as under a plain await, cancellation too;
    past the bound it resumes only once the reader has taken a response."""

    async def main() -> None:
        stream = ResponseStream(asyncio.get_running_loop(), limit=1)
        seen: list[str] = []

        async def model() -> str:
            seen.append(await asyncio.sleep(0, "value"))
            for value in (1, 2):  # past the bound: taken, from the loop
                stream.send(StreamedResponse({"OUT": np.array([value])}))
            await asyncio.sleep(0)  # held here
            seen.append("resumed")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            return "never"

        task = asyncio.ensure_future(Paced(model(), stream))
        await asyncio.sleep(0.05)
        assert seen == ["value"]
        await anext(stream)  # one waits: still the bound
        await asyncio.sleep(0.05)
        assert seen == ["value"]
        await anext(stream)
        await asyncio.sleep(0.05)
        assert seen == ["value", "resumed"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen[-1] == "cancelled"

    asyncio.run(main())
