"""The router's lane (`lockgate/router/lane.py`): KServe v2 inference passed to a replica and
back below ASGI, and back on the app's path when an attempt there gives no answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lockgate.router.lane_answer import BadAnswer, LaneReader
from lockgate.router.lane_head import LaneHead, LaneHeads, header_lines
from tests.conftest import RunningServer, free_port, start_server
from tests.router.test_router import body, metric, repository, start_router

INFER = "/v2/models/who/infer"


def raw_request(value: float, extra: str = "") -> bytes:
    data = json.dumps(body(value)).encode()
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` answers framed by their content-length: (status, headers, body)."""
    buffer = b""
    answers = []
    while len(answers) < count:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = buffer[:end].decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in head[1:])
            size = end + 4 + int(headers["content-length"])
            if len(buffer) >= size:
                answers.append((int(head[0].split()[1]), headers, buffer[end + 4 : size]))
                buffer = buffer[size:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(answers)} answers"
        buffer += chunk
    return answers


def lane(router: RunningServer, outcome: str) -> float:
    return metric(router.url, f'lockgate_router_lane_total{{outcome="{outcome}"}}')


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("lane-replica")
    server = start_server(repository(root, 7), root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(
    replica: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    server = start_router(tmp_path_factory.mktemp("lane-router"), "--replica", replica.url)
    yield server
    server.stop()


def test_inference_goes_on_the_lane_and_answers_as_the_app_path_does(
    router: RunningServer, replica: RunningServer
) -> None:
    """Kept-alive requests after the first are answered on the lane, with the replica's answer
    as it came; a `Connection: close` request takes the app's path and closes."""
    before = lane(router, "answered")
    with httpx.Client(base_url=router.url) as client:
        for i in range(20):
            r = client.post(INFER, json=body(float(i)))
            assert r.status_code == 200
            assert r.json()["outputs"][0]["data"] == [float(i), 1.0]
            assert r.headers["x-lockgate-inflight"].isdigit()
            direct = httpx.post(replica.url + INFER, json=body(float(i)))
            assert r.json() == direct.json()
        bad = client.post(INFER, content=b"{not json")
        assert bad.status_code == 400 and "error" in bad.json()
    assert lane(router, "answered") - before >= 19  # the first may open the connection
    assert metric(router.url, 'lockgate_router_requests_total{status="200"}') >= 20
    assert metric(router.url, 'lockgate_router_model_requests_total{group="main",model="who"') >= 21
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(raw_request(3.0, "Connection: close\r\n"))
        ((status, headers, _),) = read_answers(sock, 1)
        assert status == 200 and headers.get("connection") == "close"
        assert sock.recv(1) == b""  # closed after the answer


def test_pipelined_requests_are_answered_in_order(router: RunningServer) -> None:
    """Requests sent together, the first taken on the lane, are answered in the order sent."""
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(raw_request(1.0))  # opens the router's connection to the replica
        read_answers(sock, 1)
        sock.sendall(b"".join(raw_request(float(v)) for v in (10, 11, 12, 13)))
        answers = read_answers(sock, 4)
    values = [json.loads(data)["outputs"][0]["data"][0] for _, _, data in answers]
    assert [status for status, _, _ in answers] == [200] * 4
    assert values == [10.0, 11.0, 12.0, 13.0]


def test_a_client_that_leaves_mid_request_frees_the_replica(router: RunningServer) -> None:
    """A client gone while its request is on the lane closes the replica's connection: the
    router's count of its requests on the replica returns to zero, and it keeps serving."""
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(raw_request(1.0))
        read_answers(sock, 1)
        sock.sendall(raw_request(1.0).replace(b"/who/", b"/slow/"))  # sleeps 0.3 s
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
        if replicas[0]["in_flight"] == 0:
            break
        time.sleep(0.02)
    assert replicas[0]["in_flight"] == 0
    assert httpx.post(router.url + INFER, json=body(2.0)).status_code == 200


def test_the_head_parse_leaves_what_it_cannot_take_to_the_app_path() -> None:
    whole = raw_request(1.0)
    head = LaneHead.parse(whole + b"POST")
    assert head is not None and head.path == INFER and head.size == len(whole)
    assert head.timeout is None
    assert (b"content-type", b"application/json") in header_lines(whole)
    timed = LaneHead.parse(whole.replace(b"Host: x", b"Request-Timeout:  2.5"))
    assert timed is not None and timed.timeout == b"2.5"
    kept = LaneHead.parse(whole.replace(b"Host: x", b"Connection: Keep-Alive"))
    assert kept is not None
    partial = LaneHead.parse(whole[:-1])  # the body is not all in: it is to come
    assert partial is not None and partial.size == len(whole)
    assert LaneHead.parse(whole[: whole.find(b"\r\n\r\n") + 2]) is None  # nor the head
    for changed in (
        whole.replace(b"HTTP/1.1", b"HTTP/1.0"),
        whole.replace(b"/infer", b"/infer?x=1"),
        whole.replace(b"/who/", b"/w%6Fo/"),
        whole.replace(b"/infer", b"/ready"),
        whole.replace(b"Host: x\r\n", b"Expect: 100-continue\r\n"),
        whole.replace(b"Host: x\r\n", b"Connection: close\r\n"),
        whole.replace(b"Host: x\r\n", b"Transfer-Encoding: chunked\r\n"),
        whole.replace(b"Host: x\r\n", b"Content-Length: 3\r\n"),
        whole.replace(b"Host: x\r\n", b" folded\r\n"),
        whole.replace(b"Host: x\r\n", b"Connection: keep-alive, Upgrade\r\n"),
        whole.replace(b"Content-Length", b"Content-Length "),  # not the exact header
    ):
        assert LaneHead.parse(changed) is None, changed[:120]


class FakeReplica:
    """A replica on a raw socket, in a thread: ready, and answers inference with `status`.
    `drop_second`: it reads the second request of each connection and closes the connection
    without answering, as a replica closing an idle connection at that moment does. `answer`:
    how it answers inference: `plain` (framed by content-length), `echo` (the request's head
    as it came, with a header of its own), `chunked`, or `cut` (plain, but to the second
    inference request of each connection its head and half its body, then the connection
    closes)."""

    def __init__(
        self, status: int, drop_second: bool = False, delay: float = 0.0, answer: str = "plain"
    ) -> None:
        self.status = status
        self.drop_second = drop_second
        self.delay = delay  # seconds before each inference answer
        self.answer = answer
        self.cut = 0  # inference requests whose client closed before their answer
        self.port = free_port()
        self.inference = 0  # answered
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = inferred = 0  # on this connection
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                requests += 1
                if head.startswith(b"GET"):
                    status, data = 200, b'{"ready": true}'
                elif self.drop_second and requests == 2:
                    break
                else:
                    if self.delay:
                        await asyncio.sleep(self.delay)
                        if reader.at_eof():  # the router closed it: the other copy won
                            self.cut += 1
                            break
                    self.inference += 1
                    inferred += 1
                    status, data = self.status, b'{"fake": %d}' % self.port
                    if self.answer in ("echo", "chunked") or (self.answer, inferred) == ("cut", 2):
                        if await self._answer(writer, head):
                            continue
                        break
                extra = b"retry-after: 1\r\n" if status == 503 else b""
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n%s"
                    b"content-length: %d\r\n\r\n%s" % (status, extra, len(data), data)
                )
                await writer.drain()
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, head: bytes) -> bool:
        """An inference answer other than plain; False when the connection is to close."""
        data = b'{"fake": %d}' % self.port
        if self.answer == "echo":
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Fake: yes\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(head), head)
            )
        elif self.answer == "chunked":
            half = len(data) // 2
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
                % (half, data[:half], len(data) - half, data[half:])
            )
        else:  # cut: half the answer, and the connection closes
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(data), data[: len(data) // 2])
            )
            await writer.drain()
            return False
        await writer.drain()
        return True

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fakes() -> Iterator[list[FakeReplica]]:
    made: list[FakeReplica] = []
    yield made
    for fake in made:
        fake.stop()


