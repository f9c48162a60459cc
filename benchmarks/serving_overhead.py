"""serving_overhead: what lockgate adds to one small ONNX model, against two baselines.

- direct: onnxruntime `session.run` in this process on one row (1 intra-op thread), pinned
  to the server's core: the model's own time.
- floor: `benchmarks/floor_app.py`, a raw ASGI app on uvicorn (uvloop, httptools) that runs
  the same model inline: the least an HTTP server in Python can add.

V2 JSON with one row of the digits model. Latency at concurrency 1 comes from a raw
keep-alive socket client (`RawClient`: pre-encoded requests, responses read by length, pinned
to the client core), so the client's own cost, tens of microseconds, stays out of the figure.
Throughput at concurrency 32 comes from the same kind of client in a closed loop
(`raw_load.closed_loop`: 32 keep-alive connections, each sending its next pre-encoded request
the moment the last is answered), the same client for both servers. It used to come from 32
aiohttp workers, but aiohttp costs its one client core about 70 to 100 µs a request: it could
not offer much more than 10,000 to 14,000 requests a second, about what the floor serves, so
the floor's figure was the client's, not the server's. The table notes the client's CPU per
request and the share of its core it used, so a run whose client was the limit shows it.
Repetitions alternate lockgate and floor so that drift on a noisy machine hits both; tables
quote medians over repetitions. Triton's perf_analyzer cross-checks the c=1 latency when
`.venv-perf` has it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import raw_load
from benchmarks.common import (
    CLIENT_CORE,
    ROOT,
    SERVER_CORE,
    Context,
    LoadResult,
    Server,
    SuiteResult,
    Target,
    environment,
    free_port,
    median,
    percentile,
    pin_command,
    pinned,
    raw_latencies,
    run_async,
    running,
    start_lockgate,
    start_server,
    time_calls,
    v2_body,
)

SUITE = "serving_overhead"
MODEL = "digits_onnx"
TARGET_ADDED_P50_MS = 1.0
PERF_ANALYZER = ROOT / ".venv-perf" / "bin" / "perf_analyzer_wrapped"


@dataclass(slots=True)
class Samples:
    """Per-repetition figures for one server (or the direct call), in seconds or req/s."""

    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)  # client CPU seconds per request
    client_share: list[float] = field(default_factory=list)  # of the client's core
    errors: int = 0

    def add_latency(self, latencies: list[float]) -> None:
        self.p50.append(percentile(latencies, 50))
        self.p99.append(percentile(latencies, 99))

    def add_run(self, result: LoadResult) -> None:
        self.errors += result.errors + result.refused


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    model_dir = demo_model(ctx, MODEL)
    repository = ctx.work / "overhead-repo"
    shutil.copytree(model_dir, repository / MODEL)
    rows = digits_rows(16)  # [16, 64] float32
    ctx.say(SUITE, "starting lockgate and the floor app on core 0")
    lockgate = start_lockgate(repository, ctx.work)
    floor = start_floor(model_dir / "1" / "model.onnx", ctx.work)
    with running(lockgate, floor):
        samples = measure(ctx, {"lockgate": lockgate, "floor": floor}, rows, model_dir)
        perf = perf_analyzer(ctx, lockgate)
    result = report(samples, perf)
    result.seconds = time.perf_counter() - started
    return result


def demo_model(ctx: Context, name: str) -> Path:
    """A demo model folder, built into the lockgate cache if needed."""
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository, default_demo_path

    chosen = [m for m in DEMO_MODELS if m.name == name]
    repository = build_demo_repository(
        default_demo_path(), models=chosen, progress=lambda m: ctx.say("build", m)
    )
    return repository / name


def digits_rows(count: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().data[:count] / 16.0).astype(np.float32)  # [count, 64]


def start_floor(model_path: Path, work: Path) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.floor_app", str(model_path), "--port", str(port)]
    return start_server("floor", command, port, work)


def measure(
    ctx: Context, servers: dict[str, Server], rows: np.ndarray, model_dir: Path
) -> dict[str, Samples]:
    bodies = tuple(v2_body({"input": rows[i : i + 1]}) for i in range(len(rows)))
    targets = {n: Target(f"{s.url}/v2/models/{MODEL}/infer", bodies) for n, s in servers.items()}
    samples = {name: Samples() for name in [*servers, "direct"]}
    session = direct_session(model_dir / "1" / "model.onnx")
    count = 300 if ctx.quick else 1500
    for rep in range(1, ctx.repetitions + 1):
        latencies = interleaved_c1(targets, count)
        for name, target in targets.items():
            load, client_cpu = raw_closed_loop(target, 32, ctx.scale(3.0))
            samples[name].add_latency(latencies[name])
            samples[name].rate.append(load.throughput)
            samples[name].client_cpu.append(client_cpu / max(1, load.ok + load.refused))
            samples[name].client_share.append(client_cpu / load.seconds)
            samples[name].add_run(load)
            ctx.say(
                SUITE,
                f"rep {rep}: {name:8} c=1 p50 {percentile(latencies[name], 50) * 1e3:.3f} ms "
                f"p99 {percentile(latencies[name], 99) * 1e3:.3f} ms, "
                f"c=32 {load.throughput:,.0f} req/s "
                f"(client {client_cpu / load.seconds:.0%} of its core)",
            )
        times = time_direct(session, rows, count)
        samples["direct"].add_latency(times)
        ctx.say(SUITE, f"rep {rep}: direct   p50 {percentile(times, 50) * 1e3:.3f} ms")
    return samples


def raw_closed_loop(target: Target, clients: int, seconds: float) -> tuple[LoadResult, float]:
    """`clients` raw keep-alive connections in a closed loop for `seconds` (after a short
    warmup), on this process's core: the load and the client's CPU seconds it took."""
    parts = urllib.parse.urlsplit(target.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [raw_load.post_request(host, port, parts.path, body) for body in target.bodies]
    run_async(raw_load.closed_loop(host, port, requests, clients, min(0.5, seconds / 4)))
    cpu, start = time.process_time(), time.perf_counter()
    outcomes = run_async(raw_load.closed_loop(host, port, requests, clients, seconds))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    latencies = [t for t, s in zip(outcomes.latencies, outcomes.statuses, strict=True) if s == 200]
    return LoadResult(latencies, Counter(outcomes.statuses), elapsed), cpu


def interleaved_c1(
    targets: dict[str, Target], count: int, chunks: int = 10
) -> dict[str, list[float]]:
    """c=1 latencies of each target, `count` each, sent in alternating chunks.

    Background load on a shared machine changes by the second; alternating every
    count/chunks requests exposes every target to the same load.
    """
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    with pinned(CLIENT_CORE):
        for _ in range(chunks):
            for name, target in targets.items():
                latencies[name] += raw_latencies(target, count // chunks)
    return latencies


def time_direct(session: Any, rows: np.ndarray, count: int) -> list[float]:
    """Seconds per `session.run` on one row, on the server's core."""
    feeds = [{"input": rows[i : i + 1]} for i in range(len(rows))]  # each [1, 64]
    calls = iter(range(count + 50))
    with pinned(SERVER_CORE):
        return time_calls(lambda: session.run(None, feeds[next(calls) % len(feeds)]), count, 50)


