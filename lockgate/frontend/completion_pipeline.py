"""The completion pipeline: the steps of one completion on a language model, shared by every
route that asks for one (`/v1/completions` and `/v1/chat/completions` in
`frontend/openai_routes.py`, Triton's generate in `frontend/generate_routes.py`).

A route decodes its body into the OpenAI completion request it amounts to, then:

    tokenize  off the event loop, at most `tokenize_threads` at once (503 past the queue)
    prepare   context and sampling limits, the model's sampling defaults, the grammar of
              guided decoding or of a forced tool call (compiled), priority, cache key
    cached    a completion the response cache already holds, or None
    submit    admission by the engine; the outputs as they come (a `Generation`)
    collect   (answers sent whole) the outputs joined, per choice; with best_of, the best
    keep      cache a completion that finished

and encodes the answer in its own wire format: nothing here knows one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from lockgate.cache.completion import Completion, CompletionCache, CompletionKey
from lockgate.core.metrics import Counter
from lockgate.errors import BadRequest, Forbidden, ServingError, Unavailable
from lockgate.frontend.app import App
from lockgate.frontend.http import HttpRequest, cancel_on_disconnect
from lockgate.llm.guided import Grammar
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMService
from lockgate.protocol import openai as oa
from lockgate.protocol import tool_calls

if TYPE_CHECKING:
    from lockgate.llm.async_engine import RequestStream
    from lockgate.llm.engine import RequestOutput

# the cache namespaces of completions: of a text prompt (/v1/completions and generate share
# it: the same prompt and parameters give the same text), and of a chat
TEXT_COMPLETION = "cmpl"
CHAT_COMPLETION = "chatcmpl"
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


class Superseded(Unavailable):
    """The version a request resolved began draining before the request reached its engine
    (a reload swapped a new version in meanwhile): `CompletionPipeline.resubmitted` starts
    it over, once. Uncaught, a 503 like any draining engine's refusal."""

    def __init__(self, message: str, model: str) -> None:
        super().__init__(message, retry_after=1)
        self.model = model


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    """A completion checked and ready to submit."""

    service: LLMService
    prompt_ids: list[int]
    params: SamplingParams
    priority: int  # the engine's: 1 is the highest
    key: CompletionKey | None  # its response-cache key; None: not cached
    n: int = 1  # choices answered
    best_of: int = 1  # sequences generated (at least n): the n of highest cumulative logprob

    def candidates(self) -> list[SamplingParams]:
        """The sampling of each sequence: a seeded request's sequence i draws with seed + i
        (distinct, reproducible); with best_of > n each reports its logprobs, to be ranked."""
        params = self.params
        if self.best_of > self.n and params.logprobs is None:
            params = replace(params, logprobs=0)
        if self.best_of == 1 or params.seed is None:
            return [params] * self.best_of
        return [replace(params, seed=(params.seed + i) % 2**63) for i in range(self.best_of)]


@dataclass(slots=True)
class Collected:
    """The outputs of a completion answered whole, joined."""

    text: str
    logprobs: list[Any]  # one entry per generated token, when logprobs were asked
    last: RequestOutput | None  # None: no output at all
    prompt_logprobs: list[Any] | None = None  # one per prompt token, when they were asked
    echo_logprobs: list[Any] | None = None  # the prompt's in front of `logprobs` (echo)

    @property
    def finish_reason(self) -> str | None:
        last = self.last
        return last.finish_reason.value if last and last.finish_reason else None

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


class Generation:
    """The outputs of one submitted completion, as the engine makes them: an async iterator,
    and an async context manager that aborts the request (freeing its KV blocks) on exit.
    A traced request's trace gets the engine's timings of it."""

    __slots__ = ("outputs", "request")

    def __init__(self, outputs: RequestStream, request: HttpRequest) -> None:
        self.outputs = outputs
        self.request = request

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.outputs.__anext__()
        traced = self.request.trace
        if traced is not None and traced.timings is None:
            traced.timings = out.timings  # the engine's own record, filled in as it goes
        return out

    def index(self, out: RequestOutput) -> int:
        """The choice an output belongs to (0 to best_of - 1)."""
        return self.outputs.index(out.request_id)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.outputs.__aexit__(*exc_info)


