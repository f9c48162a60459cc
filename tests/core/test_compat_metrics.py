"""Triton's names read off lockgate's own series at scrape time: the counts, the failure
reasons, microseconds, and no series lockgate has no data for."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from lockgate.config import ModelConfig, ResponseCacheConfig
from lockgate.core.compat_metrics import REASONS, TritonMetrics, failure_reason
from lockgate.core.manager import ModelManager, ModelState, ServedModel, ServedVersion
from lockgate.core.metrics import Registry
from tests.core.test_metrics import promtool_check

NOWHERE = Path("/nonexistent")


def served(models: ModelManager, config: ModelConfig, state: ModelState) -> None:
    version = ServedVersion(config, 1, NOWHERE, NOWHERE, state=state)
    models.models[config.name] = ServedModel(config.name, NOWHERE, config, {1: version})


def series(text: str) -> dict[str, float]:
    found = re.findall(r"^(nv_\S+) (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def test_counts_reasons_and_microseconds_from_lockgate_series() -> None:
    models = ModelManager(Registry())
    models.registry.register(TritonMetrics(models))
    served(models, ModelConfig("m", "python"), ModelState.READY)
    served(models, ModelConfig("loading", "python"), ModelState.LOADING)
    m, labels = models.metrics, ("m", "1")
    for outcome in ("success", "success", "cancelled", "unavailable", "backend_error"):
        m.requests.inc((*labels, outcome))
    m.requests.inc((*labels, "invalid_request"), 2)
    m.request_latency.observe(labels, 0.25)
    m.queue_latency.observe(labels, 0.001)
    m.compute_latency.observe(labels, 0.01)
    m.batch_size.observe(labels, 5)
    text = models.registry.exposition()[0].decode()
    got = series(text)
    mv = 'model="m",version="1"'
    assert got[f"nv_inference_request_success{{{mv}}}"] == 2
    reasons = {
        r: got[f'nv_inference_request_failure{{model="m",reason="{r}",version="1"}}']
        for r in REASONS
    }
    assert reasons == {"REJECTED": 1, "CANCELED": 1, "BACKEND": 1, "OTHER": 2}
    assert got[f"nv_inference_count{{{mv}}}"] == 5
    assert got[f"nv_inference_exec_count{{{mv}}}"] == 1
    assert got[f"nv_inference_request_duration_us{{{mv}}}"] == 250_000
    assert got[f"nv_inference_queue_duration_us{{{mv}}}"] == 1_000
    assert got[f"nv_inference_compute_infer_duration_us{{{mv}}}"] == 10_000
    # no batcher: no phase times, no queue; no response cache: no cache series
    assert not any(
        n.startswith(("nv_inference_compute_input", "nv_inference_pending", "nv_cache"))
        for n in got
    )
    assert not any('model="loading"' in n for n in got)  # a version not ready has none
    assert "# TYPE nv_inference_request_success untyped" in text  # Triton's name, no _total
    promtool_check(text)


def test_cache_series_only_for_a_model_that_caches() -> None:
    models = ModelManager(Registry())
    models.registry.register(TritonMetrics(models))
    cached = replace(ModelConfig("c", "python"), response_cache=ResponseCacheConfig(enable=True))
    served(models, cached, ModelState.READY)
    served(models, ModelConfig("u", "python"), ModelState.READY)
    models.metrics.cache_hit_latency.observe(("c", "1"), 0.002)
    models.metrics.cache_miss_latency.observe(("c", "1"), 0.003)
    got = series(models.registry.exposition()[0].decode())
    assert got['nv_cache_num_hits_per_model{model="c",version="1"}'] == 1
    assert got['nv_cache_num_misses_per_model{model="c",version="1"}'] == 1
    assert got['nv_cache_hit_duration_per_model{model="c",version="1"}'] == 2_000
    assert got['nv_cache_miss_duration_per_model{model="c",version="1"}'] == 3_000
    assert not any(n.startswith("nv_cache") and 'model="u"' in n for n in got)


def test_language_models_have_vllm_names_not_triton_names() -> None:
    models = ModelManager(Registry())
    models.registry.register(TritonMetrics(models))
    served(models, ModelConfig("smol", "llm"), ModelState.READY)
    assert "nv_" not in models.registry.exposition()[0].decode()


def test_failure_reasons() -> None:
    assert failure_reason("cancelled") == "CANCELED"
    assert failure_reason("deadline_exceeded") == "REJECTED"
    assert failure_reason("backend_error") == "BACKEND"
    assert failure_reason("payload_too_large") == "OTHER"
