"""Metrics on prometheus_client: the text exposition parsed line by line, histograms checked for
consistency, OpenMetrics with exemplars, and one registry per server."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections import defaultdict

import prometheus_client
import pytest

from lockgate.core.metrics import LATENCY_BUCKETS, Registry
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


def text_of(registry: Registry, accept: str = "") -> str:
    body, content_type = registry.exposition(accept)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    return body.decode()


def test_exposition_is_valid_text() -> None:
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
    text = text_of(registry)
    families = parse(text)
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
    assert buckets == {"0.01": 2, "0.1": 4, "1.0": 5, "+Inf": 6}  # le is inclusive
    assert {s[2] for s in families["t_empty_seconds"]} == {0.0}
    assert "_created" not in text  # a series each, in the text format, for nothing


def test_serving_metrics_exposition_is_valid_text() -> None:
    registry = Registry()
    metrics = ServingMetrics.create(registry)
    labels = ("digits", "1")
    metrics.requests.inc((*labels, "success"))
    metrics.rejected.inc((*labels, "queue_full"))
    metrics.batch_size.observe(labels, 3)
    metrics.request_latency.observe(labels, 0.004)
    metrics.queue_depth.set_function(labels, lambda: 2.0)
    families = parse(text_of(registry))
    for name, samples in families.items():
        if name in ("lockgate_batch_size", "lockgate_request_duration_seconds"):
            check_histogram(name, samples)
    assert families["lockgate_queue_depth"] == [
        ("lockgate_queue_depth", {"model": "digits", "version": "1"}, 2.0)
    ]


def test_each_registry_has_its_own_metrics_and_process_collectors() -> None:
    first, second = Registry(), Registry()
    first.counter("x_total", "X.").inc()
    second.counter("x_total", "X.")  # the same name in another server of this process
    assert "x_total 1.0" in text_of(first) and "x_total 0.0" in text_of(second)
    for name in ("process_cpu_seconds_total", "python_gc_objects_collected_total", "python_info"):
        assert f"# TYPE {name} " in text_of(first), name
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "x_total" not in default


def test_registration_is_idempotent_and_typed() -> None:
    registry = Registry()
    assert registry.counter("x_total", "X.") is registry.counter("x_total", "X.")
    with pytest.raises(ValueError, match="another type"):
        registry.gauge("x_total", "X.")


def test_a_successor_keeps_the_gauge_series_it_took_over() -> None:
    registry = Registry()
    gauge = registry.gauge("depth", "Depth.", ("model",))
    old, new = (lambda: 1.0), (lambda: 2.0)
    gauge.set_function(("m",), old)
    gauge.set_function(("m",), new)
    gauge.remove_function(("m",), old)
    assert 'depth{model="m"} 2.0' in text_of(registry)
    gauge.remove_function(("m",), new)
    assert 'depth{model="m"}' not in text_of(registry)


def test_values_and_totals_for_reports() -> None:
    registry = Registry()
    requests = registry.counter("r_total", "R.", ("model", "outcome"))
    requests.inc(("m", "success"), 3)
    requests.inc(("m", "error"))
    assert requests.values() == {("m", "success"): 3.0, ("m", "error"): 1.0}
    latency = registry.histogram("l_seconds", "L.", ("model",))
    assert latency.totals(("m",)) == (0, 0.0)
    latency.observe(("m",), 0.25)
    latency.observe(("m",), 0.5)
    assert latency.totals(("m",)) == (2, 0.75)


def test_openmetrics_is_negotiated_and_carries_exemplars() -> None:
    registry = Registry()
    latency = registry.histogram("l_seconds", "L.", ("model",), (0.1, 1.0))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    latency.observe(("m",), 0.05, trace_id)
    body, content_type = registry.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    line = next(x for x in text.splitlines() if x.startswith('l_seconds_bucket{le="0.1"'))
    assert f'# {{trace_id="{trace_id}"}} 0.05' in line
    for accept in ("", "text/plain", "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"):
        assert "trace_id" not in text_of(registry, accept)


# Triton's and vLLM's names (--metrics-compat), written as those servers write them: promtool's
# lint finds fault with their style (units as `_us`, ':' in names, a gauge named `_count`),
# which is theirs to keep, not lockgate's to fix
FOREIGN_NAMES = ("nv_", "vllm:")
LINT_PROBLEMS = 3  # promtool's exit code when the exposition parsed and only lint complained


def promtool_check(text: str) -> None:
    """`promtool check metrics` (Debian's prometheus package) on an exposition: it parses,
    and lint finds nothing, but in the style of Triton's and vLLM's own names."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode == LINT_PROBLEMS:
        ours = [line for line in problems if not line.startswith(FOREIGN_NAMES)]
        assert not ours, "\n".join(ours)
    else:
        assert done.returncode == 0, "\n".join(problems)


def test_promtool_accepts_the_serving_metrics() -> None:
    registry = Registry()
    metrics = ServingMetrics.create(registry)
    metrics.requests.inc(("digits", "1", "success"))
    metrics.request_latency.observe(("digits", "1"), 0.004)
    promtool_check(text_of(registry))


def test_observations_land_in_the_buckets_prometheus_client_would_choose() -> None:
    """Counters and histograms update their series' values directly: every value, on a bound,
    between bounds, past the last, infinite or NaN, lands where prometheus_client's own
    `observe` puts it, and a removed series starts again from zero."""
    ours = Registry().histogram("x_seconds", "x", ("m",))
    theirs = prometheus_client.Histogram(
        "y_seconds", "y", ("m",), registry=None, buckets=LATENCY_BUCKETS
    )
    values = [0.0, 0.00005, 0.0001, 0.00010001, 0.3, 60.0, 61.0, math.inf, -1.0, math.nan]
    for value in values:
        ours.observe(("a",), value)
        theirs.labels("a").observe(value)
    (mine,) = ours.metric.collect()
    (reference,) = theirs.collect()
    assert [(s.labels, s.value) for s in mine.samples if s.name.endswith("_bucket")] == [
        (s.labels, s.value) for s in reference.samples if s.name.endswith("_bucket")
    ]
    assert ours.totals(("a",))[0] == len(values) - 1  # NaN reaches no bucket
    counter = Registry().counter("z_total", "z", ("reason",))
    counter.inc(("r",))
    counter.inc(("r",), 2.5)
    assert counter.values() == {("r",): 3.5}
    with pytest.raises(ValueError):
        counter.inc(("r",), -1.0)
    counter.remove(("r",))
    counter.inc(("r",))
    assert counter.values() == {("r",): 1.0}


def test_a_prometheus_client_without_the_values_it_updates_falls_back_to_its_children() -> None:
    """Counters and histograms update prometheus_client's values directly; a version that keeps
    them elsewhere is served by the children's own `inc` and `observe`, with the same result."""
    from lockgate.core import metrics

    class Bare:
        def __init__(self) -> None:
            self.calls: list[float] = []

        def inc(self, amount: float = 1.0) -> None:
            self.calls.append(amount)

        def observe(self, value: float) -> None:
            self.calls.append(value)

    counted = metrics._counted(Bare())  # type: ignore[arg-type]
    counted.inc(2.0)
    assert counted.calls == [2.0]  # type: ignore[attr-defined]
    bare = Bare()
    bucketed = metrics._Bucketed(bare)  # type: ignore[arg-type]
    bucketed.observe(0.25)
    assert bare.calls == [0.25]


def test_a_tally_counts_in_its_series_whenever_the_series_is_read() -> None:
    registry = Registry()
    counter = registry.counter("lockgate_t_total", "t", ("reason",))
    tally = counter.tally(("busy",))
    assert counter.tally(("busy",)) is tally  # one per series
    assert b'lockgate_t_total{reason="busy"} 0.0' in registry.exposition()[0]  # exists at once
    tally.count += 3
    counter.inc(("busy",))
    assert counter.values() == {("busy",): 4.0}
    tally.count += 2
    assert b'lockgate_t_total{reason="busy"} 6.0' in registry.exposition()[0]
    assert b'lockgate_t_total{reason="busy"} 6.0' in registry.exposition()[0]  # added once


def test_a_histogram_tally_observes_in_its_series_whenever_the_series_is_read() -> None:
    """Observed on a tally, every value lands where prometheus_client's own `observe` puts it,
    a traced one with its exemplar, and each is added to the series once, however often it
    is read."""
    registry = Registry()
    ours = registry.histogram("lockgate_x_seconds", "x", ("m",))
    theirs = prometheus_client.Histogram(
        "y_seconds", "y", ("m",), registry=None, buckets=LATENCY_BUCKETS
    )
    tally = ours.tally(("a",))
    assert ours.tally(("a",)) is tally  # one per series
    values = [0.0, 0.00005, 0.0001, 0.00010001, 0.3, 60.0, 61.0, math.inf, -1.0, math.nan]
    for value in values:
        tally.observe(value)
        theirs.labels("a").observe(value)
    ours.observe(("a",), 0.002)
    theirs.labels("a").observe(0.002)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    tally.observe(0.05, trace_id)
    theirs.labels("a").observe(0.05)
    assert ours.totals(("a",))[0] == len(values) + 1  # NaN reaches no bucket
    assert ours.totals(("a",))[0] == len(values) + 1  # added once
    (reference,) = theirs.collect()
    expected = [(s.labels, s.value) for s in reference.samples if s.name.endswith("_bucket")]
    for _ in range(2):
        family = parse(text_of(registry))["lockgate_x_seconds"]
        buckets = [(labels, value) for name, labels, value in family if name.endswith("_bucket")]
        assert buckets == expected
    text = registry.exposition("application/openmetrics-text; version=1.0.0")[0].decode()
    line = next(x for x in text.splitlines() if x.startswith('lockgate_x_seconds_bucket{le="0.05"'))
    assert f'# {{trace_id="{trace_id}"}} 0.05' in line
    tally.observe(0.5)
    assert ours.totals(("a",))[0] == len(values) + 2
