"""KServe v2 inference on a language model, as Triton's vLLM backend serves it, through the
session's SmolLM2 server with Triton's own clients: tritonclient.grpc streaming exactly as the
vLLM backend's sample client does it, tritonclient.http infer, and perf_analyzer."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lockgate.demo.smollm2 import SERVED_NAME
from tests.conftest import PERF_ANALYZER, RunningServer

MODEL = "smollm2"
PROMPT = "The capital of France is"


def greedy(server: RunningServer, prompt: str, max_tokens: int) -> Any:
    """The greedy completion of `prompt` from /v1/completions."""
    client = server.openai_client()
    return client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0
    ).choices[0]


def request(
    client_module: Any,
    prompt: str,
    stream: bool,
    sampling: dict[str, Any] | str | None = None,
    **flags: bool,
) -> list[Any]:
    """The inputs the vLLM backend's sample client builds (`create_request`)."""
    inputs = [client_module.InferInput("text_input", [1], "BYTES")]
    inputs[-1].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs.append(client_module.InferInput("stream", [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(client_module.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([raw.encode()], dtype=np.object_))
    for name, value in flags.items():
        inputs.append(client_module.InferInput(name, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=bool))
    return inputs


class Stream:
    """One gRPC stream of tritonclient.grpc, its responses by request id."""

    def __init__(self, server: RunningServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_address)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, request_id: str, inputs: list[Any], outputs: tuple[str, ...]) -> None:
        self.client.async_stream_infer(
            MODEL,
            inputs,
            request_id=request_id,
            outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
        )

    def until_final(self, count: int = 1) -> dict[str, list[Any]]:
        """The responses of `count` requests, until each one's final response."""
        found: dict[str, list[Any]] = {}
        finals = 0
        while finals < count:
            result, error = self.results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            found.setdefault(response.id, []).append(result)
            finals += response.parameters["triton_final_response"].bool_param
        return found

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_metadata_and_config_declare_the_vllm_backends_tensors(llm_server: RunningServer) -> None:
    metadata = httpx.get(f"{llm_server.url}/v2/models/{MODEL}").json()
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in metadata["inputs"]}
    assert inputs["text_input"] == ("BYTES", [1])
    assert inputs["sampling_parameters"] == ("BYTES", [1])
    assert inputs["stream"] == inputs["return_num_output_tokens"] == ("BOOL", [1])
    assert metadata["outputs"][0]["name"] == "text_output"
    client = grpcclient.InferenceServerClient(llm_server.grpc_address)
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert {i["name"]: i.get("optional", False) for i in config["input"]}["text_input"] is False
    client.close()
    # the OpenAI API still lists it as before
    listed = httpx.get(f"{llm_server.url}/v1/models").json()["data"]
    assert any(m["id"] == SERVED_NAME and m["max_model_len"] == 512 for m in listed)


def test_streamed_deltas_add_up_to_the_greedy_completion(llm_server: RunningServer) -> None:
    expected = greedy(llm_server, PROMPT, 12)
    stream = Stream(llm_server)
    sampling = {"temperature": "0", "max_tokens": "12"}  # strings, as the sample client's
    inputs = request(
        grpcclient,
        PROMPT,
        True,
        sampling,
        return_finish_reason=True,
        return_num_output_tokens=True,
    )
    stream.send("7", inputs, ("text_output", "finish_reason", "num_output_tokens"))
    responses = stream.until_final()["7"]
    stream.close()
    assert len(responses) > 1  # a response per piece
    text = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
    assert text == expected.text
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in responses]
    assert finals == [False] * (len(responses) - 1) + [True]
    assert responses[-1].as_numpy("finish_reason")[0].decode() == expected.finish_reason
    assert {r.as_numpy("finish_reason")[0] for r in responses[:-1]} == {b"None"}
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 12


def test_two_requests_on_one_stream_get_their_own_answers(llm_server: RunningServer) -> None:
    prompts = {"a": PROMPT, "b": "Once upon a time"}
    expected = {rid: greedy(llm_server, prompt, 8).text for rid, prompt in prompts.items()}
    stream = Stream(llm_server)
    for rid, prompt in prompts.items():
        inputs = request(grpcclient, prompt, True, {"temperature": 0, "max_tokens": 8})
        stream.send(rid, inputs, ("text_output",))
    found = stream.until_final(2)
    stream.close()
    texts = {
        rid: "".join(r.as_numpy("text_output")[0].decode() for r in responses)
        for rid, responses in found.items()
    }
    assert texts == expected


