"""Content codings (`protocol/content_coding.py`), through a real server. Compressed request
bodies: gzip and deflate bodies are inflated for v2 inference (JSON and binary tensors) and
the other JSON routes, under the body limit counted on the inflated bytes; other codings get
415. Compressed requests take the ASGI path, not the lane. Compressed answers: a client that
accepts gzip or deflate gets answers of at least `--compress-min-bytes` in it, on the lane
and on the ASGI path alike."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import RunningServer, digits_rows, models_of, start_server
from tests.frontend.test_hostile_input import read_response
from tests.frontend.test_lane import INFER, LONG, connect, digits_body, head_and_body, lane_count

LIMIT_MB = 4


@pytest.fixture(scope="module")
def server(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Named as conftest's, so `bounded_rss` watches it; a small body limit."""
    repo = models_of(test_repo, tmp_path_factory.mktemp("coding-repo"), "digits_onnx", "minilm")
    running = start_server(
        repo, tmp_path_factory.mktemp("coding"), "--no-llm", "--max-body-mb", str(LIMIT_MB)
    )
    yield running
    running.stop()


def compress(body: bytes, coding: str) -> bytes:
    return gzip.compress(body) if coding == "gzip" else zlib.compress(body)


def post(server: RunningServer, path: str, body: bytes, coding: str) -> httpx.Response:
    headers = {"content-encoding": coding, "content-type": "application/json"}
    headers["request-timeout"] = "30"
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_tritonclient_compressed_requests_are_inflated(
    server: RunningServer, coding: str, binary: bool
) -> None:
    """With binary tensors, Inference-Header-Content-Length counts the inflated body."""
    client = httpclient.InferenceServerClient(server.address)
    x = digits_rows(8)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("probabilities", binary_data=binary)]
    timeout = {"Request-Timeout": "30"}
    plain = client.infer("digits_onnx", [inp], outputs=outputs, headers=timeout)
    packed = client.infer(
        "digits_onnx",
        [inp],
        outputs=outputs,
        headers=timeout,
        request_compression_algorithm=coding,
    )
    expected = plain.as_numpy("probabilities")
    assert expected is not None and expected.shape == (8, 10)
    np.testing.assert_array_equal(packed.as_numpy("probabilities"), expected)


def test_compressed_json_routes_other_than_inference(server: RunningServer) -> None:
    body = json.dumps({"model": "minilm", "input": ["a compressed request"]}).encode()
    plain = httpx.post(server.url + "/v1/embeddings", content=body, timeout=30)
    assert plain.status_code == 200, plain.text
    for coding in ("gzip", "deflate"):
        packed = post(server, "/v1/embeddings", compress(body, coding), coding)
        assert packed.status_code == 200, packed.text
        assert packed.json()["data"] == plain.json()["data"]


def test_other_codings_get_415_and_identity_is_plain(server: RunningServer) -> None:
    body = digits_body(0)
    for coding in ("br", "compress", "zstd", "gzip, br", "gzip, gzip"):
        answer = post(server, INFER, body, coding)
        assert answer.status_code == 415, (coding, answer.text)
        assert coding in answer.json()["error"] and "gzip" in answer.json()["error"]
    refused = post(server, "/v1/embeddings", b'{"model": "minilm", "input": "x"}', "br")
    assert refused.status_code == 415
    assert refused.json()["error"]["type"] == "unsupported_media_type"
    assert post(server, INFER, body, "identity").status_code == 200
    assert post(server, INFER, gzip.compress(body), "identity, GZIP").status_code == 200


def test_the_limit_counts_inflated_bytes(server: RunningServer) -> None:
    """JSON padded with spaces: small on the wire, near or past the limit inflated (the
    larger one inflates beyond the event loop's share, on a worker thread)."""
    request = json.loads(digits_body(0))
    under = json.dumps(request, indent=1).encode() + b" " * (LIMIT_MB * 2**20 - 4096)
    over = under + b" " * 8192
    for coding in ("gzip", "deflate"):
        assert post(server, INFER, compress(under, coding), coding).status_code == 200
        answer = post(server, INFER, compress(over, coding), coding)
        assert answer.status_code == 413, answer.text
        assert "inflates" in answer.json()["error"]


