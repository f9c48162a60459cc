"""The OpenAI Responses API's wire format (`POST /v1/responses`): the request schema, its
conversion to the chat request it amounts to, and the response object and stream events.

A request becomes a chat request (`chat_request`): `instructions` a system message first, the
stored conversation of `previous_response_id` next, then the `input` items (messages,
`function_call` and `function_call_output` items as an assistant's tool calls and tool
results); `text.format` becomes `response_format`, `max_output_tokens` `max_tokens`. The
answer's output items are built as the text and calls arrive (`ResponseOutput`), with the
stream events that announce them, so an answer sent whole and one streamed are the same.
A stored response's input items (`GET /v1/responses/{id}/input_items`) are listed a page at
a time (`InputItemsQuery`, `input_items_page`).

Unknown fields are ignored, as OpenAI does; fields lockgate cannot honour (built-in tools,
`background`, `include`, image, audio and file inputs, ...) are a 400 that names them.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa

RESPONSE_ID_PREFIX = "resp_"
# on the answer to POST /v1/responses (whole or streamed, in its head): the response's id, by
# which a router sends its GET, DELETE and previous_response_id to the replica that stored it
RESPONSE_ID_HEADER = b"x-lockgate-response-id"
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = frozenset({"input_text", "output_text"})


class PlainText(msgspec.Struct, tag_field="type", tag="text"):
    """text.format {"type": "text"}: no constraint."""


class JsonObject(msgspec.Struct, tag_field="type", tag="json_object"):
    """text.format {"type": "json_object"}: the output is a JSON object."""


class JsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    """text.format {"type": "json_schema", "name", "schema", "strict"}: the output matches it."""

    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = PlainText | JsonObject | JsonSchema


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a text model has one verbosity


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None  # a model that does not reason takes none
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[dict[str, Any]]  # a user message's text, or input items
    instructions: str | None = None  # a system message before everything else
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # function tools: see `function_tools`
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # echoed and stored, at most 16 pairs
    store: bool = True  # kept for GET /v1/responses/{id} and previous_response_id
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # only "disabled" is served
    reasoning: Reasoning | None = None
    # known to the API, not implemented by lockgate: refused by name when they change anything
    background: bool | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    # no effect on the answer: accepted (a cache hint, an abuse-tracking id, a bound on
    # built-in tool calls of which there are none, the stream's obfuscation padding)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None

    def check(self) -> None:
        """400 naming the first field given that lockgate does not serve."""
        refused = {
            "background": self.background is True,
            "include": bool(self.include),
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "top_logprobs": bool(self.top_logprobs),
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "truncation": self.truncation == "auto",
            "reasoning": self.reasoning is not None and self.reasoning.effort is not None,
        }
        for name, given in refused.items():
            if given:
                raise BadRequest(f"'{name}' is not supported by lockgate: {_WHY[name]}", param=name)
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be given with stream: true")
        if self.metadata is not None and len(self.metadata) > 16:
            raise BadRequest("metadata takes at most 16 pairs", param="metadata")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise BadRequest("max_output_tokens must be at least 1", param="max_output_tokens")


_WHY = {
    "background": "responses are answered while the request waits; leave it out",
    "include": "no built-in tool or reasoning output to include; leave it out",
    "conversation": "use previous_response_id to continue a stored response",
    "prompt": "prompt templates are not stored here; give input and instructions",
    "top_logprobs": "logprobs are served by /v1/chat/completions",
    "service_tier": "one tier is served: leave it out, or give 'auto' or 'default'",
    "truncation": "a prompt longer than the context is refused; use 'disabled'",
    "reasoning": "the model does not reason; leave reasoning.effort out",
}


# -- the chat request it amounts to -------------------------------------------------------------


def input_messages(body: ResponsesRequest) -> list[oa.ChatMessage]:
    """The request's `input` as chat messages (400 naming the item when one is not served)."""
    if isinstance(body.input, str):
        return [oa.ChatMessage(role="user", content=body.input)]
    messages: list[oa.ChatMessage] = []
    for index, item in enumerate(body.input):
        message = _item_message(index, item)
        last = messages[-1] if messages else None
        if message.tool_calls and last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or ()), *message.tool_calls]
        else:
            messages.append(message)
    return messages


