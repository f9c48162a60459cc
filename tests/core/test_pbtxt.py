from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockgate.core.pbtxt import Ident, Message, PbtxtSyntaxError, parse


def test_scalars_and_nested_messages() -> None:
    message = parse(
        """
        name: "digits"   # a comment
        max_batch_size: 8
        ratio: 0.5
        big: 0x1F
        negative: -3
        enabled: true
        kind: KIND_CPU
        nested { inner: 1 deeper < x: "y" > }
        """
    )
    assert message.get("name") == "digits"
    assert message.get("max_batch_size") == 8
    assert message.get("ratio") == 0.5
    assert message.get("big") == 31
    assert message.get("negative") == -3
    assert message.get("enabled") is True
    kind = message.get("kind")
    assert isinstance(kind, Ident) and kind == "KIND_CPU"
    nested = message.get("nested")
    assert isinstance(nested, Message)
    deeper = nested.get("deeper")
    assert isinstance(deeper, Message) and deeper.get("x") == "y"


def test_repeated_fields_as_keys_and_lists_accumulate() -> None:
    message = parse(
        "dims: [ -1, 3 ] dims: 4\ninput [ { name: 'a' }, { name: 'b' } ] input { name: 'c' }"
    )
    assert message.values("dims") == [-1, 3, 4]
    names = [m.get("name") for m in message.values("input") if isinstance(m, Message)]
    assert names == ["a", "b", "c"]


def test_string_escapes_and_concatenation() -> None:
    message = parse(r'''s: "tab\there \"q\" \\ \x41\101 caf\303\251" t: 'a' "b" u: "\u00e9"''')
    assert message.get("s") == 'tab\there "q" \\ AA café'
    assert message.get("t") == "ab"
    assert message.get("u") == "é"


def test_separators_and_special_floats() -> None:
    message = parse("a: 1; b: 2, c: -inf d: 1e3 e: 2.5f f: nan")
    assert message.get("a") == 1 and message.get("b") == 2
    assert message.get("c") == -math.inf
    assert message.get("d") == 1000.0
    assert message.get("e") == 2.5
    value = message.get("f")
    assert isinstance(value, float) and math.isnan(value)


def test_empty_list_and_empty_message() -> None:
    message = parse("dims: [] all { }")
    assert message.values("dims") == []
    assert isinstance(message.get("all"), Message)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("name: ", 1, "expected a value"),
        ("a {\n b: 1\n", 3, "expected a field name"),
        ("a: [1 2]", 1, "expected ','"),
        ('a: "unterminated', 1, "unexpected character"),
        ("a 1", 1, "expected ':'"),
        ("\n\n  }", 3, "expected a field name"),
        ('a: "\\q"', 1, "unknown escape"),
    ],
)
def test_syntax_errors_report_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(PbtxtSyntaxError) as info:
        parse(text)
    assert info.value.line == line
    assert fragment in str(info.value)


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8))
def test_integer_lists_round_trip(values: list[int]) -> None:
    text = "dims: [" + ", ".join(str(v) for v in values) + "]"
    assert parse(text).values("dims") == values


@given(st.text(max_size=30))
def test_strings_round_trip(value: str) -> None:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    assert parse(f'name: "{escaped}"').get("name") == value
