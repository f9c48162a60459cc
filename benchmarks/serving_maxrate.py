"""serving_maxrate: the highest open-loop rate lockgate sustains on one core, against the floor.

digits_onnx (the demo's ONNX classifier, one row per request, KServe v2 JSON) served by
lockgate (`lockgate serve --no-llm`, the model as shipped: dynamic batching, a 50 ms latency
SLO) and by the floor (`benchmarks/floor_app.py`: raw ASGI on uvicorn, onnxruntime inline),
each pinned to the server core. For each, the highest Poisson arrival rate it sustains: a step
at a rate passes when the server answered ≥ 99% of the requests offered with 200 and the p99
of *all* of them, from their scheduled send time, is under 50 ms; a refusal or a failure counts
as a miss (an infinite latency), so a server cannot pass by refusing. The search goes up in
coarse steps until a step fails, then bisects between the last pass and the first failure.
The two searches run step for step in turn, so drift on a shared machine hits both.

The client is `benchmarks/openloop.c` (compiled with `cc` into the scratch folder), a C
epoll loop on the client core: pre-encoded requests on kept-alive connections (at most
`CONNECTIONS`), one request at a time on each, opened as needed; a request that comes due
while all are busy waits for one, and that wait counts in its latency. It spends about 3% of
its core per 1,000 requests per second; a Python client tops out near 10,000 on one core,
about what the floor serves, so it would measure itself. Each step records the client's own
dispatch rate (arrivals sent per second of its schedule), how late it dispatched them (p99
lag), its CPU share and the share of time it was runnable but waiting for its core (other
work on the machine). A step where the client fell behind (dispatch rate under 98% of the
target, lag p99 over a tenth of the SLO, or CPU over 90%) is client-bound: its latencies
carry the client's delay. The servers' own waiting share (all their threads, from /proc)
shows how much other work took their core; a failed step where the server waited for its
core more than `CROWDED` of the time measured that other work, not the server. Either kind of
step is disturbed: it is run again (`RETRIES`), and if it stays disturbed that search ends
there and its rate is a lower bound, said in the notes. Other work only ever slows a server,
so a pass stands at once while a failure counts only when a second run fails too.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    CLIENT_CORE,
    ROOT,
    Context,
    Server,
    SuiteResult,
    environment,
    median,
    pin_command,
    process_cpu_seconds,
    running,
    start_lockgate,
)
from benchmarks.overload_real import digits_bodies
from benchmarks.raw_load import post_request
from benchmarks.serving_overhead import demo_model, start_floor

SUITE = "serving_maxrate"
MODEL = "digits_onnx"
SLO_S = 0.050  # p99 of every request, from its scheduled time
SERVED = 0.99  # share of the offered requests answered with 200
TARGET_RATIO = 0.9
CONNECTIONS = 256
FIRST_RATE, COARSE_STEP = 4000.0, 4000.0  # requests per second
BISECTIONS, QUICK_BISECTIONS = 4, 2
STEP_S = 1.5  # of arrivals per step
CLIENT_RATE_SHARE, CLIENT_LAG_S, CLIENT_CPU_SHARE = 0.98, SLO_S / 10, 0.90
CROWDED = 0.10  # a failure while the server waited this share of the time for its core
RETRIES = 2  # a disturbed step is run again this many times before the search stops
SOURCE = ROOT / "benchmarks" / "openloop.c"
RECORD = np.dtype([("latency_ns", "<i8"), ("lag_ns", "<i8"), ("status", "<i4"), ("pad", "<i4")])


@dataclass(slots=True)
class Step:
    """One open-loop run at one rate against one server."""

    rate: float  # target, requests per second
    sent: int
    served: int  # answered 200
    p50: float  # seconds, over every request (a miss is infinite)
    p99: float
    dispatch_rate: float  # what the client dispatched, requests per second of its schedule
    lag_p99: float  # seconds the client dispatched late, its own delay
    client_cpu: float  # share of the client's core over the arrival window
    client_waiting: float  # share of that window the client was runnable but not running
    server_cpu: float  # share of the server's core over the step
    server_waiting: float  # the same for the server's threads: other work on its core
    statuses: dict[int, int]

    @property
    def client_bound(self) -> bool:
        return (
            self.dispatch_rate < CLIENT_RATE_SHARE * self.rate
            or self.lag_p99 > CLIENT_LAG_S
            or self.client_cpu > CLIENT_CPU_SHARE
        )

    @property
    def passed(self) -> bool:
        return self.served >= SERVED * self.sent and self.p99 < SLO_S

    @property
    def disturbed(self) -> str:
        """Why this step says nothing about the server ('' if it does)."""
        if self.client_bound:
            return "client behind"
        if not self.passed and self.server_waiting > CROWDED:
            return "server core crowded"
        return ""

    def line(self) -> str:
        verdict = self.disturbed or ("pass" if self.passed else "fail")
        return (
            f"{self.rate:7,.0f}/s: served {self.served / max(self.sent, 1):6.1%}, "
            f"p50 {self.p50 * 1e3:7.2f} ms, p99 {self.p99 * 1e3:8.2f} ms, server CPU "
            f"{self.server_cpu:4.0%} (waited {self.server_waiting:4.0%}); client "
            f"{self.dispatch_rate:7,.0f}/s, lag p99 {self.lag_p99 * 1e6:5.0f} µs, CPU "
            f"{self.client_cpu:4.0%} (waited {self.client_waiting:4.0%}): {verdict}"
        )


@dataclass(slots=True)
class Search:
    """Coarse steps up until one fails, then bisection between the last pass and the first
    failure. A client-bound step ends the search: its rate says nothing about the server."""

    bisections: int
    steps: list[Step] = field(default_factory=list)
    passed: Step | None = None  # the highest passing step
    failed: float = float("inf")  # the lowest failing rate
    bisected: int = 0  # steps since the first failure
    disturbed: str = ""  # why the search stopped early, if it did

    def next_rate(self) -> float | None:
        if self.disturbed or self.bisected >= self.bisections:
            return None
        low = self.passed.rate if self.passed else 0.0
        if self.failed == float("inf"):
            return FIRST_RATE if self.passed is None else low + COARSE_STEP
        return (low + self.failed) / 2

    def record(self, step: Step) -> None:
        self.steps.append(step)
        if self.failed != float("inf"):
            self.bisected += 1
        if step.disturbed:
            self.disturbed = f"{step.disturbed} at {step.rate:,.0f}/s"
        elif step.passed:
            if self.passed is None or step.rate > self.passed.rate:
                self.passed = step
        else:
            self.failed = min(self.failed, step.rate)

    @property
    def max_rate(self) -> float:
        return self.passed.rate if self.passed else 0.0


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    client = OpenLoop.build(ctx.work)
    model_dir = demo_model(ctx, MODEL)
    repository = ctx.work / "maxrate-repo"
    shutil.copytree(model_dir, repository / MODEL)
    ctx.say(SUITE, "starting lockgate and the floor app on core 0")
    lockgate = start_lockgate(repository, ctx.work)
    floor = start_floor(model_dir / "1" / "model.onnx", ctx.work)
    servers = {"lockgate": lockgate, "floor": floor}
    with running(lockgate, floor):
        loads = {name: Load(ctx, client, server) for name, server in servers.items()}
        for load in loads.values():
            load.step(1000.0, warmup=True)
        searches = [search_both(ctx, loads, rep) for rep in range(1, ctx.repetitions + 1)]
    result = report(searches)
    result.seconds = time.perf_counter() - started
    return result


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """`openloop.c`, compiled: one run of it is one step."""

    binary: Path

    @classmethod
    def build(cls, work: Path) -> OpenLoop:
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError(f"{SUITE} needs a C compiler (cc) to build {SOURCE.name}")
        binary = work / "openloop"
        subprocess.run([compiler, "-O2", "-o", str(binary), str(SOURCE), "-lm"], check=True)
        return cls(binary)

    def command(
        self,
        port: int,
        requests: Path,
        rate: float,
        seconds: float,
        out: Path,
        *,
        connections: int = CONNECTIONS,
        seed: int = 0,
        drain_s: float = 10.0,
    ) -> list[str]:
        """Poisson arrivals at `rate` for `seconds` to 127.0.0.1:`port`, the requests taken in
        turn from `requests` (`write_requests`); one record per request to `out`
        (`read_records`), a JSON summary on stdout."""
        return [
            str(self.binary),
            *("127.0.0.1", str(port), f"{rate:.1f}", f"{seconds}", str(connections)),
            *(str(seed), f"{drain_s}", str(requests), str(out)),
        ]


def write_requests(path: Path, requests: list[bytes]) -> None:
    """Pre-encoded requests in `openloop.c`'s format: each after its 4-byte length."""
    with open(path, "wb") as out:
        for request in requests:
            out.write(struct.pack("<I", len(request)) + request)


