"""Requests refused on arrival: a POST whose head is all in is judged from its raw bytes,
before the HTTP parser sees it. These tests hold a model busy (a sleeping model with a
100 ms SLO, two requests with long timeouts always in front) so every request under the SLO
is refused, and check the connection around each refusal: pipelined requests after it,
bodies that arrive later, keep-alive and close, and the head timeout."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server

HEAD_TIMEOUT = 1.0
SLEEPER = """
import time


class Model:
    def load(self, config, version_dir):
        self.seconds = float(config.parameters["sleep_s"])

    def infer(self, inputs):
        time.sleep(self.seconds)
        return {"y": inputs["x"]}
"""
CONFIG = """\
name: held
backend: python
max_batch_size: 1
inputs:
  - {name: x, datatype: FP32, dims: [4]}
outputs:
  - {name: y, datatype: FP32, dims: [4]}
latency_slo_ms: 100
parameters: {sleep_s: "0.5"}
"""
BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()
INFER = b"POST /v2/models/held/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"


def infer_request(*extra: bytes, body: bytes = BODY) -> bytes:
    head = INFER + b"".join(line + b"\r\n" for line in extra)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


class Reader:
    """HTTP/1.1 responses read one after another from one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            self.buffer = head + b"\r\n\r\n" + rest
            self._fill()
            rest = self.buffer.partition(b"\r\n\r\n")[2]
        self.buffer = rest[length:]
        return int(lines[0].split()[1]), headers, rest[:length]

    def closed(self, within: float) -> bool:
        self.sock.settimeout(within)
        try:
            return self.buffer == b"" and self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed (buffered {self.buffer[:200]!r})"
        self.buffer += chunk


FREE_CONFIG = CONFIG.replace("name: held", "name: free").replace('"0.5"', '"0"')


@contextlib.contextmanager
def held_server(
    tmp: Path, *flags: str, holders: int = 2, sleep_s: float = 0.5
) -> Iterator[RunningServer]:
    """A server with `held` (kept busy: `holders` requests with long timeouts always in
    front, each sleeping `sleep_s`) and `free` (idle)."""
    repo = tmp / "repo"
    held = CONFIG.replace('"0.5"', f'"{sleep_s}"')
    for name, config in (("held", held), ("free", FREE_CONFIG)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(SLEEPER)
        (repo / name / "config.yaml").write_text(config)
    server = start_server(repo, tmp, "--no-llm", "--head-timeout", str(HEAD_TIMEOUT), *flags)
    stop = threading.Event()

    def hold() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(
                    server.url + "/v2/models/held/infer",
                    content=BODY,
                    headers={"request-timeout": "30", "content-type": "application/json"},
                )

    threads = [threading.Thread(target=hold) for _ in range(holders)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    try:
        yield server
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        server.stop()


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with held_server(tmp_path_factory.mktemp("held")) as server:
        yield server


def connect(server: RunningServer) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock, Reader(sock)


def refused(status: int, headers: dict[str, str], body: bytes) -> bool:
    return status == 503 and int(headers["retry-after"]) >= 1 and b"error" in body


def test_a_refusal_keeps_the_connection_and_pipelined_requests_are_answered(
    held: RunningServer,
) -> None:
    sock, reader = connect(held)
    with sock:
        sock.sendall(infer_request() + LIVE + infer_request(b"Connection: keep-alive") + LIVE)
        assert refused(*reader.response())
        assert reader.response()[0] == 200
        assert refused(*reader.response())
        assert reader.response()[0] == 200
        assert not reader.closed(0.2)


def test_a_body_that_arrives_later_is_dropped_and_the_next_request_read(
    held: RunningServer,
) -> None:
    sock, reader = connect(held)
    whole = infer_request()
    split = whole.index(b"\r\n\r\n") + 10  # the head and a few bytes of the body
    with sock:
        sock.sendall(whole[:split])
        assert refused(*reader.response())  # answered before the body is in
        time.sleep(0.1)
        sock.sendall(whole[split:-5])
        time.sleep(0.1)
        sock.sendall(whole[-5:] + LIVE)
        status, _, body = reader.response()
        assert status == 200, body


def test_connection_close_is_honoured(held: RunningServer) -> None:
    sock, reader = connect(held)
    with sock:
        sock.sendall(infer_request(b"Connection: close"))
        status, headers, body = reader.response()
        assert refused(status, headers, body)
        assert headers["connection"] == "close"
        assert reader.closed(5)


def test_an_idle_connection_after_a_refusal_is_not_taken_for_a_stalled_head(
    held: RunningServer,
) -> None:
    sock, reader = connect(held)
    with sock:
        sock.sendall(infer_request())
        assert refused(*reader.response())
        time.sleep(HEAD_TIMEOUT * 1.5)  # longer than the head timeout, shorter than keep-alive
        sock.sendall(LIVE)
        assert reader.response()[0] == 200


def test_a_body_that_never_arrives_closes_the_connection_at_the_head_timeout(
    held: RunningServer,
) -> None:
    sock, reader = connect(held)
    with sock:
        whole = infer_request()
        sock.sendall(whole[: whole.index(b"\r\n\r\n") + 4])
        assert refused(*reader.response())
        assert reader.closed(HEAD_TIMEOUT * 4)


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(
            INFER + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
            id="chunked",
        ),
        pytest.param(infer_request(b"Expect: 100-continue"), id="expect"),
        pytest.param(
            infer_request().replace(b"/held/infer", b"/%68eld/infer"), id="percent-encoded"
        ),
    ],
)
def test_heads_the_arrival_check_leaves_to_the_parser_are_still_refused(
    held: RunningServer, request_bytes: bytes
) -> None:
    sock, reader = connect(held)
    with sock:
        sock.sendall(request_bytes + LIVE)
        status, headers, body = reader.response()
        assert refused(status, headers, body), (status, body)


