"""The Prometheus metrics of one server, on prometheus_client.

Each server has a `CollectorRegistry` of its own (several servers may share one process, as
in the tests), never prometheus_client's process-wide default; the process, GC and platform
collectors are registered in it. Counters, gauges and histograms are addressed by a tuple of
label values, resolved to the prometheus_client child once and kept: an observation on the
request path is a dict lookup and the update of the child's values. Counters and histograms
update those values directly (`_counted`, `_Bucketed`): the child's own `inc` and `observe`
check on every call what holds once the child exists, and a histogram scans its 30 bounds
for the bucket, which on a small model's request path took about a microsecond a call.
A series counted often on the event loop's thread alone is counted on a tally (`Tally`,
`HistogramTally`): plain numbers, added to the series whenever it is read. `exposition()`
answers a scrape in the text format 0.0.4, or in OpenMetrics (with exemplars) when the
scraper asks for it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

import prometheus_client as prom
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric as Family
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.registry import Collector, CollectorRegistry

LabelValues = tuple[str, ...]

# Latency buckets in seconds, 100 µs .. 60 s: fine enough to tell 200 ms from 250 ms.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

OPENMETRICS = "application/openmetrics-text"

W = TypeVar("W", bound=MetricWrapperBase)  # prometheus_client's Counter, Gauge or Histogram


class Labelled(Generic[W]):
    """A prometheus_client metric and its children, by label values."""

    def __init__(self, metric: W, labelnames: Sequence[str]) -> None:
        self.metric = metric
        self.labelnames = tuple(labelnames)
        self._children: dict[LabelValues, W] = {}

    def labels(self, labels: LabelValues) -> W:
        child = self._children.get(labels)
        if child is None:
            child = self.metric.labels(*labels) if self.labelnames else self.metric
            self._children[labels] = child
        return child

    def remove(self, labels: LabelValues) -> None:
        if self._children.pop(labels, None) is not None and self.labelnames:
            self.metric.remove(*labels)


class Value(Protocol):
    """prometheus_client's value of one sample (`values.MutexValue`, or its multiprocess
    twin): thread-safe."""

    def inc(self, amount: float) -> None: ...


def _counted(child: prom.Counter) -> Value:
    """The value of one counter series, as its prometheus_client child holds it (the child
    itself, whose `inc` does the same, for a prometheus_client that keeps it elsewhere)."""
    value = getattr(child, "_value", None)
    return value if hasattr(value, "inc") else child  # type: ignore[return-value]


class _Bucketed:
    """The values of one histogram series, as its prometheus_client child holds them: the
    buckets' counts (not cumulative), by upper bound, the last +Inf, and the sum."""

    __slots__ = ("bounds", "buckets", "child", "sum")

    def __init__(self, child: prom.Histogram) -> None:
        self.child = child
        self.bounds: list[float] = list(getattr(child, "_upper_bounds", ()))
        self.buckets: list[Value] = list(getattr(child, "_buckets", ()))
        self.sum: Value | None = getattr(child, "_sum", None)
        if len(self.buckets) != len(self.bounds) or not hasattr(self.sum, "inc"):
            self.buckets = []  # a prometheus_client that keeps them elsewhere: `observe`

    def observe(self, value: float) -> None:
        if not self.buckets or self.sum is None:
            self.child.observe(value)
            return
        # the first bucket whose bound is at least `value`, as prometheus_client's scan finds
        self.buckets[bisect.bisect_left(self.bounds, value)].inc(1)
        self.sum.inc(value)


