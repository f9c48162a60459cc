"""Guided decoding on the OpenAI routes, through a real server and the `openai` client:
response_format (json_object, json_schema) and vLLM's guided_json, guided_regex and
guided_grammar, on SmolLM2."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def chat(client: openai.OpenAI, content: str, max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


def test_json_object_output_parses_as_json(client: openai.OpenAI) -> None:
    question = "What is the capital of France? Answer with a city and a country."
    result = chat(client, question, 40, response_format={"type": "json_object"})
    choice = result.choices[0]
    assert choice.finish_reason == "stop"  # the object closed: the grammar ended it
    assert isinstance(json.loads(choice.message.content or ""), dict)
    plain = chat(client, question, 40)  # without the format, SmolLM2 answers in prose
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content or "")


def test_json_schema_output_validates_whole_and_streamed(client: openai.OpenAI) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}}
    question = "What color is the sky? Answer in JSON with keys color and count."
    result = chat(client, question, 40, response_format=form)
    text = result.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    assert result.choices[0].finish_reason == "stop"
    chunks = list(chat(client, question, 40, response_format=form, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_guided_json_and_guided_regex_on_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        temperature=0.7,
        seed=3,
        extra_body={"guided_regex": PHONE},
    )
    assert re.fullmatch(PHONE, result.choices[0].text), result.choices[0].text
    assert result.choices[0].finish_reason == "stop"
    answer = client.completions.create(
        model=MODEL,
        prompt="A sky in JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


def test_guided_grammar_in_lark(client: openai.OpenAI) -> None:
    grammar = 'start: answer "." \nanswer: "yes" | "no" | "maybe"'
    result = chat(client, "Is water wet?", 8, extra_body={"guided_grammar": grammar})
    assert result.choices[0].message.content in {"yes.", "no.", "maybe."}


def test_vllm_structured_outputs_are_the_guided_fields_under_other_names(
    client: openai.OpenAI,
) -> None:
    """vLLM's structured_outputs: json, regex, choice, grammar and json_object hold the output
    as guided_json, guided_regex, guided_choice, guided_grammar and json_object do."""

    def complete(structured: dict[str, Any], tokens: int = 20) -> str:
        result = client.completions.create(
            model=MODEL,
            prompt="Call me at",
            max_tokens=tokens,
            temperature=0.7,
            seed=3,
            extra_body={"structured_outputs": structured},
        )
        return result.choices[0].text

    assert re.fullmatch(PHONE, complete({"regex": PHONE}))
    assert complete({"choice": ["never", "tomorrow"]}) in {"never", "tomorrow"}
    jsonschema.validate(json.loads(complete({"json": SCHEMA}, 40)), SCHEMA)
    assert isinstance(json.loads(complete({"json_object": True}, 60)), dict)
    grammar = 'start: "at " answer\nanswer: "noon" | "dawn"'
    assert complete({"grammar": grammar}) in {"at noon", "at dawn"}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"structured_outputs": {"regex": "a+", "choice": ["b"]}}, r"not several: "
            r"structured_outputs\.regex, structured_outputs\.choice"),
        ({"structured_outputs": {"structural_tag": "{}"}}, r"unknown field `structural_tag`"),
        ({"structured_outputs": {"regex": "[0-9"}}, r"(?s)structured_outputs\.regex: .*unclosed"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "objekt"}}}},
            r"response_format\.json_schema\.schema: .*objekt",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
            r"response_format\.json_schema\.schema: .*uniqueItems",
        ),
        ({"response_format": {"type": "xml"}}, r"response_format\.type"),
        ({"response_format": {"type": "json_schema"}}, r"json_schema"),
        ({"guided_regex": "[0-9"}, r"(?s)guided_regex: .*unclosed character class"),
        ({"guided_grammar": "start: foo"}, r"(?s)guided_grammar: .*unknown name"),
        ({"guided_json": "{not json"}, r"guided_json: "),
        ({"guided_regex": "a" * 40000}, r"guided_regex has 40000 characters, more than the limit"),
        (
            {"guided_regex": "a+", "response_format": {"type": "json_object"}},
            r"not several: response_format, guided_regex",
        ),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_problem(
    client: openai.OpenAI, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=named):
        chat(client, "hi", 4, extra_body=extra)


def test_unconstrained_request_in_the_same_batch_is_unaffected(client: openai.OpenAI) -> None:
    prompt = "The three primary colors are"

    def plain() -> str:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        return result.choices[0].text

    def guided() -> str:
        result = client.completions.create(
            model=MODEL,
            prompt="A sky in JSON:",
            max_tokens=40,
            temperature=0,
            extra_body={"guided_json": SCHEMA},
        )
        return result.choices[0].text

    alone = plain()
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(guided) for _ in range(2)]
        together = [pool.submit(plain) for _ in range(2)]
        assert [f.result() for f in together] == [alone, alone]
        for f in constrained:
            jsonschema.validate(json.loads(f.result()), SCHEMA)


def test_a_grammar_whose_masks_cost_too_much_ends_its_output(client: openai.OpenAI) -> None:
    # many alternatives that each nest the whole schema: small, but a token's mask costs
    # far more than --max-grammar-mask-ms (20 ms) of CPU, so the output ends at once
    costly = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}] * 180}
    assert len(json.dumps(costly)) < 8192  # within --max-grammar-chars
    result = chat(client, "hi", 30, extra_body={"guided_json": costly})
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 1
    after = chat(client, "hi", 30, extra_body={"guided_regex": "[a-z]{3,5}"})  # still serving
    assert re.fullmatch("[a-z]{3,5}", after.choices[0].message.content or "")
