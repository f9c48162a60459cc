"""A served language model: its tokenizer and engine, and its Prometheus metrics.

`lockgate.llm.startup` loads one; this module needs no torch, so the OpenAI routes import
it on a server installed without the `llm` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockgate.config import ModelConfig
from lockgate.core.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Registry

if TYPE_CHECKING:
    from lockgate.llm.async_engine import AsyncLLMEngine
    from lockgate.llm.engine_config import EngineConfig
    from lockgate.llm.tokenizer import ChatTokenizer


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

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, and wait up to `timeout` s for the admitted ones."""
        return await self.engine.drain(timeout)

    def close(self) -> None:
        self.engine.close()


class LLMMetrics:
    """vLLM's metric meanings under lockgate's prefix, read from the engines at scrape time."""

    def __init__(self, registry: Registry, services: Callable[[], Iterable[LLMService]]) -> None:
        m = ("model_name",)
        self.services = services  # the language models served now
        self.ttft = registry.histogram(
            "lockgate_llm_time_to_first_token_seconds", "Time to first token.", m, LATENCY_BUCKETS
        )
        self.itl = registry.histogram(
            "lockgate_llm_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            m,
            LATENCY_BUCKETS,
        )
        self.e2e = registry.histogram(
            "lockgate_llm_e2e_request_latency_seconds",
            "End-to-end request latency.",
            m,
            LATENCY_BUCKETS,
        )
        self.queue = registry.histogram(
            "lockgate_llm_request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            m,
            LATENCY_BUCKETS,
        )
        self.prompt = registry.histogram(
            "lockgate_llm_request_prompt_tokens", "Prompt tokens per request.", m, TOKEN_BUCKETS
        )
        self.generation = registry.histogram(
            "lockgate_llm_request_generation_tokens",
            "Generated tokens per request.",
            m,
            TOKEN_BUCKETS,
        )
        self.running = registry.gauge(
            "lockgate_llm_num_requests_running", "Requests in the running batch.", m
        )
        self.waiting = registry.gauge(
            "lockgate_llm_num_requests_waiting", "Requests waiting to be scheduled.", m
        )
        self.kv_usage = registry.gauge(
            "lockgate_llm_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", m
        )
        self.prefix_queries = registry.counter(
            "lockgate_llm_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            m,
        )
        self.prefix_hits = registry.counter(
            "lockgate_llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", m
        )
        self.preemptions = registry.counter(
            "lockgate_llm_num_preemptions_total", "Sequences preempted (recomputed later).", m
        )
        self.finished = registry.counter(
            "lockgate_llm_request_success_total",
            "Finished requests by finish reason.",
            (*m, "finished_reason"),
        )
        self.prompt_total = registry.counter(
            "lockgate_llm_prompt_tokens_total", "Prompt tokens computed.", m
        )
        self.generation_total = registry.counter(
            "lockgate_llm_generation_tokens_total", "Tokens generated.", m
        )
        self.step_overhead = registry.gauge(
            "lockgate_llm_step_overhead_ratio",
            "Share of engine step time spent outside the model forward.",
            m,
        )
        registry.add_collector(self.collect)

    def collect(self) -> None:
        for service in self.services():
            self._collect(service)

    def _collect(self, service: LLMService) -> None:
        labels = (service.name,)
        engine = service.engine.engine
        for t in engine.finished_log.drain():
            for histogram, value in (
                (self.ttft, t.ttft),
                (self.e2e, t.e2e),
                (self.queue, t.queue_time),
            ):
                if value is not None:
                    histogram.observe(labels, value)
            for gap in t.inter_token_latencies:
                self.itl.observe(labels, gap)
            self.prompt.observe(labels, t.num_prompt_tokens)
            self.generation.observe(labels, t.num_generation_tokens)
        stats = engine.stats()
        self.running.set(labels, stats.num_running)
        self.waiting.set(labels, stats.num_waiting)
        self.kv_usage.set(labels, stats.kv_usage)
        self.prefix_queries.values[labels] = stats.prefix_cache_queries
        self.prefix_hits.values[labels] = stats.prefix_cache_hits
        self.preemptions.values[labels] = stats.num_preemptions
        self.prompt_total.values[labels] = stats.prompt_tokens
        self.generation_total.values[labels] = stats.generation_tokens
        for reason, count in stats.finished_by_reason.items():
            self.finished.values[(*labels, reason)] = count
        self.step_overhead.set(labels, stats.step_overhead_share)