def test_a_replica_connection_that_closes_before_answering_loses_no_request(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """The replica closes each kept-alive connection on its second request, unanswered: each
    such request, sent from the lane, is sent again along the app's path on a new connection,
    without counting against the replica's health."""
    fakes.append(FakeReplica(200, drop_second=True))
    router = start_router(tmp_path, "--replica", fakes[0].url, "--probe-interval", "60")
    try:
        with httpx.Client(base_url=router.url) as client:
            for _ in range(6):
                r = client.post(INFER, json=body())
                assert r.status_code == 200, r.text
        assert lane(router, "app_path") >= 5  # (the first may have opened the connection)
        assert fakes[0].inference == 6
        assert metric(router.url, 'lockgate_router_attempts_total{outcome="error"') == 0
        replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
        assert replicas[0]["usable"] and replicas[0]["in_flight"] == 0
    finally:
        router.stop()


def test_a_503_on_the_lane_is_retried_on_another_replica_or_passed_on(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """A replica whose admission refuses: the lane's attempt goes on along the app's path, to
    the other replica; with no other, the replica's 503 and its Retry-After reach the client."""
    fakes.extend([FakeReplica(503), FakeReplica(200)])
    router = start_router(tmp_path, "--replica", fakes[0].url, "--replica", fakes[1].url)
    try:
        with httpx.Client(base_url=router.url) as client:
            answers = [client.post(INFER, json=body()) for _ in range(30)]
        assert [r.status_code for r in answers] == [200] * 30
        assert all(r.json() == {"fake": fakes[1].port} for r in answers)
        assert lane(router, "answered") > 0
    finally:
        router.stop()
    alone = start_router(tmp_path, "--replica", fakes[0].url)
    try:
        with httpx.Client(base_url=alone.url) as client:
            for _ in range(5):
                r = client.post(INFER, json=body())
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json() == {"fake": fakes[0].port}
                time.sleep(0.15)  # past the moment the router counts the replica full
        assert lane(alone, "app_path") >= 1
    finally:
        alone.stop()


def test_a_slow_replica_is_hedged_on_the_lane(tmp_path: Path, fakes: list[FakeReplica]) -> None:
    """One of two replicas answers after 300 ms: requests sent to it get a second copy on the
    other after the hedge delay, the first answer goes to the client, and the slow copy's
    connection is closed."""
    fakes.extend([FakeReplica(200, delay=0.3), FakeReplica(200)])
    flags = ("--hedge-delay-ms", "20", "--hedge-budget", "1")
    router = start_router(tmp_path, "--replica", fakes[0].url, "--replica", fakes[1].url, *flags)
    try:
        times = []
        with httpx.Client(base_url=router.url) as client:
            # a model is hedged once an answer said it is no language model (`model_kinds.py`)
            assert client.post(INFER, json=body()).status_code == 200
            time.sleep(0.4)
            answered = fakes[0].inference
            for _ in range(20):
                t0 = time.perf_counter()
                r = client.post(INFER, json=body())
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json() == {"fake": fakes[1].port}
        assert max(times) < 0.25, times
        assert metric(router.url, 'lockgate_router_hedges_total{winner="second"}') >= 1
        # the fast replica's answers stay on the lane; a closed loser's replica has no idle
        # connection for its next request, which opens one along the app's path (hedged too)
        assert lane(router, "answered") >= 5
        time.sleep(0.4)  # the slow replica's copies end
        assert fakes[0].inference == answered and fakes[0].cut >= 1
        replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
        assert [r["in_flight"] for r in replicas] == [0, 0]
    finally:
        router.stop()


def test_a_model_named_send_once_is_never_hedged_on_a_replica_that_does_not_mark_it(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """Replicas that are not lockgate (the fakes) never mark a language model's answers; with
    `--send-once who`, the router sends each of its requests to one replica, however slow the
    answer, where the same replicas get hedged copies without the flag (the test above)."""
    fakes.extend([FakeReplica(200, delay=0.3), FakeReplica(200)])
    flags = ("--hedge-delay-ms", "20", "--hedge-budget", "1", "--send-once", "who")
    router = start_router(tmp_path, "--replica", fakes[0].url, "--replica", fakes[1].url, *flags)
    try:
        with httpx.Client(base_url=router.url) as client:
            answers = [client.post(INFER, json=body()) for _ in range(12)]
        assert [r.status_code for r in answers] == [200] * 12
        slow = [r for r in answers if r.json() == {"fake": fakes[0].port}]
        assert slow, "power of two choices sent none to the slow replica"
        assert all(r.elapsed.total_seconds() >= 0.3 for r in slow)
        assert metric(router.url, "lockgate_router_hedges_total") == 0
        assert fakes[0].inference + fakes[1].inference == 12  # one copy each
        assert fakes[0].cut == 0
    finally:
        router.stop()


def test_each_head_is_searched_once() -> None:
    """The lane remembers what it made of each head by the head's bytes: a client sending the
    same head again (every body of one size) costs a lookup, not a search; a head the lane
    does not take is remembered too, one longer than the memo keeps is searched each time,
    and past its limit the memo starts again."""
    resolved: list[str] = []

    def resolve(head: LaneHead) -> LaneHead | None:
        resolved.append(head.path)
        return head if "who" in head.path else None

    heads = LaneHeads(resolve, limit=2, max_key=400)
    whole = raw_request(1.0)
    first = heads.of(whole)
    assert first is not None and first.path == INFER and heads.of(whole) is first
    assert heads.of(raw_request(2.0)) is first  # another body of the same size
    assert resolved == [INFER]
    other = whole.replace(b"/who/", b"/not/")
    assert heads.of(other) is None and heads.of(other) is None
    assert resolved == [INFER, "/v2/models/not/infer"]
    assert heads.of(whole[: whole.find(b"\r\n\r\n")]) is None  # not all in: not remembered
    heads.of(raw_request(1.0, "X-Id: 1\r\n"))  # a third head: the memo starts again
    assert len(heads.known) == 1
    long = raw_request(1.0, f"X-Pad: {'p' * 400}\r\n")
    assert heads.of(long) is not None and heads.of(long) is not None
    assert resolved[-2:] == [INFER, INFER] and len(heads.known) == 1


def answer_bytes(extra: bytes = b"", body: bytes = b'{"ok": 1}') -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Lockgate-Inflight: 3\r\n"
        b"%sContent-Length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


def test_a_lane_answer_passes_as_it_came_when_its_head_allows() -> None:
    """The lane's reader gives each whole answer, from one read or several; the router reads
    its head by search (any case), passes it on as it came when it is framed by its
    content-length with nothing about the connection in it, and refuses what is not one
    answer."""
    reader = LaneReader()
    raw = answer_bytes()
    answer = reader.feed(raw)
    assert answer is not None and answer.status == 200 and answer.keep_alive
    assert answer.as_is and answer.raw == raw and answer.body == b'{"ok": 1}'
    assert answer.header(b"\r\nx-lockgate-inflight:") == b"3"
    assert answer.header(b"\r\nx-lockgate-model-kind:") is None
    assert (b"content-type", b"application/json") in answer.headers
    parts = [raw[:10], raw[10:60], raw[60:-3], raw[-3:]]  # split anywhere, the head too
    assert [reader.feed(part) for part in parts][:-1] == [None, None, None]
    chunked = (
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"ok\r\n5\r\n": 1}\r\n0\r\n\r\n'
    )
    answer = reader.feed(chunked)
    assert answer is not None and not answer.as_is and answer.body == b'{"ok": 1}'
    for extra in (b"Connection: keep-alive\r\n", b"Keep-Alive: timeout=5\r\n"):
        answer = reader.feed(answer_bytes(extra))
        assert answer is not None and not answer.as_is
    answer = reader.feed(answer_bytes(b"Connection: close\r\n"))
    assert answer is not None and not answer.keep_alive
    for bad in (raw + b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 100 Continue\r\n\r\n", b"hello\r\n\r\n"):
        with pytest.raises(BadAnswer):
            LaneReader().feed(bad)


def test_the_lane_passes_on_the_headers_each_side_sent(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """On the lane the replica gets the client's request as it was sent (its own headers
    among them), and the client the replica's answer with the replica's headers."""
    fakes.append(FakeReplica(200, answer="echo"))
    router = start_router(tmp_path, "--replica", fakes[0].url, "--probe-interval", "60")
    try:
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            for value in (1.0, 2.0, 3.0):
                request = raw_request(value, "X-Request-Id: abc-7\r\nUser-Agent: lane-test\r\n")
                sock.sendall(request)
                ((status, headers, data),) = read_answers(sock, 1)
                assert status == 200 and headers["x-fake"] == "yes"
                assert headers["content-type"] == "text/plain"
                assert data == request[: request.find(b"\r\n\r\n") + 4]
        assert lane(router, "answered") >= 2  # (the first may open the connection)
    finally:
        router.stop()


def test_a_body_split_across_reads_and_a_chunked_one_are_answered(
    router: RunningServer,
) -> None:
    """A request whose body comes in several writes after its head takes the lane once all
    of it is in; a chunked body takes the app's path. Both are answered as sent."""
    before = lane(router, "answered")
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(raw_request(1.0))
        read_answers(sock, 1)
        for value in (4.0, 5.0):
            request = raw_request(value)
            cut = request.find(b"\r\n\r\n") + 4
            for part in (request[:cut], request[cut : cut + 10], request[cut + 10 :]):
                sock.sendall(part)
                time.sleep(0.02)
            ((status, _, data),) = read_answers(sock, 1)
            assert status == 200 and json.loads(data)["outputs"][0]["data"] == [value, 1.0]
        payload = json.dumps(body(6.0)).encode()
        chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            10,
            payload[:10],
            len(payload) - 10,
            payload[10:],
        )
        sock.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
            + chunks
        )
        ((status, _, data),) = read_answers(sock, 1)
        assert status == 200 and json.loads(data)["outputs"][0]["data"] == [6.0, 1.0]
    assert lane(router, "answered") - before >= 3


def test_a_chunked_answer_goes_on_framed_by_its_length(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """A replica's chunked answer to a lane request reaches the client whole, its head built
    again: framed by content-length, without the replica's transfer-encoding."""
    fakes.append(FakeReplica(200, answer="chunked"))
    router = start_router(tmp_path, "--replica", fakes[0].url, "--probe-interval", "60")
    try:
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            for value in (1.0, 2.0, 3.0):
                sock.sendall(raw_request(value))
                ((status, headers, data),) = read_answers(sock, 1)
                assert status == 200 and json.loads(data) == {"fake": fakes[0].port}
                assert "transfer-encoding" not in headers
        assert lane(router, "answered") >= 2
    finally:
        router.stop()


def test_a_replica_that_breaks_off_its_answer_is_retried_within_budget(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    """A replica that closes its connection halfway through an answer on the lane: once the
    model is known to answer as a classic model (sent twice when need be), the request goes
    again to the other replica, within the retry budget. (The app's path passes an answer on
    as it comes, so one broken off there reaches the client broken off.) With no other
    replica, the client gets 502."""
    fakes.extend([FakeReplica(200, answer="cut"), FakeReplica(200)])
    flags = ("--probe-interval", "60", "--no-hedge", "--eject-after", "1000")
    router = start_router(
        tmp_path,
        "--replica",
        fakes[0].url,
        "--replica",
        fakes[1].url,
        *flags,
        "--retry-budget",
        "0.5",
    )
    errors = 'lockgate_router_attempts_total{outcome="error"'
    try:
        with httpx.Client(base_url=router.url) as client:
            # until an answer has told the model is a classic one, and each replica has a
            # connection open (its first answer on it is whole)
            while fakes[0].inference == 0 or fakes[1].inference == 0:
                with contextlib.suppress(httpx.RemoteProtocolError):
                    client.post(INFER, json=body())
            cut, retried = metric(router.url, errors), metric(router.url, "lockgate_router_retries")
            answers = [client.post(INFER, json=body()) for _ in range(16)]
        assert [r.status_code for r in answers] == [200] * 16
        cut = metric(router.url, errors) - cut
        assert cut >= 1 and metric(router.url, "lockgate_router_retries") - retried == cut
        assert lane(router, "app_path") >= cut
    finally:
        router.stop()
    alone = start_router(tmp_path, "--replica", fakes[0].url, "--probe-interval", "60")
    try:
        with httpx.Client(base_url=alone.url) as client:
            assert client.post(INFER, json=body()).status_code == 200  # opens a connection
            assert client.post(INFER, json=body()).status_code == 502  # cut, on the lane
    finally:
        alone.stop()
