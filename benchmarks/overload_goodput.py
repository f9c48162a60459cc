"""overload_goodput: does goodput hold from half to five times capacity, or collapse?

A python model that sleeps 20 ms per batch of up to 4 rows, whatever its size, so its capacity
(about 200 req/s) is known and stable; the SLO is 200 ms. Two models share that code:

- `steady`:     no `latency_slo_ms`; every request carries its deadline, `timeout` = SLO (µs)
- `steady_slo`: `latency_slo_ms: 200`; requests carry no deadline (the SLO is the default one)

Each model is measured on a lockgate with deadline-aware admission (the default) and on one
started with `--no-admission`, one server at a time on the server core:

1. Capacity: a closed loop (16 workers, no deadline) against that server, after a warm-up.
2. Levels: open-loop Poisson arrivals at 0.5, 1, 1.5, 2, 3 and 5 times that capacity, 8 s
   each, with a 2 s pause between levels so that the queue drains. Latency counts from the
   *scheduled* send time.

Per level: offered rate, throughput (200s/s), goodput (200s answered within the SLO, per
second of offered load, and as a share of capacity), p50/p99 of the 200s, refusals (503 and
429) with their p99, 504s, and lost requests (sent - answered; must be 0). Refusal reasons
come from `lockgate_requests_rejected_total`, scraped before and after each level.

Target: with admission on, goodput ≥ 80% of capacity at every level ≥ 1x and nothing lost.
The curve without admission is the comparison. A PNG of the curves goes to
`results/overload_goodput.png`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.common import (
    Context,
    Server,
    SuiteResult,
    Target,
    closed_loop,
    environment,
    percentile,
    run_async,
    running,
    scrape_metrics,
    start_lockgate,
)

SUITE = "overload_goodput"
SLO_S = 0.200  # the latency objective: the requests' timeout, or the model's latency_slo_ms
SERVICE_S = 0.020  # the model sleeps this long per batch, whatever its size
MAX_BATCH = 4
QUEUE_ROWS = 256  # dynamic_batching.max_queue_size
LEVELS = (0.5, 1.0, 1.5, 2.0, 3.0, 5.0)  # offered rate / capacity
LEVEL_S, QUICK_LEVEL_S = 8.0, 3.0
PAUSE_S = 2.0
GOODPUT_TARGET = 0.8  # share of capacity, at every level >= 1x, admission on
VARIANTS = ("steady", "steady_slo")  # deadline per request; SLO as the default deadline
REFUSALS = (503, 429)

MODEL_CODE = f'''
import time


class Model:
    """Doubles its input; every batch takes {SERVICE_S} s, whatever its size."""

    def infer(self, inputs):
        time.sleep({SERVICE_S})
        return {{"y": inputs["x"] * 2}}
'''


def write_repository(repo: Path) -> Path:
    """`steady` (deadline per request) and `steady_slo` (latency_slo_ms) with the same code."""
    for name in VARIANTS:
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(MODEL_CODE)
        slo = f"latency_slo_ms: {SLO_S * 1000:g}\n" if name == "steady_slo" else ""
        config = f"""\
            name: {name}
            backend: python
            max_batch_size: {MAX_BATCH}
            inputs:
              - {{name: x, datatype: FP32, dims: [4]}}
            outputs:
              - {{name: y, datatype: FP32, dims: [4]}}
            dynamic_batching: {{max_queue_size: {QUEUE_ROWS}}}
            """
        (folder / "config.yaml").write_text(textwrap.dedent(config) + slo)
    return repo


def body(value: float, timeout_us: int | None) -> bytes:
    payload: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]
    }
    if timeout_us is not None:
        payload["parameters"] = {"timeout": timeout_us}
    return json.dumps(payload).encode()


def target(server: Server, variant: str) -> Target:
    timeout = int(SLO_S * 1e6) if variant == "steady" else None
    bodies = tuple(body(float(i), timeout) for i in range(16))
    return Target(f"{server.url}/v2/models/{variant}/infer", bodies)


# -- one level ---------------------------------------------------------------------------


@dataclass(slots=True)
class Level:
    """Every answer of one open-loop run at `factor` times capacity."""

    factor: float
    rate: float  # scheduled Poisson rate, req/s
    seconds: float  # length of the arrival window
    sent: int = 0
    statuses: list[int] = field(default_factory=list)  # 0: the transport failed
    latencies: list[float] = field(default_factory=list)  # s from the scheduled send
    send_lag: list[float] = field(default_factory=list)  # s from schedule to the send
    health: list[float] = field(default_factory=list)  # s per health check, 10 per second
    rejected: dict[str, float] = field(default_factory=dict)  # server's reasons, this level
    cpu_seconds: float = 0.0  # user + system CPU time of the server process during the level
    wall_seconds: float = 0.0  # wall time of the level, first send to last answer

    @property
    def answered(self) -> int:
        return len(self.statuses)

    @property
    def lost(self) -> int:
        return self.sent - self.answered

    def count(self, *statuses: int) -> int:
        return sum(1 for s in self.statuses if s in statuses)

    def of(self, *statuses: int) -> list[float]:
        return [lat for s, lat in zip(self.statuses, self.latencies, strict=True) if s in statuses]

    @property
    def offered(self) -> float:
        return self.sent / self.seconds

    @property
    def throughput(self) -> float:
        return self.count(200) / self.seconds

    @property
    def goodput(self) -> float:
        """200s answered within the SLO, per second of arrivals."""
        return sum(1 for lat in self.of(200) if lat <= SLO_S) / self.seconds

    @property
    def cpu_share(self) -> float:
        """The server's CPU use during the level, in cores (1.0: one core busy throughout)."""
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds else float("nan")

    @property
    def cpu_ms_per_request(self) -> float:
        return self.cpu_seconds * 1e3 / self.answered if self.answered else float("nan")

    @property
    def others(self) -> int:
        return self.answered - self.count(200, 504, *REFUSALS)


