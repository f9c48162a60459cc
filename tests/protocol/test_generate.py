"""The generate extension's request body (`protocol/generate.py`)."""

from __future__ import annotations

import json

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import generate
from lockgate.protocol import openai as oa


def decode(raw: object) -> generate.GenerateRequest:
    return generate.decode(json.dumps(raw).encode())


def test_sampling_fields_from_parameters_or_the_top_level() -> None:
    body = decode(
        {
            "text_input": "Hello",
            "max_tokens": 5,
            "parameters": {"temperature": 0, "stop": ["."], "stream": False},
        }
    )
    assert body.text_input == "Hello" == oa.prompts_of(body.completion.prompt, 100, 1)[0]
    assert body.completion.max_tokens == 5
    assert body.completion.temperature == 0.0
    assert body.completion.stop == ["."]
    assert body.completion.top_p is None  # not given: the model's default applies
    assert body.stream is False and body.exclude_input_in_output


def test_unknown_names_are_refused_by_name_and_bounded() -> None:
    raw = {"text_input": "x", "parameters": {f"p{i:02}": 1 for i in range(20)}}
    with pytest.raises(BadRequest) as caught:
        decode(raw)
    message = caught.value.message
    assert "'p00'" in message and "and 12 more" in message and "'p19'" not in message
