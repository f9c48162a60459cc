"""plan_check: the p99 that `lockgate plan` predicts against the p99 `lockgate bench` measures.

Three models, each served alone by a lockgate pinned to the server core (the client on the
other core):

- `sleeper`: a python model that sleeps 10 ms per call, `max_batch_size: 1`. Its service
  time is nearly constant and uses no CPU, so the front end runs beside it: the ideal case.
- `minilm`: the demo's sentence embedder (tokenizer and int8 ONNX encoder on one thread,
  `max_batch_size: 32`, `latency_slo_ms: 500`): CPU-bound, batching.
- `digits_onnx`: the demo's logistic regression in ONNX (`max_batch_size: 64`,
  `latency_slo_ms: 50`): a model of tens of microseconds, whose cost is mostly the front
  end's HTTP and JSON on the same core. Its batches take under 150 µs, so lockgate runs them
  inline on the event loop (`inline_max_us`): a request never waits in the batcher, batches
  stay at one row (the mean batch is in the table), and the queue is the event loop's.

The servers run with `--max-loop-lag-ms 0 --queue-target-ms 0 --no-admission`: the plan
predicts the latency of a queue that admits every request, and on a busy machine lockgate's
overload guards refuse some requests even below capacity, which would cut the tail measured.

Each repetition, per model:

1. `lockgate profile --max-batch-size <the model's>` (30 timed rounds, 2 s of CPU
   measurement, 200 requests after idle gaps): T(B), the fixed overhead d, the coefficient of
   variation of T(1), the server's CPU per request, whose part beyond the model's compute is
   the front end's (`frontend`), and the round trips of requests that found the server idle.
   A one-row request inside a busy period occupies the replica's core for
   S(1) = T(1) + frontend; one that finds it idle takes what the idle samples say.
2. For each utilization rho in 0.3, 0.5, 0.7 of the one-row capacity 1 / S(1), `lockgate
   plan --profile ... --rate rho/S(1) --headroom 0 --redundancy 0` predicts the p99 of one
   replica with the model's queue model: `batch` for minilm (a work-conserving batcher with
   cap `max_batch_size`, S(B) = a + (b + frontend) B, simulated), `mg1` for the two models
   whose batches stay at one row (M/G/1 with S(1) and the measured cv); both with the idle
   start (a request that finds the replica idle takes the profile's service after idle, mixed
   over the Poisson idle times at the rate). The SLO given is loose, so one replica is the
   plan. Beside it, computed from the same profile: the same model without the idle start
   (`--no-idle-start`); the naive prediction that treats the whole round trip as the queue's
   service time (M/D/1, d = 0); M/M/1 with S(1); and the model `lockgate plan` used first
   (d + M/D/1 with S = T(1), no front end, no variance).
3. `lockgate bench --rate rho/S(1)` runs open-loop Poisson load for the level (after one
   second of warmup). The p99 compared is counted from when each request left the client
   (the bench's per-request latency less its send lag, from `--output-requests-csv`): the
   client is a queue of its own on one core, at about 0.3 ms of CPU per request as busy as
   digits_onnx's server, and the plan is for the server. The bench's p99 from the scheduled
   send time is reported beside it. The server's CPU (/proc) and statistics give its CPU per
   request and mean batch size during the level.
4. For digits_onnx, right after, the same server gets the same Poisson rate for the same time
   from `benchmarks/openloop.c` (the C open-loop client of `serving_maxrate`, about 3% of a
   core per 1,000 req/s, pinned to the client core): a client that is not a queue of its own
   at digits_onnx's scale. Its p99 is counted the same way, from when each request left (the
   latency less the client's own dispatch lag). digits_onnx's target is judged on this p99
   and the bench's is reported beside it; without a C compiler (`cc`) the bench's p99 is
   judged, and the notes say so. The other models' clients are idle enough at their rates
   (and the extra levels would cost minutes), so they are measured by the bench alone.

A level measured the machine more than the server, and is reported but left out of the
medians, when the client sent late (send lag p99 above 10% of the predicted p99, and above
2 ms: the client's timers wake up to 1 ms late even on a quiet machine) or when other work
took the server's core (/proc/stat: the core's busy time less the server's own CPU, above
10% of the level): the plan describes a replica that has its core. The same tests, on the C
client's dispatch lag and the server core over its run, decide whether a C level is kept.
Rows quote the median over the kept repetitions of the measured p99 (digits_onnx's: the C
client's), with the median prediction as the baseline; the ratio is measured / predicted.
Beside them, the plan's queue fed the send times the bench really produced instead of
Poisson arrivals (see `trace_p99`). Run alone with `python -m benchmarks.plan_check`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    CLIENT_CORE,
    SERVER_CORE,
    Context,
    Server,
    SuiteResult,
    environment,
    percentile,
    pin_command,
    pinning_available,
    process_cpu_seconds,
    running,
    start_lockgate,
)
from benchmarks.overload_real import digits_bodies
from benchmarks.raw_load import post_request
from benchmarks.serving_maxrate import OpenLoop, read_records, write_requests
from lockgate.plan.batching import BatchQueue
from lockgate.plan.planner import PlanInputs, p99_at, plan
from lockgate.plan.profile import ReplicaProfile

SUITE = "plan_check"
SLEEP_S = 0.010  # the sleeper's sleep per call
UTILIZATIONS = (0.3, 0.5, 0.7)
TOLERANCE = 0.15  # |predicted - measured| / measured
TARGET_MODELS = ("minilm", "digits_onnx")
OPENLOOP_MODELS = ("digits_onnx",)  # also measured by the C client, and judged on it
LEVEL_S = 12.0
MAX_SEND_LAG = 0.10  # of the predicted p99: a client this late measured the machine
MIN_SEND_LAG_MS = 2.0  # the client's timers wake up to 1 ms late even on a quiet machine
MAX_OTHER_WORK = 0.10  # of the server core's time, taken by other processes
SERVER_FLAGS = (
    *("--grpc-port", "off", "--max-loop-lag-ms", "0", "--queue-target-ms", "0"),
    "--no-admission",
)

SLEEPER = '''
import time


class Model:
    """Sleeps a fixed time per call: a constant service time, whatever the input."""

    def load(self, config, version_dir):
        self.seconds = float(config.parameters["sleep_s"])

    def infer(self, inputs):
        time.sleep(self.seconds)
        return {"y": inputs["x"]}
'''


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    max_batch_size: int
    queue_model: str  # the one lockgate plan predicts with


MODELS = (
    Model("sleeper", 1, "mg1"),
    Model("minilm", 32, "batch"),
    Model("digits_onnx", 64, "mg1"),  # runs inline on the event loop: batches stay small
)


def write_sleeper(repository: Path) -> None:
    """A python model whose service time is a fixed sleep."""
    folder = repository / "sleeper"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLEEPER)
    config = f"""\
        backend: python
        max_batch_size: 1
        inputs:
          - {{name: x, datatype: FP32, dims: [4]}}
        outputs:
          - {{name: y, datatype: FP32, dims: [4]}}
        instance_count: 1
        parameters:
          sleep_s: "{SLEEP_S}"
        """
    (folder / "config.yaml").write_text(textwrap.dedent(config))


def write_repository(root: Path, model: Model, ctx: Context) -> Path:
    """A repository holding `model` alone: the sleeper, or a copy of the built demo model."""
    repository = root / f"repo-{model.name}"
    repository.mkdir(parents=True)
    if model.name == "sleeper":
        write_sleeper(repository)
        return repository
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository, default_demo_path

    chosen = [m for m in DEMO_MODELS if m.name == model.name]
    demo = build_demo_repository(
        default_demo_path(), models=chosen, progress=lambda m: ctx.say("build", m)
    )
    shutil.copytree(demo / model.name, repository / model.name)
    return repository


def lockgate(*argv: str) -> str:
    """Run a lockgate command and return its stdout; a failure raises with its stderr."""
    command = [sys.executable, "-m", "lockgate.cli", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"lockgate {argv[0]} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


@dataclass(slots=True)
class Point:
    """One load level of one model in one repetition."""

    model: str
    rho: float
    rate: float
    t1_s: float  # T(1), the model's compute
    frontend_s: float  # front-end CPU per request on the model's core
    overhead_s: float  # the profile's d: one-row round trip - compute
    cv: float
    predicted_p99_ms: float  # lockgate plan with the model's queue model
    no_idle_p99_ms: float  # the same without the idle start
    naive_p99_ms: float  # M/D/1 with S = the whole round trip, d = 0
    mm1_p99_ms: float
    before_p99_ms: float  # d + M/D/1 with S = T(1)
    trace_p99_ms: float  # the plan's queue fed the client's actual send times
    measured_p99_ms: float  # from the send
    measured_p50_ms: float
    scheduled_p99_ms: float  # the bench's: from the scheduled send time
    throughput: float
    requests: int
    errors: int
    send_lag_p99_ms: float
    client_cpu_util: float  # the client's cores busy: its own queue for sends and answers
    server_cpu_per_request_ms: float
    mean_batch: float
    other_work: float | None  # share of the server core's time other processes used
    warnings: list[str] = field(default_factory=list)
    c: OpenLoopLevel | None = None  # the C client's level right after, where it ran

    @property
    def judged_p99_ms(self) -> float:
        """The p99 the target is judged on: the C client's where it ran, else the bench's."""
        return self.c.p99_ms if self.c is not None else self.measured_p99_ms

    @property
    def error(self) -> float:
        return (self.predicted_p99_ms - self.judged_p99_ms) / self.judged_p99_ms

    @property
    def bench_starved(self) -> bool:
        """The bench sent late, or other work took the server's core during its level."""
        return disturbed(self, self.measured_p99_ms, self.send_lag_p99_ms, self.other_work)

    @property
    def starved(self) -> bool:
        """The judged measurement's client sent late, or other work took the server's core."""
        if self.c is None:
            return self.bench_starved
        return disturbed(self, self.c.p99_ms, self.c.lag_p99_ms, self.c.other_work)


