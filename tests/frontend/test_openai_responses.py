"""The OpenAI Responses API (/v1/responses), through a real server and the `openai` client, on
SmolLM2 with greedy decoding: each answer compared with /v1/chat/completions' for the same
messages (input, instructions, a tool's result after previous_response_id), streamed events in
order and adding up to the answer sent whole, max_output_tokens, a JSON schema, a forced
function call, the store (retrieve, delete, unknown ids, the input items listed a page at a
time, cancel refused) and the fields refused by name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import CACHED_LLM, RunningServer

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": WEATHER_PARAMETERS,
}


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(
        **{"model": MODEL, "input": ASK, "temperature": 0, "max_output_tokens": 16, **fields}
    )


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(
        **{"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16, **fields}
    )


def test_a_response_is_the_chat_answer_to_its_input(client: openai.OpenAI) -> None:
    response = create(client)
    expected = chat(client, [{"role": "user", "content": ASK}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.store is True
    assert response.output_text == expected.choices[0].message.content
    assert response.output_text  # real text, not an empty answer on both sides
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens == expected.usage.prompt_tokens
    assert usage.output_tokens == expected.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    done = "completed" if expected.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == done
    assert response.max_output_tokens == 16 and response.temperature == 0


def test_instructions_are_a_system_message_first(client: openai.OpenAI) -> None:
    system = "You answer in one word, in capital letters."
    response = create(client, instructions=system)
    expected = chat(
        client, [{"role": "system", "content": system}, {"role": "user", "content": ASK}]
    )
    assert response.output_text == expected.choices[0].message.content
    assert response.instructions == system
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_input_items_are_the_chat_messages(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Red."}],
        },
        {"role": "user", "content": "Another one?"},
    ]
    response = create(client, input=items)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
    ]
    assert response.output_text == chat(client, messages).choices[0].message.content


def test_a_stream_sends_the_events_in_order_adding_up_to_the_whole(client: openai.OpenAI) -> None:
    whole = create(client)
    events = list(create(client, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert len(deltas) > 1  # one per chunk, not the text at once
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text
    assert events[-4].text == whole.output_text
    assert final.usage == whole.usage and final.status == whole.status
    assert final.id == events[0].response.id != whole.id
    with client.responses.stream(
        model=MODEL, input=ASK, temperature=0, max_output_tokens=16
    ) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    response = create(client, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"
    [*_, last] = create(client, max_output_tokens=3, stream=True)
    assert last.type == "response.incomplete"
    assert last.response.output_text == response.output_text


def test_a_json_schema_format_gives_json_that_matches_it(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    response = create(client, text={"format": form}, max_output_tokens=64)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_forced_call_then_its_result_after_previous_response_id(client: openai.OpenAI) -> None:
    ask = "What is the weather like in Paris?"
    named = {"type": "function", "name": "get_weather"}
    first = create(client, input=ask, tools=[WEATHER], tool_choice=named, max_output_tokens=48)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = create(client, input=[result], previous_response_id=first.id)
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    expected = chat(client, history)
    assert second.output_text == expected.choices[0].message.content
    assert second.output_text
    streamed = list(
        create(
            client, input=ask, tools=[WEATHER], tool_choice=named, max_output_tokens=48, stream=True
        )
    )
    [delta] = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert delta.delta == done.arguments == call.arguments
    assert streamed[-1].response.output[0].arguments == call.arguments
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].id == call.id and listed[1].arguments == call.arguments
    assert (listed[2].call_id, listed[2].output) == (call.call_id, "Sunny, 21 C")


def test_the_input_items_of_a_stored_response_page_in_either_order(client: openai.OpenAI) -> None:
    asked = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    first = create(client, input=asked, max_output_tokens=4)
    second = create(client, input="Another one?", previous_response_id=first.id)
    listed = list(client.responses.input_items.list(second.id, order="asc", limit=2))
    assert [(i.type, i.role) for i in listed] == [
        ("message", "developer"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    texts = [i.content[0].text for i in listed]
    assert texts == ["Be brief.", "Name a colour.", first.output_text, "Another one?"]
    assert listed[2].id == first.output[0].id  # the first response's output, as it was made
    assert [i.content[0].type for i in listed] == [
        "input_text",
        "input_text",
        "output_text",
        "input_text",
    ]
    assert len({i.id for i in listed}) == 4
    assert [i.status for i in listed] == ["completed", "completed", first.status, "completed"]
    ids = [i.id for i in listed]
    assert [i.id for i in client.responses.input_items.list(second.id)] == ids[::-1]  # desc
    page = client.responses.input_items.list(second.id, order="asc", limit=3)
    assert [i.id for i in page.data] == ids[:3] and page.has_more
    rest = page.get_next_page()
    assert [i.id for i in rest.data] == ids[3:] and not rest.has_more
    backward = client.responses.input_items.list(
        second.id, order="asc", limit=2, extra_query={"before": ids[3]}
    )
    assert [i.id for i in backward.data] == ids[1:3] and backward.has_more
    included = client.responses.input_items.list(
        first.id, include=["message.input_image.image_url"]
    )
    assert [i.id for i in included] == ids[1::-1]  # the first response's own: its input
    bad = [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"after": "msg_unknown"}, "after"),
        ({"include": ["everything"]}, "include"),
    ]
    for query, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.input_items.list(second.id, extra_query=query)
        assert caught.value.body["param"] == param and caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_cancel_is_refused_as_for_a_response_not_made_in_the_background(
    client: openai.OpenAI,
) -> None:
    response = create(client, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(response.id)
    assert caught.value.body["message"] == "Cannot cancel a synchronous response."
    assert client.responses.retrieve(response.id) == response  # unchanged
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_a_stored_response_is_retrieved_and_deleted(client: openai.OpenAI) -> None:
    response = create(client, max_output_tokens=4, metadata={"topic": "geography"})
    found = client.responses.retrieve(response.id)
    assert found == response and found.metadata == {"topic": "geography"}
    client.responses.delete(response.id)
    for ask in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            ask(response.id)
    unstored = create(client, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, previous_response_id="resp_unknown")
    assert caught.value.body["param"] == "previous_response_id"


def test_a_cached_answer_is_the_generated_one(llm_variants_server: RunningServer) -> None:
    """On SmolLM2 with its response cache on: the same response, whole and streamed."""
    client = llm_variants_server.openai_client()
    asked: dict[str, Any] = {"model": CACHED_LLM, "input": "Name a planet.", "max_output_tokens": 8}
    first = create(client, **asked)
    again = client.responses.with_raw_response.create(temperature=0, **asked)
    assert again.headers.get("x-lockgate-cache") == "hit"
    hit = again.parse()
    assert (hit.output_text, hit.status, hit.usage.output_tokens) == (
        first.output_text,
        first.status,
        first.usage.output_tokens,
    )
    assert hit.usage.input_tokens == first.usage.input_tokens
    streamed = client.responses.with_raw_response.create(temperature=0, stream=True, **asked)
    assert streamed.headers.get("x-lockgate-cache") == "hit"
    events = list(streamed.parse())
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [hit.output_text]
    assert events[-1].response.output_text == hit.output_text


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "file_search"),
        ({"background": True}, "background"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tool_choice": {"type": "web_search_preview"}}, "web_search_preview"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y.png"}],
                    }
                ]
            },
            "input_image",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **fields)
    assert named in caught.value.body["message"]
    assert caught.value.body["param"]


def test_bad_input_is_a_400_in_the_api_s_error_shape(llm_server: RunningServer) -> None:
    url = f"{llm_server.url}/v1/responses"
    cases = [
        ({"model": MODEL, "input": ASK, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": "word " * 5000}, None),  # past the 512-token context
    ]
    for body, param in cases:
        answer = httpx.post(url, json=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request" and error["message"]
        assert error["param"] == param, error
    bulky = httpx.post(url, content=b'{"input": "' + b"a" * (9 * 2**20) + b'"}', timeout=30)
    assert bulky.status_code == 413  # --max-payload-bytes, as on the chat route
    assert httpx.get(url, timeout=10).status_code == 405
    assert httpx.post(f"{url}/resp_x", json={}, timeout=10).status_code == 405
