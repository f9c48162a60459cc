"""KServe v2 inference on a language model, as Triton's vLLM backend answers it: REST and gRPC
`ModelInfer` answer once with the whole text; gRPC `ModelStreamInfer` answers with a response
per piece of text when the request's `stream` input is true (the tensors:
`protocol/llm_tensors.py`).

A request becomes the completion it amounts to and runs through the completion pipeline the
OpenAI routes and Triton's generate use (`frontend/completion_pipeline.py`): tokenizing off
the event loop, the context and stop limits, the model's sampling defaults, priority, the
completion cache and the engine's admission (TTFT prediction, `max_waiting`, deadlines). The
same prompt and parameters give the same text on every API.

`V2Service.infer` and `V2Service.stream` hand a language model's requests here, so both
transports share it. Triton refuses ModelInfer and REST infer on a decoupled model, as the
vLLM backend's is; lockgate answers them when `stream` is false, since one response then
holds the whole answer (stream true is refused there with a 400 naming the streaming routes).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

from lockgate.backends.response_stream import StreamedResponse
from lockgate.cache.completion import Completion
from lockgate.core.manager import ServedVersion
from lockgate.core.validate import validate_outputs
from lockgate.errors import BadRequest, ServingError
from lockgate.frontend.completion_pipeline import (
    TEXT_COMPLETION,
    CompletionPipeline,
    Generation,
    PreparedCompletion,
)
from lockgate.frontend.generate_routes import DEFAULT_MAX_TOKENS
from lockgate.frontend.http import Disconnect, HttpRequest
from lockgate.frontend.v2_service import Deadline, InferResult
from lockgate.llm.service import LLMService
from lockgate.protocol import llm_tensors
from lockgate.protocol import openai as oa
from lockgate.protocol.llm_tensors import Piece, TensorRequest
from lockgate.protocol.v2_codec import V2InferRequest


@dataclass(slots=True)
class _Started:
    """A request checked and handed to the engine (or answered by the completion cache)."""

    asked: TensorRequest
    prepared: PreparedCompletion
    hit: Completion | None = None
    outputs: Generation | None = None


class LanguageInfer:
    """A language model's v2 requests, on the completion pipeline of the OpenAI routes."""

    def __init__(self, pipeline: CompletionPipeline) -> None:
        self.pipeline = pipeline

    async def infer(
        self, served: ServedVersion, decoded: V2InferRequest, deadline: Deadline, granted: bool
    ) -> InferResult:
        """One response with the whole text (prompt first unless exclude_input_in_output)."""
        try:
            asked = _decode(served, decoded)
            if asked.stream:
                raise llm_tensors.stream_refused(served.config.name)
            started = await self._start(served, asked, decoded, deadline, granted)
            piece = await self._whole(started)
        except ServingError as exc:
            self._count(served, deadline.received, exc.kind)
            raise
        self._count(served, deadline.received, "success")
        return InferResult(served, llm_tensors.outputs(piece, started.asked.returns))

    async def stream(
        self, served: ServedVersion, decoded: V2InferRequest, deadline: Deadline, granted: bool
    ) -> AsyncGenerator[StreamedResponse]:
        """With `stream` true, a response per output of the engine (the new text), the last
        final; else one final response with the whole text. An error before the engine runs
        raises; one after ends the stream as its final response. Closing the iterator aborts
        the sequence (its KV blocks are freed)."""
        kind = "cancelled"  # until the final response
        try:
            asked = _decode(served, decoded)
            started = await self._start(served, asked, decoded, deadline, granted)
            async for response in self._responses(started):
                if response.final:
                    kind = "success" if response.error is None else response.error.kind
                yield response
        except ServingError as exc:
            kind = exc.kind
            raise
        finally:
            self._count(served, deadline.received, kind)

    async def _responses(self, started: _Started) -> AsyncGenerator[StreamedResponse]:
        returns = started.asked.returns
        if not started.asked.stream:
            piece = await self._whole(started)
            yield StreamedResponse(llm_tensors.outputs(piece, returns), final=True)
            return
        if started.outputs is None:  # a cache hit: the whole text at once
            assert started.hit is not None
            yield StreamedResponse(llm_tensors.outputs(_cached(started.hit), returns), final=True)
            return
        async for response in self._pieces(started, started.outputs):
            yield response

    def _count(self, served: ServedVersion, received: float, kind: str) -> None:
        """Count a request among the model's (`lockgate_requests_total`, and the statistics
        perf_analyzer reads), as a composition's: one execution, its latency when answered."""
        metrics = self.pipeline.app.models.metrics
        labels = (served.config.name, str(served.version))
        metrics.requests.inc((*labels, kind))
        if kind == "success":
            metrics.batch_size.observe(labels, 1)
            metrics.request_latency.observe(labels, time.monotonic() - received, "")
            served.last_inference_ms = int(time.time() * 1000)

    async def _start(
        self,
        served: ServedVersion,
        asked: TensorRequest,
        decoded: V2InferRequest,
        deadline: Deadline,
        granted: bool,
    ) -> _Started:
        """Tokenize, check and submit (or find in the completion cache) a decoded request."""
        service = served.service
        if not isinstance(service, LLMService):
            raise BadRequest(f"version {served.version} of '{served.config.name}' is not served")
        pipeline = self.pipeline
        view = _view(deadline.received)
        ids = await pipeline.tokenize(service, asked.text_input)
        prepared = pipeline.prepare(
            view,
            service,
            asked.completion,
            ids,
            max_tokens=asked.completion.max_tokens,
            default_max=DEFAULT_MAX_TOKENS,
            logprobs=asked.logprobs,
            namespace=TEXT_COMPLETION,
            granted=granted,
        )
        hit = await pipeline.cached(prepared)
        if hit is not None:
            return _Started(asked, prepared, hit=hit)
        at = deadline.of(decoded).resolve(served)
        outputs = pipeline.submit(view, [prepared], oa.new_id("v2"), at)
        return _Started(asked, prepared, outputs=outputs)

    async def _whole(self, started: _Started) -> Piece:
        prefix = started.asked.text_input if started.asked.prepend_input else ""
        if started.outputs is None:
            assert started.hit is not None
            piece = _cached(started.hit)
            return replace(piece, text=prefix + piece.text)
        collected = await self.pipeline.collect(_view(time.monotonic()), started.outputs)
        last = collected.last
        self.pipeline.keep(started.prepared, collected.text, last)
        return Piece(
            prefix + collected.text,
            collected.finish_reason,
            last.num_prompt_tokens if last else len(started.prepared.prompt_ids),
            last.num_output_tokens if last else 0,
            collected.cumulative_logprob,
        )

    async def _pieces(
        self, started: _Started, outputs: Generation
    ) -> AsyncGenerator[StreamedResponse]:
        returns = started.asked.returns
        texts: list[str] = []
        counted = 0  # output tokens sent so far
        logprob = 0.0
        last = None
        async with outputs:
            try:
                async for out in outputs:
                    texts.append(out.text)
                    logprob += sum(entry.logprob for entry in out.logprobs or ())
                    reason = out.finish_reason.value if out.finish_reason else None
                    piece = Piece(
                        out.text,
                        reason,
                        out.num_prompt_tokens,
                        out.num_output_tokens - counted,
                        logprob,
                    )
                    counted = out.num_output_tokens
                    last = out
                    final = out.finished
                    yield StreamedResponse(llm_tensors.outputs(piece, returns), final=final)
            except ServingError as exc:
                yield StreamedResponse(error=exc, final=True)
                return
        self.pipeline.keep(started.prepared, "".join(texts), last)


