"""The step loop: schedule, run the model, append tokens, stop, free.

`LLMEngine` is the synchronous core; `AsyncLLMEngine` steps it on its own thread and streams
each request's tokens to asyncio consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from lockgate.errors import BackendError, ConfigError, ServingError, Unavailable
from lockgate.llm.attention import KVCache
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.metrics import EngineStats, FinishedLog, RequestTimings, StepCounters
from lockgate.llm.runner import CausalLM, ModelRunner, RunnerOutput
from lockgate.llm.sampling import Sampler, SamplerOutput, TokenLogprobs
from lockgate.llm.scheduler import Scheduler, SchedulerOutput
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence


class TextDecoder(Protocol):
    """Turns one request's tokens into text incrementally."""

    def add(self, token_id: int) -> str: ...  # the new text this token completes

    def flush(self) -> str: ...  # text held back until the end of the stream


DecoderFactory = Callable[[list[int]], TextDecoder]  # prompt token ids -> decoder


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the last output; "" without a decoder
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    timings: RequestTimings


class LLMEngine:
    """Continuous-batching generation over a paged KV cache (not thread-safe except
    `add_request`, `abort` and `stats`, which may be called while another thread steps)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCache,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        decoder_factory: DecoderFactory | None = None,
        seed: int | None = None,
    ) -> None:
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        if block_size != config.block_size:
            raise ConfigError(
                "EngineConfig", "block_size", f"the KV cache's blocks hold {block_size} tokens"
            )
        if num_blocks * block_size < config.max_model_len:
            raise ConfigError(
                "EngineConfig",
                "max_model_len",
                f"{config.max_model_len} tokens do not fit in {num_blocks} KV blocks",
            )
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decoder_factory = decoder_factory
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model, kv_caches, block_size, Sampler(seed))
        self.counters = StepCounters()
        self.finished_log = FinishedLog()
        self._decoders: dict[str, TextDecoder] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        deadline: float | None = None,
        priority: int = 1,
    ) -> str:
        """Queue a request; raises Unavailable (503: its first token would come too late),
        QueueFull (429) or BadRequest (400). Returns its id."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        now = time.monotonic()
        seq = Sequence.from_prompt(request_id, prompt_token_ids, params, now, deadline, priority)
        with self._lock:
            self.scheduler.add(seq, now)
            if self.decoder_factory is not None:
                self._decoders[request_id] = self.decoder_factory(list(prompt_token_ids))
        return request_id

    def abort(self, request_id: str) -> bool:
        """Finish a request at once and free its KV blocks; False if unknown or done."""
        with self._lock:
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                self._record_finished(seq, time.monotonic())
        return seq is not None

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the outputs of every request it advanced."""
        t0 = time.perf_counter()
        with self._lock:
            out = self.scheduler.schedule(time.monotonic())
        result = self.runner.run(out) if out.scheduled else None
        with self._lock:
            outputs = self._postprocess(out, result.sampled if result else SamplerOutput([], []))
        self._record_step(out, result, time.perf_counter() - t0)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline: run the prompts to completion; returns each one's output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for o in self.step():
                tokens[o.request_id] += o.new_token_ids
        return [tokens[i] for i in ids]

    def stats(self) -> EngineStats:
        with self._lock:
            bm, c = self.block_manager, self.counters
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_usage=bm.usage,
                num_free_blocks=bm.num_free_blocks,
                num_total_blocks=bm.num_total_blocks,
                prefix_cache_queries=bm.prefix_cache_queries,
                prefix_cache_hits=bm.prefix_cache_hits,
                num_preemptions=self.scheduler.num_preemptions,
                finished_by_reason=dict(c.finished_by_reason),
                prompt_tokens=c.prompt_tokens,
                generation_tokens=c.generation_tokens,
                num_steps=c.num_steps,
                step_time=c.step_time,
                forward_time=c.forward_time,
                prepare_time=c.prepare_time,
                sample_time=c.sample_time,
            )

    def check_invariants(self) -> None:
        """Raise InvariantError unless the KV allocator agrees with the live sequences."""
        with self._lock:
            self.block_manager.check_invariants(self.scheduler.sequences.values())

    def _postprocess(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        self.scheduler.update(out)
        outputs = []
        for seq in [*out.expired, *self.scheduler.take_shed()]:
            self._record_finished(seq, now)
            outputs.append(self._output(seq, [], "", None))
        rows = [s.seq for s in out.scheduled if s.needs_logits]
        for seq, token, lp in zip(rows, sampled.token_ids, sampled.logprobs, strict=True):
            if not seq.is_finished:  # else aborted while the step ran
                outputs.append(self._append_token(seq, token, lp, now))
        return outputs

    def _append_token(
        self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        seq.append_token(token)
        seq.timings.record_token(now)
        old_len = len(seq.output_text)
        decoder = self._decoders.get(seq.seq_id)
        if decoder is not None:
            seq.output_text += decoder.add(token)
        hit_stop_string = bool(seq.params.stop) and self._cut_at_stop_string(seq, old_len)
        reason = FinishReason.STOP if hit_stop_string else self._stop_reason(seq, token)
        if reason is not None:
            if decoder is not None and not hit_stop_string:
                seq.output_text += decoder.flush()
            self.scheduler.finish(seq, reason)
            self._record_finished(seq, now)
        return self._output(seq, [token], self._emit_text(seq), None if lp is None else [lp])

    def _cut_at_stop_string(self, seq: Sequence, old_len: int) -> bool:
        """If a stop string appears in the text added since `old_len`, cut the output text
        before it (the stop string is not returned) and return True."""
        window = max(0, old_len - max(len(s) for s in seq.params.stop) + 1)
        hits = [i for s in seq.params.stop if (i := seq.output_text.find(s, window)) >= 0]
        if hits:
            seq.output_text = seq.output_text[: min(hits)]
        return bool(hits)

    def _emit_text(self, seq: Sequence) -> str:
        """New text for the client, holding back a tail that may begin a stop string."""
        end = len(seq.output_text)
        if seq.params.stop and not seq.is_finished:
            end -= max(len(s) for s in seq.params.stop) - 1
        if end <= seq.num_emitted_chars:
            return ""
        text = seq.output_text[seq.num_emitted_chars : end]
        seq.num_emitted_chars = end
        return text

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(
        self, seq: Sequence, tokens: list[int], text: str, lps: list[TokenLogprobs] | None
    ) -> RequestOutput:
        return RequestOutput(
            seq.seq_id, tokens, text, seq.is_finished, seq.finish_reason, lps,
            seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens, seq.timings,
        )  # fmt: skip

    def _record_finished(self, seq: Sequence, now: float) -> None:
        self._decoders.pop(seq.seq_id, None)
        reason = seq.finish_reason.value if seq.finish_reason else "unknown"
        seq.timings.finished, seq.timings.finish_reason = now, reason
        seq.timings.num_cached_tokens = seq.num_cached_tokens
        self.counters.finished_by_reason[reason] += 1
        self.finished_log.push(seq.timings)

    def _record_step(self, out: SchedulerOutput, result: RunnerOutput | None, total: float) -> None:
        prompt = sum(
            max(0, min(s.start + s.num_tokens, s.seq.num_prompt_tokens) - s.start)
            for s in out.scheduled
        )
        with self._lock:
            self.scheduler.admission.prefill.observe(prompt, total, time.monotonic())  # type: ignore[union-attr]
            c = self.counters
            c.num_steps += 1
            c.step_time += total
            c.prompt_tokens += prompt
            if result is not None:
                c.generation_tokens += len(result.sampled.token_ids)
                c.forward_time += result.forward_time
                c.prepare_time += result.prepare_time
                c.sample_time += result.sample_time


@dataclass(slots=True)
class _Delivery:
    stream: RequestStream
    item: RequestOutput | ServingError


class RequestStream:
    """The outputs of one request as an async iterator. Closing it (or cancelling the task
    that awaits it) aborts the request and frees its KV blocks."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | ServingError] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer went away
            self._abort()
            raise
        if isinstance(item, ServingError):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._abort()

    def put(self, item: RequestOutput | ServingError) -> None:
        self._queue.put_nowait(item)

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        if not self._done:
            self._engine.abort_later(self.request_id)