def _item_message(index: int, item: dict[str, Any]) -> oa.ChatMessage:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(ROLES)}, not {str(role)[:40]!r}",
                param="input",
            )
        return oa.ChatMessage(role=ROLES[role], content=_content_text(where, item.get("content")))
    if kind == "function_call":
        name, call_id = _text(where, item, "name"), _text(where, item, "call_id")
        arguments = _text(where, item, "arguments")
        if not isinstance(_json_or_none(arguments), dict):
            raise BadRequest(f"{where}.arguments must be a JSON object, as text", param="input")
        call = oa.ToolCall(id=call_id, function=oa.FunctionCall(name=name, arguments=arguments))
        return oa.ChatMessage(role="assistant", content=None, tool_calls=[call])
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content_text(f"{where}.output", output)
        call_id = _text(where, item, "call_id")
        return oa.ChatMessage(role="tool", content=text, tool_call_id=call_id)
    raise BadRequest(
        f"{where}: input items of type {str(kind)[:40]!r} are not supported by lockgate "
        "(message, function_call and function_call_output are)",
        param="input",
    )


def _content_text(where: str, content: Any) -> str:
    """A message's content: a string, or parts of type input_text or output_text, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise BadRequest(
                f"{where}.content[{j}]: content parts of type {str(kind)[:40]!r} are not "
                "supported by lockgate (input_text and output_text are)",
                param="input",
            )
        texts.append(_text(f"{where}.content[{j}]", part, "text"))
    return "".join(texts)


def _text(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string", param="input")
    return value


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def function_tools(body: ResponsesRequest) -> list[oa.ToolDefinition] | None:
    """The request's tools as chat tools: functions only (a built-in tool is a 400 naming it)."""
    if body.tools is None:
        return None
    found = []
    for index, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(
                f"tools[{index}]: tools of type {str(kind)[:40]!r} are not supported by "
                "lockgate (function tools are)",
                param="tools",
            )
        try:
            function = msgspec.convert(
                {k: v for k, v in tool.items() if k != "type"}, oa.FunctionDefinition
            )
        except msgspec.ValidationError as exc:
            where = str(exc).replace("`$", f"`$.tools[{index}]")
            raise BadRequest(f"invalid request: {where}", param="tools") from None
        found.append(oa.ToolDefinition(type="function", function=function))
    return found


def chat_tool_choice(
    choice: Literal["none", "auto", "required"] | dict[str, Any] | None,
) -> Literal["none", "auto", "required"] | oa.NamedToolChoice | None:
    """tool_choice as the chat API gives it: {"type": "function", "name"} names a function."""
    if not isinstance(choice, dict):
        return choice
    kind, name = choice.get("type"), choice.get("name")
    if kind != "function" or not isinstance(name, str):
        raise BadRequest(
            f"tool_choice of type {str(kind)[:40]!r} is not supported by lockgate: give 'auto', "
            "'none', 'required' or {'type': 'function', 'name': ...}",
            param="tool_choice",
        )
    return oa.NamedToolChoice(type="function", function=oa.FunctionName(name=name))


def response_format(text: TextConfig | None) -> oa.ResponseFormat | None:
    form = text.format if text is not None else None
    if isinstance(form, JsonObject):
        return oa.JsonObjectFormat()
    if isinstance(form, JsonSchema):
        spec = oa.JsonSchemaSpec(
            name=form.name, schema=form.schema, description=form.description, strict=form.strict
        )
        return oa.JsonSchemaFormat(json_schema=spec)
    return None


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as the API lists its items: each with an id (one of its own) and
    a status, a message's content as parts. Call after `input_messages` has checked it."""
    if isinstance(body.input, str):
        return [_message_item("user", [body.input])]
    return [_input_item(item) for item in body.input]