def read_records(path: Path) -> np.ndarray:
    """`openloop.c`'s records: latency_ns and lag_ns (int64), status (int32; 0: the connection
    was lost, -1: no answer by the end of the drain)."""
    return np.fromfile(path, dtype=RECORD)


class Load:
    """Runs the C client at one server: one step at a time, each a fresh client process."""

    def __init__(self, ctx: Context, client: OpenLoop, server: Server) -> None:
        self.ctx, self.client, self.server = ctx, client, server
        path = f"/v2/models/{MODEL}/infer"
        self.requests = ctx.work / f"requests-{server.name}.bin"
        bodies = digits_bodies(16)
        write_requests(
            self.requests, [post_request("127.0.0.1", server.port, path, b) for b in bodies]
        )
        self.seed = 0

    def step(self, rate: float, warmup: bool = False) -> Step:
        seconds = 0.5 if warmup else self.ctx.scale(STEP_S)
        self.seed += 1
        out = self.ctx.work / f"records-{self.server.name}.bin"
        command = self.client.command(
            self.server.port, self.requests, rate, seconds, out, seed=self.seed
        )
        pid = self.server.process.pid
        cpu, waited, began = process_cpu_seconds(pid), runqueue_seconds(pid), time.perf_counter()
        done = subprocess.run(
            pin_command(command, CLIENT_CORE), capture_output=True, text=True, timeout=60
        )
        elapsed = time.perf_counter() - began
        server = (
            (process_cpu_seconds(pid) - cpu) / elapsed,
            (runqueue_seconds(pid) - waited) / elapsed,
        )
        if done.returncode != 0:
            raise RuntimeError(f"openloop failed ({done.returncode}): {done.stderr[-300:]}")
        summary = json.loads(done.stdout)
        time.sleep(0.3)  # let the server's last queue settle before the next step
        return measure(rate, read_records(out), summary, server)


