"""The metric set of the classic-model path, labelled by model and version."""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.core.metrics import BATCH_BUCKETS, Counter, Gauge, Histogram, LabelValues, Registry


@dataclass(frozen=True, slots=True)
class Timed:
    """Events counted, and their seconds in all."""

    count: int
    seconds: float


@dataclass(frozen=True, slots=True)
class VersionTotals:
    """One model version's counts and times since it loaded, as Triton's statistics extension
    and Triton's metric names report them: read from the series, never counted again."""

    outcomes: dict[str, float]  # requests answered, by outcome (success or an error kind)
    answered: Timed  # successful requests, admission to answer
    queued: Timed  # requests that waited in the batcher queue
    computed: Timed  # batches the batcher ran, and the model's time
    executions: int  # executions: the batcher's batches, a composition's own runs
    rows: int  # rows in those executions (response-cache hits excluded)
    cache_hits: Timed
    cache_misses: Timed

    @property
    def failures(self) -> float:
        return sum(n for outcome, n in self.outcomes.items() if outcome != "success")


@dataclass(slots=True)
class ServingMetrics:
    requests: Counter  # model, version, outcome
    rejected: Counter  # model, version, reason
    request_latency: Histogram  # end to end inside the server
    queue_latency: Histogram
    compute_latency: Histogram
    batch_size: Histogram
    cache_hit_latency: Histogram  # requests answered from the response cache
    cache_miss_latency: Histogram  # response-cache lookups that found nothing
    batches: Counter
    queue_depth: Gauge
    inflight: Gauge
    load_seconds: Gauge
    warmup_seconds: Gauge
    model_ready: Gauge
    sequences: Gauge  # a stateful model's live sequences

    def totals(self, labels: LabelValues) -> VersionTotals:
        """The totals of the version with these labels (model, version): for reports and
        scrapes, not the request path."""
        outcomes = {k[2]: n for k, n in self.requests.values().items() if k[:2] == labels}
        executions, rows = self.batch_size.totals(labels)
        return VersionTotals(
            outcomes=outcomes,
            answered=Timed(*self.request_latency.totals(labels)),
            queued=Timed(*self.queue_latency.totals(labels)),
            computed=Timed(*self.compute_latency.totals(labels)),
            executions=executions,
            rows=int(rows),
            cache_hits=Timed(*self.cache_hit_latency.totals(labels)),
            cache_misses=Timed(*self.cache_miss_latency.totals(labels)),
        )

    @classmethod
    def create(cls, registry: Registry) -> ServingMetrics:
        mv = ("model", "version")
        return cls(
            requests=registry.counter(
                "lockgate_requests_total",
                "Inference requests answered, by outcome (success, or an error kind).",
                (*mv, "outcome"),
            ),
            rejected=registry.counter(
                "lockgate_requests_rejected_total",
                "Requests refused before they ran, by reason.",
                (*mv, "reason"),
            ),
            request_latency=registry.histogram(
                "lockgate_request_duration_seconds",
                "Time from admission to answer, in seconds.",
                mv,
            ),
            queue_latency=registry.histogram(
                "lockgate_queue_duration_seconds",
                "Time a request waited in the batcher queue, in seconds.",
                mv,
            ),
            compute_latency=registry.histogram(
                "lockgate_compute_duration_seconds",
                "Time the model took to run one batch, in seconds.",
                mv,
            ),
            batch_size=registry.histogram(
                "lockgate_batch_size", "Rows per executed batch.", mv, BATCH_BUCKETS
            ),
            cache_hit_latency=registry.histogram(
                "lockgate_cache_hit_duration_seconds",
                "Time to answer a request from the response cache, in seconds.",
                mv,
            ),
            cache_miss_latency=registry.histogram(
                "lockgate_cache_miss_duration_seconds",
                "Time a response-cache lookup took that found no answer, in seconds.",
                mv,
            ),
            batches=registry.counter("lockgate_batches_total", "Batches executed.", mv),
            queue_depth=registry.gauge(
                "lockgate_queue_depth", "Rows waiting in the batcher queue.", mv
            ),
            inflight=registry.gauge(
                "lockgate_inflight_requests", "Requests admitted and not yet answered.", mv
            ),
            load_seconds=registry.gauge(
                "lockgate_model_load_seconds", "Time taken to load the model, in seconds.", mv
            ),
            warmup_seconds=registry.gauge(
                "lockgate_model_warmup_seconds", "Time taken to warm the model up, in seconds.", mv
            ),
            model_ready=registry.gauge(
                "lockgate_model_ready", "1 when the model version is ready to serve.", mv
            ),
            sequences=registry.gauge(
                "lockgate_sequences_live",
                "Live sequences of a stateful model (sequence_batching), idle ones freed.",
                mv,
            ),
        )
