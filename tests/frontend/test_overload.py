"""Overload and faults through a real server: admitted work keeps its SLO, the rest is refused fast.

The overload model sleeps a fixed time per batch, so its capacity is known and stable. The test
measures that capacity closed-loop, then offers about three times it open-loop (Poisson
arrivals, latency from the scheduled send time) with a per-request timeout equal to the SLO.

A control stream of health checks rides along at a tenth of the rate: on a busy machine the
client's and the server's own scheduling delays show up there too, and a refusal is fast when it
is as fast as a health check under the same load.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import pytest

from benchmarks.overload_real import minilm_bodies as benchmark_bodies
from tests.conftest import RunningServer, free_port, http_post, models_of, start_server

SLO_S = 0.500  # the latency objective, sent as each request's timeout
SERVICE_S = 0.050  # the model sleeps this long per batch, whatever its size
MAX_BATCH = 4
OVERLOAD = 3.0  # offered load as a multiple of the measured capacity
DURATION_S = float(os.environ.get("LOCKGATE_OVERLOAD_SECONDS", "10"))

STEADY_MODEL = f'''
import time


class Model:
    """Doubles its input; every batch takes {SERVICE_S} s, whatever its size."""

    def infer(self, inputs):
        time.sleep({SERVICE_S})
        return {{"y": inputs["x"] * 2}}
'''


def write_steady_model(repo: Path) -> None:
    folder = repo / "steady"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(STEADY_MODEL)
    (folder / "config.yaml").write_text(
        textwrap.dedent(
            f"""\
            backend: python
            max_batch_size: {MAX_BATCH}
            inputs:
              - {{name: x, datatype: FP32, dims: [4]}}
            outputs:
              - {{name: y, datatype: FP32, dims: [4]}}
            dynamic_batching: {{max_queue_size: 256}}
            """
        )
    )


@pytest.fixture(scope="module")
def steady_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("steady-repo")
    write_steady_model(repo)
    return repo


@pytest.fixture(scope="module")
def steady_server(
    steady_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    server = start_server(steady_repo, tmp_path_factory.mktemp("steady"), "--no-llm")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`test_repo`'s faulty and echo models on a server of this module's own: its floods would
    leave the session's server busy for the modules after it."""
    repo = models_of(test_repo, tmp_path_factory.mktemp("faulty-repo"), "faulty", "echo")
    running = start_server(repo, tmp_path_factory.mktemp("faulty"), "--no-llm")
    yield running
    running.stop()


def infer_body(value: float, timeout_us: int | None) -> bytes:
    payload: dict[str, object] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]
    }
    if timeout_us is not None:
        payload["parameters"] = {"timeout": timeout_us}
    return json.dumps(payload).encode()


# -- load generation ---------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    status: int  # HTTP status; 0 when the request failed at the transport
    latency: float  # seconds from the scheduled send time to the whole response
    error: str = ""  # the JSON error message of a non-200 answer
    control: bool = False  # a health check of the control stream


@dataclass(slots=True)
class LoadResult:
    sent: int
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    control: list[Outcome] = field(default_factory=list)

    def latencies(self, status: int) -> np.ndarray:
        return np.array([o.latency for o in self.outcomes if o.status == status])

    def control_p99(self) -> float:
        values = [o.latency for o in self.control]
        return float(np.percentile(values, 99)) if values else 0.0

    def count(self, status: int) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    def p50(self, status: int) -> float:
        values = self.latencies(status)
        return float(np.percentile(values, 50)) if len(values) else 0.0

    def p99(self, status: int) -> float:
        values = self.latencies(status)
        return float(np.percentile(values, 99)) if len(values) else 0.0

    def goodput(self, slo: float) -> float:
        """200s within the SLO per second of offered load."""
        good = sum(1 for o in self.outcomes if o.status == 200 and o.latency <= slo)
        return good / self.duration

    def summary(self, slo: float) -> str:
        statuses = sorted({o.status for o in self.outcomes})
        counts = ", ".join(f"{s}: {self.count(s)}" for s in statuses)
        return (
            f"sent {self.sent} in {self.duration:.1f} s ({self.sent / self.duration:.0f}/s); "
            f"{counts}; goodput {self.goodput(slo):.0f}/s; "
            f"p50/p99 200 {self.p50(200) * 1000:.1f}/{self.p99(200) * 1000:.1f} ms; "
            f"p99 503 {self.p99(503) * 1000:.1f} ms; "
            f"p99 health check {self.control_p99() * 1000:.1f} ms"
        )


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, scheduled: float) -> Outcome:
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            raw = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(0, time.perf_counter() - scheduled, repr(exc))
    latency = time.perf_counter() - scheduled
    return Outcome(status, latency, "" if status == 200 else _error_of(raw))