def _input_item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        fields = {k: item[k] for k in ("call_id", "name", "arguments")}
        return {"id": new_id("fc_"), "type": kind, "status": "completed", **fields}
    if kind == "function_call_output":
        output = item["output"]
        if not isinstance(output, str):
            output = [{"type": "input_text", "text": p["text"]} for p in output]
        return {
            "id": new_id("fco_"),
            "type": kind,
            "status": "completed",
            "call_id": item["call_id"],
            "output": output,
        }
    content = item["content"]
    texts = [content] if isinstance(content, str) else [p["text"] for p in content]
    return _message_item(item["role"], texts)


def _message_item(role: str, texts: list[str]) -> dict[str, Any]:
    """A message item, its texts as parts: an assistant's `output_text` (as the response that
    made it gave them), the others' `input_text`."""
    if role == "assistant":
        parts = [
            {"type": "output_text", "text": t, "annotations": [], "logprobs": []} for t in texts
        ]
    else:
        parts = [{"type": "input_text", "text": t} for t in texts]
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": parts,
    }


def chat_request(body: ResponsesRequest, history: list[oa.ChatMessage]) -> oa.ChatRequest:
    """The chat request a response request amounts to, after `history` (the conversation of
    its previous response, empty without one)."""
    messages = [oa.ChatMessage(role="system", content=body.instructions)]
    if body.instructions is None:
        messages = []
    messages += history
    messages += input_messages(body)
    if not messages:
        raise BadRequest("input must not be an empty list", param="input")
    return oa.ChatRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        tools=function_tools(body),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
    )


# -- the answer ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def incomplete_reason(finish_reason: str | None) -> str | None:
    """Why a response is incomplete: its output ran out of tokens ("length"; a deadline or a
    guided-decoding mask over its time also end it so), else None (it is complete)."""
    return "max_output_tokens" if finish_reason in ("length", "deadline") else None


def response_object(
    body: ResponsesRequest,
    rid: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    incomplete: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object, with the request's settings echoed as the API returns them."""
    tools = [{"type": "function", **_function_echo(t.function)} for t in function_tools(body) or ()]
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": _format_echo(body.text)},
        "tool_choice": body.tool_choice or "auto",
        "tools": tools,
        "top_logprobs": 0,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage.to_dict() if usage is not None else None,
        "user": body.user,
    }


def _function_echo(function: oa.FunctionDefinition) -> dict[str, Any]:
    return {
        "name": function.name,
        "description": function.description,
        "parameters": function.parameters,
        "strict": function.strict,
    }


def _format_echo(text: TextConfig | None) -> dict[str, Any]:
    form = text.format if text is not None else None
    if form is None:
        return {"type": "text"}
    found: dict[str, Any] = msgspec.to_builtins(form)
    return found


