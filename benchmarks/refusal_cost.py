"""refusal_cost: what a refusal costs the server, against a served request, in CPU.

`python -m benchmarks.run --suite refusal_cost [--quick]`

Under overload most requests are refused, and every refusal takes CPU from the requests being
served on the same core. One lockgate, pinned to the server core, serves two models:

- `digits_onnx` from the demo repository (one row per request): the served request.
- `held`: a python model with `latency_slo_ms: 100` whose every batch sleeps 10 s, kept busy
  by a background client that sends it one request at a time. Every other request to it is
  predicted to miss its SLO, so it is refused at the protocol layer, before its body is read:
  the cheapest refusal lockgate makes, and the one it makes under overload. The sleep costs no
  CPU, so what the server spends is the refusals'.

Each round sends the same small requests one at a time on one keep-alive connection (the
`RawClient`, a few microseconds per request), and reads the server's CPU time from /proc
before and after. Rounds alternate; the table gives medians.

Target: a refusal costs <= 10% of the CPU of a served digits_onnx request.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import (
    Context,
    RawClient,
    Server,
    SuiteResult,
    environment,
    free_port,
    process_cpu_seconds,
    running,
    start_server,
)
from benchmarks.plan_check import SLEEPER

SUITE = "refusal_cost"
TARGET = 0.10  # refusal CPU / served CPU
# each batch of `held` sleeps this long: longer than a round of refusals on a busy machine, or
# the round's own client, sending the moment it is answered, takes the idle model first when a
# hold ends, and each of its requests waits out a whole hold
HOLD_S = 10.0
HELD_SLO_MS = 100
MAX_NOT_SERVED = 0.01  # of the served rounds' requests: past it, the round measured noise

HELD_CONFIG = f"""\
name: held
backend: python
max_batch_size: 1
inputs:
  - {{name: x, datatype: FP32, dims: [4]}}
outputs:
  - {{name: y, datatype: FP32, dims: [4]}}
latency_slo_ms: {HELD_SLO_MS}
parameters: {{sleep_s: "{HOLD_S}"}}
"""


def write_repository(work: Path) -> Path:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    digits = [m for m in DEMO_MODELS if m.name == "digits_onnx"]
    repo = build_demo_repository(work / "repo", models=digits)
    folder = repo / "held"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLEEPER)  # sleeps sleep_s per batch
    (folder / "config.yaml").write_text(HELD_CONFIG)
    return repo


def digits_body() -> bytes:
    from sklearn.datasets import load_digits

    row = (load_digits().data[0] / 16.0).astype(np.float32)
    payload = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": []}]}
    payload["inputs"][0]["data"] = row.tolist()
    return json.dumps(payload).encode()


HELD_BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


class Holder:
    """Keeps `held` busy: one request at a time, each answered after HOLD_S."""

    def __init__(self, server: Server) -> None:
        self.url = f"{server.url}/v2/models/held/infer"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            request = urllib.request.Request(
                self.url, HELD_BODY, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=HOLD_S + 5) as response:
                    response.read()
            except OSError:
                time.sleep(0.01)  # refused: the model was still busy; ask again

    def __enter__(self) -> Holder:
        self.thread.start()
        time.sleep(0.3)  # the first held batch is running
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=HOLD_S * 2)


def cpu_per_request(server: Server, path: str, body: bytes, count: int) -> tuple[float, int]:
    """Server CPU seconds per request over `count` sequential requests, and how many were
    answered 200."""
    client = RawClient(server.url + path)
    request = client.request(body)
    try:
        for _ in range(50):  # warm the connection and the path
            client.send(request)
        before = process_cpu_seconds(server.process.pid)
        ok = sum(client.send(request) == 200 for _ in range(count))
        used = process_cpu_seconds(server.process.pid) - before
    finally:
        client.close()
    return used / count, ok


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    # no refusal pause: one client resending at once would be paused 100 ms per refusal, and
    # this suite measures what each refusal costs, not how many there are
    command += ["--no-llm", "--grpc-port", "off", "--refusal-pause-ms", "0"]
    server = start_server("lockgate", command, port, ctx.work)
    count = 2000 if ctx.quick else 10000
    rounds = 2 if ctx.quick else 5
    served: list[float] = []
    refused: list[float] = []
    not_served = 0
    with running(server):
        body = digits_body()
        for r in range(rounds):
            cost, ok = cpu_per_request(server, "/v2/models/digits_onnx/infer", body, count)
            if ok < count * (1 - MAX_NOT_SERVED):  # a busy machine can delay a few past 50 ms
                raise RuntimeError(f"digits_onnx answered {ok} of {count} with 200")
            served.append(cost)
            not_served += count - ok
            with Holder(server):
                cost, ok = cpu_per_request(server, "/v2/models/held/infer", HELD_BODY, count)
            if ok > count // 100:
                raise RuntimeError(f"held admitted {ok} of {count}: it was not kept busy")
            refused.append(cost)
            ctx.say(
                SUITE,
                f"round {r + 1}/{rounds}: served {served[-1] * 1e6:.1f} µs, "
                f"refused {refused[-1] * 1e6:.1f} µs of server CPU per request",
            )
    served_us = statistics.median(served) * 1e6
    refused_us = statistics.median(refused) * 1e6
    result = SuiteResult(
        suite=SUITE,
        title="What a refusal costs: server CPU per request refused before its body, "
        "against a served digits_onnx request",
        target=f"refusal <= {TARGET:.0%} of a served request's CPU",
        met=refused_us <= TARGET * served_us,
        environment=environment(),
    )
    result.add("served digits_onnx request", served_us, "µs CPU")
    result.add(
        "refused before the body",
        refused_us,
        "µs CPU",
        baseline_label="served request",
        baseline=served_us,
    )
    result.notes.append(
        f"Medians of {rounds} rounds of {count} sequential requests on one keep-alive "
        "connection, server pinned to its core; CPU is the server process's user + system "
        "time from /proc, client excluded."
    )
    if not_served:
        result.notes.append(
            f"{not_served} of the served rounds' {rounds * count} digits_onnx requests were "
            "not answered 200 (refused or past the 50 ms SLO on a busy machine); their CPU "
            "is in the served figure."
        )
    result.raw = {"served_s": served, "refused_s": refused, "count": count}
    result.seconds = time.perf_counter() - started
    return result