def test_a_request_not_streamed_answers_once_with_the_whole_text(
    llm_server: RunningServer,
) -> None:
    expected = greedy(llm_server, PROMPT, 4).text
    sampling = {"temperature": 0, "max_tokens": 4}
    stream = Stream(llm_server)
    stream.send("whole", request(grpcclient, PROMPT, False, sampling), ("text_output",))
    (response,) = stream.until_final()["whole"]
    stream.close()
    assert response.as_numpy("text_output")[0].decode() == PROMPT + expected  # as the backend
    # tritonclient.http infer (binary tensors), with and without the prompt
    client = httpclient.InferenceServerClient(llm_server.address)
    result = client.infer(MODEL, request(httpclient, PROMPT, False, sampling))
    assert result.as_numpy("text_output")[0].decode() == PROMPT + expected
    excluded = request(httpclient, PROMPT, False, sampling, exclude_input_in_output=True)
    result = client.infer(MODEL, excluded)
    assert result.as_numpy("text_output")[0].decode() == expected
    # ModelInfer, the request's parameters standing in for sampling_parameters
    grpc_client = grpcclient.InferenceServerClient(llm_server.grpc_address)
    result = grpc_client.infer(
        MODEL,
        request(
            grpcclient, PROMPT, False, exclude_input_in_output=True, return_num_input_tokens=True
        ),
        parameters={"temperature": 0, "max_tokens": 4},
    )
    assert result.as_numpy("text_output")[0].decode() == expected
    assert int(result.as_numpy("num_input_tokens")[0]) > 3
    # an output named among the request's is returned, as its return_* flag would
    result = grpc_client.infer(
        MODEL,
        request(grpcclient, PROMPT, False, sampling),
        outputs=[grpcclient.InferRequestedOutput("finish_reason")],
    )
    assert result.as_numpy("finish_reason")[0] == b"length"
    assert result.as_numpy("text_output") is None
    # JSON tensors over REST
    body = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
            {
                "name": "sampling_parameters",
                "datatype": "BYTES",
                "shape": [1],
                "data": [json.dumps(sampling)],
            },
            {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": [1], "data": [True]},
        ]
    }
    r = httpx.post(f"{llm_server.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [expected]
    grpc_client.close()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ("{temperature: 0", "sampling_parameters is not JSON"),
        ('{"temperature": 0, "beam_width": 2}', "unknown sampling parameters: 'beam_width'"),
    ],
)
def test_bad_requests_are_refused_with_a_message(
    llm_server: RunningServer, sampling: str, message: str
) -> None:
    client = httpclient.InferenceServerClient(llm_server.address)
    with pytest.raises(InferenceServerException, match=message) as refused:
        client.infer(MODEL, request(httpclient, PROMPT, False, sampling))
    assert refused.value.status() == "400"
    stream = Stream(llm_server)
    stream.send("bad", request(grpcclient, PROMPT, True, sampling), ("text_output",))
    _, error = stream.results.get(timeout=30)
    assert error is not None and message in error.message()
    stream.close()
    grpc_client = grpcclient.InferenceServerClient(llm_server.grpc_address)
    with pytest.raises(InferenceServerException, match=message) as refused:
        grpc_client.infer(MODEL, request(grpcclient, PROMPT, False, sampling))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    grpc_client.close()


def test_what_infer_cannot_answer_is_a_400(llm_server: RunningServer) -> None:
    url = f"{llm_server.url}/v2/models/{MODEL}/infer"
    no_text = {"inputs": [{"name": "stream", "datatype": "BOOL", "shape": [1], "data": [False]}]}
    r = httpx.post(url, json=no_text, timeout=30)
    assert r.status_code == 400 and "text_input" in r.json()["error"]
    streamed = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
            {"name": "stream", "datatype": "BOOL", "shape": [1], "data": [True]},
        ]
    }
    r = httpx.post(url, json=streamed, timeout=30)
    assert r.status_code == 400 and "ModelStreamInfer" in r.json()["error"]
    # and the model serves on
    client = httpclient.InferenceServerClient(llm_server.address)
    result = client.infer(MODEL, request(httpclient, PROMPT, False, {"max_tokens": 2}))
    assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)


def test_a_cancelled_stream_frees_its_sequence(llm_server: RunningServer) -> None:
    aborted = f'finished_reason="abort",model_name="{SERVED_NAME}"'
    before = _metric_or_zero(llm_server, "lockgate_llm_request_success_total", aborted)
    stream = Stream(llm_server)
    sampling = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    stream.send("long", request(grpcclient, PROMPT, True, sampling), ("text_output",))
    _, error = stream.results.get(timeout=60)  # generating
    assert error is None, error
    stream.client.stop_stream(cancel_requests=True)
    stream.client.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = llm_server.metric("lockgate_llm_num_requests_running")
        after = _metric_or_zero(llm_server, "lockgate_llm_request_success_total", aborted)
        if running == 0 and after == before + 1:
            break
        time.sleep(0.1)
    assert running == 0 and after == before + 1


def _metric_or_zero(server: RunningServer, name: str, labels: str) -> float:
    try:
        return server.metric(name, labels)
    except AssertionError:
        return 0.0


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason="perf_analyzer not installed (scripts/install-perf-analyzer.sh)",
)
def test_perf_analyzer_streams_from_the_language_model(
    llm_server: RunningServer, tmp_path: Path
) -> None:
    data = {
        "data": [
            {
                "text_input": [PROMPT],
                "stream": [True],
                "sampling_parameters": [json.dumps({"max_tokens": 2, "temperature": 0})],
            }
        ]
    }
    (tmp_path / "input.json").write_text(json.dumps(data))
    command = [str(PERF_ANALYZER), "-m", MODEL, "-u", llm_server.grpc_address, "-i", "grpc"]
    command += ["--streaming", "--input-data", str(tmp_path / "input.json")]
    # windows of a few requests, not of a time, and a wide stability bound: a busy machine's
    # slow and uneven requests still make a measurement
    command += ["--concurrency-range", "1", "--measurement-mode", "count_windows"]
    command += ["--measurement-request-count", "3", "--max-trials", "3"]
    command += ["--stability-percentage", "1000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Detected decoupled model" in done.stdout
    # the server's statistics count the model's requests, as perf_analyzer checks them
    served = re.search(r"Successful request count: (\d+)", done.stdout)
    assert served is not None and int(served.group(1)) >= 3, done.stdout