@dataclass(slots=True)
class CompletionPipeline:
    app: App
    completions: CompletionCache = field(init=False)
    rejected: Counter = field(init=False)  # refusals by the engine's admission
    tokenizers: asyncio.Semaphore = field(init=False)
    tokenizing: int = 0  # prompts being tokenized or waiting to be

    def __post_init__(self) -> None:
        self.tokenizers = asyncio.Semaphore(self.limits.tokenize_threads)
        self.completions = CompletionCache(self.app.cache)
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

    # -- tokenize ----------------------------------------------------------------------
    async def tokenize(self, service: LLMService, prompt: oa.Prompt) -> list[int]:
        """The token ids of a prompt: a string, or token ids (checked against the vocabulary)."""
        return await self._off_loop(self._prompt_ids, service, prompt)

    async def tokenize_all(
        self, service: LLMService, prompts: list[oa.Prompt], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """The token ids of a batch's prompts, tokenized one after the other in one turn of a
        tokenizer thread (a batch takes one place among those waiting); special tokens (BOS)
        added to a text prompt unless not `add_special_tokens`."""
        return await self._off_loop(
            lambda: [self._prompt_ids(service, prompt, add_special_tokens) for prompt in prompts]
        )

    async def tokenize_text(
        self, service: LLMService, text: str, add_special_tokens: bool = True
    ) -> list[int]:
        """A text's token ids (/tokenize: special tokens added or not)."""
        check_length(service, len(text), self.limits.max_prompt_chars)
        return await self._off_loop(service.tokenizer.encode, text, add_special_tokens)

    async def tokenize_chat(
        self,
        service: LLMService,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        generation_prompt: bool = True,
        continue_final: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of chat messages ({"role", "content", ...}) through the model's chat
        template, with the assistant's turn opened (unless not `generation_prompt`), or the
        final message left open (`continue_final`); `tools` for a template that takes them,
        `template_kwargs` as more variables of the template (vLLM's chat_template_kwargs)."""
        chars = sum(len(m["content"] or "") for m in messages)
        if tools is not None:
            chars += len(msgspec.json.encode(tools))
        if template_kwargs:
            chars += len(msgspec.json.encode(template_kwargs))
        most = self.limits.max_prompt_chars
        check_length(service, chars, most)
        render = _ChatRender(generation_prompt, continue_final, template_kwargs)
        return await self._off_loop(_chat_ids, service, messages, tools, most, render)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
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

    def _prompt_ids(
        self, service: LLMService, prompt: oa.Prompt, add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            check_length(service, len(prompt), self.limits.max_prompt_chars)
            return service.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        bad = [t for t in prompt if not 0 <= t < service.vocab_size]
        if bad:
            raise BadRequest(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{service.vocab_size - 1})"
            )
        return list(prompt)

    # -- prepare -----------------------------------------------------------------------
    def prepare(
        self,
        request: HttpRequest,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        default_max: int | None,
        logprobs: int | None,
        namespace: str,
        tools: oa.ToolUse | None = None,
        prompt_logprobs: int | None = None,
        granted: bool | None = None,
    ) -> PreparedCompletion:
        """Check a completion against the model's context and the server's limits (400),
        and its priority against the client's key (403). `default_max` is the max_tokens of
        a request without one (None: the rest of the context); `namespace` is the cache's
        (TEXT_COMPLETION or CHAT_COMPLETION); `tools`, a chat's tools offered;
        `prompt_logprobs`, the top tokens to report at each prompt token (None: none);
        `granted`, whether the client may raise its priority when its transport has decided
        it (None: by the request's bearer key)."""
        best_of = body.best_of if isinstance(body, oa.CompletionRequest) else None
        sequences = self.limits.sequences(body.n, best_of, body.stream)
        params = self.sampling(
            service, body, len(prompt_ids), max_tokens, default_max, logprobs, tools
        )
        if prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=prompt_logprobs)
        priority = self.priority(request, service, body.priority, granted)
        key = self.cache_key(service, namespace, prompt_ids, params) if sequences == 1 else None
        if request.trace is not None and not request.trace.bound:  # /v2 routes know it
            request.trace.bind(service.name, service.config.name)
        return PreparedCompletion(
            service, prompt_ids, params, priority, key, n=body.n, best_of=sequences
        )

    def sampling(
        self,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        prompt_len: int,
        max_tokens: int | None,
        default_max: int | None,
        logprobs: int | None,
        tools: oa.ToolUse | None = None,
    ) -> SamplingParams:
        limit = service.engine_config.max_model_len
        if prompt_len >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_len} tokens. Please reduce the length of the prompt."
            )
        if max_tokens is None:
            max_tokens = default_max or (limit - prompt_len)
        if max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        if prompt_len + max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                "the completion). Please reduce the length of the prompt or max_tokens."
            )
        stop = self.limits.stop_strings(body.stop)
        self.limits.check_stop_token_ids(body.stop_token_ids, service.vocab_size)
        bad_words = bad_words_token_ids(service, self.limits.bad_words(body.bad_words))
        return SamplingParams(
            **service.generation.fill(
                body.temperature, body.top_p, body.top_k, body.min_p, body.repetition_penalty
            ),
            seed=_seed(body.seed),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
            logit_bias=_logit_bias(
                self.limits.logit_bias(body.logit_bias),
                service.vocab_size,
                self.limits.max_logit_bias,
            ),
            allowed_token_ids=allowed_token_ids(body.allowed_token_ids, service.vocab_size),
            bad_words_token_ids=bad_words,
            grammar=self.grammar(service, body, tools),
            cache_salt=self.limits.cache_salt(body.cache_salt),
        )

    def grammar(
        self,
        service: LLMService,
        body: oa.CompletionRequest | oa.ChatRequest,
        tools: oa.ToolUse | None = None,
    ) -> Grammar | None:
        """The grammar a request holds its output to (response_format or vLLM's guided_*
        fields, or the calls of a forced tool_choice), compiled for the model before
        admission: 400 naming what is wrong. The tools of tool_choice "auto" are compiled
        too, to check their schemas, but leave the output free."""
        constraint = body.output_constraint(self.limits)
        if tools is not None:
            if tools.forced and constraint is not None:
                raise BadRequest(
                    f"tool_choice {tools.choice_text} holds the output to tool calls: leave "
                    f"{constraint.field.partition('.')[0]} out, or use tool_choice 'auto'"
                )
            if tools.forced or service.tokenizer.grammars.problem is None:
                calls = self.tool_grammar(service, tools)
                if tools.forced:
                    return calls
        if constraint is None:
            return None
        return service.tokenizer.grammars.compile(
            constraint.kind,
            constraint.source,
            strict=constraint.strict,
            where=constraint.field,
            mask_budget=self.limits.max_grammar_mask_ms / 1000,
        )

    def tool_grammar(self, service: LLMService, tools: oa.ToolUse) -> Grammar:
        """The grammar of the calls `tools` allows, compiled; a schema llguidance refuses is a
        400 naming its tool (each tool is compiled alone to find it)."""
        compiler = service.tokenizer.grammars
        budget = self.limits.max_grammar_mask_ms / 1000
        functions = tools.callable if tools.forced else tools.tools
        source = tool_calls.grammar(functions, tools.most_calls)
        try:
            return compiler.compile("lark", source, where="tools", mask_budget=budget)
        except BadRequest:
            for index, function in enumerate(tools.tools):
                compiler.compile(
                    "json_schema",
                    _encode(tool_calls.call_schema(function)).decode(),
                    strict=function.strict is True,
                    where=f"tools[{index}].function.parameters",
                )
            raise

    def priority(
        self, request: HttpRequest, service: LLMService, asked: int, granted: bool | None = None
    ) -> int:
        """The engine priority of a request that asked `asked` (0: the model's default);
        `granted` as `prepare` takes it."""
        if asked < 0:
            raise BadRequest("priority must be a non-negative integer (1 is the highest)")
        levels = max(1, service.config.batcher.priority_levels)
        default = service.config.batcher.default_priority_level or levels
        priority = min(asked or default, levels)
        if granted is None:
            granted = self.app.priority_granted(request.bearer())
        if priority < default and not granted:
            raise Forbidden(
                f"priority {priority} is above the model's default ({default}): "
                "it needs a key that grants it"
            )
        return priority

    def cache_key(
        self, service: LLMService, namespace: str, prompt_ids: list[int], params: SamplingParams
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
            service.name, version, settings, namespace, prompt_ids, repr(params)
        )

    # -- run ---------------------------------------------------------------------------
    async def cached(self, prepared: PreparedCompletion) -> Completion | None:
        """The completion the response cache holds for it, or None."""
        if prepared.key is None:
            return None
        return await self.completions.get(prepared.key)

    def submit(
        self,
        request: HttpRequest,
        batch: list[PreparedCompletion],
        rid: str,
        at: float | None = None,
    ) -> Generation:
        """Hand the completions of a batch (one per prompt; one alone but for a batch of
        prompts) to the engine, whose admission refuses them all or none here (429, 503). The
        outputs' indexes run over the prompts in order, each prompt's `best_of` sequences in
        turn. The deadline is `at` (time.monotonic()) when given, else the Request-Timeout
        header's."""
        if self.app.draining:
            raise Unavailable("server is shutting down", retry_after=1)
        service = batch[0].service
        prompts: list[list[int]] = []
        candidates: list[SamplingParams] = []
        for prepared in batch:
            mine = prepared.candidates()
            candidates += mine
            prompts += [prepared.prompt_ids] * len(mine)
        ids: list[str | None] = (
            [rid] if len(candidates) == 1 else [f"{rid}-{i}" for i in range(len(candidates))]
        )
        try:
            outputs = service.engine.generate_choices(
                prompts,
                candidates,
                ids,
                at if at is not None else deadline(request),
                batch[0].priority,
            )
        except ServingError as exc:
            if service.engine.draining and self.superseded(service):
                raise Superseded(str(exc), service.name) from exc
            self.rejected.inc((service.name, exc.kind))
            raise
        return Generation(outputs, request)

    async def resubmitted(self, attempt: Callable[[], Awaitable[None]]) -> None:
        """Run a route's `attempt` (resolve the model, tokenize, submit, answer), and once more
        when a reload superseded the version it resolved before it submitted (nothing was sent
        then). Superseded twice: counted as a refusal, and answered 503."""
        try:
            await attempt()
        except Superseded:
            try:
                await attempt()
            except Superseded as exc:
                self.rejected.inc((exc.model, exc.kind))
                raise

    def superseded(self, service: LLMService) -> bool:
        """Whether another version of its model now serves under its name."""
        serving = self.app.models.services()
        current = (s for s in serving if isinstance(s, LLMService) and s.name == service.name)
        return any(s is not service for s in current)

    async def collect(self, request: HttpRequest, outputs: Generation) -> Collected:
        """Every output of a completion of one choice answered whole."""
        return (await self.collect_choices(request, outputs, 1))[0]

    async def collect_choices(
        self, request: HttpRequest, outputs: Generation, sequences: int
    ) -> list[Collected]:
        """Every output of a completion answered whole, joined per sequence (in order); the
        request ends, all its sequences with it, if its client leaves."""
        texts: list[list[str]] = [[] for _ in range(sequences)]
        joined = [Collected("", [], None) for _ in range(sequences)]
        async with cancel_on_disconnect(request), outputs:
            async for out in outputs:
                index = outputs.index(out)
                texts[index].append(out.text)
                if out.logprobs:
                    joined[index].logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    joined[index].prompt_logprobs = out.prompt_logprobs
                joined[index].last = out
        for collected, pieces in zip(joined, texts, strict=True):
            collected.text = "".join(pieces)
        return joined

    @staticmethod
    def choose(prepared: PreparedCompletion, candidates: list[Collected]) -> list[Collected]:
        """The n choices to answer: with best_of > n, the n candidates of highest cumulative
        logprob, best first, their logprobs dropped unless asked for."""
        if prepared.best_of <= prepared.n:
            return candidates
        best = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)
        chosen = best[: prepared.n]
        if prepared.params.logprobs is None:
            chosen = [replace(c, logprobs=[]) for c in chosen]
        return chosen

    def keep(self, prepared: PreparedCompletion, text: str, last: RequestOutput | None) -> None:
        """Cache a completion that finished (not one cut short), when it has a key."""
        key = prepared.key
        if key is not None and last is not None and last.finish_reason is not None:
            completion = Completion(
                text, last.finish_reason.value, last.num_prompt_tokens, last.num_output_tokens
            )
            self.completions.put(key, completion)