def _error_of(raw: bytes) -> str:
    """The message of a JSON error body; empty when the body is not one."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return ""
    return str(payload.get("error", "")) if isinstance(payload, dict) else ""


async def closed_loop(url: str, body: bytes, concurrency: int, seconds: float) -> float:
    """Requests per second answered with 200 by `concurrency` clients sending back to back."""
    done = 0
    async with aiohttp.ClientSession() as session:
        stop = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                outcome = await _send(session, url, body, time.perf_counter())
                done += outcome.status == 200

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def _check(session: aiohttp.ClientSession, url: str, scheduled: float) -> Outcome:
    async with session.get(url) as r:
        await r.read()
        return Outcome(r.status, time.perf_counter() - scheduled, control=True)


async def open_loop(
    base: str,
    body: bytes | list[bytes],
    rate: float,
    seconds: float,
    seed: int = 0,
    model: str = "steady",
) -> LoadResult:
    """Poisson arrivals at `rate` plus health checks at `rate / 10`; latency from schedule.
    With a list of bodies, request i sends body i modulo their number."""
    bodies = body if isinstance(body, list) else [body]
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * seconds * 1.2) + 10))
    offsets = offsets[offsets < seconds]  # [n] seconds from the start
    checks = np.cumsum(rng.exponential(10.0 / rate, size=int(rate * seconds * 0.12) + 10))
    checks = checks[checks < seconds]  # [m]
    plan = sorted([(float(t), False) for t in offsets] + [(float(t), True) for t in checks])
    url, health = base + f"/v2/models/{model}/infer", base + "/v2/health/live"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)  # past it, a request counts as a client timeout
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[Outcome]] = []
        start = time.perf_counter()
        for index, (offset, control) in enumerate(plan):
            body = bodies[index % len(bodies)]
            scheduled = start + offset
            wait = scheduled - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            send = (
                _check(session, health, scheduled)
                if control
                else _send(session, url, body, scheduled)
            )
            tasks.append(asyncio.create_task(send))
        outcomes = await asyncio.gather(*tasks)
    result = LoadResult(len(offsets), seconds)
    for outcome in outcomes:
        (result.control if outcome.control else result.outcomes).append(outcome)
    return result


def run_overload(server: RunningServer) -> tuple[float, LoadResult, dict[str, float]]:
    """Capacity (req/s), the overload run, and the server's own refusal timings."""
    url = server.url + "/v2/models/steady/infer"
    asyncio.run(closed_loop(url, infer_body(1.0, None), 4 * MAX_BATCH, 0.5))  # warm
    capacity = asyncio.run(closed_loop(url, infer_body(1.0, None), 4 * MAX_BATCH, 2.0))
    body = infer_body(1.0, int(SLO_S * 1e6))
    result = asyncio.run(open_loop(server.url, body, OVERLOAD * capacity, DURATION_S))
    return capacity, result, server_timings(server)


Buckets = dict[float, float]  # the server's cumulative counts by upper bound (seconds)


