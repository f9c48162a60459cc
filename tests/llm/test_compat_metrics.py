"""vLLM's names read off an engine's stats and lockgate's request histograms at scrape time:
the same values as lockgate's own series, ':' kept in both exposition formats."""

from __future__ import annotations

import asyncio
import re

from lockgate.core.metrics import Registry
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.compat_metrics import VLLMMetrics
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMMetrics
from tests.core.test_metrics import promtool_check
from tests.llm.test_engine import collect, make_engine
from tests.llm.test_service import PARAMS, served, value
from tests.llm.test_speculative import make_engine as speculative_engine


def test_vllm_series_are_lockgate_series_renamed() -> None:
    registry = Registry()
    service = served(AsyncLLMEngine(make_engine()))
    metrics = LLMMetrics(registry, lambda: [service])
    registry.register(VLLMMetrics(metrics.requests, lambda: [service]))
    service.instrument(registry)

    async def requests() -> None:
        streams = [service.engine.generate([1, 2, 3, 4, 5], PARAMS) for _ in range(6)]
        await asyncio.gather(*(collect(s) for s in streams))

    try:
        asyncio.run(requests())
    finally:
        service.close()
    text = registry.exposition()[0].decode()
    m = '{model_name="fake"}'
    assert value(text, f"vllm:prompt_tokens_total{m}") == 6 * 5  # every prompt token, once
    assert value(text, f"vllm:generation_tokens_total{m}") == 6 * 4
    assert (
        value(text, 'vllm:request_success_total{finished_reason="length",model_name="fake"}') == 6
    )
    assert value(text, f"vllm:num_requests_running{m}") == 0
    assert value(text, f"vllm:num_requests_waiting{m}") == 0
    assert 0 <= value(text, f"vllm:kv_cache_usage_perc{m}") <= 1
    for vllm, own in (
        (
            "vllm:time_to_first_token_seconds_count",
            "lockgate_llm_time_to_first_token_seconds_count",
        ),
        ("vllm:inter_token_latency_seconds_sum", "lockgate_llm_inter_token_latency_seconds_sum"),
        (
            "vllm:request_time_per_output_token_seconds_count",
            "lockgate_llm_request_time_per_output_token_seconds_count",
        ),
        ("vllm:e2e_request_latency_seconds_sum", "lockgate_llm_e2e_request_latency_seconds_sum"),
        ("vllm:request_generation_tokens_sum", "lockgate_llm_request_generation_tokens_sum"),
        ("vllm:prefix_cache_queries_total", "lockgate_llm_prefix_cache_queries_total"),
    ):
        assert value(text, vllm + m) == value(text, own + m), vllm
    buckets = re.findall(r'^vllm:time_to_first_token_seconds_bucket\{le="([^"]+)"', text, re.M)
    own = re.findall(r'^lockgate_llm_time_to_first_token_seconds_bucket\{le="([^"]+)"', text, re.M)
    assert buckets == own  # lockgate's buckets, not vLLM's: said in the docs
    assert "vllm:time_to_first_token_seconds_created" not in text
    assert "vllm:spec_decode" not in text  # no speculative decoding: no series
    promtool_check(text)
    openmetrics = registry.exposition("application/openmetrics-text")[0].decode()
    assert f"vllm:generation_tokens_total{m} 24.0" in openmetrics
    assert "vllm_" not in openmetrics  # ':' kept in the samples as in HELP and TYPE


def test_nothing_without_a_language_model() -> None:
    registry = Registry()
    metrics = LLMMetrics(registry, lambda: [])
    registry.register(VLLMMetrics(metrics.requests, lambda: []))
    assert "vllm:" not in registry.exposition()[0].decode()


def test_speculative_decoding_counts_drafts_and_accepted_tokens() -> None:
    registry = Registry()
    # the copy model repeats its prompt: prompt lookup drafts, and they are accepted
    service = served(AsyncLLMEngine(speculative_engine(True)))
    metrics = LLMMetrics(registry, lambda: [service])
    registry.register(VLLMMetrics(metrics.requests, lambda: [service]))

    async def requests() -> None:
        long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        streams = [service.engine.generate(list(range(1, 12)), long) for _ in range(2)]
        await asyncio.gather(*(collect(s) for s in streams))

    try:
        asyncio.run(requests())
    finally:
        service.close()
    text = registry.exposition()[0].decode()
    m = '{model_name="fake"}'
    for name in ("num_draft_tokens_total", "num_accepted_tokens_total"):
        got = value(text, f"vllm:spec_decode_{name}{m}")
        assert got == value(text, f"lockgate_llm_spec_decode_{name}{m}"), name
    assert value(text, f"vllm:spec_decode_num_accepted_tokens_total{m}") > 0