@dataclass(frozen=True, slots=True)
class OpenLoopLevel:
    """What `openloop.c` measured at one level: latencies from when each request left."""

    p99_ms: float  # NaN when nothing succeeded
    p50_ms: float
    scheduled_p99_ms: float  # from the scheduled time, misses infinite
    lag_p99_ms: float  # the client's own dispatch lag
    requests: int
    errors: int
    client_cpu_util: float
    other_work: float | None  # share of the server core's time other processes used


def disturbed(point: Point, p99_ms: float, lag_p99_ms: float, other: float | None) -> bool:
    """A level that measured the machine: its client sent late, other work took the server's
    core, or no request succeeded."""
    limit = max(MIN_SEND_LAG_MS, MAX_SEND_LAG * point.predicted_p99_ms)
    crowded = other is not None and other > MAX_OTHER_WORK
    return lag_p99_ms > limit or crowded or not math.isfinite(p99_ms)


def profile(server: Server, model: Model, path: Path) -> ReplicaProfile:
    lockgate(
        *("profile", "--url", server.url, "--model", model.name),
        *("--max-batch-size", str(model.max_batch_size), "--repeats", "30", "--warmup", "3"),
        *("--cpu-seconds", "2", "--output", str(path)),
    )
    return ReplicaProfile.load(path)


