"""Prometheus metrics without a dependency: counters, gauges and histograms with labels.

Observation is a dict lookup plus a bisect, cheap enough for the request path. `render()`
writes the text exposition format (version 0.0.4).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

LabelValues = tuple[str, ...]

# Latency buckets in seconds, 100 µs .. 60 s: fine enough to tell 200 ms from 250 ms.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels_text(names: Sequence[str], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> str:
        head = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.samples())


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: LabelValues = ()) -> float:
        return self.values.get(labels, 0.0)

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels_text(self.labelnames, labels)} {_num(value)}"


class Gauge(Metric):
    """A gauge holds a value, or reads one from a callback at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}
        self.callbacks: dict[LabelValues, Callable[[], float]] = {}

    def set(self, labels: LabelValues, value: float) -> None:
        self.values[labels] = value

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: LabelValues = ()) -> float:
        if labels in self.callbacks:
            return self.callbacks[labels]()
        return self.values.get(labels, 0.0)

    def set_function(self, labels: LabelValues, fn: Callable[[], float]) -> None:
        self.callbacks[labels] = fn

    def remove(self, labels: LabelValues) -> None:
        self.values.pop(labels, None)
        self.callbacks.pop(labels, None)

    def remove_function(self, labels: LabelValues, fn: Callable[[], float]) -> None:
        """Drop `fn` if it still reports these labels (a successor may have taken them over)."""
        if self.callbacks.get(labels) is fn:
            del self.callbacks[labels]

    def samples(self) -> Iterable[str]:
        merged = dict(self.values)
        merged.update({k: fn() for k, fn in self.callbacks.items()})
        for labels, value in sorted(merged.items()):
            yield f"{self.name}{_labels_text(self.labelnames, labels)} {_num(value)}"


class HistogramChild:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """An estimate from the buckets (upper bound of the bucket holding the q-quantile)."""
        if self.count == 0:
            return math.nan
        rank = q * self.count
        running = 0
        for i, c in enumerate(self.counts):
            running += c
            if running >= rank:
                return self.bounds[i] if i < len(self.bounds) else math.inf
        return math.inf


class Histogram(Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.bounds = tuple(sorted(buckets))
        self.children: dict[LabelValues, HistogramChild] = {}

    def labels(self, labels: LabelValues) -> HistogramChild:
        child = self.children.get(labels)
        if child is None:
            child = self.children[labels] = HistogramChild(self.bounds)
        return child

    def observe(self, labels: LabelValues, value: float) -> None:
        self.labels(labels).observe(value)

    def samples(self) -> Iterable[str]:
        for labels, child in sorted(self.children.items()):
            running = 0
            for bound, c in zip((*self.bounds, math.inf), child.counts, strict=True):
                running += c
                le = _labels_text(self.labelnames, labels, f'le="{_num(bound)}"')
                yield f"{self.name}_bucket{le} {running}"
            base = _labels_text(self.labelnames, labels)
            yield f"{self.name}_sum{base} {_num(child.sum)}"
            yield f"{self.name}_count{base} {child.count}"


class Registry:
    """All metrics of one server. Registration is idempotent by name."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()
        self._collectors: list[Callable[[], None]] = []

    def add_collector(self, collect: Callable[[], None]) -> None:
        """Call `collect` before every render, to pull values kept elsewhere."""
        self._collectors.append(collect)

    def _register(self, metric: Metric) -> Metric:
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is not None:
                if type(existing) is not type(metric):
                    raise ValueError(f"metric {metric.name} registered with another type")
                return existing
            self._metrics[metric.name] = metric
            return metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        metric = self._register(Counter(name, help_text, labelnames))
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        metric = self._register(Gauge(name, help_text, labelnames))
        assert isinstance(metric, Gauge)
        return metric

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        metric = self._register(Histogram(name, help_text, labelnames, buckets))
        assert isinstance(metric, Histogram)
        return metric

    def get(self, name: str) -> Metric | None:
        return self._metrics.get(name)

    def render(self) -> str:
        for collect in self._collectors:
            collect()
        with self._lock:
            metrics = list(self._metrics.values())
        return "".join(m.render() for m in metrics)