def conversation_of(output: list[dict[str, Any]]) -> list[oa.ChatMessage]:
    """A response's output items as the assistant message that continues its conversation."""
    texts = [
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    calls = [
        oa.ToolCall(
            id=item["call_id"],
            function=oa.FunctionCall(name=item["name"], arguments=item["arguments"]),
        )
        for item in output
        if item["type"] == "function_call"
    ]
    content = "".join(texts) if texts or not calls else None
    return [oa.ChatMessage(role="assistant", content=content, tool_calls=calls or None)]


@dataclass(slots=True)
class ResponseOutput:
    """A response's output items, built as its text and calls arrive, and the stream events
    that announce them, numbered (`sequence_number`) from the stream's first. A message item is
    opened by the first text after a call (or at the start) and closed by the next call or
    `close`; each call is an item of its own, announced whole."""

    items: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0  # events made so far
    message: dict[str, Any] | None = None  # the message item open, taking text

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event of `kind` (`response.created`, ...), the next in sequence."""
        made = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return made

    def text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = []
        if self.message is None:
            events += self._open_message()
        assert self.message is not None
        part = self.message["content"][0]
        part["text"] += delta
        where = self._where(self.message)
        events.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call whole (as the tool-call parser gives it: id, function name and arguments)."""
        events = self.close("completed")
        function = call["function"]
        item = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": "",
        }
        index = len(self.items)
        self.items.append(item)
        events.append(self._item_event("response.output_item.added", index, item))
        arguments = function["arguments"]
        where = {"item_id": item["id"], "output_index": index}
        events.append(
            self.event("response.function_call_arguments.delta", **where, delta=arguments)
        )
        item["arguments"], item["status"] = arguments, "completed"
        events.append(
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=arguments,
            )
        )
        events.append(self._item_event("response.output_item.done", index, item))
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the message item open, if any, as `status` (completed or incomplete)."""
        message, self.message = self.message, None
        if message is None:
            return []
        part = message["content"][0]
        where = self._where(message)
        message["status"] = status
        return [
            self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **where, part=_copy(part)),
            self._item_event("response.output_item.done", self.items.index(message), message),
        ]

    @property
    def output_text(self) -> str:
        return "".join(
            p["text"] for i in self.items if i["type"] == "message" for p in i["content"]
        )

    def _open_message(self) -> list[dict[str, Any]]:
        message: dict[str, Any] = {
            "id": new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        index = len(self.items)
        self.items.append(message)
        self.message = message
        added = self._item_event("response.output_item.added", index, message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message["content"].append(part)
        where = self._where(message)
        return [added, self.event("response.content_part.added", **where, part=_copy(part))]

    def _where(self, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "item_id": message["id"],
            "output_index": self.items.index(message),
            "content_index": 0,
        }

    def _item_event(self, kind: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
        return self.event(kind, output_index=index, item=_copy(item))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (the events carry snapshots; the item goes on changing)."""
    copied: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(item))
    return copied


def now() -> int:
    return int(time.time())


# -- the input items of a stored response ------------------------------------------------------

INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
    }
)
MAX_PAGE = 100


@dataclass(frozen=True, slots=True)
class InputItemsQuery:
    """The query of `GET /v1/responses/{id}/input_items`: a page of at most `limit` items in
    `order` ("asc": the conversation's order; "desc", the default: the latest first), those
    after the item `after` and before the item `before` in that order."""

    limit: int = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    before: str | None = None

    @classmethod
    def parse(cls, query_string: bytes) -> InputItemsQuery:
        """From the URL's query (400 naming the parameter that is wrong). `include` is checked
        and has nothing to add: the items served hold no image, search result or logprob."""
        pairs = urllib.parse.parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
        query: dict[str, str] = {}
        for key, value in pairs:
            if key in ("include", "include[]"):
                if value not in INCLUDABLE:
                    raise BadRequest(
                        f"include: {value[:60]!r} is not one of {', '.join(sorted(INCLUDABLE))}",
                        param="include",
                    )
            else:
                query[key] = value
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order must be 'asc' or 'desc', not {order[:20]!r}", param="order")
        limit = query.get("limit", "20")
        if not re.fullmatch("[0-9]{1,3}", limit) or not 1 <= int(limit) <= MAX_PAGE:
            raise BadRequest(
                f"limit must be an integer from 1 to {MAX_PAGE}, not {limit[:20]!r}", param="limit"
            )
        return cls(
            int(limit), "asc" if order == "asc" else "desc", query.get("after"), query.get("before")
        )


def input_items_page(items: tuple[dict[str, Any], ...], query: InputItemsQuery) -> dict[str, Any]:
    """A page of a stored response's input items (`items` in the conversation's order), as the
    API's list object: `data`, `first_id`, `last_id`, `has_more` (items beyond the page, the way
    it pages: on after it, or before it when only `before` is given). A cursor that names no item
    of the list is a 400."""
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    start, end = 0, len(ordered)
    if query.after is not None:
        start = _position(ordered, query.after, "after") + 1
    if query.before is not None:
        end = _position(ordered, query.before, "before")
    window = ordered[start:end]
    if query.before is not None and query.after is None:  # paging backward: the nearest ones
        data, has_more = window[-query.limit :], len(window) > query.limit
    else:
        data, has_more = window[: query.limit], len(window) > query.limit
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _position(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    for index, item in enumerate(items):
        if item["id"] == item_id:
            return index
    raise BadRequest(
        f"{param}: no item with id '{item_id[:80]}' among this response's input items", param=param
    )