def runqueue_seconds(pid: int) -> float:
    """Seconds the threads of process `pid` spent runnable but waiting for a core."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(stat.read_text().split()[1])
    return total / 1e9


def measure(
    rate: float, records: np.ndarray, summary: dict[str, Any], server: tuple[float, float]
) -> Step:
    ok = records["status"] == 200
    latencies = np.where(ok, records["latency_ns"] / 1e9, np.inf)  # a miss is infinite
    p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99], method="higher"))
    statuses, counts = np.unique(records["status"], return_counts=True)
    return Step(
        rate=rate,
        sent=len(records),
        served=int(ok.sum()),
        p50=p50,
        p99=p99,
        dispatch_rate=float(summary["dispatch_rate"]),
        lag_p99=float(np.percentile(records["lag_ns"], 99)) / 1e9,
        client_cpu=float(summary["cpu_share"]),
        client_waiting=float(summary["runqueue_share"]),
        server_cpu=server[0],
        server_waiting=server[1],
        statuses={int(s): int(n) for s, n in zip(statuses, counts, strict=True)},
    )


def search_both(ctx: Context, loads: dict[str, Load], rep: int) -> dict[str, Search]:
    """Both servers' searches, a step of each in turn."""
    bisections = QUICK_BISECTIONS if ctx.quick else BISECTIONS
    searches = {name: Search(bisections) for name in loads}
    while True:
        pending = [(n, s, r) for n, s in searches.items() if (r := s.next_rate()) is not None]
        if not pending:
            return searches
        for name, search, rate in pending:

            def one(load: Load = loads[name], rate: float = rate, name: str = name) -> Step:
                step = load.step(rate)
                ctx.say(SUITE, f"rep {rep}: {name:8} {step.line()}")
                return step

            search.record(settle(one))


def settle(run: Callable[[], Step]) -> Step:
    """A step's verdict: a disturbed step is run again (up to `RETRIES` times), and a failure
    once more. Other work on the machine only ever slows a server, so a pass stands at once
    and a failure counts when it repeats."""
    confirming = False
    for _ in range(RETRIES + 2):
        step = run()
        if step.disturbed:
            continue
        if step.passed or confirming:
            return step
        confirming = True
    return step


# -- report ------------------------------------------------------------------------------