def predict(rate: float, model: Model, profile_path: Path, *flags: str) -> float:
    """`lockgate plan` for one replica at `rate`: its p99 in ms."""
    out = lockgate(
        *("plan", "--profile", str(profile_path), "--rate", f"{rate:.4f}", "--slo-ms", "100000"),
        *("--queue-model", model.queue_model, "--headroom", "0", "--redundancy", "0", "--json"),
        *flags,
    )
    result: dict[str, Any] = json.loads(out)
    if result["replicas"] != 1:
        raise RuntimeError(f"expected a one-replica plan at {rate:.1f}/s, got {result}")
    return float(result["p99_s"]) * 1e3


def alternatives(replica: ReplicaProfile, rate: float) -> tuple[float, float, float]:
    """(naive, M/M/1, before) p99s in ms at `rate`; inf where the queue would be unstable."""
    t1 = replica.service.service_time(1)
    round_trip = t1 + replica.service.overhead_s
    naive = p99_at("md1", rate * round_trip, round_trip, 1)
    inputs = PlanInputs(
        rate=rate, slo_p99_s=1e5, profile=replica, max_batch_size=1, queue_model="mm1",
        headroom=0, redundancy=0,
    )  # fmt: skip
    mm1 = plan(inputs).p99_s
    before = replica.service.overhead_s + p99_at("md1", rate * t1, t1, 1)
    return naive * 1e3, mm1 * 1e3, before * 1e3


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """The server's CPU seconds, its core's busy seconds and its statistics at one moment."""

    cpu_s: float
    core_busy_s: float | None  # None: the server is not pinned
    wall_s: float
    rows: int
    batches: int

    @classmethod
    def read(cls, server: Server, model: str) -> ServerLoad:
        import urllib.request

        url = f"{server.url}/v2/models/{model}/stats"
        with urllib.request.urlopen(url, timeout=10) as response:
            entry = json.loads(response.read())["model_stats"][0]
        cpu = process_cpu_seconds(server.process.pid)
        rows, batches = int(entry["inference_count"]), int(entry["execution_count"])
        return cls(cpu, core_busy_seconds(), time.perf_counter(), rows, batches)

    def since(self, before: ServerLoad) -> ServerLoad:
        busy = None
        if self.core_busy_s is not None and before.core_busy_s is not None:
            busy = self.core_busy_s - before.core_busy_s
        return ServerLoad(
            self.cpu_s - before.cpu_s,
            busy,
            self.wall_s - before.wall_s,
            self.rows - before.rows,
            self.batches - before.batches,
        )

    @property
    def other_work(self) -> float | None:
        """Share of the core's time that went to other processes (over a difference)."""
        if self.core_busy_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.core_busy_s - self.cpu_s) / self.wall_s


