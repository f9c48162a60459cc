"""Hostile and malformed input through real sockets: every case gets a 4xx with a JSON
message, never a 500, a hang or unbounded memory, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import (
    RunningServer,
    digits_rows,
    models_of,
    start_server,
    start_test_repo_server,
)

INFER = "/v2/models/digits_onnx/infer"
# each case: the peak RSS of its server grows less than RSS_GROWTH_BOUND_MIB
pytestmark = pytest.mark.usefixtures("bounded_rss")


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> str:
        """The JSON error message; fails the test if the body is not `{"error": "..."}`."""
        message = json.loads(self.body)["error"]
        assert isinstance(message, str) and message
        return message


@pytest.fixture(scope="module")
def server(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A `test_repo` server of this module's own: its cases measure the memory of a server
    that no other module has used."""
    running = start_test_repo_server(test_repo, tmp_path_factory)
    yield running
    running.stop()


def exchange(server: RunningServer, data: bytes, *, half_close: bool = False) -> RawResponse:
    """Send raw bytes, read one HTTP response (head, then Content-Length bytes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock)


def read_response(sock: socket.socket) -> RawResponse:
    return read_responses(sock, 1)[0]


def read_responses(sock: socket.socket, count: int) -> list[RawResponse]:
    """`count` answers from one connection, read in order from the same buffer."""
    buffer = b""
    answers = []
    while len(answers) < count:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed without a response (got {buffer[:200]!r})"
            buffer += chunk
        head, _, body = buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed in the middle of the response body"
            body += chunk
        answers.append(RawResponse(int(lines[0].split()[1]), headers, body[:length]))
        buffer = body[length:]
    return answers


def request_bytes(method: str, path: str, body: bytes = b"", *extra: str) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: test", "Connection: close", *extra]
    if body and not any(h.lower().startswith("content-length") for h in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def post(server: RunningServer, path: str, content: bytes, **headers: str) -> httpx.Response:
    """POST, retried while the server sheds load (503: minilm has a latency SLO)."""
    for _ in range(20):
        r = httpx.post(server.url + path, content=content, headers=headers, timeout=60)
        if r.status_code != 503:
            return r
        time.sleep(0.25)
    return r


def assert_client_error(response: httpx.Response, *statuses: int) -> str:
    allowed = statuses or (400,)
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    message = response.json()["error"]
    assert isinstance(message, str) and message
    return message


def binary_body(
    model_input: str, datatype: str, shape: list[int], data: bytes, **params: object
) -> bytes:
    parameters = {"binary_data_size": len(data), **params}
    header = {
        "inputs": [
            {"name": model_input, "shape": shape, "datatype": datatype, "parameters": parameters}
        ]
    }
    return json.dumps(header).encode()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read())
    assert match is not None
    return int(match.group(1)) / 1024


def digits_ok(server: RunningServer) -> None:
    """The server still answers a normal request correctly."""
    x = digits_rows(4)
    body = {
        "inputs": [
            {"name": "input", "shape": [4, 64], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    r = httpx.post(server.url + INFER, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"][0]["data"]) == 4


# -- bodies and framing ----------------------------------------------------------------


def test_truncated_body_then_close_leaves_server_up(server: RunningServer) -> None:
    data = request_bytes("POST", INFER, b'{"inputs": [', "Content-Length: 1000")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(data)
    digits_ok(server)


def test_truncated_body_held_open_does_not_block_other_requests(server: RunningServer) -> None:
    data = request_bytes("POST", INFER, b'{"inputs": [', "Content-Length: 1000")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(data)
        digits_ok(server)  # the stalled request occupies nothing but its connection
        sock.sendall(b" " * 988)  # complete it: a malformed body, answered 400
        response = read_response(sock)
    assert response.status == 400
    assert "JSON" in response.error()


@pytest.fixture(scope="module")
def impatient_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = models_of(test_repo, tmp_path_factory.mktemp("impatient-repo"), "digits_onnx")
    running = start_server(
        repo, tmp_path_factory.mktemp("impatient"), "--no-llm", "--body-timeout", "1"
    )
    yield running
    running.stop()


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickled"])
def test_slow_body_gets_408_and_the_connection_closes(
    impatient_server: RunningServer, trickle: bool
) -> None:
    """A body that stalls, or trickles in a byte at a time, holds a connection for at most
    --body-timeout seconds: then 408 with a message, and the server closes the connection."""
    head = f"POST {INFER} HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", impatient_server.port), timeout=15) as sock:
        sock.sendall(head.encode() + b'{"inputs": [')
        started = time.monotonic()
        if trickle:
            sock.settimeout(0.2)
            response = None
            while response is None and time.monotonic() - started < 10:
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
                try:
                    response = read_response(sock)
                except TimeoutError:
                    continue
            sock.settimeout(15)
        else:
            response = read_response(sock)
        elapsed = time.monotonic() - started
        assert response is not None and response.status == 408, response
        assert "not received within 1 s" in response.error()
        assert response.headers.get("connection") == "close"
        assert 0.9 <= elapsed < 10
        assert sock.recv(1024) == b""  # closed by the server
    digits_ok(impatient_server)


def test_content_length_smaller_than_body(server: RunningServer) -> None:
    body = json.dumps({"inputs": []}).encode()
    response = exchange(
        server, request_bytes("POST", INFER, body + b" GARBAGE", "Content-Length: 5")
    )
    assert response.status == 400
    response.error()


@pytest.mark.parametrize("value", ["-5", "abc", "1e3", "99999999999999999999999"])
def test_bad_content_length_header(server: RunningServer, value: str) -> None:
    response = exchange(server, request_bytes("POST", INFER, b"{}", f"Content-Length: {value}"))
    assert response.status in (400, 413)
    response.error()


def test_declared_body_over_limit_is_refused_before_it_is_sent(server: RunningServer) -> None:
    started = time.monotonic()
    response = exchange(server, request_bytes("POST", INFER, b"{", f"Content-Length: {2**40}"))
    assert response.status == 413
    assert "limit" in response.error()
    assert time.monotonic() - started < 5


# -- binary tensor framing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("header_length", "expected"),
    [
        (lambda n: str(n + 10_000), "outside the body"),
        (lambda n: "-3", "integer"),
        (lambda n: "12abc", "integer"),
        (lambda n: "", "integer"),
        (lambda n: str(n - 7), "JSON"),
    ],
    ids=["larger", "negative", "not-a-number", "empty", "inside-json"],
)
def test_wrong_inference_header_content_length(
    server: RunningServer, header_length, expected: str
) -> None:
    data = np.zeros((1, 64), np.float32).tobytes()
    header = binary_body("input", "FP32", [1, 64], data)
    r = post(
        server,
        INFER,
        header + data,
        **{"Inference-Header-Content-Length": header_length(len(header))},
    )
    assert expected in assert_client_error(r)


def test_header_length_pointing_inside_a_utf8_sequence(server: RunningServer) -> None:
    data = np.zeros((1, 64), np.float32).tobytes()
    header = json.dumps(
        {
            "id": "ééé",
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 256},
                }
            ],
        },
        ensure_ascii=False,
    ).encode()
    cut = header.index("é".encode()) + 1  # between the two bytes of é
    r = post(server, INFER, header + data, **{"Inference-Header-Content-Length": str(cut)})
    assert_client_error(r)


@pytest.mark.parametrize("size", [10**6, 8, -1, "256", 2.5, True, 2**70])
def test_binary_data_size_lying(server: RunningServer, size: object) -> None:
    data = np.zeros((1, 64), np.float32).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
    ).encode()
    r = post(server, INFER, header + data, **{"Inference-Header-Content-Length": str(len(header))})
    assert_client_error(r)


def test_binary_data_after_the_last_input(server: RunningServer) -> None:
    data = np.zeros((1, 64), np.float32).tobytes()
    header = binary_body("input", "FP32", [1, 64], data)
    r = post(
        server,
        INFER,
        header + data + b"tail",
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert "belong to no input" in assert_client_error(r)


# -- shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [[2**62, 2**62], [2**63 - 1, 2], [2**64], [-1, 64], [1000, 1000, 1000], [1] * 1000],
    ids=["overflow-int64", "max-int64", "over-uint64", "negative", "1e9-elements", "rank-1000"],
)
def test_absurd_shapes_answer_fast(server: RunningServer, shape: list[int]) -> None:
    body = {"inputs": [{"name": "input", "shape": shape, "datatype": "FP32", "data": [1.0]}]}
    started = time.monotonic()
    r = httpx.post(server.url + INFER, json=body, timeout=30)
    assert_client_error(r)
    assert time.monotonic() - started < 5


def test_billion_elements_claimed_with_little_data_allocates_nothing(server: RunningServer) -> None:
    before = rss_mib(server.process.pid)
    data = b"\0" * 64
    for datatype, shape in (("FP32", [10**9]), ("BYTES", [10**9]), ("FP64", [10**5, 10**4])):
        header = binary_body("input", datatype, shape, data)
        r = post(
            server, INFER, header + data, **{"Inference-Header-Content-Length": str(len(header))}
        )
        assert_client_error(r)
    assert rss_mib(server.process.pid) - before < 50


def test_bytes_element_claiming_more_than_sent(server: RunningServer) -> None:
    data = struct.pack("<I", 2**31) + b"abc"
    header = binary_body("text", "BYTES", [1, 1], data)
    r = post(
        server,
        "/v2/models/minilm/infer",
        header + data,
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert "claims" in assert_client_error(r)


# -- checked against the model before any data is decoded --------------------------------


def triton_error(server: RunningServer, *inputs: triton.InferInput) -> str:
    """The message of the 400 that tritonclient gets for `inputs` to digits_onnx."""
    client = triton.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits_onnx", list(inputs))
    assert caught.value.status() == "400", caught.value
    return str(caught.value.message())


def triton_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(
    ("name", "array", "datatype", "expected"),
    [
        ("pixels", np.zeros((1, 64), np.float32), "FP32", "unexpected inference input 'pixels'"),
        ("input", np.zeros((1, 64), np.float64), "FP64", "expects datatype FP32, got FP64"),
        ("input", np.zeros((1, 63), np.float32), "FP32", "expected shape [-1,64], got [1,63]"),
        ("input", np.zeros((65, 64), np.float32), "FP32", "batch size 65 is outside 1..64"),
        ("input", np.zeros((64,), np.float32), "FP32", "expected shape [-1,64], got [64]"),
    ],
    ids=["name", "datatype", "shape", "batch", "rank"],
)
def test_inputs_the_model_does_not_take_get_400_with_tritonclient(
    server: RunningServer, name: str, array: np.ndarray, datatype: str, expected: str, binary: bool
) -> None:
    assert expected in triton_error(server, triton_input(name, array, datatype, binary))


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        ({"datatype": "INT64", "data": ["not", "numbers"]}, "expects datatype FP32, got INT64"),
        ({"name": "pixels", "data": [[0.5] * 64] * 50_000}, "unexpected inference input"),
        ({"shape": [1, 65], "data": "not even an array"}, "expected shape [-1,64], got [1,65]"),
    ],
    ids=["datatype", "name", "shape"],
)
def test_the_model_refuses_before_the_data_is_read(
    server: RunningServer, tensor: dict[str, object], expected: str
) -> None:
    """What the model would refuse is answered from the declaration alone: the data, however
    large or malformed, is never decoded."""
    body = {"name": "input", "shape": [2, 64], "datatype": "FP32", **tensor}
    started = time.monotonic()
    r = httpx.post(server.url + INFER, json={"inputs": [body]}, timeout=30)
    assert expected in assert_client_error(r)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("shape", "data", "expected"),
    [
        ([2, 64], [0.5] * 64, "shape [2,64] has 128 elements but data has 64"),
        ([1, 64], [0.5] * 65, "shape [1,64] has 64 elements but data has 65"),
        ([1, 64], [[0.5] * 32, [0.5] * 32], "data has 3 arrays, more than shape [1,64] nests (2)"),
        ([1, 64], [[[0.5] * 64]], "nested 3 deep, deeper than shape [1,64]"),
        ([2, 64], [[0.5] * 64, []], "an empty array inside it"),
    ],
    ids=["fewer", "more", "arrays", "deeper", "empty"],
)
def test_data_that_does_not_match_its_shape(
    server: RunningServer, shape: list[int], data: list[object], expected: str
) -> None:
    body = {"inputs": [{"name": "input", "shape": shape, "datatype": "FP32", "data": data}]}
    r = httpx.post(server.url + INFER, json=body, timeout=30)
    assert expected in assert_client_error(r)


def watch_liveness(server: RunningServer, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.02)


@pytest.mark.parametrize("depth", [100_000, 500])
@pytest.mark.parametrize(
    ("model", "tensor", "leaf"),
    [
        ("digits_onnx", b'"name": "input", "shape": [64, 64], "datatype": "FP32"', b"0.5"),
        ("minilm", b'"name": "text", "shape": [32, 1], "datatype": "BYTES"', b'"x"'),
    ],
    ids=["digits_onnx", "minilm"],
)
def test_data_nested_deeper_than_its_shape_is_refused_at_once(
    server: RunningServer, model: str, tensor: bytes, leaf: bytes, depth: int
) -> None:
    """A valid declaration, then data nested 500 or 100,000 deep: refused in milliseconds
    (from its opening brackets, or by the JSON parser's depth limit), while liveness keeps
    answering."""
    data = b"[" * depth + leaf + b"]" * depth
    body = b'{"inputs": [{' + tensor + b', "data": ' + data + b"}]}"
    expected = "nested 500 deep, deeper than shape" if depth == 500 else "nested too deeply"
    stop, latencies = threading.Event(), []
    prober = threading.Thread(target=watch_liveness, args=(server, stop, latencies))
    prober.start()
    try:
        started = time.monotonic()
        for _ in range(10):
            r = post(server, f"/v2/models/{model}/infer", body)
            assert expected in assert_client_error(r)
        elapsed = (time.monotonic() - started) / 10
    finally:
        stop.set()
        prober.join()
    assert elapsed < 0.5, elapsed
    assert latencies and max(latencies) < 1.0, max(latencies)


# -- datatypes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("INT8", [300]),
        ("INT8", [-129]),
        ("UINT8", [-1]),
        ("UINT8", [256]),
        ("INT16", [2**15]),
        ("UINT16", [-1]),
        ("INT32", [2**31]),
        ("UINT32", [2**32]),
        ("INT64", [2**63]),
        ("INT64", [2**70]),
        ("UINT64", [-1]),
        ("UINT64", [2**64]),
        ("INT32", ["7"]),
        ("INT64", [1.5]),
        ("UINT8", [True]),
        ("INT16", [None]),
        ("FP32", [True]),
        ("FP32", ["1.0"]),
        ("FP64", [[1.0, "x"]]),
        ("FP16", [{}]),
        ("BF16", ["x"]),
        ("BOOL", [1]),
        ("BOOL", ["true"]),
        ("BYTES", [1]),
        ("BYTES", [None]),
        ("FP32", "1.0"),
        ("FP32", {"a": 1}),
        ("FP32", []),
        ("COMPLEX64", [1.0]),
        ("fp32", [1.0]),
    ],
)
def test_wrong_data_for_every_datatype(server: RunningServer, datatype: str, data: object) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": datatype, "data": data}]}
    r = httpx.post(server.url + "/v2/models/echo/infer", json=body, timeout=30)
    assert_client_error(r)


@pytest.mark.parametrize("datatype", ["FP16", "FP64", "INT32", "BYTES", "BOOL"])
def test_valid_data_of_the_wrong_datatype_for_the_model(
    server: RunningServer, datatype: str
) -> None:
    value = {"BYTES": "a", "BOOL": True, "INT32": 1}.get(datatype, 1.0)
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": datatype, "data": [value] * 4}]}
    r = httpx.post(server.url + "/v2/models/echo/infer", json=body, timeout=30)
    assert "expects datatype FP32" in assert_client_error(r)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_in_binary_fp32(server: RunningServer, value: float) -> None:
    x = digits_rows(2)
    x[0, :32] = value
    header = binary_body("input", "FP32", [2, 64], x.tobytes())
    r = post(
        server, INFER, header + x.tobytes(), **{"Inference-Header-Content-Length": str(len(header))}
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        assert outputs["label"]["shape"] == [2]
    else:
        assert_client_error(r)


def test_nan_to_sklearn_is_a_client_error(server: RunningServer) -> None:
    x = digits_rows(1)
    x[0, 0] = np.nan
    header = binary_body("input", "FP32", [1, 64], x.tobytes())
    r = post(
        server,
        "/v2/models/digits_sklearn/infer",
        header + x.tobytes(),
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code in (200, 400), r.text


# -- JSON structure ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b"{" * 100_000,
        b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": '
        + b"[" * 100_000
        + b"1.0"
        + b"]" * 100_000
        + b"}]}",
        b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": '
        + b"[" * 100_000
        + b"}]}",
        b'{"inputs": [], "parameters": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    ],
    ids=["arrays", "objects", "nested-data", "unclosed-data", "nested-parameters"],
)
def test_deeply_nested_json(server: RunningServer, body: bytes) -> None:
    started = time.monotonic()
    assert_client_error(post(server, INFER, body))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"42",
        b'"inputs"',
        b"{}",
        b'{"inputs": {}}',
        b'{"inputs": [null]}',
        b'{"inputs": [{"name": 1, "shape": [1], "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [{"name": "input", "shape": "1", "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [{"name": "input", "shape": [1.5], "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [], "parameters": {"priority": -1}}',
        b'{"inputs": [], "parameters": []}',
        b'{"inputs": [], "outputs": [{"name": "label", "parameters": {"binary_data": "yes"}}]}',
        b'{"inputs": [], "outputs": [{"name": "label"}, {"name": "label"}]}',
        b'{"inputs": [], "id": 5}',
        b'{"inputs": []',
        b'{"inputs": []}}',
    ],
)
def test_malformed_request_json(server: RunningServer, body: bytes) -> None:
    assert_client_error(post(server, INFER, body))


def test_huge_number_of_inputs(server: RunningServer) -> None:
    inputs = [
        {"name": f"in{i}", "shape": [1], "datatype": "FP32", "data": [1.0]} for i in range(1024)
    ]
    started = time.monotonic()
    r = httpx.post(server.url + INFER, json={"inputs": inputs}, timeout=30)
    assert "unexpected inference input" in assert_client_error(r)
    assert time.monotonic() - started < 10


def test_inputs_past_the_most_a_request_holds_are_counted_before_they_are_built(
    server: RunningServer,
) -> None:
    """300,000 tiny inputs (20 MB) took the event loop seconds to decode and plan; they are
    counted first and refused, and the loop stays free for a probe meanwhile."""
    tensor = '{"name":"in","shape":[1],"datatype":"FP32","data":[1]}'
    body = ('{"inputs":[' + ",".join([tensor] * 300_000) + "]}").encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.url + INFER, content=body, timeout=30)
        time.sleep(0.05)
        probe = time.monotonic()
        assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200
        probe_seconds = time.monotonic() - probe
        r = answer.result()
    assert "length <= 1024" in assert_client_error(r)
    assert probe_seconds < 0.5


def test_same_input_twice(server: RunningServer) -> None:
    tensor = {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}
    r = httpx.post(server.url + INFER, json={"inputs": [tensor, tensor]}, timeout=30)
    assert "more than once" in assert_client_error(r)


def test_unknown_fields_are_ignored_as_triton_does(server: RunningServer) -> None:
    """Triton looks up the members it knows and ignores the rest; so does lockgate."""
    x = digits_rows(1)
    tensor = {
        "name": "input",
        "shape": [1, 64],
        "datatype": "FP32",
        "data": x.ravel().tolist(),
        "unknown": {"deep": [1, 2]},
        "parameters": {"custom": "x"},
    }
    body = {
        "inputs": [tensor],
        "outputs": [{"name": "label", "extra": True}],
        "unknown_top_level": [None],
        "parameters": {"custom_param": 1},
    }
    r = httpx.post(server.url + INFER, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["label"]


def test_non_utf8_bytes_in_the_json_body(server: RunningServer) -> None:
    body = b'{"inputs": [{"name": "in\xff\xfe", "shape": [1], "datatype": "FP32", "data": [1]}]}'
    assert "JSON" in assert_client_error(post(server, INFER, body))
    body = b'{"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["\xc3"]}]}'
    assert_client_error(post(server, "/v2/models/minilm/infer", body))


def bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def minilm_embedding(server: RunningServer, text: str) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    r = post(server, "/v2/models/minilm/infer", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"][0]["data"], np.float32)


def test_non_utf8_bytes_to_minilm_decode_with_replacement(server: RunningServer) -> None:
    data = bytes_tensor([b"caf\xe9 \xff\xfe ok"])
    header = binary_body("text", "BYTES", [1, 1], data)
    r = post(
        server,
        "/v2/models/minilm/infer",
        header + data,
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["outputs"][0]["data"], np.float32)
    expected = minilm_embedding(server, "caf\ufffd \ufffd\ufffd ok")
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_non_utf8_bytes_to_minilm_never_a_server_error(server: RunningServer) -> None:
    data = bytes_tensor([b"\xff\xfe\x80abc", b"hello \xc3"])
    header = binary_body("text", "BYTES", [2, 1], data)
    r = post(
        server,
        "/v2/models/minilm/infer",
        header + data,
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert "UTF-8" in assert_client_error(r)


def test_one_megabyte_text_to_minilm_is_truncated(server: RunningServer) -> None:
    long = minilm_embedding(server, "lockgate serves models " * 46_000)  # ~1 MB
    assert long.shape == (384,)
    assert np.isfinite(long).all()
    np.testing.assert_allclose(np.linalg.norm(long), 1.0, rtol=1e-4)


# -- paths -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/..%2F..%2Fetc/infer",
        "/v2/models/../../etc/passwd",
        "/v2/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/v2/models/..%2F..%2F..%2F..%2Fetc%2Fpasswd/config",
        "/v2/models/a%00b/infer",
        "/v2/models/%00/config",
        "/v2/models/digits_onnx%00/infer",
        "/v2/models/digits_onnx/versions/1%00/infer",
        "/v2/models/digits_onnx/versions/..%2F1/infer",
        "/v2/models/digits_onnx/versions/99999999999999999999999/infer",
        "/v2/models/" + "a" * 8000 + "/infer",
        "/v2/models/%ff%fe/infer",
        "/v2/repository/models/..%2F..%2Fetc/load",
        "/v2/repository/models/../x/load",
    ],
)
def test_path_tricks_in_model_names(server: RunningServer, path: str) -> None:
    method = "GET" if path.endswith("/config") else "POST"  # the method the route takes
    response = exchange(server, request_bytes(method, path, b"{}"))
    assert response.status in (400, 404), (response.status, response.body[:200])
    response.error()
    assert b"root:" not in response.body


def test_very_long_url_is_refused(server: RunningServer) -> None:
    response = exchange(server, request_bytes("GET", "/v2/models/" + "a" * 100_000))
    assert response.status in (400, 414, 431)
    response.error()


# -- HTTP-level junk ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x01GARBAGE \xff\xfe\r\n\r\n",
        b"FOO /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v2 HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET\r\n\r\n",
        b"POST /v2/models/echo/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v2/models/echo/infer HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"GET /v2 HTTP/1.1\r\nBad Header\r\n\r\n",
    ],
    ids=[
        "binary",
        "unknown-method",
        "bad-version",
        "no-path",
        "bad-chunk",
        "two-lengths",
        "bad-header",
    ],
)
def test_garbage_requests(server: RunningServer, data: bytes) -> None:
    response = exchange(server, data, half_close=True)
    assert 400 <= response.status < 500, response.body[:200]
    response.error()


@pytest.mark.parametrize("upgrade", ["websocket", "h2c"])
def test_upgrade_requests_are_served_as_plain_http(server: RunningServer, upgrade: str) -> None:
    """lockgate upgrades nothing: a WebSocket or h2c handshake gets the route's answer, not a
    500 from an upgrade no route completes, and writes no log line."""
    key = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13"
    for path in ("/v2/health/live", "/v2/models/digits_onnx/ready"):
        head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {upgrade}"
        response = exchange(server, f"{head}\r\n{key}\r\n\r\n".encode())
        assert response.status == 200, response.body[:200]
    assert "upgrade" not in server.log().lower()


@pytest.mark.parametrize("method", ["DELETE", "PUT", "PATCH", "GET"])
def test_wrong_method_on_infer(server: RunningServer, method: str) -> None:
    r = httpx.request(method, server.url + INFER, timeout=10)
    assert_client_error(r, 404, 405)


def test_header_flood_is_cut_without_growing_memory(server: RunningServer) -> None:
    before = rss_mib(server.process.pid)
    line = b"X-Flood: " + b"v" * 1000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(100):  # 100 MB of headers, unless the server hangs up first
                sock.sendall(line * 1000)
        except OSError:
            pass
        response = read_response(sock)
    assert response.status == 431
    response.error()
    assert rss_mib(server.process.pid) - before < 50


def test_many_small_headers_within_the_limit(server: RunningServer) -> None:
    headers = {f"x-h{i}": "v" for i in range(500)}
    assert httpx.get(server.url + "/v2/health/live", headers=headers).status_code == 200


def test_server_is_still_up_and_logged_no_crash(server: RunningServer) -> None:
    digits_ok(server)
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    log = server.log()
    assert "Traceback" not in log
    assert "unhandled error" not in log
    assert server.process.poll() is None


def test_garbage_requests_are_counted_not_logged_one_line_each(server: RunningServer) -> None:
    """A client sending garbage in a loop would write a log line per request: they are
    counted in lockgate_http_refused_total instead."""
    assert exchange(server, b"\x00\x01GARBAGE\r\n\r\n", half_close=True).status == 400
    before = server.metric("lockgate_http_refused_total", 'reason="invalid_http"')
    for _ in range(20):
        assert exchange(server, b"\x00\x01GARBAGE\r\n\r\n", half_close=True).status == 400
    after = server.metric("lockgate_http_refused_total", 'reason="invalid_http"')
    assert after - before == 20
    assert "Invalid HTTP request received" not in server.log()