async def offer(load: Target, level: Level, seed: int) -> None:
    """Poisson arrivals at `level.rate` for `level.seconds`; every answer recorded."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=1024)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(load.url.split("/v2/")[0] + "/v2/health/ready") as response:
            await response.read()  # one connection open before the clock starts
        pending: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        control = asyncio.create_task(check_health(session, load, level, start))
        offset = rng.expovariate(level.rate)
        while offset < level.seconds:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            data = load.bodies[level.sent % len(load.bodies)]
            task = asyncio.create_task(send(session, load, data, start + offset, level))
            pending.add(task)
            task.add_done_callback(pending.discard)
            level.sent += 1
            offset += rng.expovariate(level.rate)
        await asyncio.gather(*pending, control)


async def check_health(
    session: aiohttp.ClientSession, load: Target, level: Level, start: float
) -> None:
    """A control stream: /v2/health/live every 100 ms, timed from its scheduled time. When the
    server's event loop (or the machine) stalls, these slow down as much as anything."""
    url = load.url.split("/v2/")[0] + "/v2/health/live"
    for tick in np.arange(0.05, level.seconds, 0.1):
        scheduled = start + float(tick)
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        try:
            async with session.get(url) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError):
            continue
        level.health.append(time.perf_counter() - scheduled)


async def send(
    session: aiohttp.ClientSession, load: Target, data: bytes, scheduled: float, level: Level
) -> None:
    level.send_lag.append(time.perf_counter() - scheduled)
    headers = {"Content-Type": load.content_type}
    try:
        async with session.post(load.url, data=data, headers=headers) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status = 0
    level.latencies.append(time.perf_counter() - scheduled)
    level.statuses.append(status)


def run_level(server: Server, variant: str, level: Level, seed: int) -> Level:
    before = scrape_metrics(server.url)
    cpu, wall = cpu_seconds(server.process.pid), time.perf_counter()
    try:
        import uvloop
    except ImportError:
        asyncio.run(offer(target(server, variant), level, seed))
    else:
        uvloop.run(offer(target(server, variant), level, seed))
    level.cpu_seconds = cpu_seconds(server.process.pid) - cpu
    level.wall_seconds = time.perf_counter() - wall
    level.rejected = rejected(before, scrape_metrics(server.url), variant)
    return level


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": fields 3.. of proc(5)
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def rejected(before: dict[str, float], after: dict[str, float], model: str) -> dict[str, float]:
    """lockgate_requests_rejected_total of `model` by reason, between two scrapes."""
    found: dict[str, float] = {}
    for key, value in after.items():
        if key.split("{")[0] != "lockgate_requests_rejected_total" or f'model="{model}"' not in key:
            continue
        reason = key.split('reason="')[1].split('"')[0] if 'reason="' in key else "?"
        delta = value - before.get(key, 0.0)
        if delta:
            found[reason] = found.get(reason, 0.0) + delta
    return found


# -- curves ------------------------------------------------------------------------------