def server_buckets(server: RunningServer, status: str, route: str = "infer") -> Buckets:
    """The server's histogram, from each request's first byte to its response, so far."""
    labels = f'route="{route}",status="{status}"'  # in name order, after le
    pattern = rf'^lockgate_http_request_duration_seconds_bucket{{le="([^"]+)",{labels}}} (\S+)$'
    text = httpx.get(server.url + "/metrics").text
    return {float(bound): float(count) for bound, count in re.findall(pattern, text, re.M)}


def p99_since(now: Buckets, before: Buckets) -> float:
    """The p99 (a bucket bound) of the responses counted between two readings."""
    counts = sorted((bound, count - before.get(bound, 0.0)) for bound, count in now.items())
    assert counts and counts[-1][1] > 0, "no responses since the last reading"
    total = counts[-1][1]
    return next(bound for bound, count in counts if count >= 0.99 * total)


def server_timings(server: RunningServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lockgate_requests_rejected_total") or line.startswith(
            "lockgate_requests_total"
        ):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_overload_keeps_slo_and_refuses_fast(steady_server: RunningServer) -> None:
    series = {
        "admitted": ("200", "infer"),
        "refused": ("503", "infer"),
        "health": ("200", "health"),
    }
    for attempt in (1, 2):
        before = {name: server_buckets(steady_server, *labels) for name, labels in series.items()}
        capacity, result, timings = run_overload(steady_server)
        server = {
            name: p99_since(server_buckets(steady_server, *labels), before[name])
            for name, labels in series.items()
        }
        report = (
            f"attempt {attempt}: capacity {capacity:.0f}/s; {result.summary(SLO_S)}; server p99 "
            + ", ".join(f"{name} {p99 * 1000:.1f} ms" for name, p99 in server.items())
        )
        print(report, timings)
        expected = MAX_BATCH / SERVICE_S
        assert 0.25 * expected < capacity < 1.1 * expected, report  # a noisy machine is slower
        # nothing is lost: every request has an answer, 200 or a refusal with a JSON error
        assert len(result.outcomes) == result.sent, report
        assert all(o.status in (200, 429, 503, 504) for o in result.outcomes), report
        assert all(o.error for o in result.outcomes if o.status != 200), report
        assert result.count(503) > result.sent / 3, report  # the overload was real
        # admitted requests meet the SLO at p99: as the server measures them (arrival to
        # answer), and as the client sees them, less the client's own delays (the health-check
        # p99); refusals are fast: the server answers one within 10 ms of its first byte at
        # p99, or as fast as it answers health checks when the machine itself stalls (the
        # client-side figure, in the report, adds the client's own scheduling delays)
        timely = [
            server["admitted"] <= SLO_S,
            result.p99(200) <= SLO_S + result.control_p99(),
            server["refused"] <= max(0.010, server["health"]),
            result.goodput(SLO_S) >= 0.8 * capacity,
        ]
        if all(timely):
            break
        # one repeat of the timings, each attempt measured on its own: other tests share the
        # machine, and a stall of it (seen in the health checks' p99) shows in every figure;
        # a connection the client opens mid-run can also wait in the server's accept queue,
        # before the server's clock starts (a known gap: see README, operating under load)
    assert server["admitted"] <= SLO_S, report
    assert result.p99(200) <= SLO_S + result.control_p99(), report
    assert server["refused"] <= max(0.010, server["health"]), report
    assert result.goodput(SLO_S) >= 0.8 * capacity, report


@pytest.mark.skipif(
    not os.environ.get("LOCKGATE_OVERLOAD_COMPARE"),
    reason="set LOCKGATE_OVERLOAD_COMPARE=1 to record the same overload without admission",
)
def test_overload_without_admission_is_recorded(
    steady_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(
        steady_repo, tmp_path_factory.mktemp("open"), "--no-llm", "--no-admission"
    )
    try:
        capacity, result, timings = run_overload(server)
    finally:
        server.stop()
    print(f"without admission: capacity {capacity:.0f}/s; " + result.summary(SLO_S), timings)
    assert len(result.outcomes) == result.sent


# -- a CPU-bound model on a core shared with another process ------------------------------

MINILM_SLO_S = 0.500  # the demo's latency_slo_ms


def minilm_bodies(count: int) -> list[bytes]:
    """Sentences of 30 to 90 words: each row costs the encoder tens of milliseconds."""
    return list(benchmark_bodies(count))


def pin(pid: int, core: int) -> bool:
    """Pin every thread of a process to one core; False where that cannot be done."""
    if len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None:
        return False
    done = subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], capture_output=True)
    return done.returncode == 0


