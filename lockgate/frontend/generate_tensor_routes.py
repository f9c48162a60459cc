"""Triton's generate extension on a model of named tensors: `POST /v2/models/{m}[/versions/{v}]
/generate` and `.../generate_stream` on any model but a language model (whose routes are
`frontend/generate_routes.py`), as Triton serves them on a Python model, vLLM's or
TensorRT-LLM's.

Routes only. The body becomes the v2 request it amounts to (`protocol/generate_tensors.py`:
fields named as inputs are inputs, the others parameters) and runs as /infer runs it
(`V2Service`: the same checks, deadline, priority, cache and statistics); a decoupled model's
request streams from its response sender.

- generate_stream: each response the model sends is an event, `data: {...}` with its
  outputs as fields, in order; an error response is an event `data: {"error": "..."}` and
  the stream goes on; the model's final flag ends the stream. The status is the first
  response's, 200 or that error's, as Triton's. A request refused before it reaches the model
  (a bad body, a full queue) is answered as any refused request: a JSON error. A client that
  goes away cancels its request: the model's `is_cancelled()` turns true, and what it sends
  afterwards is dropped.
- generate: the one response, as a JSON object. A decoupled model must send exactly one, as
  Triton requires: a second cancels the request, and the answer is a 400 that says to use
  generate_stream.
- A model that is not decoupled answers once: generate_stream sends that answer as one event.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Callable
from typing import Any

from lockgate.backends.response_stream import StreamedResponse
from lockgate.datatypes import Arrays
from lockgate.errors import BadRequest, ServingError
from lockgate.frontend.http import (
    EVENT_STREAM,
    HttpRequest,
    answer_whole,
    cancel_on_disconnect,
    error_headers,
    respond_json,
    send_event,
)
from lockgate.frontend.v2_service import Deadline, V2Service, timeout_header
from lockgate.protocol import generate, generate_tensors

ONE_RESPONSE = (  # Triton's words
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)
Reply = Callable[[Arrays], dict[str, Any]]  # a response's outputs -> its JSON object


async def generate_tensors_route(
    request: HttpRequest,
    v2: V2Service,
    name: str,
    version: str | None,
    stream: bool,
    priority_granted: bool = True,
) -> None:
    """Answer a /generate request, or a /generate_stream one when `stream`."""
    served = v2.served(name, version)  # 404 or 503 before the body is read
    body = await request.body()
    try:
        decoded = generate_tensors.decode(body, served.config)
        seconds = timeout_header(request.header_str(b"request-timeout"))
    except ServingError as error:
        v2.refused(served, error)
        raise
    deadline = Deadline(request.received, header_seconds=seconds)
    datatypes = {spec.name: spec.datatype for spec in served.config.outputs}
    if not served.config.decoupled:
        trace_id = request.trace.trace_id if request.trace else ""
        async with cancel_on_disconnect(request):
            result = await v2.infer(name, served, decoded, deadline, priority_granted, trace_id)
        if request.trace is not None and result.request is not None:
            request.trace.requests.append(result.request)
        version_served = str(result.served.version)
        answer = generate_tensors.encode(
            name, version_served, decoded.id, result.outputs, datatypes
        )
        await answer_whole(request.send, stream, answer, result.headers)
        return
    reply: Reply = functools.partial(
        generate_tensors.encode, name, str(served.version), decoded.id, datatypes=datatypes
    )
    responses = v2.stream(name, served, decoded, deadline, priority_granted)
    if stream:
        await _stream(request, responses, reply)
    else:
        await _one(request, responses, reply)


async def _stream(
    request: HttpRequest, responses: AsyncGenerator[StreamedResponse], reply: Reply
) -> None:
    """Each response as an event, as it comes; the stream starts with the first one."""
    send = request.send
    started = False
    async with cancel_on_disconnect(request), contextlib.aclosing(responses):
        async for response in responses:  # a refusal before the first is raised: a JSON error
            if response.empty:
                continue  # the final flag alone
            if response.error is not None:
                payload = generate.error(response.error.message)
            else:
                assert response.outputs is not None
                payload = reply(response.outputs)
            if not started:
                status, headers = 200, list(EVENT_STREAM)
                if response.error is not None:
                    status = response.error.status
                    headers += error_headers(response.error)
                await send({"type": "http.response.start", "status": status, "headers": headers})
                started = True
            await send_event(send, payload)
    if not started:  # the final flag and nothing else
        await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _one(
    request: HttpRequest, responses: AsyncGenerator[StreamedResponse], reply: Reply
) -> None:
    """The one response of a decoupled model, as a JSON object."""
    one: StreamedResponse | None = None
    async with cancel_on_disconnect(request), contextlib.aclosing(responses):
        async for response in responses:
            if response.empty:
                continue
            if one is not None:
                raise BadRequest(ONE_RESPONSE)  # closing the responses cancels the request
            one = response
    if one is None:
        raise BadRequest(ONE_RESPONSE)
    if one.error is not None:
        raise one.error
    assert one.outputs is not None
    await respond_json(request.send, 200, reply(one.outputs))