@dataclass(slots=True)
class Curve:
    mode: str  # "admission" or "no-admission"
    variant: str  # "steady" or "steady_slo"
    capacity: float  # req/s, closed loop on the same server
    levels: list[Level] = field(default_factory=list)

    @property
    def name(self) -> str:
        deadline = "timeout=SLO" if self.variant == "steady" else "latency_slo_ms, no deadline"
        return f"{self.mode}, {deadline}"

    def share(self, level: Level) -> float:
        return level.goodput / self.capacity if self.capacity else float("nan")


def measure_capacity(ctx: Context, server: Server) -> float:
    """Closed-loop req/s of `steady` with no deadline (admission cannot refuse)."""
    url = target(server, "steady").url
    untimed = Target(url, tuple(body(float(i), None) for i in range(16)))
    run_async(closed_loop(untimed, 4 * MAX_BATCH, seconds=1.0, warmup=50))  # warm
    probe = run_async(closed_loop(untimed, 4 * MAX_BATCH, seconds=ctx.scale(4.0), warmup=0))
    return probe.throughput


def measure(ctx: Context, servers: dict[str, Server]) -> list[Curve]:
    """Capacity of each server, then every level, alternating the servers inside a level."""
    capacity = {mode: measure_capacity(ctx, server) for mode, server in servers.items()}
    expected = MAX_BATCH / SERVICE_S
    for mode, value in capacity.items():
        ctx.say(SUITE, f"{mode}: capacity {value:.0f} req/s (the model alone: {expected:.0f})")
    curves = [Curve(m, v, capacity[m]) for v in VARIANTS for m in servers]
    seconds = QUICK_LEVEL_S if ctx.quick else LEVEL_S
    for i, factor in enumerate(LEVELS):
        for curve in curves:
            time.sleep(PAUSE_S)
            level = Level(factor, factor * curve.capacity, seconds)
            curve.levels.append(run_level(servers[curve.mode], curve.variant, level, i))
            ctx.say(SUITE, f"{curve.name}: {describe(curve, level)}")
    for server in servers.values():
        if server.process.poll() is not None:
            raise RuntimeError(f"lockgate exited:\n{server.log_tail()}")
    return curves


def describe(curve: Curve, level: Level) -> str:
    refusals = level.of(*REFUSALS)
    return (
        f"{level.factor:g}x offered {level.offered:.0f}/s, served {level.throughput:.0f}/s, "
        f"goodput {level.goodput:.0f}/s ({curve.share(level):.0%}), "
        f"p50/p99 {percentile(level.of(200), 50) * 1e3:.0f}/"
        f"{percentile(level.of(200), 99) * 1e3:.0f} ms, refused {len(refusals)} "
        f"(p99 {percentile(refusals, 99) * 1e3:.1f} ms), 504 {level.count(504)}, "
        f"other {level.others}, lost {level.lost}, server {level.rejected}, "
        f"send lag p99 {percentile(level.send_lag, 99) * 1e3:.1f} ms, "
        f"health check p99 {percentile(level.health, 99) * 1e3:.1f} ms, server CPU "
        f"{level.cpu_share:.0%} of a core ({level.cpu_ms_per_request:.2f} ms per request)"
    )


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work / "overload-repo")
    load = [os.getloadavg()[0]]
    ctx.say(SUITE, "starting two lockgates on the server core: with and without admission")
    servers = {"admission": start_lockgate(repo, ctx.work)}
    with running(*servers.values()):
        servers["no-admission"] = start_lockgate(repo, ctx.work, "--no-admission")
        with running(servers["no-admission"]):
            curves = measure(ctx, servers)
    load.append(os.getloadavg()[0])
    result = report(curves, load)
    plot = plot_curves(curves, ctx.results / f"{SUITE}.png")
    if plot is not None:
        result.notes.append(f"Plot: [{plot.name}]({plot.name}).")
    result.seconds = time.perf_counter() - started
    return result


# -- report ------------------------------------------------------------------------------


def met(curves: list[Curve]) -> bool:
    admitted = [c for c in curves if c.mode == "admission"]
    holds = all(
        c.share(level) >= GOODPUT_TARGET
        for c in admitted
        for level in c.levels
        if level.factor >= 1
    )
    return holds and all(level.lost == 0 for c in curves for level in c.levels)


