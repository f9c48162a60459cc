"""Client mistakes and hostile sizes that once cost a 500 or a stalled server: each is a 4xx
with a message, refused before the work it would cost, while liveness keeps answering."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import v2_codec as v2
from tests.conftest import RunningServer, digits_rows, models_of, start_server
from tests.frontend.test_hostile_input import (
    INFER,
    assert_client_error,
    read_response,
    request_bytes,
)

MODEL = "SmolLM2-135M-Instruct"
# each case: the peak RSS of its server grows less than RSS_GROWTH_BOUND_MIB
pytestmark = pytest.mark.usefixtures("bounded_rss")


def digits_body(**parameters: object) -> dict[str, object]:
    x = digits_rows(1)
    tensor = {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}
    return {"inputs": [tensor], "parameters": parameters}


# -- KServe v2 ----------------------------------------------------------------------------


def test_a_400_digit_timeout_is_a_400(server: RunningServer) -> None:
    body = json.dumps(digits_body()).replace(
        '"parameters": {}', '"parameters": {"timeout": ' + "9" * 400 + "}"
    )
    r = httpx.post(server.url + INFER, content=body, timeout=30)
    assert "timeout" in assert_client_error(r)


def test_a_5000_digit_header_length_is_a_400(server: RunningServer) -> None:
    r = httpx.post(
        server.url + INFER,
        content=b"{}",
        headers={"Inference-Header-Content-Length": "9" * 5000},
        timeout=30,
    )
    assert "Inference-Header-Content-Length" in assert_client_error(r)


def test_data_far_longer_than_its_shape_is_refused_before_it_is_decoded(
    server: RunningServer,
) -> None:
    """A million numbers declared as [1, 64]: refused from the data's length, without
    building a Python list of a million numbers first (nested, they cost ~34x the body)."""
    data = "[" + ",".join(["[0.5]"] * 1_000_000) + "]"
    body = '{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":' + data + "}]}"
    r = httpx.post(server.url + INFER, content=body, timeout=30)
    assert "more than 64 elements" in assert_client_error(r)


def test_classification_of_a_bytes_output_is_a_400() -> None:
    want = v2.RequestedOutput("label", False, 3)
    with pytest.raises(BadRequest, match="numeric"):
        v2._output_array(want, np.array([b"a", b"b"], dtype=object), {"label": "BYTES"}, True)
    scores = np.array([[0.1, 0.7, 0.2]], np.float32)
    values, datatype = v2._output_array(want, scores, None, True)
    assert datatype == "BYTES" and values[0, 0].endswith(b":1")


# -- the OpenAI API -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def bad_request(call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    return str(caught.value)


def test_a_6_mb_prompt_is_refused_at_once_and_liveness_answers(
    llm_server: RunningServer,
) -> None:
    prompt = "lorem ipsum " * 500_000  # 6 MB, within --max-payload-bytes
    probes: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            assert httpx.get(llm_server.url + "/v2/health/live", timeout=10).status_code == 200
            probes.append(time.monotonic() - started)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        started = time.monotonic()
        r = httpx.post(
            llm_server.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
            timeout=120,
        )
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        prober.join()
    assert r.status_code == 400, r.text[:300]
    assert "characters cannot fit the context" in r.json()["error"]["message"]
    assert elapsed < 10, elapsed  # no tokenizing of 6 MB first
    assert probes and max(probes) < 1.0, max(probes)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_a_language_model_body_over_the_payload_limit_is_a_413_before_it_is_read(
    llm_server: RunningServer, path: str
) -> None:
    """Such a body would be decoded whole on the event loop (a 60 MB one stalled it for over
    200 ms): past --max-payload-bytes (8 MiB) it is refused on its declared length, unsent."""
    head = request_bytes("POST", path, b"", "Content-Length: 18000000")
    with socket.create_connection(("127.0.0.1", llm_server.port), timeout=10) as sock:
        sock.sendall(head)  # and none of the body
        answer = read_response(sock)
    assert answer.status == 413, answer
    error = json.loads(answer.body)["error"]
    assert (
        "over the limit of 8388608" in error["message"]
        and "--max-payload-bytes" in error["message"]
    ), error
    chunked = httpx.post(  # streamed without a length: refused once past the limit
        llm_server.url + path,
        content=iter([b"{" + b" " * 2**20] * 9),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert chunked.status_code == 413 and "--max-payload-bytes" in chunked.text, chunked.text


def test_more_than_four_stop_strings_are_a_400(client: openai.OpenAI) -> None:
    message = bad_request(
        client.completions.create, model=MODEL, prompt="Hi", max_tokens=2, stop=["a"] * 5
    )
    assert "at most 4" in message


@pytest.mark.parametrize(
    "field",
    [
        {"best_of": 3},
        {"suffix": "!"},
        {"functions": [{"name": "f"}]},
    ],
)
def test_fields_lockgate_does_not_implement_are_refused_by_name(
    client: openai.OpenAI, field: dict[str, object]
) -> None:
    message = bad_request(
        client.chat.completions.create,
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body=field,
    )
    assert f"'{next(iter(field))}' is not supported" in message


def test_logit_bias_forces_its_token_at_every_step_and_is_checked(client: openai.OpenAI) -> None:
    def complete(tokens: int, bias: dict[str, int] | None) -> str:
        out = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=tokens, temperature=0.0,
            logit_bias=bias or openai.NOT_GIVEN,
        )  # fmt: skip
        return out.choices[0].text

    forced = {"1000": 100}  # +100 on one token makes it the greedy choice at every step
    one = complete(1, forced)
    assert one and complete(3, forced) == one * 3
    assert complete(3, {"2000": 100}) != one * 3  # another token: another text
    assert complete(3, None) != one * 3
    message = bad_request(
        client.completions.create,
        model=MODEL,
        prompt="Hi",
        max_tokens=1,
        logit_bias={"99999999": 5},
    )
    assert "not a token id" in message
    message = bad_request(
        client.completions.create, model=MODEL, prompt="Hi", max_tokens=1, logit_bias={"5": 500}
    )
    assert "outside [-100, 100]" in message


def test_deeply_nested_json_is_a_400(llm_server: RunningServer) -> None:
    body = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(llm_server.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert httpx.get(llm_server.url + "/v2/health/live").status_code == 200


def test_a_server_with_no_model_loaded_is_not_ready(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.onnx").write_bytes(b"this is not an onnx file")
    (repo / "broken" / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 4\n")
    server = start_server(repo, tmp_path, "--no-llm", wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = httpx.get(server.url + "/v2/health/ready", timeout=10)
            if "loading" not in r.text:
                break
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"] == "no model is loaded", r.text
        assert httpx.get(server.url + "/v2/health/live").status_code == 200
    finally:
        server.stop()


# -- gRPC ---------------------------------------------------------------------------------


def test_a_grpc_stream_is_read_no_faster_than_its_answers_go_out(
    test_repo: Path, tmp_path: Path
) -> None:
    """With at most 3 requests of a stream in flight, a client that writes 30 at once never
    has more than 3 at the model; all 30 are answered, in full and correctly."""
    import grpc

    from lockgate.protocol.grpc import inference_pb2 as pb
    from lockgate.protocol.grpc import inference_pb2_grpc as pb_grpc
    from tests.conftest import free_port

    repo = models_of(test_repo, tmp_path / "repo", "echo")
    server = start_server(
        repo, tmp_path, "--no-llm", "--grpc-max-stream-inflight", "3", grpc_port=free_port()
    )
    peak = 0.0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        pattern = 'lockgate_inflight_requests{model="echo",version="1"} '
        while not stop.is_set():
            for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
                if line.startswith(pattern):
                    peak = max(peak, float(line[len(pattern) :]))
            time.sleep(0.01)

    def requests() -> object:
        for i in range(30):
            request = pb.ModelInferRequest(model_name="echo", id=str(i))
            request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
            request.inputs.add(name="delay", datatype="FP32", shape=[1, 1])
            request.raw_input_contents.append(np.full((1, 4), i, np.float32).tobytes())
            request.raw_input_contents.append(np.full((1, 1), 0.05, np.float32).tobytes())
            yield request

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answers = list(stub.ModelStreamInfer(requests(), timeout=60))
    finally:
        stop.set()
        watcher.join()
        server.stop()
    assert len(answers) == 30 and not [a.error_message for a in answers if a.error_message]
    for answer in answers:
        y = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
        assert np.all(y == 2 * float(answer.infer_response.id))
    assert 1 <= peak <= 3, peak


def test_priority_above_the_default_needs_a_key_that_grants_it(
    test_repo: Path, tmp_path: Path
) -> None:
    """`slow` has two priority levels, 2 by default: asking for 1 needs a priority key."""
    repo = models_of(test_repo, tmp_path / "repo", "slow")
    server = start_server(repo, tmp_path, "--no-llm", env={"LOCKGATE_PRIORITY_KEYS": "prio-secret"})
    body = {
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
        "parameters": {"priority": 1},
    }
    url = server.url + "/v2/models/slow/infer"
    try:
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == 403 and "needs a key" in refused.json()["error"]
        granted = httpx.post(url, json=body, headers={"Authorization": "Bearer prio-secret"})
        assert granted.status_code == 200, granted.text
        body["parameters"] = {"priority": 2}  # the default itself needs nothing
        assert httpx.post(url, json=body, timeout=30).status_code == 200
    finally:
        server.stop()
    assert "prio-secret" not in server.log()
