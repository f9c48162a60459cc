"""A served language model: its tokenizer and engine, and its Prometheus metrics.

`lockgate.llm.startup` loads one; this module needs no torch, so the OpenAI routes import
it on a server installed without the `llm` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from lockgate.config import ModelConfig
from lockgate.core.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Registry
from lockgate.llm.generation_config import GenerationDefaults
from lockgate.llm.metrics import EngineStats, RequestObserver, RequestTimings

if TYPE_CHECKING:
    from lockgate.llm.async_engine import AsyncLLMEngine
    from lockgate.llm.engine_config import EngineConfig
    from lockgate.llm.tokenizer import ChatTokenizer


# observed / predicted TTFT: 1 is a perfect prediction
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

# vLLM's buckets (vllm/v1/metrics/loggers.py). The request histograms hold them among lockgate's
# own, so their `vllm:*` series are read with exactly vLLM's `le` at scrape time
# (`llm/compat_metrics.py`) and an observation is counted once.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TOKEN_LATENCY_BUCKETS = (  # inter-token latency, time per output token
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (  # end to end, queue, prefill, decode and inference time
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
MAX_VLLM_TOKEN_BUCKET = 10**7  # vLLM's token buckets go up to the context length: held to here


def vllm_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets of prompt and generated tokens: 1, 2, 5, 10, 20, 50, ... up to the context
    length (`build_1_2_5_buckets`), held to `MAX_VLLM_TOKEN_BUCKET`."""
    top = min(max_model_len, MAX_VLLM_TOKEN_BUCKET)
    return tuple(b for e in range(8) for b in (10**e, 2 * 10**e, 5 * 10**e) if b <= top)