class HistogramTally:
    """Observations of one histogram series made on the event loop's thread alone: plain
    counts by bucket and a plain sum, added to the series whenever it is read
    (`Histogram.fold`: a scrape, `Histogram.totals`). The series' own values take a lock for
    each count and one for the sum, and every answered request observes three series (its
    HTTP latency, its latency in the batcher, its wait in the queue)."""

    __slots__ = ("added", "added_sum", "bounds", "counts", "direct", "series", "sum")

    def __init__(self, series: _Bucketed) -> None:
        self.series = series
        # a prometheus_client that keeps the values elsewhere: observed on the child
        self.direct = not series.buckets or series.sum is None
        self.bounds = series.bounds
        self.counts = [0] * len(series.buckets)  # written by the loop's thread alone
        self.sum = 0.0
        self.added = [0] * len(series.buckets)  # of those, added: written by `fold` alone
        self.added_sum = 0.0

    def observe(self, value: float, trace_id: str = "") -> None:
        """Count `value`; with a `trace_id` (its bucket's exemplar points at that trace), or
        NaN (no bucket), on the series itself, as `Histogram.observe` does."""
        if trace_id or value != value:
            self.series.child.observe(value, {"trace_id": trace_id} if trace_id else None)
        elif self.direct:
            self.series.observe(value)
        else:  # the first bucket whose bound is at least `value`, as prometheus_client's scan
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    def fold(self) -> None:
        buckets = self.series.buckets
        for index, count in enumerate(self.counts):
            if count > self.added[index]:
                buckets[index].inc(count - self.added[index])
                self.added[index] = count
        total = self.sum
        if total != self.added_sum and self.series.sum is not None:  # (None: `direct`)
            self.series.sum.inc(total - self.added_sum)
            self.added_sum = total


class Tally:
    """Counts of one counter series made on the event loop's thread alone: a plain integer,
    `tally.count += 1`, added to the series whenever it is read (`Counter.fold`: a scrape,
    `Counter.values`). prometheus_client's value takes a lock for each count, and a request
    refused under overload counts three series on the path that must cost least."""

    __slots__ = ("added", "count", "value")

    def __init__(self, value: Value) -> None:
        self.value = value
        self.count = 0  # counted so far: written by the loop's thread alone
        self.added = 0  # of those, added to `value`: written by `Counter.fold` alone


class Counter(Labelled[prom.Counter]):
    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(prom.Counter(name, help_text, labelnames, registry=None), labelnames)
        self._counted: dict[LabelValues, Value] = {}
        self._tallies: dict[LabelValues, Tally] = {}
        self._folding = threading.Lock()

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        value = self._counted.get(labels)
        if value is None:
            value = self._counted[labels] = _counted(self.labels(labels))
        if amount < 0:
            raise ValueError("a counter only goes up")
        value.inc(amount)

    def tally(self, labels: LabelValues = ()) -> Tally:
        """The tally of one series, for a path on the event loop's thread that counts on it
        often (`Tally`): kept, and counted on with no lookup by label values."""
        tally = self._tallies.get(labels)
        if tally is None:
            self.inc(labels, 0)  # the series exists from now on
            with self._folding:
                tally = self._tallies[labels] = Tally(self._counted[labels])
        return tally

    def fold(self) -> None:
        """Add what the tallies counted since the last fold to their series."""
        with self._folding:
            for tally in self._tallies.values():
                count = tally.count
                if count > tally.added:
                    tally.value.inc(count - tally.added)
                    tally.added = count

    def remove(self, labels: LabelValues) -> None:
        with self._folding:
            self._tallies.pop(labels, None)
        self._counted.pop(labels, None)
        super().remove(labels)

    def values(self) -> dict[LabelValues, float]:
        """Every series' value now: for reports (Triton's statistics), not the request path."""
        self.fold()
        (family,) = self.metric.collect()
        total = family.name + "_total"
        return {
            tuple(s.labels[n] for n in self.labelnames): s.value
            for s in family.samples
            if s.name == total
        }


