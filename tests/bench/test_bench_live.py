"""`lockgate bench` against a real lockgate server: the CLI in a subprocess and the library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.bench.report import SLO, LevelReport, build_level_report
from lockgate.bench.runner import BenchConfig, run_bench_sync
from lockgate.bench.stats import Summary
from tests.conftest import ROOT, RunningServer


def bench_cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lockgate.cli", "bench", "--quiet", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_ordered(latency: Summary) -> None:
    assert latency.p50 > 0
    assert latency.p50 <= latency.p90 <= latency.p95 <= latency.p99 <= latency.max


def test_open_loop_cli_on_digits(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = bench_cli(
        *("--url", server.url, "--model", "digits_onnx", "--rate", "60", "--duration", "3"),
        *("--slo-ms", "10000", "--output-json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    assert "rate 60/s" in done.stdout and "goodput" in done.stdout
    level = json.loads(out.read_text())["levels"][0]
    assert level["mode"] == "open" and level["requests"] > 100  # about 180 expected
    # digits_onnx's 50 ms SLO is its default deadline: a stall of the machine may cost a 504
    errors = level["errors"]
    assert set(errors) <= {"http_504"} and sum(errors.values()) <= 0.05 * level["requests"]
    assert level["completed"] + sum(errors.values()) == level["requests"]
    latency = Summary(**level["latency_ms"])
    assert_ordered(latency)
    assert latency.p50 < 1000
    # Poisson: 180 arrivals have a standard deviation of about 7%.
    assert level["throughput"] == pytest.approx(60, rel=0.3)
    assert level["throughput"] == pytest.approx(level["sent_rate"], rel=0.15)
    assert level["goodput"] == pytest.approx(level["throughput"])
    assert level["goodput_fraction"] == pytest.approx(level["completed"] / level["requests"])


@pytest.fixture(scope="module")
def constant_run(server: RunningServer) -> LevelReport:
    config = BenchConfig(
        url=server.url, model="digits_onnx", rates=(40.0,), arrival="constant", duration=2.0
    )
    report, results = run_bench_sync(config, progress=None)
    assert len(results) == 1 and len(report.levels) == 1
    return report.levels[0]


def test_constant_rate_is_achieved(constant_run: LevelReport) -> None:
    level = constant_run
    assert level.requests == 80 and level.completed == 80 and level.errors == {}
    assert level.sent_rate == pytest.approx(40.0)
    assert level.throughput == pytest.approx(40.0, rel=0.15)
    assert_ordered(level.latency_ms)
    assert level.goodput is None  # no SLO given
    assert level.send_lag_ms.count == 80 and level.client_cpu_ms_per_request > 0


def test_goodput_follows_the_slo(server: RunningServer) -> None:
    config = BenchConfig(url=server.url, model="digits_onnx", rates=(40.0,), duration=1.5)
    _, results = run_bench_sync(config, progress=None)
    generous = build_level_report(results[0], SLO(latency_ms=60_000), llm=False)
    impossible = build_level_report(results[0], SLO(latency_ms=0.001), llm=False)
    assert generous.completed > 0 and generous.goodput == pytest.approx(generous.throughput)
    assert impossible.goodput == 0.0 and impossible.goodput_fraction == 0.0
    assert impossible.completed == generous.completed  # the SLO changes goodput only
    median = build_level_report(results[0], SLO(latency_ms=generous.latency_ms.p50), llm=False)
    assert median.goodput_fraction == pytest.approx(0.5, abs=0.1)


def test_closed_loop_on_digits(server: RunningServer) -> None:
    config = BenchConfig(url=server.url, model="digits_onnx", concurrencies=(4,), duration=1.0)
    report, _ = run_bench_sync(config, progress=None)
    level = report.levels[0]
    assert level.mode == "closed" and level.concurrency == 4
    # every request is counted once; a busy machine may make a fresh server refuse a few (503)
    assert level.completed + sum(level.errors.values()) == level.requests
    assert level.completed > 0.95 * level.requests > 10 and set(level.errors) <= {"http_503"}
    assert_ordered(level.latency_ms)


def test_unknown_model_404s_are_counted(server: RunningServer, tmp_path: Path) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}]}
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(json.dumps(body) + "\n")
    out = tmp_path / "bench.json"
    done = bench_cli(
        *("--url", server.url, "--model", "no_such_model", "--input-file", str(bodies)),
        *("--rate", "50", "--num-requests", "40", "--output-json", str(out)),
    )
    assert done.returncode == 1, done.stderr  # every request failed: counted, and exit 1
    assert "no request succeeded" in done.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["requests"] == 40 and level["completed"] == 0
    assert level["errors"] == {"http_404": 40}
    assert "http_404 40" in done.stdout


def test_unknown_model_without_bodies_is_a_clear_error(server: RunningServer) -> None:
    done = bench_cli(
        *("--url", server.url, "--model", "no_such_model", "--rate", "10", "--duration", "1")
    )
    assert done.returncode == 2
    assert "model 'no_such_model' not found" in done.stderr
    assert "Traceback" not in done.stderr