def answered_by_server(server: RunningServer) -> float:
    """Infer answers the app sent plus requests the connection gate refused with a 503 (the
    other reasons close a connection and answer no request)."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('lockgate_http_request_duration_seconds_count{route="infer"'):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("lockgate_http_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            if reason in ("loop_lag", "queue_delay", "requests", "model_admission"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def hogged_minilm(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """minilm alone, its process pinned to core 0 beside a process that burns that core."""
    repo = tmp_path_factory.mktemp("minilm-repo")
    shutil.copytree(demo_repo / "minilm", repo / "minilm")
    server = start_server(repo, tmp_path_factory.mktemp("minilm"), "--no-llm")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        pinned = pin(server.process.pid, 0) and pin(hog.pid, 0)
        print(f"server and hog pinned to core 0: {pinned}")
        yield server
    finally:
        hog.kill()
        hog.wait()
        server.stop()


def test_cpu_bound_model_beside_a_cpu_hog_keeps_its_slo(hogged_minilm: RunningServer) -> None:
    """minilm at three times the capacity it has with another process burning its core: the
    requests it admits finish inside the SLO, the rest are refused at once, no client times
    out, nothing is lost, and goodput holds at half the capacity or more."""
    server = hogged_minilm
    bodies = minilm_bodies(200)

    # warm at a light load: the profile learns these inputs (longer than warmup's) and this core
    asyncio.run(open_loop(server.url, bodies, 5.0, 3.0, model="minilm"))
    # capacity: what it serves when offered far more than it can (admission keeps it busy)
    saturated = asyncio.run(open_loop(server.url, bodies, 80.0, 4.0, seed=1, model="minilm"))
    measured = saturated.count(200) / saturated.duration
    for attempt in (1, 2):
        before = answered_by_server(server)
        result = asyncio.run(
            open_loop(server.url, bodies, OVERLOAD * measured, DURATION_S, model="minilm")
        )
        after = answered_by_server(server)
        report = f"attempt {attempt}: capacity {measured:.1f}/s; " + result.summary(MINILM_SLO_S)
        print(report)
        assert result.count(0) == 0, report  # no client timeouts or failed connections
        assert len(result.outcomes) == result.sent, report
        assert after - before == result.sent, f"server answered {after - before}; {report}"
        assert result.count(503) > 0, report  # the overload was real
        # Beside a process that takes half the core: p99 0.41-0.49 s measured (0.6-0.9 s
        # while warmup's three-word T(B) set the cap, and batches were planned at their
        # average). The p95 is held to the SLO, the p99 within a fifth of it, as this machine
        # is shared. (The median is not held to half the SLO: admission now fills the SLO
        # with full batches, and it measured 0.12-0.28 s.)
        timely = [
            float(np.percentile(result.latencies(200), 95)) <= MINILM_SLO_S,
            result.p99(200) <= 1.2 * MINILM_SLO_S,
            result.goodput(MINILM_SLO_S) >= 0.5 * measured,
        ]
        if all(timely):
            break
        # one repeat of the timings, measured on its own: the p99 of about 200 admitted
        # requests is their two or three slowest, and a stall of the shared machine (once:
        # p99 0.79 s with p95 inside the SLO) shows in it; every functional check above holds
        # on each attempt
    assert float(np.percentile(result.latencies(200), 95)) <= MINILM_SLO_S, report
    assert result.p99(200) <= 1.2 * MINILM_SLO_S, report
    assert result.goodput(MINILM_SLO_S) >= 0.5 * measured, report


def test_faulty_model_fails_only_its_batches(server: RunningServer) -> None:
    """`faulty` raises on every 10th batch of values >= 1000. A failed batch of several
    requests runs again request by request: a request gets 500 only when the batch it ran
    alone in failed too, every other one 200 with its own answer."""

    async def load() -> list[tuple[int, float, dict[str, object]]]:
        url = server.url + "/v2/models/faulty/infer"
        limit = asyncio.Semaphore(16)

        async def one(
            session: aiohttp.ClientSession, value: float
        ) -> tuple[int, float, dict[str, object]]:
            async with limit, session.post(url, data=infer_body(value, None)) as r:
                return r.status, value, await r.json(content_type=None)

        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, 1000.0 + i) for i in range(300)))

    answers = asyncio.run(load())
    failed = [(v, body) for status, v, body in answers if status == 500]
    served = [(v, body) for status, v, body in answers if status == 200]
    assert len(failed) + len(served) == len(answers), {s for s, _, _ in answers}
    assert len(served) > len(failed)
    for _, body in failed:
        assert "injected failure" in str(body["error"])
    for value, body in served:
        outputs = body["outputs"]
        assert isinstance(outputs, list) and outputs[0]["data"] == [2 * value] * 4
    assert "injected failure" in server.log()  # batches failed
    if failed:
        batches = httpx.get(server.url + "/metrics").text
        assert 'lockgate_requests_total{model="faulty",outcome="backend_error",version="1"}' in (
            batches
        )
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    ok = httpx.post(server.url + "/v2/models/echo/infer", content=infer_body(1.0, None))
    assert ok.status_code == 200


# -- a cold server under a closed loop -----------------------------------------------------


async def _raw_closed_loop(
    port: int, request: bytes, connections: int, seconds: float
) -> Counter[int]:
    """`connections` kept-alive connections, each sending `request` again as soon as its answer
    is in; the answers' statuses."""
    statuses: Counter[int] = Counter()
    stop_at = time.monotonic() + seconds

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < stop_at:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                assert length is not None, head
                await reader.readexactly(int(length[1]))
                statuses[int(head[9:12])] += 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return statuses