def report(curves: list[Curve], load: list[float]) -> SuiteResult:
    result = SuiteResult(
        suite=SUITE,
        title=(
            f"Goodput under overload: {SERVICE_S * 1e3:g} ms per batch of {MAX_BATCH}, "
            f"SLO {SLO_S * 1e3:g} ms, 0.5x to 5x capacity (open loop)"
        ),
        target=(
            f"with admission on, goodput ≥ {GOODPUT_TARGET:.0%} of capacity at every level ≥ 1x, "
            "and no request lost (sent == answered)"
        ),
        met=met(curves),
        environment=environment(),
    )
    for curve in curves:
        result.add(f"{curve.mode}: capacity (closed loop, c=16)", curve.capacity, "req/s")
        for level in curve.levels:
            add_level(result, curve, level)
    result.notes += [
        "Goodput: 200s answered within the SLO, measured from the scheduled send time, per "
        "second of arrivals. Refused: 503 (and 429). Lost: sent - answered. Health p99: a "
        "control stream of /v2/health/live every 100 ms during the level (server or machine "
        "stalls show there too).",
        f"Each level {curves[0].levels[0].seconds:g} s, one run per level (no repetitions: "
        "the suite stays near 5 minutes).",
        "Both servers run side by side on the server core (one loaded at a time); each level "
        "alternates them, so drift in the machine's load hits both curves alike.",
        "1-minute load average at the start / at the end: "
        + " / ".join(f"{v:.1f}" for v in load)
        + f" on {os.cpu_count()} CPUs (a shared machine).",
    ]
    result.raw = {"curves": [curve_json(c) for c in curves], "load_average": load}
    return result


def add_level(result: SuiteResult, curve: Curve, level: Level) -> None:
    refusals = level.of(*REFUSALS)
    ok = level.of(200)
    note = (
        f"offered {level.offered:.0f}/s, served {level.throughput:.0f}/s; "
        f"200 p50/p99 {percentile(ok, 50) * 1e3:.0f}/{percentile(ok, 99) * 1e3:.0f} ms; "
        f"refused {len(refusals)} (p99 {percentile(refusals, 99) * 1e3:.1f} ms); "
        f"504 {level.count(504)}; other {level.others}; lost {level.lost}; "
        f"health p99 {percentile(level.health, 99) * 1e3:.0f} ms; server CPU "
        f"{level.cpu_share:.0%} of a core, {level.cpu_ms_per_request:.2f} ms/request"
    )
    result.add(
        f"{curve.name} @ {level.factor:g}x: goodput",
        level.goodput,
        "req/s",
        baseline_label="capacity",
        baseline=curve.capacity,
        note=note,
    )


def curve_json(curve: Curve) -> dict[str, Any]:
    return {
        "mode": curve.mode,
        "variant": curve.variant,
        "capacity": curve.capacity,
        "levels": [level_json(level) for level in curve.levels],
    }


def level_json(level: Level) -> dict[str, Any]:
    refusals, ok = level.of(*REFUSALS), level.of(200)
    return {
        "factor": level.factor,
        "rate": level.rate,
        "offered": level.offered,
        "sent": level.sent,
        "answered": level.answered,
        "lost": level.lost,
        "statuses": dict(Counter(level.statuses)),
        "throughput": level.throughput,
        "goodput": level.goodput,
        "p50_ok_s": percentile(ok, 50),
        "p99_ok_s": percentile(ok, 99),
        "p99_refused_s": percentile(refusals, 99),
        "p99_send_lag_s": percentile(level.send_lag, 99),
        "p99_health_s": percentile(level.health, 99),
        "server_cpu_s": level.cpu_seconds,
        "wall_s": level.wall_seconds,
        "server_rejected": level.rejected,
    }


def plot_curves(curves: list[Curve], path: Path) -> Path | None:
    """Goodput / capacity against offered / capacity, one line per curve; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    ideal = np.array([0.0, 1.0, max(LEVELS)])
    axes.plot(ideal, np.minimum(ideal, 1.0), color="0.7", linestyle=":", label="ideal")
    axes.axhline(GOODPUT_TARGET, color="0.8", linestyle="--", label=f"{GOODPUT_TARGET:.0%} target")
    for curve in curves:
        x = [level.offered / curve.capacity for level in curve.levels]
        y = [curve.share(level) for level in curve.levels]
        admission = curve.mode == "admission"
        deadline = curve.variant == "steady"
        color = ("tab:blue" if deadline else "tab:cyan") if admission else "tab:red"
        color = color if admission or deadline else "tab:orange"
        style, marker = ("-" if admission else "--"), ("o" if deadline else "s")
        axes.plot(x, y, color=color, linestyle=style, marker=marker, label=curve.name)
    axes.set_xlabel("offered load / capacity")
    axes.set_ylabel("goodput (200 within SLO) / capacity")
    axes.set_title(f"lockgate goodput, SLO {SLO_S * 1e3:g} ms")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
