"""A completion request's prompts (`protocol/openai.py`'s `prompts_of`) and the generate
body: counted from the raw bytes, decoded by type, and never built when refused."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable

import msgspec
import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import generate
from lockgate.protocol import openai as oa


def prompt(value: object, most: int = 100, prompts: int = 3) -> list[oa.Prompt]:
    return oa.prompts_of(msgspec.Raw(json.dumps(value).encode()), most, prompts)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hi", ["hi"]),
        (["hi"], ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[4, 5]], [[4, 5]]),
        ('a"b', ['a"b']),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3], [4]], [[1], [2, 3], [4]]),
    ],
)
def test_prompts_as_text_or_token_ids_alone_or_in_a_batch(
    value: object, expected: list[oa.Prompt]
) -> None:
    assert prompt(value) == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ([], "the list is empty"),
        ([[]], "the list is empty"),
        ([[1], [2], [3], [4]], "at most 3 prompts per request"),
        (["a", "b", "c", "d"], "at most 3 prompts per request"),
        ([[1], []], "the list is empty"),
        ([1, [2]], "prompt must be a string"),
        ([1, "a"], "prompt must be a string"),
        ({"a": 1}, "got `object`"),
        (7, "got `int`"),
        (None, "got `null`"),
        ([[[1]]], "prompt must be a string"),
        ([1.5], "$.prompt[0]"),
        (list(range(101)), "101 token ids, more than the model's context of 100"),
        ([[1] * 150, [2] * 60], "210 token ids, more than the model's context of 100 tokens for"),
    ],
)
def test_anything_else_is_400_with_a_message(value: object, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        prompt(value)
    assert says in caught.value.message


def peak_bytes(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest):
            work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_too_many_token_ids_are_refused_before_a_list_is_built() -> None:
    data = b"[" + b"1," * 1_000_000 + b"1]"  # 2 MB of JSON: 36 MB as a Python list
    raw = msgspec.Raw(data)
    assert peak_bytes(lambda: oa.prompts_of(raw, 8192, 64)) < 3 * len(data)


def test_a_completion_body_keeps_its_prompt_raw() -> None:
    data = b'{"prompt": [' + b"1," * 1_000_000 + b'1], "max_tokens": 4}'
    body = oa.decode(data, oa.CompletionRequest)
    assert len(bytes(body.prompt)) > 2_000_000 and body.max_tokens == 4


def test_an_unknown_generate_field_is_refused_before_its_value_is_built() -> None:
    data = b'{"text_input": "hi", "junk": [' + b"[1]," * 500_000 + b"[1]]}"  # ~2 MB, 60 MB built
    message = ""

    def work() -> None:
        nonlocal message
        try:
            generate.decode(data)
        except BadRequest as exc:
            message = exc.message
            raise

    assert peak_bytes(work) < 3 * len(data)
    assert "unknown parameters: 'junk'" in message


def test_generate_names_every_unknown_field_of_a_small_body() -> None:
    body = {"text_input": "hi", "parameters": {"a": 1, "temperature": 0, "z": [2]}}
    with pytest.raises(BadRequest, match="unknown parameters: 'a', 'z'"):
        generate.decode(json.dumps(body).encode())
    with pytest.raises(BadRequest, match="unknown parameters: 'b', 'c'"):
        generate.decode(json.dumps({"text_input": "hi", "b": 1, "c": 2}).encode())


def test_too_many_token_ids_to_detokenize_are_refused_before_a_list_is_built() -> None:
    data = b"[" + b"1," * 1_000_000 + b"1]"
    assert peak_bytes(lambda: oa.token_ids_of(msgspec.Raw(data), 2048)) < 3 * len(data)
    assert oa.token_ids_of(msgspec.Raw(b"[1, 2, 3]"), 3) == [1, 2, 3]
    assert oa.token_ids_of(msgspec.Raw(b"[]"), 3) == []
    for bad in (b'["a"]', b"[[1]]", b"7", b'{"a": 1}'):
        with pytest.raises(BadRequest, match="list of token ids"):
            oa.token_ids_of(msgspec.Raw(bad), 3)