def cold_closed_loop(
    demo_repo: Path, tmp_path: Path, model: str, body: bytes, connections: int, seconds: float
) -> None:
    """A server just started with `model` alone, `connections` clients each sending `body` as
    soon as it is answered: admission refuses (almost) nothing, and nothing else fails."""
    repo = tmp_path / "repo"
    shutil.copytree(demo_repo / model, repo / model)
    server = start_server(repo, tmp_path, "--no-llm")
    try:
        request = http_post(f"/v2/models/{model}/infer", body, server.port)
        statuses = asyncio.run(_raw_closed_loop(server.port, request, connections, seconds))
    finally:
        server.stop()
    total = sum(statuses.values())
    assert total > 12 * connections, statuses  # the loop ran
    # a cold server still refuses a few at the start on some machines (8 of 218 at worst,
    # and 7 of 240 on an AVX2-only EPYC; none on most runs): README, "A fresh server"
    assert statuses[503] <= 0.05 * total, (statuses, server.log()[-1500:])
    assert set(statuses) <= {200, 503}, statuses


def test_a_cold_server_admits_a_closed_loop_well_inside_its_slo(
    demo_repo: Path, tmp_path: Path
) -> None:
    """32 clients on a server just started, each sending as soon as it is answered: digits
    answers in a few milliseconds against its 50 ms SLO, so admission has nothing to refuse.
    (The loop's CPU per answer once counted the server's first answers, tens of times costlier
    than the rest, and a fifth of the first second's requests were refused.)"""
    body = json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
    ).encode()
    cold_closed_loop(demo_repo, tmp_path, "digits_onnx", body, 32, 2.0)