def merged(*bounds: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(sorted(set().union(*bounds)))


TTFT_BUCKETS = merged(LATENCY_BUCKETS, VLLM_TTFT_BUCKETS)
TOKEN_LATENCY_BUCKETS = merged(LATENCY_BUCKETS, VLLM_TOKEN_LATENCY_BUCKETS)
REQUEST_LATENCY_BUCKETS = merged(LATENCY_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS)
REQUEST_TOKEN_BUCKETS = merged(TOKEN_BUCKETS, vllm_token_buckets(MAX_VLLM_TOKEN_BUCKET))


@dataclass(slots=True)
class LLMService:
    name: str
    config: ModelConfig
    engine_config: EngineConfig
    tokenizer: ChatTokenizer
    engine: AsyncLLMEngine
    vocab_size: int
    load_seconds: float
    created: int
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

    def instrument(self, registry: Registry) -> None:
        """Observe every request from now on (not the warmup) in the server's histograms."""
        self.engine.engine.observer = LLMRequestMetrics(registry).observer(self.name)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, and wait up to `timeout` s for the admitted ones."""
        return await self.engine.drain(timeout)

    def close(self) -> None:
        self.engine.close()


class LLMRequestMetrics:
    """vLLM's per-request histograms under lockgate's prefix, observed as each event happens."""

    def __init__(self, registry: Registry) -> None:
        m = ("model_name",)
        self.ttft = registry.histogram(
            "lockgate_llm_time_to_first_token_seconds", "Time to first token.", m, TTFT_BUCKETS
        )
        self.itl = registry.histogram(
            "lockgate_llm_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            m,
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = registry.histogram(
            "lockgate_llm_request_time_per_output_token_seconds",
            "Mean time per output token after the first (TPOT), per request.",
            m,
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = registry.histogram(
            "lockgate_llm_e2e_request_latency_seconds",
            "End-to-end request latency.",
            m,
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = registry.histogram(
            "lockgate_llm_request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            m,
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = registry.histogram(
            "lockgate_llm_request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token (prefill).",
            m,
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = registry.histogram(
            "lockgate_llm_request_decode_time_seconds",
            "Time from a request's first token to its last (decode).",
            m,
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = registry.histogram(
            "lockgate_llm_request_inference_time_seconds",
            "Time from a request's first scheduling to its last token (prefill and decode).",
            m,
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt = registry.histogram(
            "lockgate_llm_request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            REQUEST_TOKEN_BUCKETS,
        )
        self.generation = registry.histogram(
            "lockgate_llm_request_generation_tokens",
            "Generated tokens per request.",
            m,
            REQUEST_TOKEN_BUCKETS,
        )
        self.predicted_ttft = registry.histogram(
            "lockgate_llm_predicted_time_to_first_token_seconds",
            "Time to first token that admission predicted when it queued the request, for the "
            "requests observed in lockgate_llm_ttft_prediction_ratio.",
            m,
            LATENCY_BUCKETS,
        )
        self.ttft_ratio = registry.histogram(
            "lockgate_llm_ttft_prediction_ratio",
            "Observed over predicted time to first token of admitted requests (above 1: later "
            "than predicted).",
            m,
            RATIO_BUCKETS,
        )

    def observer(self, model: str) -> RequestObserver:
        return _ModelObserver(self, (model,))


class _ModelObserver:
    """One model's series of the request histograms, resolved once."""

    def __init__(self, metrics: LLMRequestMetrics, labels: tuple[str]) -> None:
        self.ttft = metrics.ttft.labels(labels)
        self.itl = metrics.itl.labels(labels)
        self.tpot = metrics.tpot.labels(labels)
        self.e2e = metrics.e2e.labels(labels)
        self.queue = metrics.queue.labels(labels)
        self.prefill = metrics.prefill.labels(labels)
        self.decode = metrics.decode.labels(labels)
        self.inference = metrics.inference.labels(labels)
        self.prompt = metrics.prompt.labels(labels)
        self.generation = metrics.generation.labels(labels)
        self.predicted_ttft = metrics.predicted_ttft.labels(labels)
        self.ttft_ratio = metrics.ttft_ratio.labels(labels)

    def token(self, timings: RequestTimings) -> None:
        if timings.num_generation_tokens == 1:
            self.ttft.observe(timings.ttft or 0.0)
            ratio = timings.ttft_prediction_ratio
            if ratio is not None and timings.predicted_ttft is not None:
                self.predicted_ttft.observe(timings.predicted_ttft)
                self.ttft_ratio.observe(ratio)
        else:
            self.itl.observe(timings.inter_token_latencies[-1])

    def finished(self, timings: RequestTimings) -> None:
        for histogram, value in (
            (self.e2e, timings.e2e),
            (self.queue, timings.queue_time),
            (self.tpot, timings.tpot),
            (self.prefill, timings.prefill_time),
            (self.decode, timings.decode_time),
            (self.inference, timings.inference_time),
        ):
            if value is not None:
                histogram.observe(value)
        self.prompt.observe(timings.num_prompt_tokens)
        self.generation.observe(timings.num_generation_tokens)


Read = Callable[[EngineStats], float]  # a value from an engine's stats snapshot
_GAUGES: tuple[tuple[str, str, Read], ...] = (
    (
        "lockgate_llm_num_requests_running",
        "Requests in the running batch.",
        lambda s: s.num_running,
    ),
    (
        "lockgate_llm_num_requests_waiting",
        "Requests waiting to be scheduled.",
        lambda s: s.num_waiting,
    ),
    (
        "lockgate_llm_kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use (0 to 1).",
        lambda s: s.kv_usage,
    ),
    (
        "lockgate_llm_step_overhead_ratio",
        "Share of engine step time spent outside the model forward.",
        lambda s: s.step_overhead_share,
    ),
    (
        "lockgate_llm_admission_prefill_tokens_per_second",
        "Prompt tokens per second of prefill time that TTFT admission predicts with (recent "
        "steps; 0 until measured).",
        lambda s: s.prefill_rate,
    ),
    (
        "lockgate_llm_admission_decode_step_seconds",
        "Seconds of a step decoding the running requests, as TTFT admission predicts it.",
        lambda s: s.decode_step_time,
    ),
)
_COUNTERS: tuple[tuple[str, str, Read], ...] = (
    (
        "lockgate_llm_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "lockgate_llm_prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        lambda s: s.prefix_cache_hits,
    ),
    (
        "lockgate_llm_num_preemptions_total",
        "Sequences preempted (recomputed later).",
        lambda s: s.num_preemptions,
    ),
    ("lockgate_llm_prompt_tokens_total", "Prompt tokens computed.", lambda s: s.prompt_tokens),
    ("lockgate_llm_generation_tokens_total", "Tokens generated.", lambda s: s.generation_tokens),
    (
        "lockgate_llm_spec_decode_num_draft_tokens_total",
        "Draft tokens verified by speculative decoding.",
        lambda s: s.spec_draft_tokens,
    ),
    (
        "lockgate_llm_spec_decode_num_accepted_tokens_total",
        "Draft tokens accepted by speculative decoding.",
        lambda s: s.spec_accepted_tokens,
    ),
)


class LLMMetrics:
    """The engines' gauges and counters, read from each engine at scrape time. The request
    histograms are observed by the engines themselves (`LLMService.instrument`); they are
    created here too, so that they are described before the first language model loads."""

    def __init__(self, registry: Registry, services: Callable[[], Iterable[LLMService]]) -> None:
        self.services = services  # the language models served now
        self.requests = LLMRequestMetrics(registry)
        registry.register(self)

    def collect(self) -> Iterator[Family]:
        m = ["model_name"]
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily, Read]] = [
            (GaugeMetricFamily(name, text, labels=m), read) for name, text, read in _GAUGES
        ]
        families += [
            (CounterMetricFamily(name, text, labels=m), read) for name, text, read in _COUNTERS
        ]
        finished = CounterMetricFamily(
            "lockgate_llm_request_success_total",
            "Finished requests by finish reason.",
            labels=[*m, "finished_reason"],
        )
        for service in self.services():
            stats = service.engine.engine.stats()
            for family, read in families:
                family.add_metric([service.name], read(stats))
            for reason, count in stats.finished_by_reason.items():
                finished.add_metric([service.name, reason], count)
        yield from (family for family, _ in families)
        yield finished
