"""plan_check: the p99 that `lockgate plan` predicts against the p99 `lockgate bench` measures.

Method. The model is a python model that sleeps 10 ms per call, `max_batch_size: 1`, one
instance: requests are served one at a time and each takes nearly the same time, so M/D/1
(Poisson arrivals, deterministic service, one server) is the honest queueing model; M/M/1 is
shown beside it for contrast. Each load level of each repetition:

1. `lockgate profile --max-batch-size 1` times 50 sequential requests through the server. It
   reads the model's compute time from the server's statistics, so it gives the instance's
   service time S and the fixed overhead d (round trip minus compute: HTTP, parsing, client).
2. For each utilization rho in 0.3, 0.5, 0.7 of the instance's capacity 1 / S, `lockgate plan
   --profile ... --rate rho/S --queue-model md1 --headroom 0 --redundancy 0` gives the p99 of one
   replica, d + the M/D/1 p99 (the SLO is loose enough that one replica is the plan). Beside it:
   the naive prediction that treats the whole round trip d + S as the queue's service time
   (`--service-ms`), and M/M/1.
3. `lockgate bench --rate rho/S` runs open-loop Poisson load for the measured window (after one
   second of warmup) and reports the p99 from the scheduled send time.

Rows quote the median over repetitions of the measured p99, with the median prediction as the
baseline; the ratio is measured / predicted. Run alone with `python -m benchmarks.plan_check`.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Context, SuiteResult, environment, running, start_lockgate
from lockgate.plan.planner import p99_at
from lockgate.service_time import ServiceTime

SUITE = "plan_check"
SERVICE_S = 0.010  # the model's sleep per call
UTILIZATIONS = (0.3, 0.5, 0.7)
TOLERANCE = 0.25  # |predicted - measured| / measured, below the knee
MODEL = "sleeper"
MAX_SEND_LAG_MS = 20.0  # a client this late (p99) was starved: the level measured the machine

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


def write_repository(root: Path) -> Path:
    """A repository with one python model whose service time is a fixed sleep."""
    folder = root / "repo" / MODEL
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
          sleep_s: "{SERVICE_S}"
        """
    (folder / "config.yaml").write_text(textwrap.dedent(config))
    return root / "repo"


