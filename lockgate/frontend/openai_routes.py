"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (both with SSE
streaming; chat with tool calls) and /v1/embeddings. Routes only: the model manager loads,
reloads and unloads the language models (`backend: llm` entries of the repository) like every
other model, and these routes serve whichever are ready. Embeddings come from any classic model
with a BYTES input and an FP32 output. A request with the header `x-lockgate-model-version: N`
is served by version N of its model (the router's version canaries set it), else by the newest
ready one."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from lockgate.cache.completion import Completion
from lockgate.cache.key import text_key
from lockgate.config import ModelConfig
from lockgate.core.manager import ServedVersion
from lockgate.core.request import InferRequest
from lockgate.datatypes import Arrays
from lockgate.errors import BadRequest, MethodNotAllowed, NotFound, ServingError
from lockgate.frontend.app import App
from lockgate.frontend.completion_pipeline import (
    CHAT_COMPLETION,
    TEXT_COMPLETION,
    Collected,
    CompletionPipeline,
    Generation,
    PreparedCompletion,
    check_message_count,
    truncated,
)
from lockgate.frontend.http import (
    HttpRequest,
    cancel_on_disconnect,
    check_method,
    respond_json,
    send_event,
)
from lockgate.llm.compat_metrics import VLLMMetrics
from lockgate.llm.sequence import TokenLogprobs
from lockgate.llm.service import LLMMetrics, LLMService
from lockgate.protocol import openai as oa
from lockgate.protocol import tool_calls

if TYPE_CHECKING:
    from lockgate.frontend.otel import RequestTrace
    from lockgate.llm.engine import RequestOutput

log = logging.getLogger("lockgate.openai")
LLM_BACKEND = "llm"


@dataclass(slots=True)
class OpenAIRoutes:
    app: App
    metrics: LLMMetrics = field(init=False)
    pipeline: CompletionPipeline = field(init=False)  # shared with Triton's generate routes

    def __post_init__(self) -> None:
        self.pipeline = CompletionPipeline(self.app)
        self.metrics = LLMMetrics(self.app.models.registry, lambda: self.services.values())
        if "vllm" in self.app.settings.metrics_compat:
            vllm = VLLMMetrics(self.metrics.requests, lambda: self.services.values())
            self.app.models.registry.register(vllm)

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
        allowed = "GET" if route == "models" or route.startswith("models/") else "POST"
        if route not in _ROUTES and not route.startswith("models/"):
            raise NotFound(f"no route for {method} /v1/{route[:200]}")
        if method != allowed:
            raise MethodNotAllowed(f"/v1/{route[:200]} takes {allowed}, not {method}", allowed)
        if route == "models":
            await respond_json(request.send, 200, self._models())
        elif route.startswith("models/"):
            await respond_json(request.send, 200, self._model(route.removeprefix("models/")))
        elif route == "completions":
            await self._completions(request)
        elif route == "chat/completions":
            await self._chat(request)
        else:
            await self._embeddings(request)

    # -- tokens (vLLM's /tokenize and /detokenize) ---------------------------------------
    async def tokenize(self, request: HttpRequest) -> None:
        """A prompt's token ids, or chat messages' through the model's template, as the
        engine would see them; `count` and the context they must fit."""
        check_method(request.method, request.path, ("POST",))
        body = oa.decode(await request.body(), oa.TokenizeRequest)
        service = self.service(body.model, requested_version(request))
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give either prompt or messages")
        if body.prompt is not None:
            prompt = body.prompt
            ids = await self.pipeline.tokenize_text(service, prompt, body.add_special_tokens)
        else:
            assert body.messages is not None
            check_message_count(service, len(body.messages))
            messages = tool_calls.prompt_messages(body.messages, None, False)
            ids = await self.pipeline.tokenize_chat(
                service,
                messages,
                generation_prompt=body.generation_prompt,
                continue_final=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            )
        answer: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": service.engine_config.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            answer["token_strs"] = [_token_text(service, t) for t in ids]
        await respond_json(request.send, 200, answer)

    async def detokenize(self, request: HttpRequest) -> None:
        """Token ids back to text (special tokens kept), at most the model's context of them."""
        check_method(request.method, request.path, ("POST",))
        body = oa.decode(await request.body(), oa.DetokenizeRequest)
        service = self.service(body.model, requested_version(request))
        tokens = oa.token_ids_of(body.tokens, service.engine_config.max_model_len)
        bad = [t for t in tokens if not 0 <= t < service.vocab_size]
        if bad:
            raise BadRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{service.vocab_size - 1})"
            )
        text = service.tokenizer.decode(tokens, skip_special_tokens=False)
        await respond_json(request.send, 200, {"prompt": text})

    # -- models ------------------------------------------------------------------------
    def _models(self) -> dict[str, Any]:
        """vLLM's model cards: `root` is the repository model an entry is served from (its
        id differs with `served_model_name`), `parent` the base model of an adapter (none
        here), `max_model_len` the context (null for an embedding model, whose context
        lockgate does not know), `permission` vLLM's one default entry."""
        data = [
            {
                **oa.model_card(s.name, s.created, s.config.name, s.engine_config.max_model_len),
                "generation_defaults": s.generation.to_dict(),
            }
            for s in self.services.values()
        ]
        data += [oa.model_card(name, 0, name, None) for name in self._embedding_models()]
        return {"object": "list", "data": data}

    def serves(self, name: str) -> bool:
        return name in self.services or name in self._embedding_models()

    def _model(self, name: str) -> dict[str, Any]:
        """GET /v1/models/{name}: one entry of the list, or 404."""
        for entry in self._models()["data"]:
            if entry["id"] == name:
                return entry
        raise NotFound(f"the model '{name[:200]}' does not exist")

    def service(self, name: str, version: int | None) -> LLMService:
        """The language model served as `name`, at `version` (None: its newest ready one)."""
        service = self.services.get(name)
        if service is None:
            if len(self.services) == 1 and not name:
                service = next(iter(self.services.values()))
            else:
                known = ", ".join(sorted(self.services)) or "none"
                raise NotFound(
                    f"the model '{name}' does not exist (language models: {known})", param="model"
                )
        if version is None:
            return service
        served = self.app.models.get(service.config.name, version)  # 404 or 503
        if not isinstance(served.service, LLMService):
            raise NotFound(f"version {version} of model '{name}' is not a language model")
        return served.service

    # -- completions -------------------------------------------------------------------
    async def _completions(self, request: HttpRequest) -> None:
        body = oa.decode(await request.body(), oa.CompletionRequest)
        await self.pipeline.resubmitted(lambda: self._completion(request, body))

    async def _completion(self, request: HttpRequest, body: oa.CompletionRequest) -> None:
        """One prompt or a batch of them; with `echo`, each choice's text (and logprobs)
        begins with its prompt's, and max_tokens 0 answers the prompt alone (its tokens'
        logprobs, as an evaluation harness scores a text)."""
        service = self.service(body.model, requested_version(request))
        _check_supported(body)
        most_ids = service.engine_config.max_model_len
        prompts = oa.prompts_of(body.prompt, most_ids, self.limits.max_prompts)
        special = body.add_special_tokens is not False
        ids = await self.pipeline.tokenize_all(service, prompts, special)
        keep = body.truncate_prompt_tokens
        ids = [truncated(service, prompt_ids, keep) for prompt_ids in ids]
        prompt_only = body.prompt_only
        batch = [
            self.pipeline.prepare(
                request,
                service,
                body,
                prompt_ids,
                max_tokens=1 if prompt_only else body.max_tokens,
                default_max=16,
                logprobs=body.logprobs,
                namespace=COMPLETION.id_prefix,
                prompt_logprobs=body.prompt_top,
            )
            for prompt_ids in ids
        ]
        echoes = None
        if body.echo:
            echoes = [
                _Echo(
                    p if isinstance(p, str) and keep is None else service.tokenizer.decode(i),
                    i,
                    not prompt_only,
                    body.logprobs,
                )
                for p, i in zip(prompts, ids, strict=True)
            ]
        await self._generate(
            request, batch, body, COMPLETION, echoes=echoes, prompt_top=body.prompt_logprobs
        )

    async def _chat(self, request: HttpRequest) -> None:
        body = oa.decode(await request.body(), oa.ChatRequest)
        await self.pipeline.resubmitted(lambda: self._chat_once(request, body))

    async def _chat_once(self, request: HttpRequest, body: oa.ChatRequest) -> None:
        service = self.service(body.model, requested_version(request))
        _check_supported(body)
        if not body.messages:
            raise BadRequest("messages must not be empty")
        check_message_count(service, len(body.messages))
        tools = body.tool_use(self.limits)
        takes_tools = service.tokenizer.takes_tools
        messages = tool_calls.prompt_messages(body.messages, tools, takes_tools)
        definitions = tools.definitions() if tools is not None and takes_tools else None
        prompt_ids = await self.pipeline.tokenize_chat(
            service,
            messages,
            definitions,
            generation_prompt=body.generation_prompt,
            continue_final=body.continue_final_message,
            template_kwargs=body.template_kwargs,
        )
        prompt_ids = truncated(service, prompt_ids, body.truncate_prompt_tokens)
        limit = body.max_completion_tokens
        if limit is not None and limit < 1:
            raise BadRequest(
                "max_completion_tokens must be at least 1", param="max_completion_tokens"
            )
        prepared = self.pipeline.prepare(
            request,
            service,
            body,
            prompt_ids,
            max_tokens=limit if limit is not None else body.max_tokens,
            default_max=None,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            namespace=CHAT.id_prefix,
            tools=tools,
            prompt_logprobs=body.prompt_logprobs,
        )
        await self._generate(
            request,
            [prepared],
            body,
            CHAT,
            tools,
            prompt_top=body.prompt_logprobs,
            chat_echo=body.echoed,
        )

    async def _generate(
        self,
        request: HttpRequest,
        batch: list[PreparedCompletion],
        body: oa.CompletionRequest | oa.ChatRequest,
        kind: _Kind,
        tools: oa.ToolUse | None = None,
        echoes: list[_Echo] | None = None,
        prompt_top: int | None = None,
        chat_echo: str = "",
    ) -> None:
        """Run prepared completions (one per prompt of a batch) and answer them, whole or
        streamed, as one response whose choices run over the prompts in order, `n` each; a
        chat's output is split into content and calls when it was offered `tools`; with
        `prompt_top`, each choice carries its prompt's logprobs in vLLM's form; a chat's
        `chat_echo` begins each choice's content. The response's id is vLLM's `request_id`
        after the route's prefix, when the request set one; the engine's are its own."""
        rid = oa.new_id(kind.id_prefix)
        shown = self.limits.response_id(kind.id_prefix, body.request_id) or rid
        service = batch[0].service
        plain = echoes is None and prompt_top is None and not chat_echo
        alone = batch[0] if len(batch) == 1 and plain else None
        hit = await self.pipeline.cached(alone) if alone is not None else None
        if hit is not None:
            await self._replay(request, hit, shown, service, body, kind, tools)
            return
        outputs = self.pipeline.submit(request, batch, rid)
        per_prompt = batch[0].best_of
        if body.stream:
            options = body.stream_options or oa.StreamOptions(include_usage=False)
            piece = kind.piece(service, tools)
            if echoes is not None or prompt_top is not None:
                piece = _completion_piece(service, tools, echoes, per_prompt, prompt_top)
            elif chat_echo:
                piece = _chat_piece(service, tools, chat_echo)
            text, last = await self._stream(
                request, outputs, shown, service, kind.chunk_object, options, piece, per_prompt
            )
        else:
            sequences = per_prompt * len(batch)
            candidates = await self.pipeline.collect_choices(request, outputs, sequences)
            chosen = []
            for i, prepared in enumerate(batch):
                group = candidates[i * per_prompt : (i + 1) * per_prompt]
                picked = self.pipeline.choose(prepared, group)
                if echoes is not None:
                    picked = [_echoed(c, echoes[i]) for c in picked]
                if chat_echo:
                    picked = [replace(c, text=chat_echo + c.text) for c in picked]
                chosen += picked
            usage = _usage(dict(enumerate(c.last for c in candidates)), per_prompt)
            answer = _answer(kind, service, shown, chosen, usage, tools, echoes, body.n, prompt_top)
            await respond_json(request.send, 200, answer)
            text, last = chosen[0].text, chosen[0].last
        if alone is not None:
            self.pipeline.keep(alone, text, last)

    async def _replay(
        self,
        request: HttpRequest,
        hit: Completion,
        rid: str,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        kind: _Kind,
        tools: oa.ToolUse | None = None,
    ) -> None:
        """Answer from the cache, streamed (one chunk with the whole text) or not."""
        usage = oa.usage(hit.prompt_tokens, hit.completion_tokens, hit.prompt_tokens)
        reason = _openai_reason(hit.finish_reason)
        marked = [(b"x-lockgate-cache", b"hit")]
        if not body.stream:
            if kind.legacy:
                payload = kind.response(rid, service.name, hit.text, reason, None, usage)
            else:
                payload = _chat_answer(rid, service.name, hit.text, reason, None, usage, tools)
            await respond_json(request.send, 200, payload, marked)
            return
        send = request.send
        await send({"type": "http.response.start", "status": 200, "headers": SSE + marked})
        if kind.legacy:
            chunk = oa.completion_chunk(rid, service.name, hit.text, reason)
        else:
            delta = {"role": "assistant", "content": hit.text}
            if tools is not None:
                parsed = tool_calls.parse(hit.text, tools, cut=reason == "length")
                delta = {"role": "assistant", **_delta(parsed, 0)}
                reason = _tool_reason(reason, len(parsed.calls))
            chunk = oa.chat_chunk(rid, service.name, delta, reason)
        if body.stream_options and body.stream_options.continuous:
            chunk["usage"] = usage
        await send_event(send, chunk)
        if body.stream_options and body.stream_options.include_usage:
            await send_event(send, oa.usage_chunk(rid, service.name, kind.chunk_object, usage))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _stream(
        self,
        request: HttpRequest,
        stream: Generation,
        rid: str,
        service: LLMService,
        obj: str,
        options: oa.StreamOptions,
        piece: Piece,
        per_prompt: int = 1,
    ) -> tuple[str, RequestOutput | None]:
        """Send the completion as server-sent events, each chunk of one choice (with
        `continuous_usage_stats`, its usage so far); the text and last output of choice 0."""
        send = request.send
        lasts: dict[int, RequestOutput] = {}  # by choice
        texts: list[str] = []  # of choice 0
        async with cancel_on_disconnect(request), stream:
            try:
                async for out in stream:
                    index = stream.index(out)
                    if not lasts:
                        await send({"type": "http.response.start", "status": 200, "headers": SSE})
                    chunk = piece(rid, service.name, out, index, index not in lasts)
                    if chunk is not None:
                        if options.continuous:
                            chunk["usage"] = _usage({index: out})
                        await send_event(send, _as_choice(chunk, index))
                    if index == 0:
                        texts.append(out.text)
                    lasts[index] = out
            except ServingError as exc:
                if not lasts:
                    raise
                error = oa.error_body(exc.message, exc.kind, exc.status, exc.param)
                await send_event(send, error)
                lasts = {}  # cut short: nothing to keep
            if options.include_usage and lasts:
                usage = _usage(lasts, per_prompt)
                await send_event(send, oa.usage_chunk(rid, service.name, obj, usage))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return "".join(texts), lasts.get(0)

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
        served = self.app.models.get(name, requested_version(request))
        _check_dimensions(served.config, body.dimensions)
        if request.trace is not None:
            request.trace.bind(name)
        async with cancel_on_disconnect(request):
            embedded = await self._embed(served, [t.encode() for t in texts], request.trace)
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

    async def _embed(
        self, served: ServedVersion, texts: list[bytes], trace: RequestTrace | None
    ) -> Embedded:
        """One vector per text, and the tokens they came from. With the model's response
        cache on, each text is looked up on its own, and only the texts not found run, in
        requests of at most `max_batch_size` texts, one after the other."""
        config, cache = served.config, self.app.cache
        name, version, settings = config.name, served.version, config.response_cache
        generation = served.fingerprint  # a version reloaded as another model: other keys
        tag = f"{version}.{generation}"
        keys = [text_key(name, tag, t) for t in texts] if settings.enable else []
        hits = await asyncio.gather(
            *(cache.get(name, version, settings, k, generation) for k in keys)
        )
        found: dict[int, Arrays] = {i: h.outputs for i, h in enumerate(hits) if h}
        missing = [i for i in range(len(texts)) if i not in found]
        step = config.max_batch_size or len(missing)
        for start in range(0, len(missing), step):
            chunk = missing[start : start + step]
            answer = await self._embed_rows(served, [texts[i] for i in chunk], trace)
            for row, i in enumerate(chunk):
                found[i] = {k: v[row : row + 1] for k, v in answer.items()}
                if settings.enable:
                    cache.put(name, version, settings, keys[i], found[i], generation)
        rows = [found[i] for i in range(len(texts))]
        vectors = np.stack([np.asarray(r[config.outputs[0].name][0], np.float32) for r in rows])
        counted = [r[TOKEN_COUNT] for r in rows if TOKEN_COUNT in r]
        return Embedded(vectors, int(sum(c.sum() for c in counted)))

    async def _embed_rows(
        self, served: ServedVersion, texts: list[bytes], trace: RequestTrace | None
    ) -> Arrays:
        """One request to the model, its phases in the trace when the request is traced."""
        config = served.config
        array = np.empty((len(texts), 1), dtype=object)  # text: [rows, 1]
        array[:, 0] = texts
        core = InferRequest(
            model=config.name,
            inputs={config.inputs[0].name: array},
            version=served.version,
            rows=len(texts),
            trace_id=trace.trace_id if trace is not None else "",
        )
        if trace is not None:
            trace.requests.append(core)
        return await self.app.executor.run(core, served)


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: np.ndarray  # [texts, dims] float32
    tokens: int  # that they were computed from, as the model's `token_count` output says