def core_busy_seconds() -> float | None:
    """Seconds the server core has been busy (user, system, interrupts, steal), from
    /proc/stat; None when the server is not pinned there."""
    if not pinning_available():
        return None
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{SERVER_CORE} "):
            ticks = [int(x) for x in line.split()[1:]]
            idle = ticks[3] + ticks[4]  # idle, iowait
            return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    return None


@dataclass(frozen=True, slots=True)
class Level:
    """What one `lockgate bench` level measured."""

    report: dict[str, Any]  # the bench's JSON level
    from_send_ms: list[float]  # latency of each measured success, from when it was sent
    sent_s: np.ndarray  # when each request of the level, warmup included, was sent: [n]
    measured: np.ndarray  # which of them count (not warmup): [n] bool
    load: ServerLoad  # the server's, over the level

    def p(self, q: float) -> float:
        return percentile(self.from_send_ms, q)  # NaN when nothing succeeded


def trace_p99(replica: ReplicaProfile, model: Model, rate: float, level: Level) -> float:
    """The p99 (ms) of the plan's queue model fed the arrivals the client really sent.

    Poisson arrivals sent by a client whose timers wake up to 1 ms late reach the server in
    small bunches; at digits_onnx's 0.35 ms per request that alone lengthens the queue."""
    t, frontend = replica.service, replica.frontend_s
    cap = model.max_batch_size if model.queue_model == "batch" else 1
    overhead = max(0.0, t.overhead_s - frontend)
    idle = replica.idle_start(t.service_time(1) + frontend)
    first = idle.at(rate) if idle is not None else None
    queue = BatchQueue(rate, t.a_s, t.b_s + frontend, cap, replica.service_cv, first_service=first)
    response = queue.serve(level.sent_s, np.random.default_rng(0))[level.measured]
    return (percentile(list(response), 99) + overhead) * 1e3


def measure(
    server: Server, model: Model, rate: float, seconds: float, seed: int, work: Path
) -> Level:
    """`lockgate bench` open loop at `rate`, and the server's load over it."""
    report, requests = work / "bench.json", work / "requests.csv"
    before = ServerLoad.read(server, model.name)
    lockgate(
        *("bench", "--url", server.url, "--model", model.name, "--rate", f"{rate:.4f}"),
        *("--duration", f"{seconds:g}", "--warmup", "1", "--seed", str(seed), "--quiet"),
        *("--output-json", str(report), "--output-requests-csv", str(requests)),
    )
    used = ServerLoad.read(server, model.name).since(before)
    with open(requests, newline="") as handle:
        rows = list(csv.DictReader(handle))
    from_send = [
        float(r["latency_ms"]) - float(r["send_lag_ms"])
        for r in rows
        if r["warmup"] == "False" and not r["error"]
    ]
    sent = np.array([float(r["scheduled_ms"]) + float(r["send_lag_ms"]) for r in rows]) / 1e3
    order = np.argsort(sent)  # [n]
    measured = np.array([r["warmup"] == "False" for r in rows])[order]
    report_json = json.loads(report.read_text())["levels"][0]
    return Level(report_json, from_send, sent[order], measured, used)


