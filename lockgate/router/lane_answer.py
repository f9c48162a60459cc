"""A replica's answer to a request of the router's lane (`lane.py`), read whole on the replica's
connection (`LaneReader`) and passed to the client as it came.

llhttp (httptools) checks the answer's framing, finds its end and decodes its body, with no
call into Python per header line: what the router reads of the head (the replica's reported
load, a language model's mark, whether the head may pass as it came) is searched for in the
head's bytes, which llhttp accepted, so each header line there is `name: value` with a token
for a name and nothing between the name and its colon.
"""

from __future__ import annotations

import re

import httptools

from lockgate.router.lane_head import header_lines

# a header line that describes the replica's connection rather than the message (hop-by-hop,
# `upstream.HOP_BY_HOP` but content-length): an answer with one has its head built again
_HOP = re.compile(
    rb"\r\n(?:connection|keep-alive|proxy-authenticate|proxy-authorization|te|trailer"
    rb"|transfer-encoding|upgrade|host|expect):"
)
_LENGTH = b"\r\ncontent-length:"


class BadAnswer(Exception):
    """Bytes from the replica that are not one answer the router can pass on."""


class LaneAnswer:
    """One whole answer: `raw`, its bytes as they came (head and body), and `body`, decoded
    from its framing."""

    __slots__ = ("body", "end", "keep_alive", "lowered", "raw", "status")

    def __init__(self, status: int, raw: bytes, body: bytes, keep_alive: bool) -> None:
        self.status = status
        self.raw = raw
        self.body = body
        self.keep_alive = keep_alive  # the replica's connection may take another request
        self.end = raw.find(b"\r\n\r\n")  # where the head ends
        self.lowered = raw[: self.end + 2].lower()  # the head: each header line starts \r\n

    def header(self, token: bytes) -> bytes | None:
        """The value of the first header line `token` starts (`b"\\r\\nname:"`, the name in
        lower case), None without one."""
        at = self.lowered.find(token)
        if at < 0:
            return None
        return self.raw[at + len(token) : self.lowered.find(b"\r\n", at + 2)].strip(b" \t")

    @property
    def as_is(self) -> bool:
        """Whether the answer may pass as it came: framed by its content-length, nothing
        after it, and nothing in its head that describes the replica's connection."""
        return (
            len(self.raw) == self.end + 4 + len(self.body)
            and _LENGTH in self.lowered
            and _HOP.search(self.lowered) is None
        )

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Its header lines, names in lower case (split only when its head is built again,
        or a refusal is kept for the app's path)."""
        return header_lines(self.raw[: self.end + 4])


class LaneReader:
    """Reads the answers to lane requests on one replica connection, one at a time, from
    their bytes as they come (`feed`)."""

    __slots__ = ("answer", "body", "parser", "raw")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.raw: list[bytes] = []  # the answer's bytes so far
        self.body: list[bytes] = []  # its body, decoded
        self.answer: LaneAnswer | None = None  # once it has ended

    def feed(self, data: bytes) -> LaneAnswer | None:
        """The whole answer once `data` ends it (None: more is to come); BadAnswer when the
        bytes are not one answer."""
        self.raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.clear()
            raise BadAnswer(str(exc)) from exc
        answer, self.answer = self.answer, None
        if answer is not None and answer.status < 200:  # the lane never asks for one (no
            raise BadAnswer("an interim answer")  # Expect): not HTTP as the router speaks it
        return answer

    def clear(self) -> None:
        """Forget the answer begun (its connection broke)."""
        self.raw.clear()
        self.body.clear()
        self.answer = None

    # -- httptools callbacks (no on_header: the head is searched, `LaneAnswer.header`) ------
    def on_message_begin(self) -> None:
        if self.answer is not None:  # a second message in the same bytes
            raise BadAnswer("bytes past the answer")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        parser, raw, body = self.parser, self.raw, self.body
        self.answer = LaneAnswer(
            parser.get_status_code(),
            raw[0] if len(raw) == 1 else b"".join(raw),
            body[0] if len(body) == 1 else b"".join(body),
            parser.should_keep_alive(),
        )
        raw.clear()
        body.clear()