def _decode(served: ServedVersion, decoded: V2InferRequest) -> TensorRequest:
    """The request's tensors read; an output it names among its outputs is returned too."""
    asked = llm_tensors.decode(decoded.inputs, decoded.parameters)
    named = [o.name for o in decoded.outputs]
    if named:  # most requests name none: no config view to build for them
        validate_outputs(llm_tensors.interface(served.config), named)
    return replace(asked, returns=asked.returns | (set(named) - {llm_tensors.TEXT_OUTPUT}))


def _cached(hit: Completion) -> Piece:
    return Piece(hit.text, hit.finish_reason, hit.prompt_tokens, hit.completion_tokens)


async def _no_message() -> dict[str, Any]:
    raise RuntimeError("a v2 request's body has been read whole")


async def _no_send(message: Any) -> None:
    raise RuntimeError("a v2 request is answered by its transport")


def _view(received: float) -> HttpRequest:
    """The request view the completion pipeline reads, for a request its transport has
    decoded (REST, gRPC or the lane): its arrival, and no connection of its own to watch (a
    client that leaves cancels the task that awaits the answer, which aborts the sequence)."""
    scope = {"headers": [], "lockgate.received": received, "lockgate.disconnect": Disconnect()}
    return HttpRequest(scope, _no_message, _no_send, "POST", "", 0)
