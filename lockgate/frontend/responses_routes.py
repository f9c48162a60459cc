"""The OpenAI Responses API: `POST /v1/responses` (whole or streamed as named server-sent
events), `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` of the responses stored.

Routes only. A request becomes the chat request it amounts to (`protocol/responses.py`) and
runs through the completion pipeline of /v1/chat/completions (`frontend/completion_pipeline.py`):
the chat template, tool calls, guided decoding of `text.format`, the context and stop limits,
the model's sampling defaults, priority, the completion cache and the engine's admission. A
response asked with `store` (the API's default) is kept in this process's `ResponseStore`
for `previous_response_id`, which continues its conversation, and for the listing of its input
items. `cancel` is answered as OpenAI answers for a response not made in the background, the
only kind lockgate makes. The answer's head names the response's id (`x-lockgate-response-id`),
whole or streamed, so that a router in front of several servers sends the requests that need it
here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from lockgate.cache.completion import Completion
from lockgate.errors import BadRequest, NotFound, ServingError
from lockgate.frontend.completion_pipeline import (
    CHAT_COMPLETION,
    CompletionPipeline,
    Generation,
    PreparedCompletion,
    check_message_count,
)
from lockgate.frontend.http import HttpRequest, cancel_on_disconnect, check_method, respond_json
from lockgate.frontend.openai_routes import requested_version
from lockgate.frontend.response_store import ResponseStore, StoredResponse
from lockgate.protocol import openai as oa
from lockgate.protocol import responses as rs
from lockgate.protocol import tool_calls

if TYPE_CHECKING:
    from lockgate.frontend.http import Send
    from lockgate.frontend.openai_routes import OpenAIRoutes
    from lockgate.llm.engine import RequestOutput

SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_encode = msgspec.json.Encoder().encode


class ResponsesRoutes:
    def __init__(self, openai: OpenAIRoutes, store_size: int) -> None:
        """Beside the OpenAI routes, sharing their models and completion pipeline; at most
        `store_size` responses stored."""
        self.openai = openai
        self.pipeline: CompletionPipeline = openai.pipeline
        self.store = ResponseStore(store_size)

    async def __call__(self, request: HttpRequest, parts: list[str]) -> None:
        """`parts`: the path after /v1/responses."""
        if not parts:
            check_method(request.method, request.path, ("POST",))
            body = oa.decode(await request.body(), rs.ResponsesRequest)
            await self.pipeline.resubmitted(lambda: self._create(request, body))
            return
        rid, rest = parts[0], parts[1:]
        if rest == ["input_items"]:
            check_method(request.method, request.path, ("GET",))
            await self._input_items(request, rid)
        elif rest == ["cancel"]:
            check_method(request.method, request.path, ("POST",))
            self._stored(rid, "id")
            # as OpenAI answers for a response not made with `background` (lockgate makes none)
            raise BadRequest("Cannot cancel a synchronous response.")
        elif rest:
            raise NotFound(f"no route for {request.method} {request.path[:200]}")
        elif request.method == "GET":
            await respond_json(request.send, 200, self._stored(rid, "id").response)
        else:
            check_method(request.method, request.path, ("GET", "DELETE"))
            if not self.store.delete(rid):
                raise self._unknown(rid, "id")
            await respond_json(
                request.send, 200, {"id": rid, "object": "response", "deleted": True}
            )

    async def _input_items(self, request: HttpRequest, rid: str) -> None:
        """A page of a stored response's input items, as `?after=&before=&limit=&order=` ask."""
        query = rs.InputItemsQuery.parse(request.scope.get("query_string", b""))
        page = rs.input_items_page(self._stored(rid, "id").input_items, query)
        await respond_json(request.send, 200, page)

    def _stored(self, rid: str, param: str) -> StoredResponse:
        stored = self.store.get(rid)
        if stored is None:
            raise self._unknown(rid, param)
        return stored

    def _unknown(self, rid: str, param: str) -> NotFound:
        return NotFound(
            f"no response with id '{rid[:80]}' is stored on this server (responses are kept "
            f"in memory, the {self.store.capacity} most recent)",
            param=param,
        )

    async def _create(self, request: HttpRequest, body: rs.ResponsesRequest) -> None:
        body.check()
        history: list[oa.ChatMessage] = []
        items: tuple[dict[str, Any], ...] = ()  # the input items of the responses before
        if body.previous_response_id is not None:
            previous = self._stored(body.previous_response_id, "previous_response_id")
            history = list(previous.conversation)
            items = (*previous.input_items, *previous.response["output"])
        if body.store and not self.store.capacity:
            body = msgspec.structs.replace(body, store=False)  # the store is off: said so
        prepared, tools = await self._prepare(request, rs.chat_request(body, history))
        service = prepared.service
        answer = _Answer(body, rs.new_id(rs.RESPONSE_ID_PREFIX), service.name, tools)
        hit = await self.pipeline.cached(prepared)
        outputs = None if hit is not None else self.pipeline.submit(request, [prepared], answer.rid)
        if body.stream:
            response, text, last = await self._stream(request, answer, outputs, hit)
        else:
            response, text, last = await self._whole(request, answer, outputs, hit)
        if hit is None:
            self.pipeline.keep(prepared, text, last)
        if response is not None and body.store:
            conversation = (
                *history,
                *rs.input_messages(body),
                *rs.conversation_of(response["output"]),
            )
            items = (*items, *rs.input_items(body))
            self.store.put(answer.rid, StoredResponse(response, conversation, items))

    async def _prepare(
        self, request: HttpRequest, chat: oa.ChatRequest
    ) -> tuple[PreparedCompletion, oa.ToolUse | None]:
        """The chat request checked, rendered and tokenized as /v1/chat/completions does it,
        and the tools it offers."""
        service = self.openai.service(chat.model, requested_version(request))
        check_message_count(service, len(chat.messages))
        tools = chat.tool_use(self.openai.limits)
        takes_tools = service.tokenizer.takes_tools
        messages = tool_calls.prompt_messages(chat.messages, tools, takes_tools)
        definitions = tools.definitions() if tools is not None and takes_tools else None
        prompt_ids = await self.pipeline.tokenize_chat(service, messages, definitions)
        prepared = self.pipeline.prepare(
            request,
            service,
            chat,
            prompt_ids,
            max_tokens=chat.max_tokens,
            default_max=None,
            logprobs=None,
            namespace=CHAT_COMPLETION,
            tools=tools,
        )
        return prepared, tools

    async def _whole(
        self,
        request: HttpRequest,
        answer: _Answer,
        outputs: Generation | None,
        hit: Completion | None,
    ) -> tuple[dict[str, Any], str, RequestOutput | None]:
        """The response sent whole: the response object, the text and the last output."""
        last, reason = None, None
        if hit is not None:
            text, reason, usage = hit.text, hit.finish_reason, _hit_usage(hit)
        else:
            assert outputs is not None
            collected = await self.pipeline.collect(request, outputs)
            text, reason, last = collected.text, collected.finish_reason, collected.last
            usage = _usage(last)
        answer.feed(text, True)
        _, response = answer.finish(reason, usage)
        marked = [(rs.RESPONSE_ID_HEADER, answer.rid.encode())]
        if hit is not None:
            marked.append((b"x-lockgate-cache", b"hit"))
        await respond_json(request.send, 200, response, marked)
        return response, text, last

    async def _stream(
        self,
        request: HttpRequest,
        answer: _Answer,
        outputs: Generation | None,
        hit: Completion | None,
    ) -> tuple[dict[str, Any] | None, str, RequestOutput | None]:
        """The response as server-sent events, `event: <type>` and `data: <event>` each: the
        response created and in progress, its items and text as they come, and the response
        completed (or incomplete); an error after the first event is an `error` event and
        `response.failed` (the response then is None: nothing to store)."""
        send = request.send
        texts: list[str] = []
        last: RequestOutput | None = None
        if hit is not None:
            await _start(send, answer, [(b"x-lockgate-cache", b"hit")])
            await _emit(send, answer.feed(hit.text, True))
            events, response = answer.finish(hit.finish_reason, _hit_usage(hit))
            return await _end(send, answer, events, response), hit.text, None
        assert outputs is not None
        async with cancel_on_disconnect(request), outputs:
            try:
                async for out in outputs:
                    if last is None:
                        await _start(send, answer)
                    await _emit(send, answer.feed(out.text, out.finish_reason is not None))
                    texts.append(out.text)
                    last = out
            except ServingError as exc:
                if last is None:
                    raise
                await _fail(send, answer, exc)
                return None, "", None
        if last is None:
            await _start(send, answer)
        reason = last.finish_reason.value if last and last.finish_reason else None
        events, response = answer.finish(reason, _usage(last))
        return await _end(send, answer, events, response), "".join(texts), last


