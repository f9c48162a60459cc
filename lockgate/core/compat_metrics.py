"""Triton's metric names for the classic models, computed at scrape time from lockgate's own.

Dashboards, alerts and autoscalers written for Triton read `nv_inference_*` and `nv_cache_*`,
labelled `model` and `version`. `TritonMetrics` reads them off what the classic-model path
already counts (`ServingMetrics`, each batcher's phase times and queues) when a scraper asks:
the request path pays nothing for them. They are read from the totals that Triton's statistics
extension reports (`ServingMetrics.totals`). A series lockgate has no data for is left out.

Triton's names carry no `_total` suffix, which Prometheus' text format asks of a counter: they
are exported untyped, with Triton's names and values; `rate()` and `increase()` read them as
counters. Durations are cumulative microseconds, as Triton's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, UnknownMetricFamily
from prometheus_client.metrics_core import Metric as Family

from lockgate.backends.base import LLM_BACKEND  # language models: vLLM's names, not Triton's
from lockgate.core.manager import ModelManager, ModelState, ServedVersion

US = 1e6  # microseconds per second

# Triton's failure reasons, and the lockgate outcome kinds each one counts
REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
_REASON_OF = {
    "unavailable": "REJECTED",  # queue full, shed, draining, deadline unmeetable
    "rate_limited": "REJECTED",
    "deadline_exceeded": "REJECTED",
    "cancelled": "CANCELED",
    "backend_error": "BACKEND",
}


def failure_reason(outcome: str) -> str:
    """Triton's failure reason for a lockgate outcome kind other than success."""
    return _REASON_OF.get(outcome, "OTHER")


class TritonMetrics:
    """The `nv_*` series of every ready version of a classic model or a composition, read at
    scrape time."""

    def __init__(self, models: ModelManager) -> None:
        self.models = models

    def collect(self) -> Iterator[Family]:
        families = _Families(["model", "version"])
        for model in list(self.models.models.values()):
            for served in list(model.versions.values()):
                if served.state is ModelState.READY and served.config.backend != LLM_BACKEND:
                    self._add(families, served)
        yield from families.all()

    def _add(self, f: _Families, served: ServedVersion) -> None:
        mv = [served.config.name, str(served.version)]
        t = self.models.metrics.totals((mv[0], mv[1]))
        by_reason = dict.fromkeys(REASONS, 0.0)
        for outcome, count in t.outcomes.items():
            if outcome != "success":
                by_reason[failure_reason(outcome)] += count
        f.success.add_metric(mv, t.outcomes.get("success", 0.0))
        for reason, count in by_reason.items():
            f.failure.add_metric([*mv, reason], count)
        f.inferences.add_metric(mv, t.rows)
        f.executions.add_metric(mv, t.executions)
        f.request_us.add_metric(mv, t.answered.seconds * US)
        f.queue_us.add_metric(mv, t.queued.seconds * US)
        f.infer_us.add_metric(mv, t.computed.seconds * US)
        batcher = served.batcher
        if batcher is not None:
            f.input_us.add_metric(mv, batcher.times.input_seconds * US)
            f.output_us.add_metric(mv, batcher.times.output_seconds * US)
            f.pending.add_metric(mv, sum(len(queue) for queue in batcher.queues))
        if served.config.response_cache.enable:
            f.cache_hits.add_metric(mv, t.cache_hits.count)
            f.cache_misses.add_metric(mv, t.cache_misses.count)
            f.cache_hit_us.add_metric(mv, t.cache_hits.seconds * US)
            f.cache_miss_us.add_metric(mv, t.cache_misses.seconds * US)


class _Families:
    """One scrape's `nv_*` families, filled version by version."""

    def __init__(self, mv: list[str]) -> None:
        def counter(name: str, text: str, labels: list[str] = mv) -> UnknownMetricFamily:
            return UnknownMetricFamily(name, text, labels=labels)

        self.success = counter(
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes.",
        )
        self.failure = counter(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes, by reason.",
            [*mv, "reason"],
        )
        self.inferences = counter(
            "nv_inference_count",
            "Number of inferences performed (batch rows, cache hits excluded).",
        )
        self.executions = counter(
            "nv_inference_exec_count", "Number of model executions performed (batches)."
        )
        self.request_us = counter(
            "nv_inference_request_duration_us",
            "Cumulative inference request duration of the successful requests, in microseconds.",
        )
        self.queue_us = counter(
            "nv_inference_queue_duration_us",
            "Cumulative inference queuing duration, in microseconds.",
        )
        self.input_us = counter(
            "nv_inference_compute_input_duration_us",
            "Cumulative time gathering the requests' inputs into batches, in microseconds.",
        )
        self.infer_us = counter(
            "nv_inference_compute_infer_duration_us",
            "Cumulative time the model ran batches, in microseconds.",
        )
        self.output_us = counter(
            "nv_inference_compute_output_duration_us",
            "Cumulative time splitting the batches' outputs back to requests, in microseconds.",
        )
        self.pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of requests waiting in the queue for an instance.",
            labels=mv,
        )
        self.cache_hits = counter(
            "nv_cache_num_hits_per_model", "Number of response cache hits per model."
        )
        self.cache_misses = counter(
            "nv_cache_num_misses_per_model", "Number of response cache misses per model."
        )
        self.cache_hit_us = counter(
            "nv_cache_hit_duration_per_model",
            "Cumulative time answering from the response cache on hits, in microseconds.",
        )
        self.cache_miss_us = counter(
            "nv_cache_miss_duration_per_model",
            "Cumulative time of response cache lookups that missed, in microseconds.",
        )

    def all(self) -> list[Family]:
        families: list[Family] = [
            self.success,
            self.failure,
            self.inferences,
            self.executions,
            self.request_us,
            self.queue_us,
            self.input_us,
            self.infer_us,
            self.output_us,
            self.pending,
            self.cache_hits,
            self.cache_misses,
            self.cache_hit_us,
            self.cache_miss_us,
        ]
        return [family for family in families if family.samples]