@dataclass(frozen=True, slots=True)
class CClient:
    """`openloop.c` built, and the requests it sends to one server."""

    binary: OpenLoop
    requests: Path

    @classmethod
    def for_server(cls, binary: OpenLoop, server: Server, model: Model, work: Path) -> CClient:
        path = f"/v2/models/{model.name}/infer"
        requests = work / f"requests-{model.name}.bin"
        write_requests(
            requests, [post_request("127.0.0.1", server.port, path, b) for b in digits_bodies(16)]
        )
        return cls(binary, requests)

    def measure(
        self, server: Server, model: Model, rate: float, run: tuple[float, int, Path]
    ) -> OpenLoopLevel:
        """Poisson arrivals at `rate` for `seconds` from the C client on the client core."""
        seconds, seed, work = run
        out = work / "records.bin"
        command = self.binary.command(server.port, self.requests, rate, seconds, out, seed=seed)
        before = ServerLoad.read(server, model.name)
        done = subprocess.run(
            pin_command(command, CLIENT_CORE), capture_output=True, text=True,
            timeout=seconds + 60,
        )  # fmt: skip
        used = ServerLoad.read(server, model.name).since(before)
        if done.returncode != 0:
            raise RuntimeError(f"openloop failed ({done.returncode}): {done.stderr[-300:]}")
        records = read_records(out)
        ok = records["status"] == 200
        from_send = list((records["latency_ns"] - records["lag_ns"])[ok] / 1e6)
        scheduled = np.where(ok, records["latency_ns"] / 1e6, np.inf)
        return OpenLoopLevel(
            p99_ms=percentile(from_send, 99),
            p50_ms=percentile(from_send, 50),
            scheduled_p99_ms=float(np.percentile(scheduled, 99, method="higher")),
            lag_p99_ms=float(np.percentile(records["lag_ns"], 99)) / 1e6,
            requests=len(records),
            errors=int((~ok).sum()),
            client_cpu_util=float(json.loads(done.stdout)["cpu_share"]),
            other_work=used.other_work,
        )


def one_point(
    server: Server,
    model: Model,
    replica: ReplicaProfile,
    rho: float,
    run: tuple[float, int, Path],
    c_client: CClient | None = None,
) -> Point:
    seconds, seed, work = run
    t1 = replica.service.service_time(1)
    rate = rho / (t1 + replica.frontend_s)
    predicted = predict(rate, model, work / "profile.json")
    no_idle = predict(rate, model, work / "profile.json", "--no-idle-start")
    naive, mm1, before = alternatives(replica, rate)
    level = measure(server, model, rate, seconds, seed, work)
    report, used = level.report, level.load
    traced = trace_p99(replica, model, rate, level)
    return Point(
        model=model.name,
        rho=rho,
        rate=rate,
        t1_s=t1,
        frontend_s=replica.frontend_s,
        overhead_s=replica.service.overhead_s,
        cv=replica.service_cv,
        predicted_p99_ms=predicted,
        no_idle_p99_ms=no_idle,
        naive_p99_ms=naive,
        mm1_p99_ms=mm1,
        before_p99_ms=before,
        trace_p99_ms=traced,
        measured_p99_ms=level.p(99),
        measured_p50_ms=level.p(50),
        scheduled_p99_ms=report["latency_ms"]["p99"],
        throughput=report["throughput"],
        requests=report["requests"],
        errors=sum(report["errors"].values()),
        send_lag_p99_ms=report["send_lag_ms"]["p99"],
        client_cpu_util=report["client_cpu_util"],
        server_cpu_per_request_ms=used.cpu_s / max(used.rows, 1) * 1e3,
        mean_batch=used.rows / max(used.batches, 1),
        other_work=used.other_work,
        warnings=report["warnings"],
        c=None if c_client is None else c_client.measure(server, model, rate, run),
    )