@dataclass(slots=True)
class _Answer:
    """One response being made: its request, and its output as it arrives."""

    body: rs.ResponsesRequest
    rid: str
    model: str
    tools: oa.ToolUse | None  # offered: the output is split into text and calls
    created_at: int = field(default_factory=rs.now)
    output: rs.ResponseOutput = field(default_factory=rs.ResponseOutput)
    parser: tool_calls.ToolCallParser | None = None

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """A piece of the model's output; the stream events it makes."""
        if self.tools is None:
            return self.output.text(text)
        if self.parser is None:
            self.parser = tool_calls.ToolCallParser(self.tools)
        parsed = self.parser.feed(text)
        if finished:
            parsed.extend(self.parser.finish())
        events = self.output.text(parsed.content)
        for call in parsed.calls:
            events += self.output.call(call)
        return events

    def finish(
        self, finish_reason: str | None, usage: rs.Usage
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that close the output, and the response: completed, or incomplete
        when its output ran out of tokens."""
        reason = rs.incomplete_reason(finish_reason)
        status = "incomplete" if reason else "completed"
        events = self.output.close(status)
        return events, self.response(status, usage, reason)

    def response(
        self,
        status: str,
        usage: rs.Usage | None = None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return rs.response_object(
            self.body,
            self.rid,
            self.created_at,
            self.model,
            status,
            self.output.items,
            usage,
            incomplete,
            error,
        )


async def _start(
    send: Send, answer: _Answer, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    named = [(rs.RESPONSE_ID_HEADER, answer.rid.encode())]
    await send(
        {"type": "http.response.start", "status": 200, "headers": SSE + named + (headers or [])}
    )
    snapshot = answer.response("in_progress")
    output = answer.output
    await _emit(
        send,
        [
            output.event("response.created", response=snapshot),
            output.event("response.in_progress", response=snapshot),
        ],
    )


async def _end(
    send: Send, answer: _Answer, events: list[dict[str, Any]], response: dict[str, Any]
) -> dict[str, Any]:
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    await _emit(send, [*events, answer.output.event(kind, response=response)])
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return response


async def _fail(send: Send, answer: _Answer, exc: ServingError) -> None:
    """An error after the stream began: an `error` event, then the response failed."""
    output = answer.output
    error = output.event("error", code=exc.kind, message=exc.message, param=exc.param)
    failed = answer.response("failed", error={"code": "server_error", "message": exc.message})
    await _emit(send, [error, output.event("response.failed", response=failed)])
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _emit(send: Send, events: list[dict[str, Any]]) -> None:
    """Stream events, each `event: <type>` and `data: <the event as JSON>`."""
    if not events:
        return
    body = b"".join(
        b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"
        for event in events
    )
    await send({"type": "http.response.body", "body": body, "more_body": True})


def _usage(last: RequestOutput | None) -> rs.Usage:
    if last is None:
        return rs.Usage(0, 0)
    return rs.Usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)


def _hit_usage(hit: Completion) -> rs.Usage:
    """A cached completion's usage: its prompt's tokens all cached."""
    return rs.Usage(hit.prompt_tokens, hit.completion_tokens, hit.prompt_tokens)
