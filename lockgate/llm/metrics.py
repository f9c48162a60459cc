"""Engine-side statistics as plain counters and per-request timings.

The engine records; exporters (Prometheus, logs, benchmarks) read `EngineStats` snapshots, and
a `RequestObserver` is told of each request's events as they happen. Nothing here knows about
HTTP. All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class RequestTimings:
    """The life of one request: queue time, TTFT and the gaps between tokens (ITL)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    predicted_ttft: float | None = None  # admission's prediction when it was queued
    modelled_ttft: float | None = None  # of which the step model's, if it waited for others
    first_token_due: float | None = None  # when admission promised its first token by
    inter_token_latencies: list[float] = field(default_factory=list)

    def record_scheduled(self, now: float) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = now

    def record_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now
        self.num_generation_tokens += 1

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def ttft_prediction_ratio(self) -> float | None:
        """Observed over predicted TTFT: above 1, the first token came later than predicted."""
        ttft, predicted = self.ttft, self.predicted_ttft
        return None if ttft is None or not predicted else ttft / predicted

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    # vLLM's phases of a request: prefill from its first scheduling to its first token, decode
    # from its first token to its last, inference the two together

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token

    @property
    def inference_time(self) -> float | None:
        if self.first_scheduled is None or self.last_token is None:
            return None
        return self.last_token - self.first_scheduled


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A consistent snapshot of the engine's gauges and counters."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks referenced by sequences
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int
    finished_by_reason: dict[str, int]
    prompt_tokens: int  # prompt tokens computed (cache hits excluded)
    generation_tokens: int
    num_steps: int
    step_time: float  # total seconds inside step()
    forward_time: float  # of which seconds in model forward + logits
    prepare_time: float  # of which seconds building the step's tensors
    sample_time: float  # of which seconds sampling
    prefill_rate: float  # admission's estimate: prompt tokens per second of prefill time
    decode_step_time: float  # admission's estimate: seconds of a step decoding the running
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def step_overhead_share(self) -> float:
        """Share of step time spent outside the model: scheduling, tensor building, postprocess."""
        return 1.0 - self.forward_time / self.step_time if self.step_time > 0 else 0.0


@dataclass(slots=True)
class StepCounters:
    """Monotonic counters the engine bumps once per step (its own thread only)."""

    num_steps: int = 0
    step_time: float = 0.0
    forward_time: float = 0.0
    prepare_time: float = 0.0
    sample_time: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: Counter[str] = field(default_factory=Counter)


class RequestObserver(Protocol):
    """Told of each request's events as they happen, under the engine's lock: keep it cheap."""

    def token(self, timings: RequestTimings) -> None:
        """A token was appended (`timings.num_generation_tokens` of them so far)."""

    def finished(self, timings: RequestTimings) -> None:
        """The request finished, stopped, was aborted or expired."""
