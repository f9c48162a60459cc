"""shared_memory: tensors passed through system shared memory against the same tensors sent on
the wire, as perf_analyzer sends both.

`python -m benchmarks.run --suite shared_memory [--quick]`

One lockgate, pinned to the server core, serves `big`: a Python model that answers its input
(262,144 FP32, 1 MiB in and 1 MiB out, no batching), so what is measured is moving the tensors.
perf_analyzer, on the client core, drives it at concurrency 2 over HTTP (binary tensors) and
gRPC (raw contents), each with and without `--shared-memory system`, in alternating rounds.

Target: system shared memory at least doubles the throughput of 1 MiB tensors on both
protocols (the reason to use it), in the same run.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    CLIENT_CORE,
    Context,
    SuiteResult,
    environment,
    free_port,
    pin_command,
    running,
    start_server,
)
from benchmarks.serving_overhead import PERF_ANALYZER

SUITE = "shared_memory"
TARGET = 2.0  # shared memory's throughput over the wire's, each protocol
ELEMENTS = 262_144  # FP32: 1 MiB
CONFIG = f"""\
backend: python
max_batch_size: 0
inputs:
  - {{name: x, datatype: FP32, dims: [{ELEMENTS}]}}
outputs:
  - {{name: y, datatype: FP32, dims: [{ELEMENTS}]}}
"""
MODEL = """\
class Model:
    def load(self, config, version_dir):
        pass

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


def write_repository(work: Path) -> Path:
    folder = work / "shm-repo" / "big"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(CONFIG)
    (folder / "1" / "model.py").write_text(MODEL)
    return folder.parent


def throughput(port: int, protocol: str, shared: bool, interval_ms: int) -> tuple[float, float]:
    """perf_analyzer's infer/sec and average latency (ms) at concurrency 2."""
    command = [str(PERF_ANALYZER), "-m", "big", "-u", f"127.0.0.1:{port}", "-i", protocol]
    command += ["--concurrency-range", "2", "--measurement-interval", str(interval_ms)]
    if shared:
        command += ["--shared-memory", "system", "--output-shared-memory-size", str(4 * ELEMENTS)]
    done = subprocess.run(
        pin_command(command, CLIENT_CORE), capture_output=True, text=True, timeout=300
    )
    rate = re.search(r"Throughput: ([\d.]+) infer/sec", done.stdout)
    latency = re.search(r"Avg latency: (\d+) usec", done.stdout)
    if done.returncode != 0 or rate is None or latency is None:
        raise RuntimeError(f"perf_analyzer failed: {done.stdout[-400:]} {done.stderr[-400:]}")
    return float(rate[1]), int(latency[1]) / 1e3


def run(ctx: Context) -> SuiteResult:
    if not PERF_ANALYZER.exists():
        raise RuntimeError("perf_analyzer is not installed (scripts/install-perf-analyzer.sh)")
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    command += ["--no-llm", "--grpc-port", str(grpc_port)]
    server = start_server("lockgate", command, port, ctx.work)
    interval = 1000 if ctx.quick else 3000
    rounds = 1 if ctx.quick else max(3, ctx.repetitions)
    rates: dict[tuple[str, bool], list[float]] = {}
    latencies: dict[tuple[str, bool], list[float]] = {}
    with running(server):
        for r in range(rounds):
            for protocol, target in (("http", port), ("grpc", grpc_port)):
                for shared in (False, True):
                    rate, latency = throughput(target, protocol, shared, interval)
                    rates.setdefault((protocol, shared), []).append(rate)
                    latencies.setdefault((protocol, shared), []).append(latency)
                    way = "system shared memory" if shared else "on the wire"
                    ctx.say(
                        SUITE,
                        f"round {r + 1}/{rounds} {protocol} {way}: {rate:,.0f} infer/s, "
                        f"{latency:.2f} ms",
                    )
    ratios = {
        p: statistics.median(rates[p, True]) / statistics.median(rates[p, False])
        for p in ("http", "grpc")
    }
    result = SuiteResult(
        suite=SUITE,
        title="System shared memory against the wire: 1 MiB FP32 in and out, perf_analyzer c=2",
        target=f"shared memory >= {TARGET:g}x the wire's throughput, HTTP and gRPC",
        met=all(r >= TARGET for r in ratios.values()),
        environment=environment(),
    )
    measures = (("throughput", rates, "infer/s"), ("average latency", latencies, "ms"))
    for protocol, name in (("http", "HTTP (binary tensors)"), ("grpc", "gRPC (raw contents)")):
        for measure, values, unit in measures:
            wire = statistics.median(values[protocol, False])
            result.add(f"{name} on the wire: {measure}", wire, unit)
            result.add(
                f"{name} in shared memory: {measure}",
                statistics.median(values[protocol, True]),
                unit,
                baseline_label="on the wire",
                baseline=wire,
            )
    result.notes.append(
        f"Medians of {rounds} alternating rounds of {interval} ms windows; server pinned to its "
        "core, perf_analyzer on the other; the model answers its input, so the figures are "
        "the cost of moving 2 MiB per request."
    )
    result.notes.append(f"Suite time {time.perf_counter() - started:.0f} s.")
    return result
