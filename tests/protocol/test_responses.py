"""The Responses API's wire format without a server: input items as the chat messages they
amount to, the fields refused by name, and the output items and stream events built as text
and calls arrive."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa
from lockgate.protocol import responses as rs


def request(**fields: Any) -> rs.ResponsesRequest:
    return oa.decode(json.dumps({"model": "m", **fields}).encode(), rs.ResponsesRequest)


def roles_and_texts(messages: list[oa.ChatMessage]) -> list[tuple[str, Any]]:
    return [(m.role, m.content) for m in messages]


def test_instructions_history_and_input_make_the_chat_messages() -> None:
    history = [
        oa.ChatMessage(role="user", content="Hi"),
        oa.ChatMessage(role="assistant", content="Hello"),
    ]
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "A "},
                {"type": "input_text", "text": "colour?"},
            ],
        },
    ]
    chat = rs.chat_request(
        request(input=items, instructions="Be kind.", max_output_tokens=5), history
    )
    assert roles_and_texts(chat.messages) == [
        ("system", "Be kind."),
        ("user", "Hi"),
        ("assistant", "Hello"),
        ("system", "Be brief."),
        ("user", "A colour?"),
    ]
    assert chat.max_tokens == 5


def test_calls_join_one_assistant_message_and_outputs_are_tool_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
    ]
    messages = rs.input_messages(request(input=items))
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in messages[1].tool_calls or ()] == ["c1", "c2"]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [("c1", "sunny"), ("c2", "rain")]


def test_tools_tool_choice_and_text_format_become_chat_s() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "name": "f", "parameters": schema, "strict": True}
    form = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    chat = rs.chat_request(
        request(input="hi", tools=[tool], tool_choice={"type": "function", "name": "f"}), []
    )
    assert chat.tools is not None and chat.tools[0].function.parameters == schema
    assert (
        isinstance(chat.tool_choice, oa.NamedToolChoice) and chat.tool_choice.function.name == "f"
    )
    formatted = rs.chat_request(request(input="hi", text={"format": form}), [])
    assert isinstance(formatted.response_format, oa.JsonSchemaFormat)
    assert formatted.response_format.json_schema.schema == schema


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "code_interpreter"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input_file",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "arguments",
        ),
        ({"tool_choice": {"type": "file_search"}}, "file_search"),
    ],
)
def test_what_is_not_served_is_named(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(BadRequest, match=named):
        rs.chat_request(request(**{"input": "hi", **fields}), [])


@pytest.mark.parametrize(
    "fields",
    [{"background": True}, {"include": ["x"]}, {"service_tier": "flex"}, {"top_logprobs": 2}],
)
def test_fields_that_would_change_the_answer_are_refused(fields: dict[str, Any]) -> None:
    [name] = fields
    with pytest.raises(BadRequest) as caught:
        request(input="hi", **fields).check()
    assert caught.value.param == name
    request(input="hi", background=False, include=[], service_tier="auto").check()  # no effect


def test_the_output_and_its_events_as_text_and_calls_arrive() -> None:
    output = rs.ResponseOutput()
    events = [*output.text("Let me "), *output.text("check."), *output.text("")]
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}
    events += output.call(call)
    events += output.close("completed")  # nothing open: no event
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    message, function_call = output.items
    assert message["status"] == "completed" and output.output_text == "Let me check."
    assert events[0]["item"]["content"] == [] and events[6]["item"] == message  # snapshots
    assert function_call["call_id"] == "call_1" and function_call["arguments"] == '{"a": 1}'
    assert events[7]["item"]["arguments"] == "" and events[7]["output_index"] == 1
    assert rs.conversation_of(output.items)[0].tool_calls == [
        oa.ToolCall(id="call_1", function=oa.FunctionCall(name="w", arguments='{"a": 1}'))
    ]


def test_the_response_object_echoes_the_request() -> None:
    body = request(input="hi", temperature=0, max_output_tokens=3, metadata={"k": "v"})
    usage = rs.Usage(7, 3, 2)
    made = rs.response_object(body, "resp_1", 5, "m", "incomplete", [], usage, "max_output_tokens")
    assert made["incomplete_details"] == {"reason": "max_output_tokens"}
    assert made["usage"]["total_tokens"] == 10
    assert made["usage"]["input_tokens_details"] == {"cached_tokens": 2}
    assert (made["temperature"], made["max_output_tokens"], made["metadata"]) == (0, 3, {"k": "v"})
    assert made["text"] == {"format": {"type": "text"}} and made["tool_choice"] == "auto"
