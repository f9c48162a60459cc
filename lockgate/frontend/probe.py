"""Health probes answered by the HTTP protocol itself, in the call that reads them.

A `GET` or `HEAD` of `/v2/health/live`, `/health` or `/v2/health/ready` whose head arrives
whole in one read, at a message boundary, is answered by `server._Protocol` from its raw bytes
(`App.probe_reply`): no parser callbacks, no ASGI scope, no task. Under overload a turn of
the event loop is long (every connection with bytes waiting is read and judged in it), and a
probe answered by a task waited for the next turn as well, behind the tasks of every request
read before it.

The answers are the ASGI routes' own: status, JSON body, the server's default headers, the
request id and the in-flight count, the latency histogram. Anything this reading does not
handle goes to the parser and the app, which answer the same: other methods (405), HTTP/1.0,
a body, encoded paths or a query, heads split over reads, a pipelined request behind one in
progress, and every request while the access log is on, a browser's cross-origin request
while CORS is on, or a key is asked of probes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.frontend.raw_head import closes, header_line

PROBE_PATHS = frozenset({b"/v2/health/live", b"/health", b"/v2/health/ready"})
_BODY_HEADERS = (b"content-length", b"transfer-encoding", b"expect", b"upgrade")


@dataclass(frozen=True, slots=True)
class Probe:
    """A probe's request, as read from its raw bytes."""

    head: bool  # HEAD: the answer has no body
    path: str
    headers: list[tuple[bytes, bytes]]  # names in lower case
    size: int  # bytes of the request (it has no body)
    keep_alive: bool
    received: float  # time.monotonic() of its first byte

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


def probe_of(data: bytes, max_head: int, received: float) -> Probe | None:
    """The probe at the start of `data`, first read at `received`, or None when `data` does
    not start with a whole one this reading handles."""
    if data[:4] != b"GET " and data[:5] != b"HEAD ":
        return None
    end = data.find(b"\r\n\r\n", 0, max_head)
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[1] not in PROBE_PATHS or parts[2] != b"HTTP/1.1":
        return None
    headers = []
    keep_alive = True
    for line in lines[1:]:
        field = header_line(line)
        if field is None:
            return None
        name, value = field
        if name in _BODY_HEADERS:
            return None
        if name == b"connection":
            closing = closes(value)
            if closing is None:
                return None
            keep_alive = keep_alive and not closing
        headers.append((name, value))
    path = parts[1].decode("latin-1")
    return Probe(parts[0] == b"HEAD", path, headers, end + 4, keep_alive, received)