class AsyncLLMEngine:
    """Steps an `LLMEngine` on a dedicated thread that sleeps while there is no work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # weak: a stream dropped by its consumer is collected, and its finalizer aborts
        self._streams: dict[str, weakref.ref[RequestStream]] = {}
        self._pending_aborts: list[str] = []
        self._wakeup = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="lockgate-llm-engine", daemon=True)
        self._thread.start()

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        deadline: float | None = None,
        priority: int = 1,
    ) -> RequestStream:
        """Submit now (refusals raise here) and stream the outputs."""
        if self._closing:
            raise Unavailable("the LLM engine is shutting down")
        loop = asyncio.get_running_loop()
        with self._wakeup:
            request_id = self.engine.add_request(
                prompt_token_ids, params, request_id, deadline, priority
            )
            stream = RequestStream(self, request_id, loop)
            self._streams[request_id] = weakref.ref(stream)
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def abort_later(self, request_id: str) -> None:
        """Abort from a context that must not block (a finalizer); done on the engine thread."""
        self._pending_aborts.append(request_id)  # list.append is atomic

    def close(self) -> None:
        """Stop the engine thread; streams still open get Unavailable."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()
        self._fail_all(Unavailable("the LLM engine shut down"))

    def _loop(self) -> None:
        while self._wait_for_work():
            while self._pending_aborts:
                self.abort(self._pending_aborts.pop())
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the model raised: fail what was in flight, keep serving
                self._fail_all(BackendError(f"LLM engine step failed: {exc!r}"))
                continue
            self._deliver(outputs)

    def _wait_for_work(self) -> bool:
        with self._wakeup:
            while not (self._closing or self.engine.has_unfinished or self._pending_aborts):
                self._wakeup.wait()
            return not self._closing

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliveries, orphans = [], []
        with self._wakeup:
            for o in outputs:
                ref = (
                    self._streams.pop(o.request_id, None)
                    if o.finished
                    else self._streams.get(o.request_id)
                )
                stream = ref() if ref is not None else None
                if stream is not None:
                    item: RequestOutput | ServingError = o
                    if o.finish_reason is FinishReason.SHED:
                        item = Unavailable("shed for a request of higher priority", retry_after=1)
                    deliveries.append(_Delivery(stream, item))
                elif ref is not None:  # the consumer dropped its stream
                    orphans.append(o.request_id)
        for request_id in orphans:
            self.abort(request_id)
        _send(deliveries)

    def _fail_all(self, error: ServingError) -> None:
        with self._wakeup:
            refs, self._streams = list(self._streams.items()), {}
        for request_id, _ in refs:
            self.engine.abort(request_id)
        _send([_Delivery(stream, error) for _, ref in refs if (stream := ref()) is not None])


def _send(deliveries: list[_Delivery]) -> None:
    """Hand items to their streams: one call into each consumer loop."""
    by_loop: defaultdict[asyncio.AbstractEventLoop, list[_Delivery]] = defaultdict(list)
    for d in deliveries:
        by_loop[d.stream.loop].append(d)
    for loop, batch in by_loop.items():
        _call_soon(loop, batch)


def _call_soon(loop: asyncio.AbstractEventLoop, batch: list[_Delivery]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
        loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[_Delivery]) -> None:
    for d in batch:
        d.stream.put(d.item)