def truncated(service: LLMService, prompt_ids: list[int], keep: int | None) -> list[int]:
    """A prompt's last `keep` token ids (vLLM's truncate_prompt_tokens; -1: the model's context
    of them; None: the prompt whole)."""
    if keep is None:
        return prompt_ids
    context = service.engine_config.max_model_len
    if keep == -1:
        keep = context
    if not 1 <= keep <= context:
        raise BadRequest(
            f"truncate_prompt_tokens must be -1 or between 1 and the model's context of "
            f"{context} tokens, got {keep}",
            param="truncate_prompt_tokens",
        )
    return prompt_ids[-keep:]


def check_message_count(service: LLMService, count: int) -> None:
    """A chat template gives each message at least a token of its own (its role's header):
    more messages than the context has tokens cannot fit, and are refused before any is
    rendered (half a million empty messages rendered and tokenized for seconds)."""
    context = service.engine_config.max_model_len
    if count > context:
        raise BadRequest(
            f"messages has {count} entries, more than the model's context of {context} tokens"
        )


def check_length(service: LLMService, chars: int, most: int) -> None:
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


def deadline(request: HttpRequest) -> float | None:
    """The deadline a Request-Timeout header sets, from the request's first byte; 400 when
    malformed."""
    header = request.header(b"request-timeout")
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        raise BadRequest("Request-Timeout header must be a number of seconds") from None
    if not 0 < seconds < 1e7:
        raise BadRequest("Request-Timeout header must be a positive number of seconds")
    return request.received + seconds


