"""Prometheus text exposition: parsed line by line, histograms checked for consistency."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import pytest

from lockgate.core.metrics import Registry
from lockgate.core.serving_metrics import ServingMetrics

SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r'(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})?'
    r" (?P<value>\S+)$"
)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Samples by metric family; fails on any line the exposition format does not allow."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    kinds: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split(" ")[2]
            assert current not in families, f"{current} described twice"
            families[current] = []
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current, "TYPE must follow the HELP of the same metric"
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            kinds[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name = match["name"]
            suffixes = ("_bucket", "_sum", "_count") if kinds[current] == "histogram" else ("",)
            assert any(name == current + s for s in suffixes), f"{name} outside its family"
            labels = dict(LABEL.findall(match["labels"] or ""))
            value = float(match["value"].replace("+Inf", "inf"))
            families[current].append((name, labels, value))
    assert set(families) == set(kinds)
    return families


def check_histogram(family: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
    series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = defaultdict(list)
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for name, sample_labels, value in samples:
        labels = dict(sample_labels)
        if name.endswith("_bucket"):
            le = labels.pop("le")
            series[tuple(sorted(labels.items()))].append((float(le.replace("+Inf", "inf")), value))
        elif name.endswith("_count"):
            counts[tuple(sorted(labels.items()))] = value
    assert series.keys() == counts.keys(), family
    for key, buckets in series.items():
        bounds = [b for b, _ in buckets]
        values = [v for _, v in buckets]
        assert bounds == sorted(bounds) and math.isinf(bounds[-1]), f"{family}{key}: bounds"
        assert values == sorted(values), f"{family}{key}: buckets must be cumulative"
        assert values[-1] == counts[key], f"{family}{key}: +Inf must equal _count"


def test_render_is_valid_exposition_text() -> None:
    registry = Registry()
    requests = registry.counter("t_requests_total", "Requests.", ("model", "outcome"))
    requests.inc(("a", "success"))
    requests.inc(("a", "success"), 2)
    requests.inc(('we"ird\\name\n', "error"))
    depth = registry.gauge("t_depth", "Depth.", ("model",))
    depth.set(("a",), 3)
    depth.set_function(("b",), lambda: 7.5)
    latency = registry.histogram("t_latency_seconds", "Latency.", ("model",), (0.01, 0.1, 1.0))
    for value in (0.005, 0.01, 0.05, 0.5, 5.0, 0.05):
        latency.observe(("a",), value)
    latency.observe(("b",), 0.2)
    registry.histogram("t_empty_seconds", "Nothing observed.")
    families = parse(registry.render())
    assert {(s[1]["model"], s[2]) for s in families["t_requests_total"]} >= {("a", 3.0)}
    assert ('we\\"ird\\\\name\\n', "error") in {
        (s[1]["model"], s[1]["outcome"]) for s in families["t_requests_total"]
    }
    assert {s[1]["model"]: s[2] for s in families["t_depth"]} == {"a": 3.0, "b": 7.5}
    check_histogram("t_latency_seconds", families["t_latency_seconds"])
    buckets = {
        s[1]["le"]: s[2]
        for s in families["t_latency_seconds"]
        if s[1].get("model") == "a" and "le" in s[1]
    }
    assert buckets == {"0.01": 2, "0.1": 4, "1": 5, "+Inf": 6}  # le is inclusive
    assert families["t_empty_seconds"] == []


def test_serving_metrics_render_valid_text() -> None:
    registry = Registry()
    metrics = ServingMetrics.create(registry)
    labels = ("digits", "1")
    metrics.requests.inc((*labels, "success"))
    metrics.rejected.inc((*labels, "queue_full"))
    metrics.batch_size.observe(labels, 3)
    metrics.request_latency.observe(labels, 0.004)
    metrics.queue_depth.set_function(labels, lambda: 2.0)
    families = parse(registry.render())
    for name, samples in families.items():
        if name in ("lockgate_batch_size", "lockgate_request_duration_seconds"):
            check_histogram(name, samples)
    assert families["lockgate_queue_depth"] == [
        ("lockgate_queue_depth", {"model": "digits", "version": "1"}, 2.0)
    ]


def test_registration_is_idempotent_and_typed() -> None:
    registry = Registry()
    assert registry.counter("x_total", "X.") is registry.counter("x_total", "X.")
    with pytest.raises(ValueError, match="another type"):
        registry.gauge("x_total", "X.")


def test_collectors_run_before_render() -> None:
    registry = Registry()
    gauge = registry.gauge("pulled", "Pulled at scrape time.")
    registry.add_collector(lambda: gauge.set((), 42))
    assert "pulled 42\n" in registry.render()


def test_histogram_quantile_estimate() -> None:
    registry = Registry()
    child = registry.histogram("q_seconds", "Q.", (), (0.1, 1.0, 10.0)).labels(())
    assert math.isnan(child.quantile(0.5))
    for value in (0.05,) * 90 + (5.0,) * 10:
        child.observe(value)
    assert child.quantile(0.5) == 0.1
    assert child.quantile(0.99) == 10.0