# An embedding model's optional output: the tokens each text was embedded from, [rows, 1].
# /v1/embeddings reports their sum as its usage (0 for a model without it).
TOKEN_COUNT = "token_count"


def requested_version(request: HttpRequest) -> int | None:
    """The version the request's `x-lockgate-model-version` header names (None: none)."""
    text = request.header(oa.MODEL_VERSION_HEADER)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 18 or int(text) < 1:
        shown = text[:40].decode("latin-1")
        raise BadRequest(f"header x-lockgate-model-version must be a version number, not {shown!r}")
    return int(text)


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
_ROUTES = frozenset({"models", "completions", "chat/completions", "embeddings"})


def _check_supported(body: oa.CompletionRequest | oa.ChatRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise BadRequest(f"'{name}' is not supported by lockgate; leave it out", param=name)
    body.check_options()


def _openai_reason(reason: str | None) -> str | None:
    return {"deadline": "length", "abort": "abort"}.get(reason, reason) if reason else None


def _usage(lasts: Mapping[int, RequestOutput | None], per_prompt: int = 1) -> dict[str, Any]:
    """Each prompt once (sequence i is of prompt i // per_prompt), and the tokens every
    sequence of the request generated (best_of's candidates not chosen too: they were
    computed)."""
    done = {i: last for i, last in lasts.items() if last is not None}
    if not done:
        return oa.usage(0, 0)
    generated = sum(last.num_output_tokens for last in done.values())
    prompts: dict[int, list[RequestOutput]] = {}
    for i, last in done.items():
        prompts.setdefault(i // per_prompt, []).append(last)
    prompt = sum(group[0].num_prompt_tokens for group in prompts.values())
    cached = sum(min(last.num_cached_tokens for last in group) for group in prompts.values())
    return oa.usage(prompt, generated, cached)


def _answer(
    kind: _Kind,
    service: LLMService,
    rid: str,
    chosen: list[Collected],
    usage: dict[str, Any],
    tools: oa.ToolUse | None = None,
    echoes: list[_Echo] | None = None,
    n: int = 1,
    prompt_top: int | None = None,
) -> dict[str, Any]:
    """The response of a completion answered whole: one choice per collected, in order (`n`
    per prompt); with `echoes`, each text and its logprobs begin with its prompt's; with
    `prompt_top`, each choice has its prompt's logprobs in vLLM's form (a chat, whose choices
    share one prompt: the response, as vLLM's)."""
    payloads = []
    for index, collected in enumerate(chosen):
        logprobs = None
        echo = echoes[index // n] if echoes is not None else None
        if echo is not None and echo.top is not None and collected.echo_logprobs is not None:
            logprobs = _joined(
                _echo_logprobs(service, echo, collected.echo_logprobs, echo.top),
                _legacy_logprobs(service, collected.logprobs, len(echo.text)),
            )
        elif collected.logprobs:
            logprobs = (_legacy_logprobs if kind.legacy else _chat_logprobs)(
                service, collected.logprobs
            )
        reason = _openai_reason(collected.finish_reason)
        text = collected.text
        if kind.legacy:
            payload = kind.response(rid, service.name, text, reason, logprobs, usage)
        else:
            payload = _chat_answer(rid, service.name, text, reason, logprobs, usage, tools)
        if prompt_top is not None and collected.prompt_logprobs is not None:
            prompt = _prompt_logprobs(service, collected.prompt_logprobs, prompt_top)
            (payload["choices"][0] if kind.legacy else payload)["prompt_logprobs"] = prompt
        payloads.append(_as_choice(payload, index))
    return {**payloads[0], "choices": [p["choices"][0] for p in payloads]}


@dataclass(frozen=True, slots=True)
class _Echo:
    """A prompt as `echo` returns it, before its completion."""

    text: str  # as the request gave it (token ids: decoded)
    token_ids: list[int]
    keep_output: bool  # False: max_tokens 0, the prompt alone
    top: int | None = None  # the most likely tokens its logprobs show (None: no logprobs)


def _echoed(collected: Collected, echo: _Echo) -> Collected:
    """A choice answered whole with its prompt in front: its text, and its logprobs (in
    `echo_logprobs`, the prompt's; the output's stay in `logprobs`), the output's dropped
    when it is the prompt alone."""
    output = collected.text if echo.keep_output else ""
    logprobs = collected.logprobs if echo.keep_output else []
    prompt = collected.prompt_logprobs
    return replace(collected, text=echo.text + output, logprobs=logprobs, echo_logprobs=prompt)


def _echo_logprobs(
    service: LLMService, echo: _Echo, entries: list[TokenLogprobs | None], top: int | None
) -> dict[str, Any]:
    """The legacy logprobs of a prompt's tokens, `top` alternatives each: the first has none
    (null), as in OpenAI's."""
    tokens = [_token_text(service, t) for t in echo.token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob if e is not None else None for e in entries],
        "top_logprobs": [_top_texts(service, e, top) if e is not None else None for e in entries],
        "text_offset": offsets,
    }


def _prompt_logprobs(
    service: LLMService, entries: list[TokenLogprobs | None], top: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own logprob, rank
    and text, and those of the `top` most likely tokens at its position, by token id."""
    found: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            found.append(None)
            continue
        one = {
            str(entry.token_id): _vllm_logprob(service, entry.token_id, entry.logprob, entry.rank)
        }
        ranked = zip(entry.top_token_ids[:top], entry.top_logprobs[:top], strict=True)
        for rank, (token, logprob) in enumerate(ranked, start=1):
            one.setdefault(str(token), _vllm_logprob(service, token, logprob, rank))
        found.append(one)
    return found


def _vllm_logprob(service: LLMService, token: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": _token_text(service, token)}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two runs of legacy logprobs, one after the other."""
    return {key: first[key] + then[key] for key in first}


def _chat_answer(
    rid: str,
    model: str,
    text: str,
    reason: str | None,
    logprobs: Any,
    usage: dict[str, Any],
    tools: oa.ToolUse | None,
) -> dict[str, Any]:
    """A chat response; offered tools, the output split into content and calls (an output
    with no valid call is all content; one held to calls and cut short ends in the call it
    was writing, as far as it got)."""
    if tools is None:
        return oa.chat_response(rid, model, text, reason, logprobs, usage)
    parsed = tool_calls.parse(text, tools, cut=reason == "length")
    if not parsed.calls:
        return oa.chat_response(rid, model, parsed.content, reason, logprobs, usage)
    reason = _tool_reason(reason, len(parsed.calls))
    content = parsed.content or None
    return oa.chat_response(rid, model, content, reason, logprobs, usage, parsed.calls)


def _tool_reason(reason: str | None, calls: int) -> str | None:
    """An output that made calls and stopped of itself finished with `tool_calls`."""
    return "tool_calls" if calls and reason == "stop" else reason


def _delta(parsed: tool_calls.Parsed, first_call: int) -> dict[str, Any]:
    """A chunk's delta of a piece of output offered tools: its content, and its calls whole,
    numbered from `first_call` (the calls of the choice's earlier chunks)."""
    if not parsed.calls:
        return {"content": parsed.content}
    delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
    delta["tool_calls"] = [{"index": first_call + i, **call} for i, call in enumerate(parsed.calls)]
    return delta


def _as_choice(payload: dict[str, Any], index: int) -> dict[str, Any]:
    """A response or chunk built for one choice, as choice `index` of the request's."""
    payload["choices"][0]["index"] = index
    return payload


def _token_text(service: LLMService, token_id: int) -> str:
    return service.tokenizer.decode([token_id], skip_special_tokens=False)


def _legacy_logprobs(service: LLMService, entries: list[Any], start: int = 0) -> dict[str, Any]:
    """`start`: where in the choice's text these tokens begin (a stream's earlier chunks)."""
    tokens = [_token_text(service, e.token_id) for e in entries]
    offsets, position = [], start
    for t in tokens:
        offsets.append(position)
        position += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_texts(service, e) for e in entries],
        "text_offset": offsets,
    }


def _top_texts(
    service: LLMService, entry: TokenLogprobs, top: int | None = None
) -> dict[str, float]:
    ranked = zip(entry.top_token_ids[:top], entry.top_logprobs[:top], strict=True)
    return {_token_text(service, t): lp for t, lp in ranked}


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


# the chunk of one output of a stream: (id, model, output, choice index, its first chunk);
# None: nothing to send (text held back by the tool-call parser)
Piece = Callable[[str, str, "RequestOutput", int, bool], dict[str, Any] | None]


def _completion_piece(
    service: LLMService,
    tools: oa.ToolUse | None,
    echoes: list[_Echo] | None = None,
    per_prompt: int = 1,
    prompt_top: int | None = None,
) -> Piece:
    """Each output's text; its logprobs' `text_offset` counts from the start of the choice's
    text, as in an answer sent whole. With `echoes`, a choice's first chunk begins with its
    prompt (choice i is of prompt i // per_prompt), and its logprobs with the prompt's; with
    `prompt_top`, a choice's first chunk carries its prompt's logprobs in vLLM's form."""
    sent: dict[int, int] = {}  # choice index -> characters of text in its earlier chunks

    def piece(rid: str, model: str, out: RequestOutput, index: int, first: bool) -> dict[str, Any]:
        text, start = out.text, sent.get(index, 0)
        echo = echoes[index // per_prompt] if echoes is not None and first else None
        if echo is not None and not echo.keep_output:
            text = ""
        logprobs = None
        if out.logprobs and (echo is None or echo.keep_output):
            logprobs = _legacy_logprobs(
                service, out.logprobs, start + len(echo.text if echo else "")
            )
        if echo is not None:
            if out.prompt_logprobs is not None and echo.top is not None:
                prompt = _echo_logprobs(service, echo, out.prompt_logprobs, echo.top)
                logprobs = _joined(prompt, logprobs) if logprobs else prompt
            text = echo.text + text
        sent[index] = start + len(text)
        reason = _openai_reason(out.finish_reason.value if out.finish_reason else None)
        chunk = oa.completion_chunk(rid, model, text, reason, logprobs)
        if prompt_top is not None and first and out.prompt_logprobs is not None:
            chunk["choices"][0]["prompt_logprobs"] = _prompt_logprobs(
                service, out.prompt_logprobs, prompt_top
            )
        return chunk

    return piece


def _chat_piece(service: LLMService, tools: oa.ToolUse | None, echo: str = "") -> Piece:
    """Each output's text as the delta's content, a choice's first beginning with `echo`;
    offered tools, split by one parser per choice into content and calls, each call sent
    whole when it closes."""
    parsers: dict[int, tool_calls.ToolCallParser] = {}

    def piece(
        rid: str, model: str, out: RequestOutput, index: int, first: bool
    ) -> dict[str, Any] | None:
        reason = _openai_reason(out.finish_reason.value if out.finish_reason else None)
        text = echo + out.text if first else out.text
        if tools is None:
            delta: dict[str, Any] = {"content": text}
        else:
            parser = parsers.get(index)
            if parser is None:
                parser = parsers[index] = tool_calls.ToolCallParser(tools)
            made = parser.made
            parsed = parser.feed(text)
            if out.finish_reason is not None:
                parsed.extend(parser.finish(cut=reason == "length"))
            delta = _delta(parsed, made)
            reason = _tool_reason(reason, parser.made)
            if delta == {"content": ""} and not (first or reason or out.logprobs):
                return None
        if first:
            delta["role"] = "assistant"
        logprobs = _chat_logprobs(service, out.logprobs) if out.logprobs else None
        return oa.chat_chunk(rid, model, delta, reason, logprobs)

    return piece


@dataclass(frozen=True, slots=True)
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str
    chunk_object: str
    legacy: bool  # logprobs in the completions format, else the chat format
    piece: Callable[[LLMService, oa.ToolUse | None], Piece]  # a stream's chunks
    response: Callable[..., dict[str, Any]]


COMPLETION = _Kind(
    TEXT_COMPLETION, "text_completion", True, _completion_piece, oa.completion_response
)
CHAT = _Kind(CHAT_COMPLETION, "chat.completion.chunk", False, _chat_piece, oa.chat_response)
