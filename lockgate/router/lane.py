"""The router's lane: KServe v2 inference passed to a replica and back below ASGI.

A `POST /v2/models/{m}[/versions/{v}]/infer` whose head arrives whole, at a message boundary
of a kept-alive HTTP/1.1 connection, is read from its raw bytes (`LaneHead.parse`), and its
body (up to 64 KiB; larger ones take the app's path) gathered as it comes.
When nothing about it needs the app's general path (`RouterApp.lane`: no rate limits, sticky
sessions, canary or shadow for its model, no hedge to time, no deadline already spent, a
body within the limit, a replica not shedding) and the replica chosen has an idle connection
at hand, the request is written to that connection from the client connection's own callback
(`LaneCall.send`), and the answer's bytes are written back to the client from the replica
connection's callback (`LaneCall.answered`) as they came: no task, no ASGI messages, no
answer head built again. The replica's answer is passed on as it is when its head has no
`connection` header and frames the body by `content-length` (a lockgate replica's always
does); other answers have their head built as the app's path builds it.

The lane keeps what the app's path does for such a request: power of two choices over the
usable replicas, the `request-timeout` header less the time spent, the replica's reported
load, its health (a 503 marks it full, other 5xx and broken connections count toward its
ejection), the request and attempt counters and the latency histogram. An attempt that gets
no answer, a 503 or another 5xx (504 aside) goes on along the app's path (`RouterApp._serve`
with the replica tried), which retries it on another replica within the retry budget and,
when none is left, passes the 503 on. A client that leaves closes the replica's connection,
so the replica drops the work. Everything else (other paths, chunked bodies, `Expect`,
`Connection: close`, HTTP/1.0, encoded paths or a query, heads split over reads)
takes the app's path from the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from lockgate.router.replica import Replica
from lockgate.router.upstream import HOP_BY_HOP, STATUS_LINES, Response

LANE_SCOPE = "lockgate.lane"  # in the scope of a request the lane hands to the app's path
_LINE_START = b"POST /v2/models/"
_LINE_END = b"/infer HTTP/1.1"
# header lines that leave a request to the app's path (searched for in the lowered head)
_LEAVE_TO_APP = (b"\r\ntransfer-encoding:", b"\r\nexpect:", b"\r\nupgrade:", b"\r\n ", b"\r\n\t")
_LENGTH = b"\r\ncontent-length:"
_CONNECTION = b"\r\nconnection:"
_TIMEOUT = b"\r\nrequest-timeout:"


@dataclass(slots=True)
class LaneHead:
    """A request head found in raw bytes: what the lane needs of it. The request is passed
    on as it came, so its header lines are split only if it goes to the app's path
    (`headers`)."""

    path: str
    length: int  # Content-Length
    size: int  # bytes of the head and its body
    timeout: bytes | None  # the request-timeout header's value

    @classmethod
    def parse(cls, data: bytes, max_head: int = 64 * 1024) -> LaneHead | None:
        """The head of a v2 inference POST at the start of `data`, when it is all in `data`
        and the lane can take it; else None (the app's path takes it). Its body may be still
        to come (`size` past the end of `data`). It is found, not parsed: the replica parses
        it, and a request whose framing could read two ways (two lengths, a folded line, a
        length the search does not see) goes to the app's path."""
        end = data.find(b"\r\n\r\n", 0, max_head)
        if end < 0:
            return None
        first = data.find(b"\r\n")
        line = data[:first]
        if not line.startswith(_LINE_START) or not line.endswith(_LINE_END):
            return None
        path = line[5:-9]
        if b" " in path or b"%" in path or b"?" in path:
            return None
        head = data[first : end + 2].lower()  # every header line starts with \r\n
        for token in _LEAVE_TO_APP:
            if token in head:
                return None
        at = head.find(_CONNECTION)
        if at >= 0 and (
            head[at + 13 : head.find(b"\r\n", at + 2)].strip(b" \t") != b"keep-alive"
            or head.find(_CONNECTION, at + 2) >= 0
        ):
            return None  # close, or a list: the app's path
        at = head.find(_LENGTH)
        if at < 0 or head.find(_LENGTH, at + 2) >= 0:
            return None
        value = head[at + 17 : head.find(b"\r\n", at + 2)].strip(b" \t")
        if not value.isdigit() or len(value) > 18:
            return None
        at = head.find(_TIMEOUT)
        timeout = None
        if at >= 0:
            timeout = head[at + 18 : head.find(b"\r\n", at + 2)].strip(b" \t")
        length = int(value)
        return cls(path.decode("ascii", "replace"), length, end + 4 + length, timeout)


def header_lines(request: bytes) -> list[tuple[bytes, bytes]]:
    """The header lines of a raw request, names in lower case (as ASGI gives them)."""
    end = request.find(b"\r\n\r\n")
    headers = []
    for line in request[request.find(b"\r\n") + 2 : end].split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers.append((name.lower(), value.strip(b" \t")))
    return headers


class _Aborts(Protocol):
    def abort(self) -> None: ...


class LaneClient(Protocol):
    """The client connection a lane request came on (`client_connection.ClientConnection`)."""

    def lane_answered(self, data: bytes) -> None: ...
    def lane_failed(self, call: LaneCall) -> None: ...


class LaneApp(Protocol):
    """What a lane request reports to (`app.RouterApp`)."""

    def lane_attempt(
        self, call: LaneCall, replica: Replica, response: Response | None, now: float
    ) -> bool: ...
    def lane_hedge(self, call: LaneCall) -> Replica | None: ...
    def lane_done(self, call: LaneCall, status: int, now: float, hedged: str | None) -> None: ...


class _Copy:
    """One copy of a lane request on one replica (an `upstream.Listener`)."""

    __slots__ = ("call", "connection", "replica")

    def __init__(self, call: LaneCall, replica: Replica) -> None:
        self.call = call
        self.replica = replica
        self.connection: _Aborts | None = None  # the replica's, while it answers

    def answered(
        self, status: int, headers: list[tuple[bytes, bytes]], raw: bytes, body: bytes
    ) -> None:
        self.connection = None
        self.call.answered(self, status, headers, raw, body)

    def broke(self, answered_nothing: bool) -> None:
        self.connection = None
        self.call.broke(self, answered_nothing)

    def abort(self) -> None:
        """Close the replica's connection: the replica drops the work."""
        connection, self.connection = self.connection, None
        if connection is not None:
            self.replica.in_flight -= 1
            connection.abort()


class LaneCall:
    """One request on the lane: sent to `replica`, and after `delay` (a hedge) a second copy
    to another replica; the first answer other than a 503 goes to the client and the other
    copy's connection closes. With none, the request goes to the app's path
    (`LaneClient.lane_failed`), skipping the replicas that gave no answer (`tried`) and with
    the first 503 (`refused`) to pass on if no other replica answers."""

    __slots__ = (
        "app",
        "arrived",
        "broken",
        "client",
        "copies",
        "done",
        "gone",
        "hedged",
        "length",
        "model",
        "path",
        "refused",
        "replica",
        "request",
        "timer",
        "tried",
        "version",
    )

    def __init__(
        self,
        app: LaneApp,
        client: LaneClient,
        head: LaneHead,
        request: bytes,
        arrived: float,
        model: str,
        version: str | None,
        replica: Replica,
    ) -> None:
        self.app = app
        self.client = client
        self.path = head.path
        self.request = request  # head and body, as they came and went to the replica
        self.length = head.length  # of the body, at the end of `request`
        self.arrived = arrived
        self.model = model
        self.version = version
        self.replica = replica  # the first copy's
        self.copies: list[_Copy] = []  # those still waiting for their answer
        self.timer: asyncio.TimerHandle | None = None  # the hedge's
        self.tried: list[Replica] = []  # replicas that gave no answer: the app's path skips them
        self.refused: tuple[Response, Replica] | None = None  # the first 503 received
        self.done = False  # answered, or handed to the app's path
        self.hedged = False  # a second copy was sent
        self.gone = False  # the client left: nothing more is written to it
        self.broken = False  # a copy's connection broke once the request was sent

    def send(self, delay: float | None) -> bool:
        """Send to the replica on an idle connection, and time a hedge after `delay` seconds
        (None: none); False (nothing sent) if no connection is idle."""
        if not self._send(self.replica):
            return False
        if delay is not None:
            self.timer = asyncio.get_running_loop().call_later(delay, self._hedge)
        return True

    def _send(self, replica: Replica) -> bool:
        copy = _Copy(self, replica)
        copy.connection = replica.upstream.send_lane(self.request, copy)
        if copy.connection is None:
            return False
        replica.in_flight += 1
        self.copies.append(copy)
        return True

    def _hedge(self) -> None:
        """No answer yet after the hedge delay: a second copy, if a replica and the hedge
        budget have room and that replica has an idle connection."""
        self.timer = None
        if self.done or not self.copies:
            return
        second = self.app.lane_hedge(self)
        if second is not None:
            self.hedged = self._send(second)

    def answered(
        self,
        copy: _Copy,
        status: int,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        body: bytes,
    ) -> None:
        if copy not in self.copies:  # closed: the other copy won, or the client left
            return
        self.copies.remove(copy)
        now = time.monotonic()
        response = Response(status, headers)
        if not self.app.lane_attempt(self, copy.replica, response, now):  # a 503
            self.tried.append(copy.replica)
            if self.refused is None:
                response.put(body)
                response.put(None)
                self.refused = (response, copy.replica)
            self._failed()
            return
        if self.done:
            return  # the other copy answered first
        self._finish()
        if self.gone:
            return
        self.client.lane_answered(raw if _as_is(headers) else _rebuilt(status, headers, body))
        winner = None
        if self.hedged:
            winner = "first" if copy.replica is self.replica else "second"
        self.app.lane_done(self, status, now, winner)

    def broke(self, copy: _Copy, answered_nothing: bool) -> None:
        if copy not in self.copies:  # closed: the other copy won, or the client left
            return
        self.copies.remove(copy)
        if answered_nothing:  # most likely an idle connection the replica had closed: the
            copy.replica.in_flight -= 1  # app's path sends it again, on a new connection
        else:
            self.app.lane_attempt(self, copy.replica, None, time.monotonic())
            self.tried.append(copy.replica)
            self.broken = True
        self._failed()

    def _failed(self) -> None:
        """A copy gave no answer to pass on: wait for the other, else the app's path."""
        if self.done or self.copies:
            return
        self._finish()
        if not self.gone:
            self.client.lane_failed(self)

    def _finish(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for other in self.copies:  # the hedge that lost: the replica drops its work
            other.abort()
        self.copies.clear()

    def cancel(self) -> None:
        """The client left: the replicas' connections close, and they drop the work."""
        if self.gone:
            return
        self.gone = True
        self._finish()

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The request's header lines (split only on the way to the app's path)."""
        return header_lines(self.request)

    @property
    def body(self) -> bytes:
        return self.request[len(self.request) - self.length :]


def _as_is(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer's head may pass as it came: framed by content-length, and nothing
    in it describes the replica's connection rather than the message."""
    length = False
    for name, _ in headers:
        if name == b"content-length":
            length = True
        elif name in HOP_BY_HOP:
            return False
    return length


def _rebuilt(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The answer with its head built as the app's path builds it: hop-by-hop headers out,
    framed by the length of its (whole, decoded) body."""
    kept = [b"%s: %s\r\n" % (k, v) for k, v in headers if k not in HOP_BY_HOP]
    line = STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
    return line + b"".join(kept) + b"content-length: %d\r\n\r\n" % len(body) + body