def run_model(ctx: Context, model: Model, seconds: float, c: OpenLoop | None) -> list[Point]:
    repository = write_repository(ctx.work, model, ctx)
    points: list[Point] = []
    server = start_lockgate(repository, ctx.work, *SERVER_FLAGS)
    with running(server):
        c_client = None
        if c is not None and model.name in OPENLOOP_MODELS:
            c_client = CClient.for_server(c, server, model, ctx.work)
        for repetition in range(ctx.repetitions):
            replica = profile(server, model, ctx.work / "profile.json")
            ctx.say(
                SUITE,
                f"{model.name} rep {repetition + 1}: T(1) "
                f"{replica.service.service_time(1) * 1e3:.3f} ms, front end "
                f"{replica.frontend_s * 1e3:.3f} ms, d {replica.service.overhead_s * 1e3:.2f} "
                f"ms, cv {replica.service_cv:.2f}",
            )
            for rho in UTILIZATIONS:
                run = (seconds, repetition, ctx.work)
                point = one_point(server, model, replica, rho, run, c_client)
                ctx.say(
                    SUITE,
                    f"{model.name} rep {repetition + 1} rho {rho}: {point.rate:.1f}/s, p99 "
                    f"predicted {point.predicted_p99_ms:.2f} ms ({model.queue_model}), lockgate "
                    f"bench {point.measured_p99_ms:.2f} ms; server CPU "
                    f"{point.server_cpu_per_request_ms:.3f} ms/request, batch "
                    f"{point.mean_batch:.2f}, send lag p99 {point.send_lag_p99_ms:.1f} ms, "
                    f"other work on the server core {_share(point.other_work)}"
                    + ("" if point.c is None else f"; {_c_line(point.c)}")
                    + f"; error {point.error:+.0%}{' (left out)' if point.starved else ''}",
                )
                points.append(point)
    return points


def _c_line(c: OpenLoopLevel) -> str:
    return (
        f"C client p99 {c.p99_ms:.2f} ms from the send, dispatch lag p99 {c.lag_p99_ms:.2f} "
        f"ms, CPU {c.client_cpu_util:.2f}, other work on the server core {_share(c.other_work)}"
    )


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    seconds = ctx.scale(LEVEL_S)
    try:
        c: OpenLoop | None = OpenLoop.build(ctx.work)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        ctx.say(SUITE, f"no C client ({exc}): digits_onnx is judged on lockgate bench's p99")
        c = None
    points = [p for model in MODELS for p in run_model(ctx, model, seconds, c)]
    return summarize(points, seconds, time.perf_counter() - started, c is not None)


@dataclass(frozen=True, slots=True)
class Cell:
    """One model at one rho, over the repetitions."""

    model: Model
    rho: float
    points: list[Point]

    @property
    def kept(self) -> list[Point]:
        return [p for p in self.points if not p.starved]

    @property
    def evaluated(self) -> bool:
        return bool(self.kept)

    def median(self, name: str) -> float:
        chosen = self.kept or self.points
        return statistics.median(getattr(p, name) for p in chosen)

    @property
    def error(self) -> float:
        measured = self.median("judged_p99_ms")
        return (self.median("predicted_p99_ms") - measured) / measured


def summarize(
    points: list[Point], seconds: float, elapsed: float, c_built: bool = False
) -> SuiteResult:
    result = SuiteResult(
        suite=SUITE,
        title="lockgate plan's p99 against lockgate bench's, one replica on one core",
        target=(
            f"predicted p99 within {TOLERANCE:.0%} of measured at rho 0.3, 0.5, 0.7 on "
            f"{' and '.join(TARGET_MODELS)} (sleeper: the ideal case, reported)"
            + (f"; {', '.join(OPENLOOP_MODELS)} measured by the C client" if c_built else "")
        ),
        met=None,
        environment=environment(),
    )
    cells = [
        Cell(model, rho, [p for p in points if p.model == model.name and p.rho == rho])
        for model in MODELS
        for rho in UTILIZATIONS
    ]
    for cell in cells:
        measured = cell.median("judged_p99_ms")
        result.add(
            f"{cell.model.name} p99 at rho {cell.rho}",
            measured,
            "ms",
            baseline_label=f"{cell.model.queue_model} predicted",
            baseline=cell.median("predicted_p99_ms"),
            note=_cell_note(cell, measured),
        )
    judged = [c for c in cells if c.model.name in TARGET_MODELS]
    if all(c.evaluated for c in judged):
        result.met = all(abs(c.error) <= TOLERANCE for c in judged)
    result.notes += _notes(points, cells, seconds, elapsed)
    result.notes.append(
        f"{', '.join(OPENLOOP_MODELS)}: measured after each bench level by the C open-loop "
        "client (benchmarks/openloop.c) at the same rate for the same time, p99 from when each "
        "request left; the rows and the target use its p99, the bench's is in the note"
        if c_built
        else f"NO C CLIENT (cc missing): {', '.join(OPENLOOP_MODELS)} judged on lockgate "
        "bench's p99, which carries the client's own queue"
    )
    result.raw["points"] = [_point_json(p) for p in points]
    return result


