"""Triton's trace settings as bookkeeping: sampling by rate and count, a model's own settings
over the global ones, clearing, and every refusal."""

from __future__ import annotations

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol.trace_settings import (
    MAX_COUNT,
    MAX_RATE,
    TraceScope,
    TraceSettings,
    TraceValues,
    change_of,
    json_change,
    json_document,
)


def settings(**startup: bool | int) -> TraceSettings:
    return TraceSettings(TraceValues(**startup), exporting=True)  # type: ignore[arg-type]


def traced(scope: TraceScope, requests: int, parented: bool = False) -> list[int]:
    return [i for i in range(requests) if scope.sample(parented)]


def test_rate_traces_one_in_n_counted_from_the_setting() -> None:
    trace = settings()
    assert traced(trace.server, 4) == [0, 1, 2, 3]
    trace.update("", change_of({"trace_rate": ["3"]}))
    assert traced(trace.server, 9) == [2, 5, 8]


def test_count_counts_down_and_then_nothing_is_traced() -> None:
    trace = settings()
    trace.update("", change_of({"trace_count": ["2"], "trace_rate": ["2"]}))
    assert traced(trace.server, 10) == [1, 3]
    assert trace.document()["trace_count"] == ["0"]
    assert traced(trace.server, 3, parented=True) == [0, 1, 2]  # the caller sampled them


def test_off_traces_nothing_not_even_a_callers_trace() -> None:
    trace = settings()
    trace.update("", change_of({"trace_level": ["OFF"]}))
    assert traced(trace.server, 5, parented=True) == []
    assert not trace.tracing


def test_a_model_setting_overrides_and_follows_the_global_one() -> None:
    trace = settings(rate=4)
    trace.update("", change_of({"trace_level": ["OFF"]}))
    trace.update("a", change_of({"trace_level": ["TIMESTAMPS"]}))
    assert trace.tracing
    assert trace.document("a") == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["4"],
        "trace_count": ["-1"],
        "trace_mode": ["opentelemetry"],
    }
    assert trace.document("b")["trace_level"] == ["OFF"]  # no settings of its own
    trace.update("", change_of({"trace_rate": ["2"], "trace_count": ["5"]}))
    assert trace.document("a")["trace_rate"] == ["2"]  # not set on the model: follows
    trace.update("a", change_of({"trace_rate": ["1"]}))
    trace.update("", change_of({"trace_rate": ["7"]}))
    assert trace.document("a")["trace_rate"] == ["1"]  # set on the model: kept
    assert traced(trace.of("a"), 3) == [0, 1, 2]
    assert trace.document("a")["trace_count"] == ["2"]  # the model's own count of 5
    trace.update("a", change_of({"trace_level": None}))  # cleared: the global OFF again
    assert trace.document("a")["trace_level"] == ["OFF"]
    trace.update("a", change_of({"trace_rate": []}))  # nothing of its own left
    assert "a" not in trace.models
    assert trace.document("a") == trace.document()


def test_clearing_a_global_setting_returns_to_the_start_up_value() -> None:
    trace = settings(rate=10)
    trace.update("", change_of({"trace_rate": ["3"]}))
    trace.update("", change_of({"trace_rate": None}))
    assert trace.document()["trace_rate"] == ["10"]


def test_a_kept_count_is_what_was_left() -> None:
    trace = settings()
    trace.update("a", change_of({"trace_count": ["3"]}))
    traced(trace.of("a"), 2)
    trace.update("a", change_of({"trace_rate": ["1"]}))
    assert trace.document("a")["trace_count"] == ["1"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["TIMESTAMPS", "TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "OFF must be given alone"),
        ({"trace_level": ["LOUD"]}, "unknown trace level"),
        ({"trace_rate": ["0"]}, f"trace_rate must be an integer from 1 to {MAX_RATE}"),
        ({"trace_rate": ["-3"]}, "trace_rate must be"),
        ({"trace_rate": [str(MAX_RATE + 1)]}, "trace_rate must be"),
        ({"trace_rate": ["ten"]}, "trace_rate must be"),
        ({"trace_rate": ["1", "2"]}, "trace_rate takes one value"),
        ({"trace_count": ["-2"]}, f"trace_count must be an integer from -1 to {MAX_COUNT}"),
        ({"trace_file": ["/tmp/t.json"]}, "trace_file cannot be set"),
        ({"trace_file": []}, "trace_file cannot be set"),
        ({"trace_mode": ["triton"]}, "trace_mode cannot be changed"),
        ({"log_frequency": ["100"]}, "log_frequency is not supported"),
        ({"trace_sample": ["1"]}, "unknown trace setting 'trace_sample'"),
    ],
)
def test_refusals(change: dict[str, list[str] | None], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        change_of(change)


def test_a_null_log_frequency_asks_nothing() -> None:
    assert change_of({"log_frequency": None}).set == {}


def test_tracing_with_no_exporter_is_refused_whole() -> None:
    trace = TraceSettings(TraceValues(), exporting=False)
    assert trace.document()["trace_level"] == ["OFF"]
    with pytest.raises(BadRequest, match="--otel-endpoint"):
        trace.update("", change_of({"trace_level": ["TIMESTAMPS"], "trace_rate": ["5"]}))
    assert trace.document()["trace_rate"] == ["1"]  # nothing applied
    trace.update("m", change_of({"trace_rate": ["5"]}))  # no tracing asked: kept
    assert trace.document("m")["trace_rate"] == ["5"]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"trace_rate": 5}, 'trace_rate must be a string, e.g. "1000"'),
        ({"trace_level": "TIMESTAMPS"}, "trace_level must be a list of strings"),
        ({"trace_level": []}, "trace_level must name a level"),
        ({"trace_level": [1]}, "trace_level must be a list of strings"),
        ({"rate": "5"}, "unknown trace setting 'rate'"),
    ],
)
def test_json_refusals(document: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        json_change(document)


def test_json_shapes() -> None:
    assert json_change({"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": None}) == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["2"],
        "trace_count": None,
    }
    assert json_document(settings().document()) == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "trace_mode": "opentelemetry",
    }


def test_start_up_values_are_checked() -> None:
    with pytest.raises(ValueError, match="trace rate"):
        TraceValues(rate=0)
    with pytest.raises(ValueError, match="trace count"):
        TraceValues(count=-2)