def report(searches: list[dict[str, Search]]) -> SuiteResult:
    clean = [s for s in searches if not any(search.disturbed for search in s.values())]
    counted = clean or searches

    def at_max(name: str, what: str) -> float:
        return median([getattr(s[name].passed, what, float("nan")) for s in counted])

    lg = median([s["lockgate"].max_rate for s in counted])
    floor = median([s["floor"].max_rate for s in counted])
    bound = [
        f"{n} (rep {i}: {s[n].disturbed})"
        for i, s in enumerate(searches, 1)
        for n in s
        if s[n].disturbed
    ]
    ratio = lg / floor if floor else float("nan")
    result = SuiteResult(
        suite=SUITE,
        title="Highest open-loop rate on one core, digits ONNX, V2 JSON",
        target=f"lockgate's max rate with p99 < {SLO_S * 1e3:g} ms ≥ {TARGET_RATIO:g}x the floor's",
        met=None if not clean or not floor else ratio >= TARGET_RATIO,
        environment=environment(),
    )
    result.add(
        f"lockgate max rate (p99 < {SLO_S * 1e3:g} ms, ≥ {SERVED:.0%} served)",
        lg,
        "req/s",
        baseline_label="floor max rate",
        baseline=floor,
        note=f"target ≥ {TARGET_RATIO:g}x",
    )
    for q in ("p50", "p99"):
        result.add(
            f"lockgate {q} at its max",
            at_max("lockgate", q) * 1e3,
            "ms",
            baseline_label=f"floor {q} at its max",
            baseline=at_max("floor", q) * 1e3,
        )
    result.add(
        "server CPU at its max",
        at_max("lockgate", "server_cpu") * 100,
        "%",
        baseline_label="floor",
        baseline=at_max("floor", "server_cpu") * 100,
        note="share of the server's core",
    )
    highest = [step for s in searches for search in s.values() for step in search.steps]
    busiest = max(highest, key=lambda step: step.client_cpu)
    result.notes.append(
        f"client (openloop.c on its own core): at most {busiest.client_cpu:.0%} of its core "
        f"(at {busiest.rate:,.0f}/s, dispatched {busiest.dispatch_rate:,.0f}/s, lag p99 "
        f"{busiest.lag_p99 * 1e6:.0f} µs) over {len(highest)} steps"
    )
    waited = {n: at_max(n, "server_waiting") for n in ("lockgate", "floor")}
    result.notes.append(
        "other work on the server core: at their max, lockgate's threads waited "
        f"{waited['lockgate']:.0%} of the time for a core, the floor's {waited['floor']:.0%}"
    )
    if bound:
        result.notes.append(
            "searches stopped by a disturbed step (the client fell behind its schedule, or "
            "other work crowded the server's core; that figure is a lower bound, and its "
            f"repetition is left out of the medians): {', '.join(bound)}"
        )
    for name in ("lockgate", "floor"):
        rates = ", ".join(f"{s[name].max_rate:,.0f}" for s in searches)
        result.notes.append(f"{name} max rate per repetition: {rates} req/s")
    for name in ("lockgate", "floor"):
        result.notes.append(f"{name} just above its max: {failure(name, counted)}")
    ratios = [s["lockgate"].max_rate / s["floor"].max_rate for s in searches if s["floor"].max_rate]
    result.notes.append(
        f"ratio per repetition: {', '.join(f'{r:.2f}' for r in ratios)}; medians over the "
        f"{len(clean)} of {len(searches)} repetitions with no disturbed step"
        + ("" if clean else " (none: medians over all, lower bounds, target not evaluated)")
    )
    result.raw = {
        f"rep{i}": {
            name: {
                "max_rate": search.max_rate,
                "disturbed": search.disturbed,
                "steps": [step_json(step) for step in search.steps],
            }
            for name, search in s.items()
        }
        for i, s in enumerate(searches, 1)
    }
    return result


def failure(name: str, searches: list[dict[str, Search]]) -> str:
    """How `name` failed at the lowest failing rate of each search: by refusing or by
    queueing."""
    said = []
    for s in searches:
        search = s[name]
        failed = [x for x in search.steps if x.rate == search.failed and not x.disturbed]
        if failed:
            step = failed[-1]
            refused = step.statuses.get(503, 0) + step.statuses.get(429, 0)
            said.append(
                f"{step.rate:,.0f}/s served {step.served / step.sent:.1%} ({refused} refused), "
                f"p50 {step.p50 * 1e3:.1f} ms"
            )
    return "; ".join(said) or "no failed step"


def step_json(step: Step) -> dict[str, Any]:
    return {
        "rate": step.rate,
        "sent": step.sent,
        "served": step.served,
        "p50_s": step.p50,
        "p99_s": step.p99 if np.isfinite(step.p99) else None,
        "dispatch_rate": step.dispatch_rate,
        "client_lag_p99_s": step.lag_p99,
        "client_cpu": step.client_cpu,
        "client_waiting": step.client_waiting,
        "server_cpu": step.server_cpu,
        "server_waiting": step.server_waiting,
        "statuses": step.statuses,
        "passed": step.passed,
        "disturbed": step.disturbed,
    }
