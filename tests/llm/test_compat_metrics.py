"""vLLM's names read off an engine's stats and lockgate's request histograms at scrape time:
the same values as lockgate's own series, the histograms with exactly vLLM's buckets, ':' kept
in both exposition formats."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.core.metrics import Registry
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.compat_metrics import VLLMMetrics
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMMetrics, LLMService
from tests.core.test_metrics import promtool_check
from tests.llm.test_engine import collect, make_engine
from tests.llm.test_service import PARAMS, served, value
from tests.llm.test_speculative import make_engine as speculative_engine

# vLLM's buckets, as vllm/v1/metrics/loggers.py sets them
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0]  # fmt: skip
PHASES = ("prefill", "decode", "inference")
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


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


def histograms(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Each histogram's series by (name, model): its buckets ({le: count}), count and sum, as
    prometheus_client's parser reads the exposition."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            series = found.setdefault((family.name, sample.labels["model_name"]), {"buckets": {}})
            if sample.name.endswith("_bucket"):
                series["buckets"][float(sample.labels["le"])] = sample.value
            else:
                series[sample.name.removeprefix(family.name)] = sample.value
    return found


def test_vllm_histograms_have_vllm_s_buckets_and_count_every_request() -> None:
    registry = Registry()
    # two models of other context lengths: vLLM's token buckets go up to each one's
    services = [
        served(AsyncLLMEngine(make_engine())),  # 128 tokens
        LLMService("small", *[None] * 3, AsyncLLMEngine(make_engine(max_model_len=48)), 0, 0, 0),
    ]
    metrics = LLMMetrics(registry, lambda: services)
    registry.register(VLLMMetrics(metrics.requests, lambda: services))
    for service in services:
        service.instrument(registry)

    async def requests() -> None:
        streams = [s.engine.generate([1, 2, 3, 4, 5], PARAMS) for s in services for _ in range(7)]
        await asyncio.gather(*(collect(s) for s in streams))

    try:
        asyncio.run(requests())
    finally:
        for service in services:
            service.close()
    found = histograms(registry.exposition()[0].decode())
    inf = math.inf
    for model, context_buckets in (
        ("fake", [1, 2, 5, 10, 20, 50, 100]),
        ("small", [1, 2, 5, 10, 20]),
    ):
        for name, own, buckets, count in (
            ("time_to_first_token_seconds", "time_to_first_token_seconds", TTFT, 7),
            ("inter_token_latency_seconds", "inter_token_latency_seconds", PER_TOKEN, 7 * 3),
            (
                "request_time_per_output_token_seconds",
                "request_time_per_output_token_seconds",
                PER_TOKEN,
                7,
            ),
            ("e2e_request_latency_seconds", "e2e_request_latency_seconds", REQUEST, 7),
            ("request_queue_time_seconds", "request_queue_time_seconds", REQUEST, 7),
            ("request_prefill_time_seconds", "request_prefill_time_seconds", REQUEST, 7),
            ("request_decode_time_seconds", "request_decode_time_seconds", REQUEST, 7),
            ("request_inference_time_seconds", "request_inference_time_seconds", REQUEST, 7),
            ("request_prompt_tokens", "request_prompt_tokens", context_buckets, 7),
            ("request_generation_tokens", "request_generation_tokens", context_buckets, 7),
        ):
            vllm, lockgate = found[(f"vllm:{name}", model)], found[(f"lockgate_llm_{own}", model)]
            assert list(vllm["buckets"]) == [*map(float, buckets), inf], (name, model)
            assert vllm["_count"] == vllm["buckets"][inf] == count, (name, model)
            assert vllm["_sum"] == lockgate["_sum"]
            # each bucket is lockgate's own count at that bound: nothing lost, nothing twice
            assert all(vllm["buckets"][le] == lockgate["buckets"][le] for le in vllm["buckets"])
        assert found[("vllm:request_prompt_tokens", model)]["_sum"] == 7 * 5
        sums = {n: found[(f"vllm:request_{n}_time_seconds", model)]["_sum"] for n in PHASES}
        assert sums["prefill"] + sums["decode"] == pytest.approx(sums["inference"])
        e2e = found[("vllm:e2e_request_latency_seconds", model)]["_sum"]
        assert min(sums["prefill"], sums["decode"]) > 0 and sums["inference"] <= e2e
        assert found[("vllm:request_generation_tokens", model)]["_sum"] == 7 * 4
        prompts = found[("vllm:request_prompt_tokens", model)]["buckets"]
        assert (prompts[2.0], prompts[5.0]) == (0, 7)  # 5 tokens each: in le="5.0", not below
