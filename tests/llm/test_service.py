"""A served language model's metrics: request histograms observed by the engine as events
happen (no scrape needed in between), engine gauges and counters read at scrape time."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from lockgate.core.metrics import Registry
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMMetrics, LLMService
from tests.llm.test_engine import collect, make_engine

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, series
    return float(match.group(1))


def served(engine: AsyncLLMEngine) -> LLMService:
    unused: Any = None  # what the metrics never read
    return LLMService("fake", unused, unused, unused, engine, 0, 0.0, 0)


def test_histograms_count_every_request_with_no_scrape_in_between() -> None:
    registry = Registry()
    service = served(AsyncLLMEngine(make_engine()))
    LLMMetrics(registry, lambda: [service])
    service.instrument(registry)

    async def rounds() -> None:
        for _ in range(3):
            streams = [service.engine.generate([1, 2, 3], PARAMS) for _ in range(10)]
            await asyncio.gather(*(collect(s) for s in streams))

    try:
        asyncio.run(rounds())
    finally:
        service.close()
    text = registry.exposition()[0].decode()  # the first and only scrape
    labels = '{model_name="fake"}'
    for name in (
        "lockgate_llm_time_to_first_token_seconds",
        "lockgate_llm_e2e_request_latency_seconds",
        "lockgate_llm_request_queue_time_seconds",
        "lockgate_llm_request_time_per_output_token_seconds",
        "lockgate_llm_request_prefill_time_seconds",
        "lockgate_llm_request_decode_time_seconds",
        "lockgate_llm_request_inference_time_seconds",
        "lockgate_llm_request_prompt_tokens",
    ):
        assert value(text, f"{name}_count{labels}") == 30, name
    assert value(text, f"lockgate_llm_inter_token_latency_seconds_count{labels}") == 30 * 3
    assert value(text, f"lockgate_llm_request_generation_tokens_sum{labels}") == 30 * 4
    assert value(text, f"lockgate_llm_generation_tokens_total{labels}") == 30 * 4
    success = '{finished_reason="length",model_name="fake"}'
    assert value(text, f"lockgate_llm_request_success_total{success}") == 30
    assert value(text, f"lockgate_llm_num_requests_running{labels}") == 0


def test_families_are_described_before_any_model_loads() -> None:
    registry = Registry()
    LLMMetrics(registry, lambda: [])
    text = registry.exposition()[0].decode()
    for name in (
        "lockgate_llm_time_to_first_token_seconds",
        "lockgate_llm_kv_cache_usage_perc",
        "lockgate_llm_request_success_total",
    ):
        assert f"# TYPE {name} " in text, name