def direct_session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    with pinned(SERVER_CORE):  # ORT's threads inherit this process's affinity
        return ort.InferenceSession(str(path), sess_options=options)


# -- perf_analyzer -----------------------------------------------------------------------


@dataclass(slots=True)
class PerfAnalyzer:
    p50: float  # seconds
    p99: float
    rate: float
    server_line: str


def perf_analyzer(ctx: Context, server: Server) -> PerfAnalyzer | None:
    if not PERF_ANALYZER.exists():
        ctx.say(SUITE, "perf_analyzer not installed (scripts/install-perf-analyzer.sh): skipped")
        return None
    ctx.say(SUITE, "perf_analyzer at concurrency 1")
    command = [str(PERF_ANALYZER), "-m", MODEL, "-u", f"127.0.0.1:{server.port}", "-i", "http"]
    command += ["--concurrency-range", "1", "--measurement-mode", "count_windows"]
    command += ["--measurement-request-count", "1000", "--stability-percentage", "100"]
    try:
        done = subprocess.run(
            pin_command(command, CLIENT_CORE), capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        ctx.say(SUITE, "perf_analyzer timed out")
        return None
    found = parse_perf_analyzer(done.stdout)
    if found is None:
        ctx.say(SUITE, f"perf_analyzer failed ({done.returncode}): {done.stderr[-300:]}")
    return found


def parse_perf_analyzer(text: str) -> PerfAnalyzer | None:
    p50 = re.search(r"p50 latency: (\d+) usec", text)
    p99 = re.search(r"p99 latency: (\d+) usec", text)
    rate = re.search(r"Throughput: ([\d.]+) infer/sec", text)
    server = re.search(r"Avg request latency: .*", text)
    if not (p50 and p99 and rate):
        return None
    line = server.group(0) if server else ""
    return PerfAnalyzer(int(p50[1]) / 1e6, int(p99[1]) / 1e6, float(rate[1]), line)


# -- report ------------------------------------------------------------------------------


def report(samples: dict[str, Samples], perf: PerfAnalyzer | None) -> SuiteResult:
    lg, floor, direct = samples["lockgate"], samples["floor"], samples["direct"]
    ms = 1e3
    added50 = (median(lg.p50) - median(direct.p50)) * ms
    added99 = (median(lg.p99) - median(direct.p99)) * ms
    result = SuiteResult(
        suite=SUITE,
        title="Serving overhead: digits ONNX, one row, V2 JSON",
        target=f"added latency at c=1, p50 (lockgate - direct ORT) ≤ {TARGET_ADDED_P50_MS:g} ms",
        met=added50 <= TARGET_ADDED_P50_MS,
        environment=environment(),
    )
    for q, lg_q, fl_q, di_q in (
        ("p50", lg.p50, floor.p50, direct.p50),
        ("p99", lg.p99, floor.p99, direct.p99),
    ):
        result.add(
            f"lockgate c=1 {q}",
            median(lg_q) * ms,
            "ms",
            baseline_label=f"floor c=1 {q}",
            baseline=median(fl_q) * ms,
        )
        result.add(f"direct ORT {q}", median(di_q) * ms, "ms", note="in-process session.run")
    result.add(
        "added latency p50 (lockgate - direct)",
        added50,
        "ms",
        baseline_label="floor - direct",
        baseline=(median(floor.p50) - median(direct.p50)) * ms,
        note=f"target ≤ {TARGET_ADDED_P50_MS:g} ms",
    )
    result.add(
        "added latency p99 (lockgate - direct)",
        added99,
        "ms",
        baseline_label="floor - direct",
        baseline=(median(floor.p99) - median(direct.p99)) * ms,
    )
    result.add(
        "lockgate - floor, c=1 p50",
        (median(lg.p50) - median(floor.p50)) * ms,
        "ms",
        note="what lockgate adds over a bare ASGI server",
    )
    result.add(
        "lockgate c=32 throughput",
        median(lg.rate),
        "req/s",
        baseline_label="floor c=32",
        baseline=median(floor.rate),
    )
    if perf is not None:
        result.add(
            "perf_analyzer c=1 p50 (lockgate)",
            perf.p50 * ms,
            "ms",
            baseline_label="raw client c=1 p50",
            baseline=median(lg.p50) * ms,
        )
        result.add(
            "perf_analyzer c=1 p99 (lockgate)",
            perf.p99 * ms,
            "ms",
            baseline_label="raw client c=1 p99",
            baseline=median(lg.p99) * ms,
        )
        if perf.server_line:
            result.notes.append(f"perf_analyzer, server side: {perf.server_line}")
    result.notes.append(
        "c=32: a closed loop of 32 raw keep-alive connections (`raw_load.closed_loop`), the "
        "same client for both servers; its CPU per request was "
        f"{median(lg.client_cpu) * 1e6:.0f} µs against lockgate and "
        f"{median(floor.client_cpu) * 1e6:.0f} µs against the floor, "
        f"{median(lg.client_share):.0%} and {median(floor.client_share):.0%} of its core."
    )
    errors = lg.errors + floor.errors
    if errors:
        result.notes.append(f"{errors} requests failed or were refused")
    result.raw = {
        name: {
            "p50_s": s.p50,
            "p99_s": s.p99,
            "req_per_s": s.rate,
            "client_cpu_s_per_request": s.client_cpu,
        }
        for name, s in samples.items()
    }
    return result
