"""vLLM's metric names for the language models, computed at scrape time from lockgate's own.

Routers (the Gateway API Inference Extension's endpoint picker, vLLM's production-stack
router), autoscalers and dashboards written for vLLM read `vllm:*` series labelled
`model_name`: above all `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
`VLLMMetrics` reads them off each engine's stats snapshot and the request histograms the
engines already observe (`LLMRequestMetrics`), under vLLM's names, when a scraper asks: the
engine pays nothing for them. The histograms have exactly vLLM's buckets, which dashboards'
`histogram_quantile` and queries naming an `le` read: lockgate's request histograms hold vLLM's
bounds among their own, so each `vllm:*` series is lockgate's with only vLLM's buckets kept (a
cumulative count at a bound both have is the same count). The token histograms' go up to each
model's context length, as vLLM's. The names vLLM has dropped (`vllm:gpu_cache_usage_perc`,
`vllm:time_per_output_token_seconds`) are not exported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from lockgate.core.metrics import Histogram
from lockgate.llm.metrics import EngineStats
from lockgate.llm.service import (
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TOKEN_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    LLMRequestMetrics,
    LLMService,
    vllm_token_buckets,
)

Read = Callable[[EngineStats], float]  # a value from an engine's stats snapshot
_GAUGES: tuple[tuple[str, str, Read], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     lambda s: s.num_running),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     lambda s: s.num_waiting),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     lambda s: s.kv_usage),
)  # fmt: skip
_COUNTERS: tuple[tuple[str, str, Read], ...] = (
    ("vllm:generation_tokens", "Number of generation tokens processed.",
     lambda s: s.generation_tokens),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
     lambda s: s.num_preemptions),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queries),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     lambda s: s.prefix_cache_hits),
)  # fmt: skip


class VLLMMetrics:
    """The `vllm:*` series of every language model served, read at scrape time."""

    def __init__(
        self, requests: LLMRequestMetrics, services: Callable[[], Iterable[LLMService]]
    ) -> None:
        self.services = services  # the language models served now
        # name, help, lockgate's histogram, and vLLM's buckets (None: the token buckets, up to
        # each model's context length)
        self.histograms: tuple[tuple[str, str, Histogram, tuple[float, ...] | None], ...] = (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             requests.ttft, VLLM_TTFT_BUCKETS),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             requests.itl, VLLM_TOKEN_LATENCY_BUCKETS),
            ("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", requests.tpot,
             VLLM_TOKEN_LATENCY_BUCKETS),
            ("vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", requests.e2e,
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", requests.queue,
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("vllm:request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request.", requests.inference,
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", requests.prefill,
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", requests.decode,
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
             requests.prompt, None),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.",
             requests.generation, None),
        )  # fmt: skip
        self.prompt = requests.prompt

    def collect(self) -> Iterator[Family]:
        m = ["model_name"]
        gauges: list[tuple[GaugeMetricFamily | CounterMetricFamily, Read]] = [
            (GaugeMetricFamily(n, text, labels=m), read) for n, text, read in _GAUGES
        ]
        counters: list[tuple[GaugeMetricFamily | CounterMetricFamily, Read]] = [
            (CounterMetricFamily(n, text, labels=m), read) for n, text, read in _COUNTERS
        ]
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=m
        )
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels=m
        )
        accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels=m
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*m, "finished_reason"],
        )
        token_buckets: dict[str, frozenset[float]] = {}  # by model: up to its context length
        for service in list(self.services()):
            context = service.engine.engine.config.max_model_len
            token_buckets[service.name] = frozenset(map(float, vllm_token_buckets(context)))
            stats = service.engine.engine.stats()
            for family, read in gauges + counters:
                family.add_metric([service.name], read(stats))
            # every prompt token of each finished request, prefix-cache hits included
            prompt.add_metric([service.name], self.prompt.totals((service.name,))[1])
            for reason, count in stats.finished_by_reason.items():
                success.add_metric([service.name, reason], count)
            if service.engine.engine.config.speculative != "none":
                drafts.add_metric([service.name], stats.spec_draft_tokens)
                accepted.add_metric([service.name], stats.spec_accepted_tokens)
        if not token_buckets:
            return
        yield from (family for family, _ in gauges)
        yield prompt
        yield from (family for family, _ in counters)
        yield success
        yield from (family for family in (drafts, accepted) if family.samples)
        for name, text, histogram, buckets in self.histograms:
            if buckets is None:
                by_model = token_buckets
            else:
                bounds = frozenset(buckets)
                by_model = dict.fromkeys(token_buckets, bounds)
            yield rebucketed(histogram, name, text, by_model)


def rebucketed(
    histogram: Histogram, name: str, text: str, buckets: Mapping[str, frozenset[float]]
) -> Family:
    """The histogram's series of these models under another name, with only the buckets of
    each model's bounds (and +Inf; its `_created` left out). Exact when the histogram's bounds
    include them: a bucket counts every observation up to its bound, whatever other bounds the
    histogram has."""
    (family,) = histogram.metric.collect()
    out = Family(name, text, "histogram")
    for sample in family.samples:
        suffix = sample.name.removeprefix(family.name)
        bounds = buckets.get(sample.labels.get("model_name", ""))
        if bounds is None or suffix == "_created":
            continue
        le = sample.labels.get("le")
        if suffix == "_bucket" and le != "+Inf" and float(le or "nan") not in bounds:
            continue
        out.samples.append(sample._replace(name=name + suffix))
    return out
