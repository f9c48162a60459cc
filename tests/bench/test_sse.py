import itertools

from hypothesis import given
from hypothesis import strategies as st

from lockgate.bench.sse import SSEDecoder

STREAM = (
    b": keep-alive\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: message\ndata: line one\ndata: line two\n\n"
    b'data:{"b": "\xc3\xa9"}\r\r'
    b"data: [DONE]\n\n"
)
EVENTS = ['{"a": 1}', "line one\nline two", '{"b": "\u00e9"}', "[DONE]"]


def test_whole_stream() -> None:
    assert SSEDecoder().feed(STREAM) == EVENTS


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_chunking_gives_the_same_events(cuts: list[int]) -> None:
    decoder = SSEDecoder()
    bounds = [0, *sorted(cuts), len(STREAM)]
    events = []
    for start, end in itertools.pairwise(bounds):
        events += decoder.feed(STREAM[start:end])
    events += decoder.flush()
    assert events == EVENTS


def test_byte_by_byte_and_unterminated_last_event() -> None:
    decoder = SSEDecoder()
    events = []
    for i in range(len(b"data: x\r\n\r\ndata: y")):
        events += decoder.feed(b"data: x\r\n\r\ndata: y"[i : i + 1])
    assert events == ["x"]
    assert decoder.flush() == ["y"]