def test_a_cold_server_admits_a_closed_loop_of_a_cpu_bound_model(
    demo_repo: Path, tmp_path: Path
) -> None:
    """8 clients on a minilm server just started, each sending a sentence of tens of words as
    soon as it is answered: batches of 7 or 8 rows take about 200 ms, so the answers come in
    well under the 500 ms SLO and admission has nothing to refuse. (Admission once planned a
    waiting request's batch at a cap that twice its time filled the whole SLO, beyond the
    share of it admission admits; kept the errors of predictions made before traffic's
    batches reshaped the profile; and took the burst of a closed loop coming back at once
    as an error of every prediction: 434 to 464 of about 750 requests were refused.)"""
    cold_closed_loop(demo_repo, tmp_path, "minilm", minilm_bodies(1)[0], 8, 5.0)


# -- liveness on the main port under overload ---------------------------------------------

LIVENESS_S = 0.050  # a probe's answer, fresh connection included, as Kubernetes times it
PROBE = b"GET /v2/health/live HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n"
OPEN_LOOP = """
import asyncio, collections, json, sys
from benchmarks import raw_load
from benchmarks.overload_real import digits_bodies
port, rate, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
path = "/v2/models/digits_onnx/infer"
requests = [raw_load.post_request("127.0.0.1", port, path, b) for b in digits_bodies(16)]
print("start", flush=True)
outcomes = asyncio.run(raw_load.open_loop("127.0.0.1", port, requests, rate, seconds, 512, 0, 10))
print(json.dumps(collections.Counter(outcomes.statuses)), flush=True)
"""


def probe_s(port: int) -> float:
    """Seconds for a liveness probe as the kubelet sends it: a new connection, closed after."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(PROBE)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    return time.monotonic() - started


@pytest.fixture
def probed_digits(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningServer, int]]:
    """digits_onnx alone, connections accepted on a thread, with a health port whose probes
    are the control."""
    repo = tmp_path_factory.mktemp("digits-repo")
    shutil.copytree(demo_repo / "digits_onnx", repo / "digits_onnx")
    health = free_port()
    tmp = tmp_path_factory.mktemp("digits")
    server = start_server(
        repo, tmp, "--no-llm", "--health-port", str(health), "--accepts-per-turn", "128"
    )
    yield server, health
    server.stop()


def test_liveness_on_the_main_port_answers_within_50_ms_under_overload(
    probed_digits: tuple[RunningServer, int],
) -> None:
    """An open loop of 10,000 requests a second on digits_onnx, from a client that opens up to
    512 connections as its requests wait: liveness probes on new connections, sent as the
    load starts and every 20 ms after, are answered on the main port within 50 ms.

    The server's event loop once accepted one connection per turn (uvloop), and a turn under
    this load takes milliseconds: the probes sent as the client opened its connections waited
    behind them in the kernel's accept queue, 2.7 to 8.7 s. The probes of the health port, a
    thread of its own, are the control: a machine that stalls every process shows there too,
    and its worst is allowed on top of the 50 ms."""
    server, health_port = probed_digits
    for attempt in (1, 2):
        load = subprocess.Popen(
            [sys.executable, "-c", OPEN_LOOP, str(server.port), "10000", "2.5"],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert load.stdout is not None
        assert load.stdout.readline().strip() == b"start"
        main, control = [], []
        try:
            for _ in range(60):
                main.append(probe_s(server.port))
                control.append(probe_s(health_port))
                time.sleep(0.02)
        finally:
            statuses = json.loads(load.communicate(timeout=60)[0])
        report = (
            f"attempt {attempt}: main port max {max(main) * 1e3:.1f} ms, median "
            f"{float(np.median(main)) * 1e3:.1f} ms; health port max {max(control) * 1e3:.1f} "
            f"ms; load {statuses}"
        )
        print(report)
        assert int(statuses.get("503", 0)) > 0, report  # the overload was real
        if max(main) <= LIVENESS_S + max(control):
            break
    assert max(main) <= LIVENESS_S + max(control), report
