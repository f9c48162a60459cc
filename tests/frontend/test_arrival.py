"""The split of a POST head on arrival, and the head each connection keeps."""

from __future__ import annotations

import pytest

from lockgate.frontend.arrival import HeadCache, LastHead, split_head

HEAD = (
    b"POST /v2/models/m/versions/2/infer?x=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 12\r\n"
    b"Request-Timeout: 0.5\r\nX-Request-Id: abc-1\r\nConnection: close"
)


def test_a_head_is_split_into_what_its_judges_read() -> None:
    head = split_head(HEAD)
    assert head is not None
    assert head.path == "/v2/models/m/versions/2/infer"
    assert head.target == ("m", "2")
    assert (head.length, head.close, head.timeout, head.timed) == (12, True, 0.5, True)
    assert head.request_id == b"abc-1"
    assert head.size == len(HEAD) + 4
    assert (b"request-timeout", b"0.5") in head.headers  # names in lower case


def test_an_unusable_request_timeout_is_not_judged_before_the_body() -> None:
    head = split_head(HEAD.replace(b"0.5", b"soon"))
    assert head is not None and not head.timed and head.timeout is None


@pytest.mark.parametrize(
    "change",
    [
        (b"Content-Length: 12\r\n", b""),
        (b"Content-Length: 12", b"Transfer-Encoding: chunked"),
        (b"HTTP/1.1", b"HTTP/1.0"),
        (b"/v2/models/m", b"/v2/models/%6d"),
        (b"Connection: close", b"Connection: upgrade"),
        (b"Host: t", b"Host : t"),
    ],
)
def test_heads_this_reading_does_not_handle_are_left_to_the_parser(
    change: tuple[bytes, bytes],
) -> None:
    assert split_head(HEAD.replace(*change)) is None


def test_a_connection_keeps_its_last_head_while_the_bytes_are_the_same() -> None:
    last = LastHead()
    data = HEAD + b"\r\n\r\n" + b"x" * 12
    first = last.of(data, len(HEAD))
    assert first is not None and last.of(data, len(HEAD)) is first
    other = HEAD.replace(b"abc-1", b"abc-2")
    second = last.of(other + b"\r\n\r\n", len(other))
    assert second is not None and second is not first and second.request_id == b"abc-2"


def test_connections_share_the_heads_split_lately_and_start_again_when_full() -> None:
    cache = HeadCache(2)
    first = LastHead(cache).of(HEAD + b"\r\n\r\n", len(HEAD))
    assert first is not None and LastHead(cache).of(HEAD + b"\r\n\r\n", len(HEAD)) is first
    others = [HEAD.replace(b"abc-1", b"abc-%d" % i) for i in (2, 3)]
    for other in others:
        assert cache.split(other) == split_head(other)
    assert list(cache.heads) == others[1:]  # full at the second: dropped, then kept
    again = cache.split(HEAD)
    assert again == first and again is not first
