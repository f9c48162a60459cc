"""The router's lane: KServe v2 inference passed to a replica and back below ASGI.

A `POST /v2/models/{m}[/versions/{v}]/infer` whose head arrives whole, at a message boundary
of a kept-alive HTTP/1.1 connection, is read from its raw bytes (`lane_head.py`: found, not
parsed, and remembered by the head's bytes, so a client that sends the same head again costs
a lookup), and its body (up to 64 KiB; larger ones take the app's path) gathered as it comes.
When nothing about it needs the app's general path (`RouterApp.lane`: no rate limits, sticky
sessions, canary or shadow for its model, no deadline already spent, a body within the
limit, not a language model's nor a sequence's, a replica not shedding) and the replica
chosen has an idle connection at hand, the request is written to that connection as it came
from the client connection's own callback (`LaneCall.send`), and the answer is read whole on
the replica's connection (`lane_answer.py`: llhttp finds its end, with no call into Python
per header line) and written back to the client from that connection's callback
(`LaneCall.answered`): no task, no ASGI messages. The replica's answer is passed on as it
came when it is framed by `content-length` and has no header about the connection (a
lockgate replica's never has); other answers have their head built as the app's path builds
it.

The lane keeps what the app's path does for such a request: power of two choices over the
usable replicas, a hedge after the model's recent latency (a second copy to another replica
on an idle connection; the first answer other than a 503 wins and the other copy's
connection closes), the `request-timeout` header less the time spent (here, nothing but the
search), the replica's reported load, its health (a 503 marks it full, other 5xx and broken
connections count toward its ejection), the request and attempt counters and the latency
histogram (counted on plain numbers, added to the counters on each scrape). An attempt that
gets no answer or a 503 goes on along the app's path (`RouterApp._serve` with the replicas
tried), which retries it on another replica within the retry budget and, when none is left,
passes the 503 on. A client that leaves closes the replica's connection, so the replica drops
the work. Everything else (other paths, chunked bodies, `Expect`, `Connection: close`,
HTTP/1.0, encoded paths or a query, heads split over reads) takes the app's path from the
start.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from lockgate.router.lane_answer import LaneAnswer
from lockgate.router.lane_head import LaneHead, header_lines
from lockgate.router.lane_target import LaneTarget
from lockgate.router.replica import Replica
from lockgate.router.upstream import HOP_BY_HOP, STATUS_LINES, Response

LANE_SCOPE = "lockgate.lane"  # in the scope of a request the lane hands to the app's path


class _Aborts(Protocol):
    def abort(self) -> None: ...


class LaneClient(Protocol):
    """The client connection a lane request came on (`client_connection.ClientConnection`)."""

    def lane_answered(self, data: bytes) -> None: ...
    def lane_failed(self, call: LaneCall) -> None: ...


class LaneApp(Protocol):
    """What a lane request reports to (`app.RouterApp`)."""

    def lane_attempt(
        self, call: LaneCall, replica: Replica, answer: LaneAnswer | None, now: float
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

    def answered(self, answer: LaneAnswer) -> None:
        self.connection = None
        self.call.answered(self, answer)

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
        "refused",
        "replica",
        "request",
        "target",
        "timer",
        "tried",
    )

    def __init__(
        self,
        app: LaneApp,
        client: LaneClient,
        head: LaneHead,
        target: LaneTarget,
        request: bytes,
        arrived: float,
        replica: Replica,
    ) -> None:
        self.app = app
        self.client = client
        self.target = target
        self.request = request  # head and body, as they came and went to the replica
        self.length = head.length  # of the body, at the end of `request`
        self.arrived = arrived
        self.replica = replica  # the first copy's
        self.copies: list[_Copy] = []  # those still waiting for their answer
        self.timer: asyncio.TimerHandle | None = None  # the hedge's
        self.tried: tuple[Replica, ...] = ()  # gave no answer to pass on: the app's path skips them
        self.refused: tuple[Response, Replica] | None = None  # the first 503 received
        self.done = False  # answered, or handed to the app's path
        self.hedged = False  # a second copy was sent
        self.gone = False  # the client left: nothing more is written to it
        self.broken = False  # a copy's connection broke once the request was sent

    @property
    def path(self) -> str:
        return self.target.path

    @property
    def model(self) -> str:
        return self.target.model

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

    def answered(self, copy: _Copy, answer: LaneAnswer) -> None:
        copies = self.copies
        if copy not in copies:  # closed: the other copy won, or the client left
            return
        copies.remove(copy)
        now = time.monotonic()
        if not self.app.lane_attempt(self, copy.replica, answer, now):  # a 503
            self.tried += (copy.replica,)
            if self.refused is None:
                refusal = Response(answer.status, answer.headers)
                refusal.put(answer.body)
                refusal.put(None)
                self.refused = (refusal, copy.replica)
            self._failed()
            return
        if self.done:
            return  # the other copy answered first
        self._finish()
        if self.gone:
            return
        self.client.lane_answered(answer.raw if answer.as_is else _rebuilt(answer))
        winner = None
        if self.hedged:
            winner = "first" if copy.replica is self.replica else "second"
        self.app.lane_done(self, answer.status, now, winner)

    def broke(self, copy: _Copy, answered_nothing: bool) -> None:
        if copy not in self.copies:  # closed: the other copy won, or the client left
            return
        self.copies.remove(copy)
        if answered_nothing:  # most likely an idle connection the replica had closed: the
            copy.replica.in_flight -= 1  # app's path sends it again, on a new connection
        else:
            self.app.lane_attempt(self, copy.replica, None, time.monotonic())
            self.tried += (copy.replica,)
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


def _rebuilt(answer: LaneAnswer) -> bytes:
    """The answer with its head built as the app's path builds it: hop-by-hop headers out,
    framed by the length of its (whole, decoded) body."""
    kept = [b"%s: %s\r\n" % (k, v) for k, v in answer.headers if k not in HOP_BY_HOP]
    status = answer.status
    line = STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
    body = answer.body
    return line + b"".join(kept) + b"content-length: %d\r\n\r\n" % len(body) + body
