"""A POST's head as split from its raw bytes on arrival, before the HTTP parser and the body.

`server._Protocol._arrival` judges a POST whose head arrives whole from this split: the
connection gate and the model's admission refuse it, or the lane takes it
(`frontend/lane.py`), or it goes to the parser. A head this reading does not handle (chunked
or content-encoded bodies, `Expect`, upgrades, encoded paths, HTTP/1.0, no Content-Length)
splits to None and goes to the parser.

A client sends the same head again and again on its keep-alive connection, and a storm of
refusals is mostly such heads; so each connection keeps the last head it split
(`LastHead`): the same bytes again cost a comparison, not a split. Clients of one model send
a few heads in all, differing in Content-Length with their bodies, on many connections; so
the server keeps the heads it split lately (`HeadCache`, shared by the connections): a head
seen on any connection costs a lookup (a split costs about 6 µs, half of a refusal). The split
is a pure function of the bytes, so a kept head is the one a split would give.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.errors import BadRequest
from lockgate.frontend.access_log import client_request_id
from lockgate.frontend.lane import lane_target
from lockgate.frontend.raw_head import closes, header_line
from lockgate.frontend.v2_service import timeout_header

# headers that leave a request to the parser: a refusal on arrival would misread it, or
# (content-encoding) its body is decoded on the ASGI path, not on the lane
PARSER_HEADERS = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"})


@dataclass(frozen=True, slots=True)
class PostHead:
    """A POST's request line and headers, up to its blank line."""

    path: str  # without the query
    headers: list[tuple[bytes, bytes]]  # names in lower case; shared by every request of the head
    length: int  # Content-Length
    close: bool  # Connection: close
    target: tuple[str, str | None] | None  # (model, version or None) of a v2 inference path
    timeout: float | None  # Request-Timeout in seconds
    # False: its Request-Timeout is unusable, and its route answers 400: no admission judges
    # it before its body, and it has no known time budget
    timed: bool
    request_id: bytes | None  # the client's X-Request-Id, when usable
    size: int  # bytes of the head, its blank line included


def split_head(block: bytes) -> PostHead | None:
    """The POST head in `block` (its bytes up to the blank line, not included), or None when
    the parser must read it."""
    lines = block.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    path_bytes = parts[1].partition(b"?")[0]
    if path_bytes[:1] != b"/" or b"%" in path_bytes:
        return None
    headers = []
    length = -1
    close = False
    for line in lines[1:]:
        field = header_line(line)
        if field is None:
            return None
        name, value = field
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 18:
                return None
            length = int(value)
        elif name == b"connection":
            closing = closes(value)
            if closing is None:
                return None
            close = close or closing
        elif name in PARSER_HEADERS:
            return None
        headers.append((name, value))
    if length < 0:
        return None
    try:
        timeout, timed = request_timeout(headers), True
    except BadRequest:
        timeout, timed = None, False
    path = path_bytes.decode("latin-1")
    rid = client_request_id(headers)
    target = lane_target(path)
    return PostHead(path, headers, length, close, target, timeout, timed, rid, len(block) + 4)


def request_timeout(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The `Request-Timeout` header in seconds, None when absent; BadRequest when unusable,
    read as its route reads it (`v2_service.timeout_header`: the route answers that 400)."""
    for name, value in headers:
        if name == b"request-timeout":
            return timeout_header(value.decode("latin-1"))
    return None


HEAD_CACHE_SIZE = 256  # heads a server keeps split; past it, it starts again


class HeadCache:
    """The heads split lately, by their bytes, shared by a server's connections. A head with
    a header that differs on every request (a request id, a trace) is split each time and
    kept a while, for nothing; when `size` are kept, they are all dropped."""

    __slots__ = ("heads", "size")

    def __init__(self, size: int = HEAD_CACHE_SIZE) -> None:
        self.heads: dict[bytes, PostHead | None] = {}
        self.size = size

    def split(self, block: bytes) -> PostHead | None:
        """`split_head(block)`, kept."""
        heads = self.heads
        try:
            return heads[block]
        except KeyError:
            pass
        if len(heads) >= self.size:  # (dropping the oldest one by one costs a scan each)
            heads.clear()
        head = heads[block] = split_head(block)
        return head


class LastHead:
    """The last head a connection split, kept for the next request that sends the same."""

    __slots__ = ("block", "cache", "head")

    def __init__(self, cache: HeadCache | None = None) -> None:
        self.block = b""
        self.head: PostHead | None = None
        self.cache = HeadCache(1) if cache is None else cache

    def of(self, data: bytes, end: int) -> PostHead | None:
        """The head of `data`, whose blank line starts at `end`."""
        block = self.block
        if end == len(block) and data.startswith(block):
            return self.head
        self.block = data[:end]
        self.head = self.cache.split(self.block)
        return self.head
