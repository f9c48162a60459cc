"""Tool calling on /v1/chat/completions, through a real server and the `openai` client, on
SmolLM2 (whose chat template takes no tools: lockgate writes them into the system message, in
Hermes's format): tool_choice naming a function, required, auto and none, streamed calls, a
history with a tool's result, and tools refused with a 400 that names the problem."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import CACHED_LLM, RunningServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "hours24": {"type": "boolean"}},
            "required": ["city", "hours24"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


# what several tests ask alike: a forced call, greedy, so the same answer every time
REQUIRED: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def answered() -> dict[str, Any]:
    """Whole (not streamed) answers to what several tests ask alike, by what was asked (as
    JSON): each is generated once in the module, by the first test that asks it."""
    return {}


def answer(client: openai.OpenAI, answered: dict[str, Any], **asked: Any) -> Any:
    """`chat`'s whole answer to `asked`, generated once in the module (`answered`)."""
    key = json.dumps(asked, sort_keys=True)
    if key not in answered:
        answered[key] = chat(client, **asked)
    return answered[key]


def chat(
    client: openai.OpenAI,
    messages: list[dict[str, Any]] = ASK,
    max_tokens: int = 48,
    model: str = MODEL,
    **extra: Any,
) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, the arguments checked against their function's schema."""
    found = []
    for call in message.tool_calls or ():
        assert call.type == "function" and call.id.startswith("call_"), call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    return found


def reassembled(chunks: list[Any]) -> tuple[str, list[tuple[str, dict[str, Any]]], str | None]:
    """A streamed choice's content, its calls (joined by index from their deltas) and its
    finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    assert all(c["id"].startswith("call_") for c in calls.values()), calls
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content, joined, reason


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t["function"]["name"])
def test_a_named_function_is_called_with_arguments_that_match_its_schema(
    client: openai.OpenAI, tool: dict[str, Any]
) -> None:
    name = tool["function"]["name"]
    result = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}})
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [(called, arguments)] = calls_of(choice.message)
    assert called == name  # the one named, even for a question about the other
    assert "city" in arguments


def test_required_makes_a_call_where_auto_answers_in_prose(
    client: openai.OpenAI, answered: dict[str, Any]
) -> None:
    free = chat(client, tools=TOOLS, tool_choice="auto")
    assert free.choices[0].message.tool_calls is None  # SmolLM2 alone does not write calls
    assert free.choices[0].message.content
    forced = answer(client, answered, **REQUIRED)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, _)] = calls_of(choice.message)
    assert name in SCHEMAS


def test_none_answers_content_and_leaves_the_tools_out_of_the_prompt(
    client: openai.OpenAI,
) -> None:
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    choice = none.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    plain = chat(client, max_tokens=12)
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert choice.message.content == plain.choices[0].message.content
    offered = chat(client, tools=TOOLS, max_tokens=1)  # auto: the tools in the system message
    assert offered.usage is not None
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 100


def test_streamed_calls_reassemble_to_the_whole_answers_calls(
    client: openai.OpenAI, answered: dict[str, Any]
) -> None:
    whole = answer(client, answered, **REQUIRED)
    chunks = list(chat(client, stream=True, **REQUIRED))
    content, calls, reason = reassembled(chunks)
    assert calls == calls_of(whole.choices[0].message) and len(calls) == 1
    assert content == "" and reason == "tool_calls"
    assert chunks[0].choices[0].delta.role == "assistant"


def raw_calls(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None, str]:
    """A streamed choice's calls as (name, arguments text), its finish_reason and content."""
    calls: dict[int, list[str]] = {}
    reason, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [(name, arguments) for name, arguments in calls.values()], reason, content


@pytest.mark.parametrize(
    ("choice", "tools", "cut"),
    [
        (NAMED_TIME, TOOLS, 5),
        (NAMED_TIME, TOOLS, 24),
        ("required", TOOLS, 24),
        ("required", [WEATHER], 3),
    ],
    ids=["named-5", "named-24", "required-24", "required-one-tool-3"],
)
def test_a_forced_call_cut_by_max_tokens_is_a_call_finished_by_length(
    client: openai.OpenAI,
    answered: dict[str, Any],
    choice: Any,
    tools: list[dict[str, Any]],
    cut: int,
) -> None:
    """As vLLM's: the call it was writing, its arguments the text written of them (a prefix
    of the whole call's), whole and streamed alike."""
    asked: dict[str, Any] = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
    whole_answer = answer(client, answered, **asked).choices[0]
    assert whole_answer.finish_reason == "tool_calls"  # the whole call, within chat's max_tokens
    [(name, arguments)] = calls_of(whole_answer.message)
    whole = json.dumps(arguments)
    short = chat(client, max_tokens=cut, **asked).choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    [call] = short.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == name
    assert whole.startswith(call.function.arguments) and call.function.arguments != whole
    calls, reason, content = raw_calls(list(chat(client, max_tokens=cut, stream=True, **asked)))
    assert (calls, reason, content) == ([(name, call.function.arguments)], "length", "")


# SmolLM2 writes no calls of itself with tool_choice auto; a grammar makes it write these
# words, which the parser reads as it would a model's own.
WRITTEN = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
)


def written(text: str) -> dict[str, Any]:
    """A grammar (Lark) whose only sentence is `text`."""
    return {"guided_grammar": "start: " + json.dumps(text)}


def test_auto_reads_the_calls_the_model_writes_whole_and_streamed(client: openai.OpenAI) -> None:
    result = chat(client, max_tokens=80, tools=[WEATHER], extra_body=written(WRITTEN))
    choice = result.choices[0]
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert choice.finish_reason == "tool_calls"
    chunks = list(
        chat(client, max_tokens=80, tools=[WEATHER], extra_body=written(WRITTEN), stream=True)
    )
    assert reassembled(chunks) == ("Let me check.", calls_of(choice.message), "tool_calls")