def lockgate(*argv: str) -> str:
    """Run a lockgate command and return its stdout; a failure raises with its stderr."""
    command = [sys.executable, "-m", "lockgate.cli", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"lockgate {argv[0]} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


@dataclass(slots=True)
class Point:
    """One load level of one repetition."""

    rho: float
    rate: float
    service_s: float
    overhead_s: float
    md1_p99_ms: float  # d + M/D/1 with S = compute time: lockgate plan with the profile
    naive_md1_p99_ms: float  # M/D/1 with S = the whole round trip, d = 0
    mm1_p99_ms: float
    measured_p99_ms: float
    measured_p50_ms: float
    throughput: float
    requests: int
    errors: int
    send_lag_p99_ms: float
    warnings: list[str]

    @property
    def error(self) -> float:
        """Relative error of the M/D/1 prediction."""
        return (self.md1_p99_ms - self.measured_p99_ms) / self.measured_p99_ms


def profile(url: str, path: Path) -> ServiceTime:
    """`lockgate profile` through the server: S = T(1) and the fixed overhead."""
    lockgate(
        *("profile", "--url", url, "--model", MODEL, "--max-batch-size", "1"),
        *("--repeats", "50", "--warmup", "5", "--output", str(path)),
    )
    return ServiceTime.load(path)


def predict(rate: float, queue_model: str, profile_path: Path) -> dict[str, Any]:
    """`lockgate plan` for one replica at `rate`: its JSON plan."""
    out = lockgate(
        *("plan", "--profile", str(profile_path), "--rate", f"{rate:.4f}", "--slo-ms", "100000"),
        *("--queue-model", queue_model, "--headroom", "0", "--redundancy", "0", "--json"),
    )
    plan: dict[str, Any] = json.loads(out)
    if plan["replicas"] != 1:
        raise RuntimeError(f"expected a one-replica plan at {rate:.1f}/s, got {plan}")
    return plan


def measure(url: str, rate: float, seconds: float, seed: int, work: Path) -> dict[str, Any]:
    """`lockgate bench`, open-loop Poisson at `rate`: the level's JSON report."""
    path = work / "bench.json"
    lockgate(
        *("bench", "--url", url, "--model", MODEL, "--rate", f"{rate:.4f}", "--quiet"),
        *("--duration", f"{seconds:g}", "--warmup", "1", "--seed", str(seed)),
        *("--output-json", str(path)),
    )
    level: dict[str, Any] = json.loads(path.read_text())["levels"][0]
    return level


def one_point(url: str, rho: float, seconds: float, seed: int, work: Path) -> Point:
    path = work / "profile.json"
    measured = profile(url, path)
    service_s = measured.service_time(1)
    rate = rho / service_s
    round_trip = service_s + measured.overhead_s
    md1, mm1 = predict(rate, "md1", path), predict(rate, "mm1", path)
    level = measure(url, rate, seconds, seed, work)
    latency = level["latency_ms"]
    return Point(
        rho=rho,
        rate=rate,
        service_s=service_s,
        overhead_s=measured.overhead_s,
        md1_p99_ms=md1["p99_s"] * 1e3,
        naive_md1_p99_ms=p99_at("md1", rate * round_trip, round_trip, 1) * 1e3,  # inf: rho >= 1
        mm1_p99_ms=mm1["p99_s"] * 1e3,
        measured_p99_ms=latency["p99"],
        measured_p50_ms=latency["p50"],
        throughput=level["throughput"],
        requests=level["requests"],
        errors=sum(level["errors"].values()),
        send_lag_p99_ms=level["send_lag_ms"]["p99"],
        warnings=level["warnings"],
    )


def run(ctx: Context) -> SuiteResult:
    seconds = ctx.scale(20.0)
    repository = write_repository(ctx.work)
    points: list[Point] = []
    server = start_lockgate(repository, ctx.work)
    with running(server):
        for repetition in range(ctx.repetitions):
            for rho in UTILIZATIONS:
                point = one_point(server.url, rho, seconds, repetition, ctx.work)
                ctx.say(
                    SUITE,
                    f"rep {repetition + 1} rho {rho}: S {point.service_s * 1e3:.2f} ms, "
                    f"{point.rate:.1f}/s, p99 predicted {point.md1_p99_ms:.1f} ms (md1), "
                    f"measured {point.measured_p99_ms:.1f} ms ({point.error:+.0%})",
                )
                points.append(point)
    return summarize(points, seconds)


def summarize(points: list[Point], seconds: float) -> SuiteResult:
    result = SuiteResult(
        suite=SUITE,
        title="lockgate plan's p99 (d + M/D/1) against lockgate bench's, one replica",
        target=f"predicted p99 within {TOLERANCE:.0%} of measured at rho <= 0.7",
        met=None,
        environment=environment(),
    )
    errors = []
    for rho in UTILIZATIONS:
        at = [p for p in points if p.rho == rho]
        measured = statistics.median(p.measured_p99_ms for p in at)
        md1 = statistics.median(p.md1_p99_ms for p in at)
        mm1 = statistics.median(p.mm1_p99_ms for p in at)
        naive = statistics.median(p.naive_md1_p99_ms for p in at)
        rate = statistics.median(p.rate for p in at)
        error = (md1 - measured) / measured
        errors.append(error)
        note = (
            f"{rate:.1f} req/s; M/D/1 error {error:+.0%}; S = round trip would predict "
            f"{_ms(naive)} ({(naive - measured) / measured:+.0%}); M/M/1 {mm1:.1f} ms "
            f"({(mm1 - measured) / measured:+.0%}); per repetition: "
            + ", ".join(f"{p.measured_p99_ms:.1f}/{p.md1_p99_ms:.1f}" for p in at)
        )
        result.add(
            f"p99 at rho {rho}",
            measured,
            "ms",
            baseline_label="M/D/1 predicted",
            baseline=md1,
            note=note,
        )
    starved = [p for p in points if p.send_lag_p99_ms > MAX_SEND_LAG_MS]
    result.met = None if starved else all(abs(e) <= TOLERANCE for e in errors)
    if starved:
        worst = max(p.send_lag_p99_ms for p in starved)
        result.notes.append(
            f"NOT EVALUATED: in {len(starved)} of {len(points)} levels the load generator sent "
            f"late (send lag p99 up to {worst:.0f} ms > {MAX_SEND_LAG_MS:g} ms): the machine "
            "was too busy for the measured p99 to describe the server."
        )
    service = statistics.median(p.service_s for p in points) * 1e3
    overhead = statistics.median(p.overhead_s for p in points) * 1e3
    result.notes += [
        f"S = T(1) (the model's compute, from the server's statistics): median {service:.2f} ms "
        f"for a {SERVICE_S * 1e3:g} ms sleep; fixed overhead d: median {overhead:.2f} ms; "
        f"{seconds:g} s per level after 1 s warmup.",
        "Cells in notes are measured/predicted p99 (ms) per repetition.",
        f"errors: {sum(p.errors for p in points)}; client warnings: "
        f"{sum(len(p.warnings) for p in points)} of {len(points)} levels.",
    ]
    result.raw["points"] = [_point_json(p) for p in points]
    return result


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if math.isfinite(value) else "unbounded (rho >= 1)"


def _point_json(point: Point) -> dict[str, Any]:
    data = {**asdict(point), "md1_error": point.error}
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in data.items()
    }


def main() -> int:
    """Run this suite alone and write its results like `python -m benchmarks.run` does."""
    from benchmarks.run import main as run_main

    return run_main(["--suite", SUITE, *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