@dataclass(frozen=True, slots=True)
class _ChatRender:
    """How chat messages are rendered through the template."""

    generation_prompt: bool  # the assistant's turn opened after the messages
    continue_final: bool  # the prompt ends inside the final message
    template_kwargs: dict[str, Any] | None  # more variables of the template


def _chat_ids(
    service: LLMService,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    most: int,
    render: _ChatRender,
) -> list[int]:
    """The prompt's ids; its rendered text (the template's own text with the contents) is
    held to `check_length` before it is encoded."""

    def rendered(chars: int) -> None:
        check_length(service, chars, most)

    try:
        return service.tokenizer.encode_chat(
            messages,
            add_generation_prompt=render.generation_prompt,
            tools=tools,
            check_chars=rendered,
            continue_final_message=render.continue_final,
            template_kwargs=render.template_kwargs,
        )
    except ServingError:
        raise
    except Exception as exc:
        raise BadRequest(f"chat template failed: {exc}") from None


def _seed(seed: int | None) -> int | None:
    """A request's seed, any 64-bit integer as OpenAI's and vLLM's take (negative ones too),
    as the engine's (in [0, 2**63))."""
    if seed is None:
        return None
    if not -(2**63) <= seed < 2**63:
        raise BadRequest(f"seed must be a 64-bit integer, got {seed}", param="seed")
    return seed % 2**63


def allowed_token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...] | None:
    """vLLM's allowed_token_ids, checked: a non-empty list of token ids of the model."""
    if ids is None:
        return None
    if not ids:
        raise BadRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"allowed_token_ids: {bad[0]} is not a token id of the model (0..{vocab_size - 1})",
            param="allowed_token_ids",
        )
    return tuple(ids)


def bad_words_token_ids(service: LLMService, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as the token sequences it blocks: each word as written (leading
    whitespace dropped), and with a space in front when that tokenizes to as many tokens,
    the first another (the word in the middle of a text)."""
    found: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(service.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(service.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            found.append(spaced)
    return tuple(found)


def _logit_bias(
    bias: dict[str, float], vocab_size: int, most: int
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