class Gauge(Labelled[prom.Gauge]):
    """A gauge holds a value, or reads one from a callback at scrape time."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(prom.Gauge(name, help_text, labelnames, registry=None), labelnames)
        self._functions: dict[LabelValues, Callable[[], float]] = {}

    def set(self, labels: LabelValues, value: float) -> None:
        self.labels(labels).set(value)

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        self.labels(labels).inc(amount)

    def set_function(self, labels: LabelValues, fn: Callable[[], float]) -> None:
        self._functions[labels] = fn
        self.labels(labels).set_function(fn)

    def remove(self, labels: LabelValues) -> None:
        self._functions.pop(labels, None)
        super().remove(labels)

    def remove_function(self, labels: LabelValues, fn: Callable[[], float]) -> None:
        """Drop the series if `fn` still reports it (a successor may have taken it over)."""
        if self._functions.get(labels) is fn:
            self.remove(labels)


class Histogram(Labelled[prom.Histogram]):
    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        metric = prom.Histogram(name, help_text, labelnames, registry=None, buckets=buckets)
        super().__init__(metric, labelnames)
        self._bucketed: dict[LabelValues, _Bucketed] = {}
        self._tallies: dict[LabelValues, HistogramTally] = {}
        self._folding = threading.Lock()

    def _series(self, labels: LabelValues) -> _Bucketed:
        series = self._bucketed.get(labels)
        if series is None:
            series = self._bucketed[labels] = _Bucketed(self.labels(labels))
        return series

    def observe(self, labels: LabelValues, value: float, trace_id: str = "") -> None:
        """Count `value`; with a `trace_id`, its bucket's exemplar points at that trace."""
        series = self._series(labels)
        if trace_id or math.isnan(value):  # the exemplar, or no bucket: as the child does
            series.child.observe(value, {"trace_id": trace_id} if trace_id else None)
        else:
            series.observe(value)

    def tally(self, labels: LabelValues = ()) -> HistogramTally:
        """The tally of one series, for a path on the event loop's thread that observes it
        for every request (`HistogramTally`): kept, and observed with no lookup by label
        values."""
        series = self._series(labels)
        with self._folding:
            tally = self._tallies.get(labels)
            if tally is None:
                tally = self._tallies[labels] = HistogramTally(series)
        return tally

    def fold(self) -> None:
        """Add what the tallies observed since the last fold to their series."""
        with self._folding:
            for tally in self._tallies.values():
                tally.fold()

    def remove(self, labels: LabelValues) -> None:
        with self._folding:
            self._tallies.pop(labels, None)
        self._bucketed.pop(labels, None)
        super().remove(labels)

    def totals(self, labels: LabelValues) -> tuple[int, float]:
        """Observations and their sum so far: for reports, not the request path."""
        self.fold()
        child = self._children.get(labels)
        if child is None:
            return 0, 0.0
        (family,) = child.collect()
        found = {s.name.removeprefix(family.name): s.value for s in family.samples}
        return int(found["_count"]), found["_sum"]


Metric = Counter | Gauge | Histogram


@runtime_checkable
class Instrumented(Protocol):
    """A model service with metrics of its own: given the server's registry when it loads."""

    def instrument(self, registry: Registry) -> None: ...


class _Own:
    """lockgate's own metrics as one collector, without the `_created` series prometheus_client
    adds to counters and histograms (in the text format each is a series of its own, so they
    would double the count for nothing Prometheus reads there)."""

    def __init__(self, metrics: dict[str, Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Family]:
        for metric in list(self.metrics.values()):
            if isinstance(metric, Counter | Histogram):
                metric.fold()
            for family in metric.metric.collect():
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
                yield family


class Registry:
    """All metrics of one server. Registration is idempotent by name."""

    def __init__(self) -> None:
        self.collectors = CollectorRegistry()
        prom.ProcessCollector(registry=self.collectors)
        prom.GCCollector(registry=self.collectors)
        prom.PlatformCollector(registry=self.collectors)
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()
        self.collectors.register(_Own(self._metrics))

    def register(self, collector: Collector) -> None:
        """Add a collector that reads its values at scrape time (from an engine, say)."""
        self.collectors.register(collector)

    def _register(self, name: str, kind: type[Metric], make: Callable[[], Metric]) -> Metric:
        with self._lock:
            existing = self._metrics.get(name)
            if existing is not None:
                if type(existing) is not kind:
                    raise ValueError(f"metric {name} registered with another type")
                return existing
            metric = self._metrics[name] = make()
            return metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        metric = self._register(name, Counter, lambda: Counter(name, help_text, labelnames))
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        metric = self._register(name, Gauge, lambda: Gauge(name, help_text, labelnames))
        assert isinstance(metric, Gauge)
        return metric

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        metric = self._register(
            name, Histogram, lambda: Histogram(name, help_text, labelnames, buckets)
        )
        assert isinstance(metric, Histogram)
        return metric

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """A scrape's body and content type: OpenMetrics when the `Accept` header lists it,
        else the text format 0.0.4."""
        if any(part.split(";")[0].strip() == OPENMETRICS for part in accept.split(",")):
            # names with ':' (vLLM's) as they are: the default escaping turns them into '_'
            # in the samples and not in the family's HELP and TYPE lines
            body = openmetrics_exposition.generate_latest(
                self.collectors, escaping=openmetrics_exposition.ALLOWUTF8
            )
            return body, openmetrics_exposition.CONTENT_TYPE_LATEST
        return prom.generate_latest(self.collectors), CONTENT_TYPE_PLAIN_0_0_4