def test_refusals_are_counted_as_admission_counts_them(held: RunningServer) -> None:
    before = httpx.get(held.url + "/metrics").text
    sock, reader = connect(held)
    with sock:
        sock.sendall(infer_request() * 20)
        for _ in range(20):
            assert refused(*reader.response())
    after = httpx.get(held.url + "/metrics").text

    def count(text: str, prefix: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
        )

    http = 'lockgate_http_refused_total{reason="model_admission"}'
    assert count(after, http) - count(before, http) >= 20
    model = (
        'lockgate_requests_rejected_total{model="held",reason="deadline_unmeetable",version="1"}'
    )
    assert count(after, model) - count(before, model) >= 20


PAUSE_S = 0.4


def paused(server: RunningServer) -> tuple[socket.socket, Reader]:
    """A connection refused 200 times over: refusals far outnumber admissions, so it is paused
    for at most the refused requests' budget (1 s; the held model's 100 ms SLO would allow
    100 ms), or `--refusal-pause-ms`."""
    sock, reader = connect(server)
    sock.sendall(infer_request(b"request-timeout: 1") * 200)
    for _ in range(200):
        assert refused(*reader.response())
    return sock, reader


def test_a_request_that_waited_out_a_refusal_pause_counts_the_wait(tmp_path: Path) -> None:
    """A client refused many times over is not read for `--refusal-pause-ms`; a request it
    sends meanwhile is taken to have arrived when the pause began. With a deadline shorter
    than the pause it is late when read, so it is never served although its model is idle:
    refused on arrival (503) when the loop has work ahead of it, else answered 504."""
    with held_server(tmp_path, "--refusal-pause-ms", str(int(PAUSE_S * 1000))) as server:
        sock, reader = paused(server)
        with sock:
            free = infer_request(b"request-timeout: 0.2").replace(b"/held/", b"/free/")
            started = time.monotonic()
            sock.sendall(free)
            status, _, body = reader.response()
            waited = time.monotonic() - started
        assert waited >= PAUSE_S * 0.5, waited  # the connection was not read at once
        assert status in (503, 504), body
        assert b"deadline" in body, body
        with httpx.Client(timeout=10) as client:  # an idle model on a fresh connection: served
            r = client.post(
                server.url + "/v2/models/free/infer",
                content=BODY,
                headers={"request-timeout": "0.2", "content-type": "application/json"},
            )
        assert r.status_code == 200, r.text


