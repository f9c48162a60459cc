"""perf_analyzer, Triton's own load generator, against the kinds of model it treats apart:
an ensemble (it reads the steps from the config and reports each composing model), a
response-cached model (its requests never reach a queue) and a cascade (a composition Triton
does not have). It checks the server's statistics between measurements and stops with an
error when they do not show the model's requests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import PERF_ANALYZER, RunningServer, free_port, start_server

pytestmark = pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason="perf_analyzer not installed (scripts/install-perf-analyzer.sh)",
)

DIGITS_IO = {
    "max_batch_size": 64,
    "inputs": [{"name": "input", "datatype": "FP32", "dims": [64]}],
    "outputs": [
        {"name": "label", "datatype": "INT64", "dims": []},
        {"name": "probabilities", "datatype": "FP32", "dims": [10]},
    ],
}


def _copy_model(demo_repo: Path, repo: Path, source: str, name: str, **changes: object) -> None:
    """`source` from the demo build as `name`, without its SLO (a stalled test machine must not
    turn a request into a 504, which ends perf_analyzer's run), with `changes` to its config."""
    shutil.copytree(demo_repo / source, repo / name)
    path = repo / name / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config.pop("latency_slo_ms", None)
    config.update(name=name, **changes)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _write_config(repo: Path, name: str, config: dict[str, object]) -> None:
    (repo / name / "1").mkdir(parents=True)
    text = yaml.safe_dump({"name": name, **DIGITS_IO, **config}, sort_keys=False)
    (repo / name / "config.yaml").write_text(text)


@pytest.fixture(scope="module")
def composed(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("composed")
    _copy_model(demo_repo, repo, "digits_onnx", "digits_onnx")
    _copy_model(demo_repo, repo, "digits_sklearn", "digits_sklearn")
    _copy_model(demo_repo, repo, "digits_onnx", "digits_cached", response_cache={"enable": True})
    cascade = {"models": ["digits_onnx", "digits_sklearn"], "threshold": 0.9}
    cascade["confidence_output"] = "probabilities"
    _write_config(repo, "digits_cascade", {"backend": "cascade", "cascade": cascade})
    maps = {"input_map": {"input": "input"}}
    maps["output_map"] = {"label": "label", "probabilities": "probabilities"}
    _write_config(
        repo,
        "digits_chain",
        {"backend": "ensemble", "ensemble": [{"model": "digits_onnx", **maps}]},
    )
    tmp = tmp_path_factory.mktemp("composed-server")
    server = start_server(repo, tmp, "--no-llm", grpc_port=free_port())
    yield server
    server.stop()


def _perf_analyzer(server: RunningServer, model: str, protocol: str = "http", *extra: str) -> str:
    address = server.grpc_address if protocol == "grpc" else server.address
    command = [str(PERF_ANALYZER), "-m", model, "-u", address, "-i", protocol, *extra]
    command += ["--concurrency-range", "2", "--measurement-interval", "500"]
    command += ["--max-trials", "3", "--stability-percentage", "100"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_an_ensemble_and_its_steps(
    composed: RunningServer, protocol: str
) -> None:
    config = httpx.get(f"{composed.url}/v2/models/digits_chain/config").json()
    assert config["platform"] == "ensemble"
    assert config["ensemble_scheduling"]["step"][0]["model_name"] == "digits_onnx"
    assert config["ensemble_scheduling"]["step"][0]["model_version"] == -1
    out = _perf_analyzer(composed, "digits_chain", protocol)
    assert "Composing models" in out and "digits_onnx, version: 1" in out


def test_perf_analyzer_measures_a_cached_model(composed: RunningServer) -> None:
    config = httpx.get(f"{composed.url}/v2/models/digits_cached/config").json()
    assert config["response_cache"] == {"enable": True}
    out = _perf_analyzer(composed, "digits_cached")
    assert "Cache hit count" in out
    stats = httpx.get(f"{composed.url}/v2/models/digits_cached/stats").json()["model_stats"][0]
    phases = stats["inference_stats"]
    assert phases["cache_hit"]["count"] > 100
    assert phases["cache_hit"]["ns"] > 0
    assert phases["cache_miss"]["count"] >= 1
    # as Triton counts a hit: a success that passed the queue
    assert phases["success"]["count"] == phases["queue"]["count"]
    assert phases["success"]["count"] >= phases["cache_hit"]["count"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_a_cascade(composed: RunningServer, protocol: str) -> None:
    before = httpx.get(f"{composed.url}/v2/models/digits_cascade/stats").json()["model_stats"][0]
    _perf_analyzer(composed, "digits_cascade", protocol)
    after = httpx.get(f"{composed.url}/v2/models/digits_cascade/stats").json()["model_stats"][0]
    served = (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    )
    assert served > 100
    assert after["execution_count"] - before["execution_count"] == served
    assert after["inference_stats"]["success"]["ns"] > 0


def test_perf_analyzer_passes_tensors_in_system_shared_memory(composed: RunningServer) -> None:
    """perf_analyzer registers its regions, names them in every request, and unregisters
    (over gRPC; tritonclient's own test covers both protocols, benchmarks/shared_memory.py
    runs perf_analyzer over both)."""
    before = _answered(composed, "digits_onnx")
    extra = ("--shared-memory", "system", "--output-shared-memory-size", "1024")
    out = _perf_analyzer(composed, "digits_onnx", "grpc", *extra)
    assert "Throughput" in out
    assert _answered(composed, "digits_onnx") > before
    assert httpx.get(composed.url + "/v2/systemsharedmemory/status").json() == []


def _answered(server: RunningServer, model: str) -> int:
    stats = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"]
    return sum(v["inference_stats"]["success"]["count"] for v in stats)