@pytest.mark.usefixtures("bounded_rss")
def test_a_zip_bomb_gets_413_without_being_inflated_whole(server: RunningServer) -> None:
    """A gzip body of about 256 KiB that would inflate to 256 MiB: more than the bound on
    the server's memory growth."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    bomb = b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush()
    assert len(bomb) < LIMIT_MB * 2**20
    answer = post(server, INFER, bomb, "gzip")
    assert answer.status_code == 413, answer.text
    assert post(server, INFER, gzip.compress(digits_body(1)), "gzip").status_code == 200


def test_broken_compressed_bodies_get_400(server: RunningServer) -> None:
    body = gzip.compress(digits_body(0))
    cases = {
        "truncated": (body[: len(body) // 2], "gzip"),
        "not gzip": (b"{this is plain json}", "gzip"),
        "gzip called deflate": (body, "deflate"),
        "bytes after the stream": (zlib.compress(digits_body(0)) + b"junk", "deflate"),
    }
    for name, (data, coding) in cases.items():
        answer = post(server, INFER, data, coding)
        assert answer.status_code == 400, (name, answer.text)
    two_members = gzip.compress(b'{"inputs": ') + gzip.compress(
        digits_body(0)[len(b'{"inputs": ') :]
    )
    assert post(server, INFER, two_members, "gzip").status_code == 200  # members concatenated


def test_compressed_requests_leave_the_lane(server: RunningServer) -> None:
    """A compressed request whose head comes whole is answered by the ASGI path; plain ones
    still take the lane."""
    body = digits_body(2, "packed")
    before = lane_count(server)
    with connect(server) as sock:
        head, packed = head_and_body(INFER, gzip.compress(body), "Content-Encoding: gzip", LONG)
        sock.sendall(head + packed)
        answer = read_response(sock)
        assert answer.status == 200, answer.body[:300]
        assert json.loads(answer.body)["id"] == "packed"
        assert lane_count(server) == before
        sock.sendall(b"".join(head_and_body(INFER, body, LONG)))
        assert read_response(sock).status == 200
    assert lane_count(server) == before + 1


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_tritonclient_asks_for_compressed_answers_and_reads_them(
    server: RunningServer, coding: str, binary: bool
) -> None:
    client = httpclient.InferenceServerClient(server.address)
    x = digits_rows(64)  # 64 rows of 10 probabilities: about 8 KB of JSON
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("probabilities", binary_data=binary)]
    plain = client.infer("digits_onnx", [inp], outputs=outputs)
    packed = client.infer(
        "digits_onnx", [inp], outputs=outputs, response_compression_algorithm=coding
    )
    expected = plain.as_numpy("probabilities")
    assert expected is not None and expected.shape == (64, 10)
    np.testing.assert_array_equal(packed.as_numpy("probabilities"), expected)


def raw_answer(server: RunningServer, accept: str | None) -> tuple[dict[str, str], bytes]:
    """The headers and the raw (still coded) body of an answer of 64 digits rows, asked on a
    raw keep-alive connection: the lane answers it."""
    x = digits_rows(64)
    tensor = {"name": "input", "shape": [64, 64], "datatype": "FP32", "data": x.ravel().tolist()}
    body = json.dumps({"inputs": [tensor]}).encode()
    extra = [LONG] + ([f"Accept-Encoding: {accept}"] if accept is not None else [])
    head, body = head_and_body(INFER, body, *extra)
    sock = connect(server)
    try:
        sock.sendall(head + body)
        answer = read_response(sock)
    finally:
        sock.close()
    assert answer.status == 200, answer.body[:200]
    return answer.headers, answer.body


def test_the_lane_compresses_large_answers_for_clients_that_accept_it(
    server: RunningServer,
) -> None:
    before = lane_count(server)
    headers, body = raw_answer(server, "br;q=1.0, gzip;q=0.5")
    assert headers["content-encoding"] == "gzip" and headers["vary"] == "accept-encoding"
    answer = json.loads(gzip.decompress(body))
    assert len(body) < len(json.dumps(answer)) / 2
    headers, body = raw_answer(server, "deflate")
    assert headers["content-encoding"] == "deflate"
    assert json.loads(zlib.decompress(body)) == answer
    for refused in (None, "identity", "gzip;q=0, deflate;q=0", "br"):
        headers, body = raw_answer(server, refused)
        assert "content-encoding" not in headers and json.loads(body) == answer
    assert lane_count(server) == before + 6


def test_asgi_answers_are_compressed_too_and_small_ones_never(server: RunningServer) -> None:
    accept = {"accept-encoding": "gzip"}
    metrics = httpx.get(server.url + "/metrics", headers=accept)
    assert metrics.headers["content-encoding"] == "gzip"  # httpx inflates it
    assert "lockgate_http_request_duration_seconds" in metrics.text
    small = httpx.get(server.url + "/v2/health/ready", headers=accept)
    assert "content-encoding" not in small.headers
    body = json.dumps({"model": "minilm", "input": ["an embedding of 384 numbers"] * 4})
    answer = httpx.post(server.url + "/v1/embeddings", content=body, headers=accept, timeout=30)
    assert answer.status_code == 200 and answer.headers["content-encoding"] == "gzip"
    assert len(answer.json()["data"]) == 4