def test_a_request_refused_for_the_pause_it_waited_does_not_pause_its_connection_again(
    tmp_path: Path,
) -> None:
    """A request sent during its connection's pause and refused when read (its budget spent
    in the pause) does not pause the connection again: its client did not resend at once,
    the pause held it. The connection's next request is read at once and served. (Paused
    again, a client with requests queued, such as an open-loop pool, had every request
    refused for the pause the one before it caused, for as long as refusals outnumbered
    answers.)"""
    with held_server(
        tmp_path, "--refusal-pause-ms", str(int(PAUSE_S * 1000)), holders=1, sleep_s=2.0
    ) as server:
        sock, reader = paused(server)
        with sock:
            started = time.monotonic()
            sock.sendall(infer_request(b"request-timeout: 0.2"))  # its model still busy
            assert refused(*reader.response())
            assert time.monotonic() - started >= PAUSE_S * 0.5  # it waited out the pause
            started = time.monotonic()
            sock.sendall(infer_request(b"request-timeout: 5").replace(b"/held/", b"/free/"))
            status, _, body = reader.response()
            waited = time.monotonic() - started
        assert status == 200, body
        assert waited < PAUSE_S * 0.5, waited  # read at once, not after another pause


def test_a_refusal_pause_is_not_taken_for_a_queue_in_front_of_the_app(tmp_path: Path) -> None:
    """A request sent during its connection's refusal pause is read after it, having waited;
    but not in a queue of the server's: the front end's standing-queue check (CoDel, 50 ms
    here) counts from the pause's end, so the requests after it are not refused as queued.
    (It counted from the request's arrival, and the pause made a standing queue: in a storm,
    the requests let through came from paused connections, and new ones were refused.)"""
    with held_server(
        tmp_path, "--refusal-pause-ms", str(int(PAUSE_S * 1000)), holders=1, sleep_s=2.0
    ) as server:
        free = infer_request(b"request-timeout: 5").replace(b"/held/", b"/free/")
        before = httpx.get(server.url + "/metrics").text  # (a request too: none until the end)
        sock, reader = paused(server)
        with sock:
            started = time.monotonic()
            sock.sendall(free)
            status, _, body = reader.response()
            assert time.monotonic() - started >= PAUSE_S * 0.5  # it waited out the pause
            assert status == 200, body
        time.sleep(0.06)  # past the check's interval: the next request closes it
        statuses = []
        with httpx.Client(timeout=10) as client:
            for _ in range(5):  # the held request still in progress
                r = client.post(
                    server.url + "/v2/models/free/infer",
                    content=BODY,
                    headers={"request-timeout": "5", "content-type": "application/json"},
                )
                statuses.append((r.status_code, r.text[:80]))
        after = httpx.get(server.url + "/metrics").text
    assert [status for status, _ in statuses] == [200] * 5, statuses
    queued = 'lockgate_http_refused_total{reason="queue_delay"}'
    assert [line for line in after.splitlines() if line.startswith(queued)] == [
        line for line in before.splitlines() if line.startswith(queued)
    ]


def test_a_kept_connection_is_refused_by_the_model_loaded_now(tmp_path: Path) -> None:
    """Each connection keeps the last head it split: after a reload the same head on the same
    connection is judged by the new version (its SLO in the refusal), after an unload by
    none (the route's 404)."""
    control = ("--model-control-mode", "explicit", "--load-model", "*")
    with held_server(tmp_path, *control) as server:
        sock, reader = connect(server)
        with sock:
            sock.sendall(infer_request())
            status, headers, body = reader.response()
            assert refused(status, headers, body) and b"budget 100.0 ms" in body, body
            config = tmp_path / "repo" / "held" / "config.yaml"
            config.write_text(CONFIG.replace("latency_slo_ms: 100", "latency_slo_ms: 80"))
            load = httpx.post(server.url + "/v2/repository/models/held/load", timeout=30)
            assert load.status_code == 200, load.text
            # until the holders keep the new version busy: then refused on arrival (no time
            # spent: its whole budget), never by the old version
            deadline = time.monotonic() + 10
            while True:
                sock.sendall(infer_request())
                status, headers, body = reader.response()
                assert b"budget 100.0 ms" not in body, body
                if b"budget 80.0 ms" in body or time.monotonic() > deadline:
                    break
            assert refused(status, headers, body) and b"budget 80.0 ms" in body, body
            unload = httpx.post(server.url + "/v2/repository/models/held/unload", timeout=30)
            assert unload.status_code == 200, unload.text
            sock.sendall(infer_request())
            status, _, body = reader.response()
            assert status == 404, body
