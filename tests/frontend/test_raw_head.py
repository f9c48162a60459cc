"""Header lines read below the HTTP parser (`frontend/raw_head.py`), for probes and for POST
heads judged on arrival: what either reading takes, and what it leaves to the parser."""

from __future__ import annotations

import pytest

from lockgate.frontend.arrival import split_head
from lockgate.frontend.probe import probe_of
from lockgate.frontend.raw_head import closes, header_line


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b"Host: t", (b"host", b"t")),
        (b"X-Request-Id:\tabc \t", (b"x-request-id", b"abc")),
        (b"Content-Length:0", (b"content-length", b"0")),
        (b"Host : t", None),  # a blank before the colon
        (b" folded", None),  # obs-fold
        (b"no colon", None),
        (b": no name", None),
    ],
)
def test_a_header_line_is_its_lower_case_name_and_stripped_value_or_none(
    line: bytes, field: tuple[bytes, bytes] | None
) -> None:
    assert header_line(line) == field


def test_only_close_and_keep_alive_are_read_as_connection_values() -> None:
    assert closes(b"Close") is True
    assert closes(b"keep-alive") is False
    assert closes(b"upgrade") is None


def test_probes_and_posts_leave_a_malformed_line_to_the_parser() -> None:
    probe = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    read = probe_of(probe, 8192, 1.0)
    assert read is not None and not read.keep_alive and read.size == len(probe)
    assert probe_of(probe.replace(b"Host: t", b"Host : t"), 8192, 1.0) is None
    assert probe_of(probe.replace(b"close", b"upgrade"), 8192, 1.0) is None
    post = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close"
    head = split_head(post)
    assert head is not None and head.close and head.length == 2 and head.target == ("m", None)
    assert split_head(post.replace(b"Host: t", b" Host: t")) is None
    assert split_head(post.replace(b"close", b"upgrade")) is None