@pytest.mark.parametrize(
    "text",
    [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": "Oslo"}\n</tool_call>',
        'x <tool_call>\n{"name": "get_wether", "arguments": {}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
    ],
    ids=["arguments not an object", "unknown function", "never closed"],
)
def test_auto_answers_a_call_it_cannot_read_as_the_text_itself(
    client: openai.OpenAI, text: str
) -> None:
    result = chat(client, max_tokens=80, tools=[WEATHER], extra_body=written(text))
    choice = result.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (text, None)
    assert choice.finish_reason == "stop"
    chunks = list(
        chat(client, max_tokens=80, tools=[WEATHER], extra_body=written(text), stream=True)
    )
    assert reassembled(chunks) == (text, [], "stop")


def history(result: str) -> list[dict[str, Any]]:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_tools_result_in_the_history_reaches_the_answer(
    client: openai.OpenAI, tool_choice: str
) -> None:
    answers = []
    for degrees in ("18", "5"):
        messages = history(f"It is {degrees} degrees celsius in Paris.")
        result = chat(client, messages, 30, tools=[WEATHER], tool_choice=tool_choice)
        choice = result.choices[0]
        assert choice.message.tool_calls is None
        answers.append(choice.message.content or "")
    assert "18" in answers[0] and "18" not in answers[1], answers
    assert "5 degrees" in answers[1], answers


def bad(client: openai.OpenAI, messages: list[dict[str, Any]] = ASK, **body: Any) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages, 4, extra_body=body)
    assert caught.value.status_code == 400
    return str(caught.value)


def function(name: str = "f", **fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **fields}}


def with_parameters(parameters: Any, **fields: Any) -> list[dict[str, Any]]:
    return [function(parameters=parameters, **fields)]


NAME = r"tools\[(\d)\]\.function\.name"
PARAMETERS = r"tools\[(\d)\]\.function\.parameters"
NAMED_G = {"type": "function", "function": {"name": "g"}}
BAD_TOOLS = [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, r"tools\[0\]\.type"),
    ({"tools": [function("get weather")]}, NAME + " 'get weather' must be 1 to 64"),
    ({"tools": [function("f" * 65)]}, NAME + " 'f{65}' must be 1 to 64"),
    ({"tools": [function("f"), function("f")]}, NAME + " 'f' is given twice"),
    ({"tools": with_parameters("city")}, PARAMETERS),
    (
        {"tools": with_parameters({"type": "string"})},
        PARAMETERS + " must be the JSON schema of an object",
    ),
    (
        {"tools": [function("g"), *with_parameters({"properties": {"a": {"type": "objekt"}}})]},
        r"tools\[1\]\.function\.parameters: .*objekt",
    ),
    (
        {"tools": with_parameters({"properties": {"a": {"uniqueItems": True}}}, strict=True)},
        PARAMETERS + ": .*uniqueItems",
    ),
    ({"tools": []}, "tools must not be an empty list"),
    (
        {"tools": [function(f"f{i}") for i in range(129)]},
        "tools has 129 tools, more than the limit of 128",
    ),
    (
        {"tools": [function(description="d" * 20000)]},
        r"tools has \d+ characters as JSON, more than the limit of 16384",
    ),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [function()], "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": [function()], "tool_choice": NAMED_G},
        "tool_choice names the function 'g', not in tools",
    ),
    (
        {
            "tools": [function()],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice 'required' holds the output to tool calls: leave response_format out",
    ),
    ({"functions": [{"name": "f"}]}, "'functions' is not supported"),
]


@pytest.mark.parametrize(("body", "named"), BAD_TOOLS)
def test_bad_tools_are_400_naming_the_problem(
    client: openai.OpenAI, body: dict[str, Any], named: str
) -> None:
    message = bad(client, **body)
    assert re.search(named, message), message


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        (
            [*ASK, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "Paris"}}]}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object",
        ),
        (
            [{"role": "user", "content": "hi", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
            r"messages\[0\]: only assistant messages have tool_calls",
        ),
    ],
)  # fmt: skip
def test_bad_calls_in_the_history_are_400(
    client: openai.OpenAI, messages: list[dict[str, Any]], named: str
) -> None:
    message = bad(client, messages, tools=[function()])
    assert re.search(named, message), message


def test_tools_are_refused_on_completions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"tools": [function()]}
        )


def test_a_cached_answer_is_read_for_calls_as_a_generated_one(
    llm_variants_server: RunningServer,
) -> None:
    """On SmolLM2 with its response cache on."""
    client = llm_variants_server.openai_client()
    asked: dict[str, Any] = {"tools": [WEATHER], "extra_body": written(WRITTEN), "max_tokens": 80}
    first = chat(client, model=CACHED_LLM, **asked)
    again = client.chat.completions.with_raw_response.create(
        model=CACHED_LLM, messages=ASK, temperature=0, **asked
    )
    assert again.headers.get("x-lockgate-cache") == "hit"
    hit = again.parse().choices[0]
    assert calls_of(hit.message) == calls_of(first.choices[0].message) != []
    assert (hit.message.content, hit.finish_reason) == ("Let me check.", "tool_calls")
    streamed = client.chat.completions.with_raw_response.create(
        model=CACHED_LLM, messages=ASK, temperature=0, stream=True, **asked
    )
    assert streamed.headers.get("x-lockgate-cache") == "hit"
    chunks = list(streamed.parse())
    assert reassembled(chunks) == ("Let me check.", calls_of(hit.message), "tool_calls")