def _cell_note(cell: Cell, measured: float) -> str:
    def vs(name: str) -> str:
        value = cell.median(name)
        if not math.isfinite(value):
            return "unbounded (rho >= 1)"
        return f"{value:.2f} ms ({(value - measured) / measured:+.0%})"

    kept = len(cell.kept)
    status = f"{kept} of {len(cell.points)} repetitions kept"
    if not kept:
        status = "NOT EVALUATED: the machine was busy in every repetition"
    cells = ", ".join(
        f"{p.judged_p99_ms:.2f}/{p.predicted_p99_ms:.2f}{'*' if p.starved else ''}"
        for p in cell.points
    )
    c_part = ""
    if any(p.c is not None for p in cell.points):
        bench = ", ".join(
            f"{p.measured_p99_ms:.2f}{'*' if p.bench_starved else ''}" for p in cell.points
        )
        c_part = (
            f"measured by the C client (dispatch lag p99 "
            f"{_c_median(cell, 'lag_p99_ms'):.2f} ms, CPU "
            f"{_c_median(cell, 'client_cpu_util'):.2f} of a core; from its scheduled send "
            f"{_c_median(cell, 'scheduled_p99_ms'):.2f} ms); lockgate bench's p99 from the "
            f"send {vs('measured_p99_ms')}, per repetition {bench}; "
        )
    return (
        f"{cell.median('rate'):.1f} req/s; error {cell.error:+.0%}; {status}; {c_part}"
        f"without the idle start {vs('no_idle_p99_ms')}; "
        f"the bench's p99 from the scheduled send {vs('scheduled_p99_ms')}; the model on the "
        f"bench's actual send times {vs('trace_p99_ms')}; naive {vs('naive_p99_ms')}; "
        f"M/M/1 {vs('mm1_p99_ms')}; before (d + M/D/1, S = T(1)) {vs('before_p99_ms')}; "
        f"server CPU {cell.median('server_cpu_per_request_ms'):.3f} ms/request, mean batch "
        f"{cell.median('mean_batch'):.2f}; the bench's client CPU "
        f"{cell.median('client_cpu_util'):.2f} of a core; per repetition: {cells}"
    )


def _notes(points: list[Point], cells: list[Cell], seconds: float, elapsed: float) -> list[str]:
    notes = []
    for model in MODELS:
        mine = [p for p in points if p.model == model.name]
        notes.append(
            f"{model.name}: T(1) {statistics.median(p.t1_s for p in mine) * 1e3:.3f} ms, front "
            f"end on its core {statistics.median(p.frontend_s for p in mine) * 1e3:.3f} ms, "
            f"d {statistics.median(p.overhead_s for p in mine) * 1e3:.2f} ms, cv of T(1) "
            f"{statistics.median(p.cv for p in mine):.2f} (medians over repetitions)"
        )
    missing = [f"{c.model.name} at {c.rho}" for c in cells if not c.evaluated]
    if missing:
        notes.append(f"NOT EVALUATED (machine busy in every repetition): {', '.join(missing)}")
    starved = sum(p.starved for p in points)
    levels = [p.other_work for p in points] + [p.c.other_work for p in points if p.c]
    others = [share for share in levels if share is not None]
    notes += [
        f"Levels left out because the client sent late or other work took the server's core: "
        f"{starved} of {len(points)} (marked * in the cells, measured/predicted p99 in ms per "
        "repetition). Other work on the server core per level: "
        + (f"median {statistics.median(others):.0%}, max {max(others):.0%}." if others else "?"),
        f"{seconds:g} s per level after 1 s warmup; suite {elapsed:.0f} s. Errors: "
        f"{sum(p.errors for p in points)}; client warnings in "
        f"{sum(bool(p.warnings) for p in points)} of {len(points)} levels.",
    ]
    return notes


def _c_median(cell: Cell, name: str) -> float:
    chosen = [p.c for p in (cell.kept or cell.points) if p.c is not None]
    return statistics.median(getattr(c, name) for c in chosen) if chosen else math.nan


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _point_json(point: Point) -> dict[str, Any]:
    data = {**asdict(point), "error": point.error, "starved": point.starved}
    data["bench_starved"] = point.bench_starved
    if point.c is not None:
        data["c"] = {k: _finite(v) for k, v in data["c"].items()}
    return {k: _finite(v) for k, v in data.items()}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main() -> int:
    """Run this suite alone and write its results like `python -m benchmarks.run` does."""
    from benchmarks.run import main as run_main

    return run_main(["--suite", SUITE, *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
