"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (both with SSE
streaming) and /v1/embeddings. Routes only: the model manager loads, reloads and unloads the
language models (`backend: llm` entries of the repository) like every other model, and these
routes serve whichever are ready. Embeddings come from any classic model with a BYTES input
and an FP32 output."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from lockgate.cache.completion import Completion, CompletionCache, CompletionKey
from lockgate.cache.key import text_key
from lockgate.config import ModelConfig
from lockgate.core.manager import ServedVersion
from lockgate.core.metrics import Counter
from lockgate.core.request import InferRequest
from lockgate.datatypes import Arrays
from lockgate.errors import BadRequest, Forbidden, NotFound, ServingError, Unavailable
from lockgate.frontend.app import App
from lockgate.frontend.http import HttpRequest, cancel_on_disconnect, respond_json
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMMetrics, LLMService
from lockgate.protocol import openai as oa

if TYPE_CHECKING:
    from lockgate.llm.engine import RequestOutput

log = logging.getLogger("lockgate.openai")
_encode = msgspec.json.Encoder().encode
LLM_BACKEND = "llm"


@dataclass(slots=True)
class OpenAIRoutes:
    app: App
    metrics: LLMMetrics = field(init=False)
    rejected: Counter = field(init=False)
    completions: CompletionCache = field(init=False)
    tokenizers: asyncio.Semaphore = field(init=False)
    tokenizing: int = 0  # prompts being tokenized or waiting to be

    def __post_init__(self) -> None:
        self.tokenizers = asyncio.Semaphore(self.limits.tokenize_threads)
        self.completions = CompletionCache(self.app.cache)
        self.metrics = LLMMetrics(self.app.models.registry, lambda: self.services.values())
        self.rejected = self.app.models.registry.counter(
            "lockgate_llm_requests_rejected_total",
            "Language-model requests refused before they queued, by reason (the error kind: "
            "unavailable for a TTFT that would miss its budget, too_many_requests for a full "
            "queue).",
            ("model", "reason"),
        )

    @property
    def limits(self) -> oa.OpenAILimits:
        return self.app.settings.openai

    @property
    def services(self) -> dict[str, LLMService]:
        """The language models ready now, by served name."""
        found = (s for s in self.app.models.services() if isinstance(s, LLMService))
        return {s.name: s for s in found}

    async def __call__(self, request: HttpRequest, parts: list[str]) -> None:
        route = "/".join(parts)
        method = request.method
        if route == "models" and method == "GET":
            await respond_json(request.send, 200, self._models())
        elif route == "completions" and method == "POST":
            await self._completions(request)
        elif route == "chat/completions" and method == "POST":
            await self._chat(request)
        elif route == "embeddings" and method == "POST":
            await self._embeddings(request)
        else:
            raise NotFound(f"no route for {method} /v1/{route[:200]}")

    # -- models ------------------------------------------------------------------------
    def _models(self) -> dict[str, Any]:
        data = [
            {
                "id": s.name,
                "object": "model",
                "created": s.created,
                "owned_by": "lockgate",
                "max_model_len": s.engine_config.max_model_len,
                "generation_defaults": s.generation.to_dict(),
            }
            for s in self.services.values()
        ]
        data += [
            {"id": name, "object": "model", "created": 0, "owned_by": "lockgate"}
            for name in self._embedding_models()
        ]
        return {"object": "list", "data": data}

    def _service(self, name: str) -> LLMService:
        service = self.services.get(name)
        if service is None:
            if len(self.services) == 1 and not name:
                return next(iter(self.services.values()))
            known = ", ".join(sorted(self.services)) or "none"
            raise NotFound(f"the model '{name}' does not exist (language models: {known})")
        return service

    # -- completions -------------------------------------------------------------------
    async def _completions(self, request: HttpRequest) -> None:
        body = oa.decode(await request.body(), oa.CompletionRequest)
        service = self._service(body.model)
        if body.echo:
            raise BadRequest("echo is not supported")
        _check_supported(body)
        prompt_ids = await self._tokenize(self._prompt_ids, service, body.prompt)
        params = self._sampling(service, body, len(prompt_ids), body.max_tokens, 16, body.logprobs)
        await self._generate(request, service, body, prompt_ids, params, COMPLETION)

    async def _chat(self, request: HttpRequest) -> None:
        body = oa.decode(await request.body(), oa.ChatRequest)
        service = self._service(body.model)
        _check_supported(body)
        messages = [{"role": m.role, "content": oa.message_text(m)} for m in body.messages]
        if not messages:
            raise BadRequest("messages must not be empty")
        chars = sum(len(m["content"] or "") for m in messages)
        _check_length(service, chars, self.limits.max_prompt_chars)
        prompt_ids = await self._tokenize(_chat_ids, service, messages)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling(service, body, len(prompt_ids), max_tokens, None, top)
        await self._generate(request, service, body, prompt_ids, params, CHAT)

    async def _generate(
        self,
        request: HttpRequest,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        kind: _Kind,
    ) -> None:
        rid = oa.new_id(kind.id_prefix)
        priority = self._priority(request, service, body.priority)
        key = self._cache_key(service, kind, prompt_ids, params)
        if key is not None:
            hit = await self.completions.get(key)
            if hit is not None:
                await self._replay(request, hit, rid, service, body, kind)
                return
        stream = self._submit(request, service, prompt_ids, params, rid, priority)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            piece = kind.piece(service)
            text, last = await self._stream(
                request, stream, rid, service, kind.chunk_object, include_usage, piece
            )
        else:
            text, reason, logprobs, last = await self._collect(
                request, stream, service, kind.legacy
            )
            payload = kind.response(rid, service.name, text, reason, logprobs, _usage(last))
            await respond_json(request.send, 200, payload)
        self._keep(key, text, last)

    def _priority(self, request: HttpRequest, service: LLMService, asked: int) -> int:
        """The engine priority of a request that asked `asked` (0: the model's default)."""
        if asked < 0:
            raise BadRequest("priority must be a non-negative integer (1 is the highest)")
        levels = max(1, service.config.batcher.priority_levels)
        default = service.config.batcher.default_priority_level or levels
        priority = min(asked or default, levels)
        if priority < default and not self.app.priority_granted(request.bearer()):
            raise Forbidden(
                f"priority {priority} is above the model's default ({default}): "
                "it needs a key that grants it"
            )
        return priority

    def _keep(self, key: CompletionKey | None, text: str, last: RequestOutput | None) -> None:
        """Cache a completion that finished (not one cut short), when it has a key."""
        if key is not None and last is not None and last.finish_reason is not None:
            completion = Completion(
                text, last.finish_reason.value, last.num_prompt_tokens, last.num_output_tokens
            )
            self.completions.put(key, completion)

    def _cache_key(
        self, service: LLMService, kind: _Kind, prompt_ids: list[int], params: SamplingParams
    ) -> CompletionKey | None:
        """The cache key of a deterministic completion (greedy, no logprobs) of a model whose
        response cache is on; None for any other."""
        settings = service.config.response_cache
        if not settings.enable or params.temperature != 0 or params.logprobs is not None:
            return None
        model = self.app.models.models.get(service.config.name)
        versions = model.versions.items() if model is not None else ()
        version = next((v for v, s in versions if s.service is service), 0)
        return CompletionCache.key(
            service.name, version, settings, kind.id_prefix, prompt_ids, repr(params)
        )

    async def _replay(
        self,
        request: HttpRequest,
        hit: Completion,
        rid: str,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        kind: _Kind,
    ) -> None:
        """Answer from the cache, streamed (one chunk with the whole text) or not."""
        usage = oa.usage(hit.prompt_tokens, hit.completion_tokens, hit.prompt_tokens)
        reason = _openai_reason(hit.finish_reason)
        marked = [(b"x-lockgate-cache", b"hit")]
        if not body.stream:
            payload = kind.response(rid, service.name, hit.text, reason, None, usage)
            await respond_json(request.send, 200, payload, marked)
            return
        send = request.send
        await send({"type": "http.response.start", "status": 200, "headers": SSE + marked})
        if kind.legacy:
            chunk = oa.completion_chunk(rid, service.name, hit.text, reason)
        else:
            delta = {"role": "assistant", "content": hit.text}
            chunk = oa.chat_chunk(rid, service.name, delta, reason)
        await _sse(send, chunk)
        if body.stream_options and body.stream_options.include_usage:
            await _sse(send, oa.usage_chunk(rid, service.name, kind.chunk_object, usage))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _tokenize(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """Tokenize off the event loop, at most `tokenize_threads` at once; past
        `tokenize_waiting` requests waiting their turn, 503."""
        if self.tokenizing >= self.limits.tokenize_threads + self.limits.tokenize_waiting:
            raise Unavailable("too many prompts waiting to be tokenized", retry_after=1)
        self.tokenizing += 1
        try:
            async with self.tokenizers:
                return await asyncio.to_thread(fn, *args)
        finally:
            self.tokenizing -= 1

    def _prompt_ids(self, service: LLMService, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            _check_length(service, len(prompt), self.limits.max_prompt_chars)
            return service.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < service.vocab_size]
            if bad:
                raise BadRequest(
                    f"prompt token id {bad[0]} is outside the vocabulary "
                    f"(0..{service.vocab_size - 1})"
                )
            return ids
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._prompt_ids(service, prompt[0])
        raise BadRequest("prompt must be a string, a list of token ids, or a list of one of those")

    def _sampling(
        self,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        prompt_len: int,
        max_tokens: int | None,
        default_max: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        if body.n != 1:
            raise BadRequest("n must be 1")
        limit = service.engine_config.max_model_len
        if prompt_len >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_len} tokens. Please reduce the length of the prompt."
            )
        if max_tokens is None:
            max_tokens = default_max or (limit - prompt_len)
        if max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1")
        if prompt_len + max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                "the completion). Please reduce the length of the prompt or max_tokens."
            )
        stop = self.limits.stop_strings(body.stop)
        self.limits.check_stop_token_ids(body.stop_token_ids)
        return SamplingParams(
            **service.generation.fill(body.temperature, body.top_p, body.top_k, body.min_p),
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
            logit_bias=_logit_bias(body.logit_bias, service.vocab_size, self.limits.max_logit_bias),
        )

    def _submit(
        self,
        request: HttpRequest,
        service: LLMService,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        priority: int,
    ) -> AsyncIterator[RequestOutput]:
        if self.app.draining:
            raise Unavailable("server is shutting down", retry_after=1)
        try:
            return service.engine.generate(ids, params, rid, _deadline(request), priority)
        except ServingError as exc:
            self.rejected.inc((service.name, exc.kind))
            raise

    async def _collect(
        self, request: HttpRequest, stream: Any, service: LLMService, legacy: bool
    ) -> tuple[str, str | None, Any, RequestOutput | None]:
        texts: list[str] = []
        entries: list[Any] = []
        last: RequestOutput | None = None
        async with cancel_on_disconnect(request.receive), stream:
            async for out in stream:
                texts.append(out.text)
                if out.logprobs:
                    entries.extend(out.logprobs)
                last = out
        reason = last.finish_reason.value if last and last.finish_reason else None
        logprobs = None
        if entries:
            logprobs = (_legacy_logprobs if legacy else _chat_logprobs)(service, entries)
        return "".join(texts), _openai_reason(reason), logprobs, last

    async def _stream(
        self,
        request: HttpRequest,
        stream: Any,
        rid: str,
        service: LLMService,
        obj: str,
        include_usage: bool,
        piece: Callable[[str, str, RequestOutput, bool], dict[str, Any]],
    ) -> tuple[str, RequestOutput | None]:
        """Send the completion as server-sent events; its text and last output."""
        send = request.send
        first = True
        last: RequestOutput | None = None
        texts: list[str] = []
        async with cancel_on_disconnect(request.receive), stream:
            try:
                async for out in stream:
                    if first:
                        await send({"type": "http.response.start", "status": 200, "headers": SSE})
                    await _sse(send, piece(rid, service.name, out, first))
                    texts.append(out.text)
                    first = False
                    last = out
            except ServingError as exc:
                if first:
                    raise
                await _sse(send, oa.error_body(exc.message, exc.kind, exc.status))
                last = None  # cut short: nothing to keep
            if include_usage and last is not None:
                await _sse(send, oa.usage_chunk(rid, service.name, obj, _usage(last)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return "".join(texts), last

    # -- embeddings --------------------------------------------------------------------
    def _embedding_models(self) -> list[str]:
        names = []
        for model in self.app.models.models.values():
            config = model.config
            if config is None or model.latest_ready() is None:
                continue
            if (
                len(config.inputs) == 1
                and config.inputs[0].datatype == "BYTES"
                and config.outputs
                and config.outputs[0].datatype == "FP32"
            ):
                names.append(model.name)
        return names

    async def _embeddings(self, request: HttpRequest) -> None:
        body = oa.decode(await request.body(), oa.EmbeddingRequest)
        names = self._embedding_models()
        name = body.model or (names[0] if len(names) == 1 else "")
        if name not in names:
            raise NotFound(
                f"the model '{body.model}' does not serve embeddings "
                f"(try: {', '.join(names) or 'none'})"
            )
        texts = oa.embedding_texts(body.input, self.limits)
        served = self.app.models.get(name)
        _check_dimensions(served.config, body.dimensions)
        async with cancel_on_disconnect(request.receive):
            embedded = await self._embed(served, [t.encode() for t in texts])
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
            for i, v in enumerate(embedded.vectors)
        ]
        tokens = embedded.tokens
        payload = {
            "object": "list",
            "data": data,
            "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await respond_json(request.send, 200, payload)

    async def _embed(self, served: ServedVersion, texts: list[bytes]) -> Embedded:
        """One vector per text, and the tokens they came from. With the model's response
        cache on, each text is looked up on its own, and only the texts not found run, in
        requests of at most `max_batch_size` texts, one after the other."""
        config, cache = served.config, self.app.cache
        name, version, settings = config.name, served.version, config.response_cache
        keys = [text_key(name, str(version), t) for t in texts] if settings.enable else []
        hits = await asyncio.gather(*(cache.get(name, version, settings, k) for k in keys))
        found: dict[int, Arrays] = {i: h.outputs for i, h in enumerate(hits) if h}
        missing = [i for i in range(len(texts)) if i not in found]
        step = config.max_batch_size or len(missing)
        for start in range(0, len(missing), step):
            chunk = missing[start : start + step]
            answer = await self._embed_rows(served, [texts[i] for i in chunk])
            for row, i in enumerate(chunk):
                found[i] = {k: v[row : row + 1] for k, v in answer.items()}
                if settings.enable:
                    cache.put(name, version, settings, keys[i], found[i])
        rows = [found[i] for i in range(len(texts))]
        vectors = np.stack([np.asarray(r[config.outputs[0].name][0], np.float32) for r in rows])
        counted = [r[TOKEN_COUNT] for r in rows if TOKEN_COUNT in r]
        return Embedded(vectors, int(sum(c.sum() for c in counted)))

    async def _embed_rows(self, served: ServedVersion, texts: list[bytes]) -> Arrays:
        config = served.config
        array = np.empty((len(texts), 1), dtype=object)  # text: [rows, 1]
        array[:, 0] = texts
        core = InferRequest(
            model=config.name,
            inputs={config.inputs[0].name: array},
            version=served.version,
            rows=len(texts),
        )
        return await self.app.executor.run(core, served)


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: np.ndarray  # [texts, dims] float32
    tokens: int  # that they were computed from, as the model's `token_count` output says


# An embedding model's optional output: the tokens each text was embedded from, [rows, 1].
# /v1/embeddings reports their sum as its usage (0 for a model without it).
TOKEN_COUNT = "token_count"


def _check_dimensions(config: ModelConfig, asked: int | None) -> None:
    """`dimensions` may only name the size of the model's own embeddings."""
    if asked is None:
        return
    dims = config.outputs[0].dims
    native = dims[-1] if dims and dims[-1] > 0 else 0
    if asked < 1:
        raise BadRequest("dimensions must be a positive integer")
    if not native:
        raise BadRequest(f"dimensions is not supported by model '{config.name}'")
    if asked > native:
        raise BadRequest(f"dimensions {asked} is more than the {native} of model '{config.name}'")
    if asked < native:
        raise BadRequest(
            f"dimensions {asked} is not supported: model '{config.name}' gives {native}-"
            "dimensional embeddings and does not shorten them (leave dimensions out)"
        )


def _vector(v: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return v.tolist()


SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _logit_bias(
    bias: dict[str, float] | None, vocab_size: int, most: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as checked (token id, bias) pairs."""
    if not bias:
        return ()
    if len(bias) > most:
        raise BadRequest(f"logit_bias takes at most {most} entries")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < vocab_size):
            raise BadRequest(
                f"logit_bias key {key[:20]!r} is not a token id in 0..{vocab_size - 1}"
            )
        if not -100.0 <= value <= 100.0:
            raise BadRequest(f"logit_bias value {value} for token {key} is outside [-100, 100]")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _check_supported(body: oa.CompletionRequest | oa.ChatRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise BadRequest(f"'{name}' is not supported by lockgate; leave it out")


def _check_length(service: LLMService, chars: int, most: int) -> None:
    """Refuse, before tokenizing, a prompt too long to fit the context whatever its tokens,
    or longer than `most` characters (0: no bound of its own)."""
    limit = service.engine_config.max_model_len * service.tokenizer.max_token_chars
    if chars > limit:
        raise BadRequest(
            f"prompt of {chars} characters cannot fit the context of "
            f"{service.engine_config.max_model_len} tokens (at most {limit} characters)"
        )
    if most and chars > most:
        raise BadRequest(f"prompt of {chars} characters is over the limit of {most} characters")


def _chat_ids(service: LLMService, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return service.tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ServingError:
        raise
    except Exception as exc:
        raise BadRequest(f"chat template failed: {exc}") from None


def _deadline(request: HttpRequest) -> float | None:
    header = request.header(b"request-timeout")
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        raise BadRequest("Request-Timeout header must be a number of seconds") from None
    if not 0 < seconds < 1e7:
        raise BadRequest("Request-Timeout header must be a positive number of seconds")
    return request.received + seconds  # counted from the request's first byte


def _openai_reason(reason: str | None) -> str | None:
    return {"deadline": "length", "abort": "abort"}.get(reason, reason) if reason else None


def _usage(last: RequestOutput | None) -> dict[str, Any]:
    if last is None:
        return oa.usage(0, 0)
    return oa.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)


async def _sse(send: Callable[[dict[str, Any]], Awaitable[None]], payload: dict[str, Any]) -> None:
    await send(
        {
            "type": "http.response.body",
            "body": b"data: " + _encode(payload) + b"\n\n",
            "more_body": True,
        }
    )


def _token_text(service: LLMService, token_id: int) -> str:
    return service.tokenizer.decode([token_id], skip_special_tokens=False)


def _legacy_logprobs(service: LLMService, entries: list[Any]) -> dict[str, Any]:
    tokens = [_token_text(service, e.token_id) for e in entries]
    offsets, position = [], 0
    for t in tokens:
        offsets.append(position)
        position += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {
                _token_text(service, t): lp
                for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
            }
            for e in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(service: LLMService, entries: list[Any]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(service, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e.token_id, e.logprob),
                "top_logprobs": [
                    item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
                ],
            }
            for e in entries
        ]
    }


def _completion_piece(
    service: LLMService,
) -> Callable[[str, str, RequestOutput, bool], dict[str, Any]]:
    def piece(rid: str, model: str, out: RequestOutput, first: bool) -> dict[str, Any]:
        logprobs = _legacy_logprobs(service, out.logprobs) if out.logprobs else None
        reason = _openai_reason(out.finish_reason.value if out.finish_reason else None)
        return oa.completion_chunk(rid, model, out.text, reason, logprobs)

    return piece


def _chat_piece(service: LLMService) -> Callable[[str, str, RequestOutput, bool], dict[str, Any]]:
    def piece(rid: str, model: str, out: RequestOutput, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": out.text}
        if first:
            delta["role"] = "assistant"
        logprobs = _chat_logprobs(service, out.logprobs) if out.logprobs else None
        reason = _openai_reason(out.finish_reason.value if out.finish_reason else None)
        return oa.chat_chunk(rid, model, delta, reason, logprobs)

    return piece


@dataclass(frozen=True, slots=True)
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str
    chunk_object: str
    legacy: bool  # logprobs in the completions format, else the chat format
    piece: Callable[[LLMService], Callable[[str, str, RequestOutput, bool], dict[str, Any]]]
    response: Callable[..., dict[str, Any]]


COMPLETION = _Kind("cmpl", "text_completion", True, _completion_piece, oa.completion_response)
CHAT = _Kind("chatcmpl", "chat.completion.chunk", False, _chat_piece, oa.chat_response)
