import json
import math

import pytest

from lockgate.bench.client import RequestRecord
from lockgate.bench.loadgen import Level, LevelResult
from lockgate.bench.report import SLO, BenchReport, build_level_report, level_row


def _record(start: float, latency: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        scheduled=start, started=start, finished=start + latency, status=200, error=error
    )


def _result(records: list[RequestRecord], rate: float | None = 10.0) -> LevelResult:
    level = Level(rate=rate, concurrency=None if rate else 2, duration=1.0)
    return LevelResult(level, records, wall_s=1.0, client_cpu_s=0.05, loop_lag=[0.0001])


def test_goodput_errors_and_window() -> None:
    records = [_record(i * 0.1, 0.01 if i % 2 else 0.05) for i in range(10)]
    records[3].error = "http_503"
    records[5].error = "timeout"
    records.append(RequestRecord(scheduled=-1.0, warmup=True, started=-1.0, finished=-0.9))
    report = build_level_report(_result(records), SLO(latency_ms=20.0), llm=False)
    assert report.requests == 10 and report.completed == 8
    assert report.errors == {"http_503": 1, "timeout": 1}
    assert report.duration_s == pytest.approx(0.9 + 0.01)
    # odd i are fast (1, 7, 9 succeed; 3 and 5 failed): 3 of 10 meet the SLO
    assert report.goodput_fraction == pytest.approx(0.3)
    assert report.goodput == pytest.approx(3 / 0.91)
    assert report.throughput == pytest.approx(8 / 0.91)
    assert report.latency_ms.count == 8
    assert report.sent_rate == pytest.approx(10.0)


def test_no_slo_means_no_goodput() -> None:
    report = build_level_report(_result([_record(0, 0.01)]), SLO(), llm=False)
    assert report.goodput is None and report.goodput_fraction is None


def test_llm_metrics_from_chunk_times() -> None:
    record = _record(0.0, 1.0)
    record.chunk_times = [0.2, 0.4, 0.6, 1.0]  # TTFT 200 ms, gaps 200, 200, 400 ms
    record.output_tokens = 5  # from the usage chunk: (1.0 - 0.2) / 4 = 200 ms per token
    record.prompt_tokens = 7
    slow = _record(0.5, 1.0)
    slow.chunk_times = [1.4]  # TTFT 900 ms: misses the TTFT SLO
    slow.output_tokens = 1
    report = build_level_report(
        _result([record, slow], rate=None), SLO(ttft_ms=500.0, tpot_ms=250.0), llm=True
    )
    llm = report.llm
    assert llm is not None
    assert record.tpot == pytest.approx(0.2)
    assert slow.tpot is None
    assert llm.ttft_ms.p50 == pytest.approx(550.0)
    assert llm.tpot_ms.count == 1
    assert sorted(record.itls()) == pytest.approx([0.2, 0.2, 0.4])
    assert llm.itl_ms.max == pytest.approx(400.0)
    assert llm.total_output_tokens == 6 and llm.total_tokens == 13
    assert report.goodput_fraction == 0.5
    assert llm.goodput_output_tokens_per_s == pytest.approx(5 / 1.5)


def test_report_json_is_strict_and_csv_has_a_row_per_level(tmp_path) -> None:
    empty = build_level_report(_result([]), SLO(latency_ms=5.0), llm=False)
    assert math.isnan(empty.latency_ms.p50)
    full = build_level_report(_result([_record(0, 0.01)]), SLO(latency_ms=5.0), llm=False)
    report = BenchReport("v2", "http://x", "toy", "poisson", 0, SLO(5.0), [empty, full])
    path = tmp_path / "r.json"
    report.write_json(path)
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert data["levels"][0]["latency_ms"]["p50"] is None
    assert data["levels"][1]["latency_ms"]["p50"] == pytest.approx(10.0)
    report.write_csv(tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("mode,offered_rate")
    assert level_row(full)["latency_p99_ms"] == pytest.approx(10.0)


def test_warnings_name_the_client_when_it_lags() -> None:
    records = [_record(i * 0.1, 0.01) for i in range(10)]
    for r in records:
        r.started = r.scheduled + 0.005  # 5 ms late
    result = _result(records)
    result.client_cpu_s = 0.95
    report = build_level_report(result, SLO(), llm=False)
    assert any("behind schedule" in w for w in report.warnings)
    assert any("cores" in w for w in report.warnings)
