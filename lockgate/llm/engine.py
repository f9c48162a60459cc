"""The step loop: schedule, run the model, append tokens, stop, free.

With speculative decoding on, a decode step appends the drafts the target model sampled too and
the token after them (`llm/speculative.py`), one at a time, so EOS, stop tokens, stop strings,
max_tokens and max_model_len end a sequence where they would without speculation.

`LLMEngine` is synchronous; `lockgate/llm/async_engine.py` steps it on its own thread and
streams each request's tokens to asyncio consumers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from lockgate.errors import ConfigError
from lockgate.llm.attention import KVCache
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.metrics import EngineStats, RequestObserver, RequestTimings, StepCounters
from lockgate.llm.runner import CausalLM, ModelRunner, RunnerOutput
from lockgate.llm.sampling import Sampler, SamplerOutput
from lockgate.llm.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence, TokenLogprobs
from lockgate.llm.speculative import SpeculationStats, num_accepted


class TextDecoder(Protocol):
    """Turns one request's tokens into text incrementally."""

    def add(self, token_id: int) -> str: ...  # the new text this token completes

    def flush(self) -> str: ...  # text held back until the end of the stream


# (prompt token ids, whether special tokens' text is left out) -> decoder
DecoderFactory = Callable[[list[int], bool], TextDecoder]


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
    # the first output of a sequence that asked for its prompt's logprobs: one per prompt
    # token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None


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
        self.speculation = SpeculationStats()  # drafts verified and accepted
        self.observer: RequestObserver | None = None  # told of tokens and finishes
        self._decoders: dict[str, TextDecoder] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._busy_until: float | None = None  # end of the last step, if it left work

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
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            blocked = tuple(sorted({*params.stop_token_ids, *eos}))
            params = replace(params, min_tokens_blocked=blocked)
        seq = Sequence.from_prompt(request_id, prompt_token_ids, params, now, deadline, priority)
        with self._lock:
            self.scheduler.add(seq, now)
            if self.decoder_factory is not None:
                skip = params.skip_special_tokens
                self._decoders[request_id] = self.decoder_factory(list(prompt_token_ids), skip)
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
            outputs = self._postprocess(out, result)
        self._record_step(out, result, t0)
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
                prefill_rate=self.scheduler.steps.prefill.rate,
                decode_step_time=self.scheduler.steps.decode.seconds(len(self.scheduler.running)),
                spec_draft_tokens=self.speculation.num_draft_tokens,
                spec_accepted_tokens=self.speculation.num_accepted_tokens,
            )

    def check_invariants(self) -> None:
        """Raise InvariantError unless the KV allocator agrees with the live sequences."""
        with self._lock:
            self.block_manager.check_invariants(self.scheduler.sequences.values())

    def _postprocess(
        self, out: SchedulerOutput, result: RunnerOutput | None
    ) -> list[RequestOutput]:
        now = time.monotonic()
        sampled = result.sampled if result is not None else SamplerOutput([], [])
        if result is not None and result.prompt_logprobs:
            for s, entries in zip(out.scheduled, result.prompt_logprobs, strict=True):
                if entries:
                    s.seq.record_prompt_logprobs(entries)
        self.scheduler.update(out)
        outputs = []
        for seq in [*out.expired, *self.scheduler.take_shed()]:
            self._record_finished(seq, now)
            outputs.append(self._output(seq, [], "", None))
        rows = [s for s in out.scheduled if s.needs_logits]
        parts = sampled.split([s.num_logits for s in rows])
        for s, part in zip(rows, parts, strict=True):
            if not s.seq.is_finished:  # else aborted while the step ran
                outputs.append(self._append_sampled(s, part, now))
        return outputs

    def _append_sampled(
        self, s: ScheduledSequence, sampled: SamplerOutput, now: float
    ) -> RequestOutput:
        """Append the sampled token, or the accepted drafts and the token after them, up to
        the first that finishes the sequence."""
        seq, drafts = s.seq, s.draft_token_ids
        accepted = num_accepted(drafts, sampled.token_ids)
        tokens: list[int] = []
        for token in sampled.token_ids[: accepted + 1]:
            tokens.append(token)
            self._append_token(seq, token, now)
            if seq.is_finished:
                break
        if drafts:
            self.speculation.record(len(drafts), accepted)
            if not seq.is_finished:
                self.scheduler.accept_drafts(seq, accepted)
        self.counters.generation_tokens += len(tokens)
        lps = [lp for lp in sampled.logprobs[: len(tokens)] if lp is not None]
        output = self._output(seq, tokens, self._emit_text(seq), lps or None)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(tokens):
            output.prompt_logprobs = seq.prompt_logprobs or [None]  # with the first output
        return output

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.append_token(token)
        seq.timings.record_token(now)
        if seq.timings.num_generation_tokens == 1:
            self.scheduler.admission.observe_first_token(seq.timings, now)
        if self.observer is not None:
            self.observer.token(seq.timings)
        old_len = len(seq.output_text)
        decoder = self._decoders.get(seq.seq_id)
        if decoder is not None:
            seq.output_text += decoder.add(token)
        stops = bool(seq.params.stop) and seq.num_output_tokens >= seq.params.min_tokens
        hit_stop_string = stops and self._cut_at_stop_string(seq, old_len)
        reason = FinishReason.STOP if hit_stop_string else self._stop_reason(seq, token)
        if reason is not None:
            if decoder is not None and not hit_stop_string:
                seq.output_text += decoder.flush()
            self.scheduler.finish(seq, reason)
            self._record_finished(seq, now)

    def _cut_at_stop_string(self, seq: Sequence, old_len: int) -> bool:
        """If a stop string appears in the text added since `old_len`, cut the output text
        before it (after it with `include_stop_str_in_output`) and return True."""
        window = max(0, old_len - max(len(s) for s in seq.params.stop) + 1)
        hits = [(i, s) for s in seq.params.stop if (i := seq.output_text.find(s, window)) >= 0]
        if hits:
            at, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            keep = len(stop) if seq.params.include_stop_str_in_output else 0
            seq.output_text = seq.output_text[: at + keep]
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
        if (reason := seq.grammar_finish) is not None:
            return reason
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
        if self.observer is not None:
            self.observer.finished(seq.timings)

    def _record_step(
        self, out: SchedulerOutput, result: RunnerOutput | None, started: float
    ) -> None:
        end = time.perf_counter()
        total = end - started
        # admission's step times run from the end of the last step that left work: the gap
        # (delivering outputs, waiting for the GIL) delays first tokens as the step does
        busy = end - (started if self._busy_until is None else self._busy_until)
        self._busy_until = end if self.has_unfinished else None
        prompt = sum(
            max(0, min(s.start + s.num_tokens, s.seq.num_prompt_tokens) - s.start)
            for s in out.scheduled
        )
        with self._lock:
            steps = self.scheduler.steps
            steps.observe(out.num_prefill_tokens, out.num_decodes, busy, time.monotonic())
            c = self.counters
            c.num_steps += 1
            c.step_time += total
            c.prompt_tokens += prompt
            if result is not None:
                c.forward_time += result.forward_time
                c.prepare_time += result.prepare_time
                c.sample_time += result.sample_time
