"""The head of a request the router's lane may take (`lane.py`): a `POST
/v2/models/{m}[/versions/{v}]/infer` found in the raw bytes of a client connection, not split
into header lines, and remembered by those bytes (`LaneHeads`): a client sends the same head
again for every body of the same size, so the search is made once per head, not per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lockgate.router.lane_target import LaneTarget

MAX_HEAD = 64 * 1024  # a head longer than this is the app's path's (uvicorn's limit)
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
    (`header_lines`)."""

    path: str
    length: int  # Content-Length
    size: int  # bytes of the head and its body
    timeout: bytes | None  # the request-timeout header's value
    target: LaneTarget | None = None  # what the router made of the path (`LaneHeads`)

    @classmethod
    def parse(cls, data: bytes, max_head: int = MAX_HEAD) -> LaneHead | None:
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


class LaneHeads:
    """Each head the lane may take, as the router resolved it (`resolve` gives the head its
    `target`, or None: the app's path), remembered by the head's bytes. At most `limit` heads
    of at most `max_key` bytes are kept; past the limit the memo starts again empty (a
    client whose heads all differ, by a header it sets per request, pays the search each
    time, as without the memo)."""

    __slots__ = ("known", "limit", "max_key", "resolve")

    def __init__(
        self, resolve: Callable[[LaneHead], LaneHead | None], limit: int = 1024, max_key: int = 2048
    ) -> None:
        self.resolve = resolve
        self.known: dict[bytes, LaneHead | None] = {}
        self.limit = limit
        self.max_key = max_key

    def of(self, data: bytes) -> LaneHead | None:
        """What the head at the start of `data` resolves to; None when it is not all in
        `data` or the lane does not take it."""
        end = data.find(b"\r\n\r\n", 0, MAX_HEAD)
        if end < 0:
            return None
        if end > self.max_key:
            head = LaneHead.parse(data)
            return None if head is None else self.resolve(head)
        key = data[:end]
        known = self.known
        found = known.get(key, known)
        if found is not known:
            return found  # type: ignore[return-value]
        head = LaneHead.parse(data)
        resolved = None if head is None else self.resolve(head)
        if len(known) >= self.limit:
            known.clear()
        known[key] = resolved
        return resolved


def header_lines(request: bytes) -> list[tuple[bytes, bytes]]:
    """The header lines of a raw request (or answer), names in lower case (as ASGI gives
    them)."""
    end = request.find(b"\r\n\r\n")
    headers = []
    for line in request[request.find(b"\r\n") + 2 : end].split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers.append((name.lower(), value.strip(b" \t")))
    return headers
