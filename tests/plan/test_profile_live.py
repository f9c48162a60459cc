"""`lockgate profile` through a real lockgate server, and its profile fed to `lockgate plan`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lockgate.plan.profile import ReplicaProfile, profile_server
from lockgate.service_time import ServiceTime, fit_service_time
from tests.conftest import ROOT, RunningServer


def lockgate(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lockgate.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def inference_counts(server: RunningServer, model: str) -> tuple[int, int]:
    """(rows inferred, batches executed) from the server's Triton-style statistics."""
    stats = httpx.get(f"{server.url}/v2/models/{model}/stats", timeout=10).json()
    entry = stats["model_stats"][0]
    return int(entry["inference_count"]), int(entry["execution_count"])


def test_profile_digits_through_the_server(server: RunningServer) -> None:
    rows_before, batches_before = inference_counts(server, "digits_onnx")
    replica = profile_server(
        server.url, "digits_onnx", 64, repeats=9, warmup=2, cpu_seconds=0, idle_requests=20
    )
    rows_after, batches_after = inference_counts(server, "digits_onnx")
    profile = replica.service
    rounds = 2 + 9  # warmup and timed; one request of each batch size per round
    assert rows_after - rows_before == rounds * sum(profile.batch_sizes) + 20  # + after idle
    assert batches_after - batches_before == rounds * len(profile.batch_sizes) + 20
    assert len(replica.idle_gaps_s) == len(replica.idle_extra_s) == 20
    assert all(-1.0 < t < 1.0 for t in replica.idle_extra_s)
    assert profile.model == "digits_onnx"
    assert profile.batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert all(0 < t < 1.0 for t in profile.median_s)
    assert profile.a_s >= 0 and profile.b_s >= 0
    # The digits model computes a batch in tens of microseconds, so the medians' order is the
    # machine's noise, not the model's: test_profile.py checks the shape of T(B) on slow models.
    assert profile.service_time(64) >= profile.service_time(1) > 0
    assert replica.cpu_per_request_s is None  # cpu_seconds=0: not measured


def test_profile_measures_the_servers_cpu_per_request(server: RunningServer) -> None:
    """digits_onnx computes a row in well under a tenth of what HTTP and JSON cost the server,
    so most of the CPU per request is the front end's: it shares the model's core."""
    replica = profile_server(server.url, "digits_onnx", 1, repeats=5, cpu_seconds=1.0)
    assert replica.cpu_per_request_s is not None and replica.compute_per_request_s is not None
    assert 0 < replica.compute_per_request_s < replica.cpu_per_request_s
    assert replica.frontend_s == pytest.approx(
        replica.cpu_per_request_s - replica.compute_per_request_s
    )
    assert 0 <= replica.frontend_per_batch_s <= replica.frontend_s  # paid once by a batch


def test_profile_cli_then_plan(server: RunningServer, tmp_path: Path) -> None:
    path = tmp_path / "digits.json"
    done = lockgate(
        *("profile", "--url", server.url, "--model", "digits_onnx", "--max-batch-size", "16"),
        *("--repeats", "5", "--idle-requests", "40", "--idle-longest-ms", "20"),
        *("--output", str(path)),
    )
    assert done.returncode == 0, done.stderr
    assert "T(B) = " in done.stdout and "a one-row request after idle takes" in done.stdout
    profile = ServiceTime.load(path)  # a replica profile is a ServiceTime with three more fields
    assert profile.batch_sizes == (1, 2, 4, 8, 16) and profile.b_s >= 0
    replica = ReplicaProfile.load(path)
    assert replica.cpu_per_request_s is not None
    one_row = profile.service_time(1) + replica.frontend_s  # what a request occupies the core for
    rate = 0.5 / one_row  # half of one replica's batch-1 capacity
    slo_ms = (profile.overhead_s + 20 * one_row) * 1e3
    done = lockgate(
        *("plan", "--profile", str(path), "--rate", f"{rate:.3f}", "--slo-ms", f"{slo_ms:.3f}"),
        *("--queue-model", "md1", "--json"),
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["replicas"] >= 1 and 1 <= plan["batch_size"] <= 16
    assert 0 < plan["utilization"] < 1 and plan["p99_s"] * 1e3 <= slo_ms
    assert plan["first_service_s"] is None  # md1 has no idle start
    argv = ("plan", "--profile", str(path), "--rate", f"{rate:.3f}", "--slo-ms", "1000")
    done = lockgate(*argv, "--queue-model", "mg1", "--max-batch-size", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert 0 < json.loads(done.stdout)["first_service_s"] < 1.0


def test_profile_of_an_unknown_model_is_a_clear_error(server: RunningServer) -> None:
    done = lockgate("profile", "--url", server.url, "--model", "nope", "--max-batch-size", "4")
    assert done.returncode == 2
    assert "model 'nope' not found" in done.stderr and "Traceback" not in done.stderr


def test_noisy_medians_still_fit_a_nonnegative_line() -> None:
    """A noisy profile whose plain least-squares slope is negative gets b = 0, not T(B) < 0."""
    falling = fit_service_time("m", (1, 2, 4, 8, 16), (0.009, 0.012, 0.008, 0.007, 0.008))
    assert falling.b_s == 0.0 and falling.a_s == pytest.approx(0.0088)
    below_zero = fit_service_time("m", (1, 2, 4), (0.001, 0.0021, 0.0041))  # plain fit: a < 0
    assert below_zero.a_s == 0.0 and below_zero.b_s == pytest.approx(0.001029, rel=1e-3)
    assert all(below_zero.service_time(b) > 0 for b in (1, 64))
