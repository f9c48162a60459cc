"""Triton's generate extension for language models: `POST /v2/models/{m}[/versions/{v}]/generate`
answers `{"model_name", "model_version", "text_output"}`, and `.../generate_stream` sends that
object as server-sent events, each with the text that is new since the last.

Routes only. A request becomes the completion it amounts to (`protocol/generate.py`) and runs
through the completion pipeline the OpenAI routes use (`frontend/completion_pipeline.py`):
tokenizing off the event loop, the context and stop limits, the model's sampling defaults,
priority, the completion cache and the engine's admission. The same prompt and parameters
give the same text on both APIs, and share cache entries with /v1/completions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lockgate.errors import BadRequest, ServingError
from lockgate.frontend.completion_pipeline import (
    TEXT_COMPLETION,
    CompletionPipeline,
    Generation,
)
from lockgate.frontend.http import (
    EVENT_STREAM,
    HttpRequest,
    answer_whole,
    cancel_on_disconnect,
    respond_json,
    send_event,
)
from lockgate.llm.service import LLMService
from lockgate.protocol import generate
from lockgate.protocol import openai as oa

if TYPE_CHECKING:
    from lockgate.frontend.openai_routes import OpenAIRoutes
    from lockgate.llm.engine import RequestOutput

DEFAULT_MAX_TOKENS = 16  # as /v1/completions and vLLM
Reply = Callable[[str], dict[str, Any]]  # text_output -> the response object


class GenerateRoutes:
    def __init__(self, openai: OpenAIRoutes) -> None:
        """Beside the OpenAI routes, sharing their completion pipeline (its tokenizer
        threads, its limits and its completion cache)."""
        self.pipeline: CompletionPipeline = openai.pipeline

    async def __call__(
        self, request: HttpRequest, name: str, version: str | None, stream: bool
    ) -> None:
        """Answer a /generate request, or a /generate_stream one when `stream`."""
        served = self.pipeline.app.v2.served(name, version)  # 404 or 503 before the body
        _language_model(served.service, name)
        body = generate.decode(await request.body())
        if body.stream is not None and body.stream != stream:
            asked = "generate_stream" if body.stream else "generate"
            raise BadRequest(f"stream {str(body.stream).lower()} is answered by /{asked}")
        await self.pipeline.resubmitted(lambda: self._once(request, name, version, body, stream))

    async def _once(
        self,
        request: HttpRequest,
        name: str,
        version: str | None,
        body: generate.GenerateRequest,
        stream: bool,
    ) -> None:
        """Resolve the version now serving and answer the request on it."""
        served = self.pipeline.app.v2.served(name, version)
        pipeline = self.pipeline
        service = _language_model(served.service, name)
        ask = body.completion
        prompt = oa.prompts_of(ask.prompt, service.engine_config.max_model_len, 1)[0]
        ids = await pipeline.tokenize(service, prompt)
        prepared = pipeline.prepare(
            request,
            service,
            ask,
            ids,
            max_tokens=ask.max_tokens,
            default_max=DEFAULT_MAX_TOKENS,
            logprobs=None,
            namespace=TEXT_COMPLETION,
        )
        prefix = "" if body.exclude_input_in_output else body.text_input
        reply: Reply = functools.partial(generate.response, name, str(served.version))
        hit = await pipeline.cached(prepared)
        if hit is not None:
            cached = [(b"x-lockgate-cache", b"hit")]
            await answer_whole(request.send, stream, reply(prefix + hit.text), cached)
            return
        outputs = pipeline.submit(request, [prepared], oa.new_id("gen"))
        if stream:
            text, last = await _stream(request, outputs, prefix, reply)
        else:
            collected = await pipeline.collect(request, outputs)
            text, last = collected.text, collected.last
            await respond_json(request.send, 200, reply(prefix + text))
        pipeline.keep(prepared, text, last)


def _language_model(service: object, name: str) -> LLMService:
    if not isinstance(service, LLMService):
        raise BadRequest(
            f"model '{name}' is not a language model: generate serves language models "
            "(send this model's requests to /infer)"
        )
    return service


async def _stream(
    request: HttpRequest, outputs: Generation, prefix: str, reply: Reply
) -> tuple[str, RequestOutput | None]:
    """Send the prefix (if any), then each output's new text, as events; the generated text
    and the last output (None when an error cut the stream short)."""
    send = request.send
    started = False
    texts: list[str] = []
    last: RequestOutput | None = None
    async with cancel_on_disconnect(request), outputs:
        try:
            async for out in outputs:
                if not started:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": EVENT_STREAM}
                    )
                    started = True
                    if prefix:
                        await send_event(send, reply(prefix))
                await send_event(send, reply(out.text))
                texts.append(out.text)
                last = out
        except ServingError as exc:
            if not started:
                raise  # answered with its status, as any refused request
            await send_event(send, generate.error(exc.message))
            last = None
    if not started:
        await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return "".join(texts), last
