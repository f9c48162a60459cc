"""slow_bodies: one client holds every place with bodies that do not come; do others get served?

`python -m benchmarks.run --suite slow_bodies [--quick]`

One lockgate, pinned to the server core, serves `digits_onnx` from the demo repository with its
defaults (`--limit-concurrency` 1024). A hostile client on 127.0.0.2 opens 1,024 connections,
each sending a complete request head (`Content-Length: 100000`) and the first bytes of its
body, then nothing: the places of `--limit-concurrency` are all held by bodies that do not
come. A second later, a well-behaved client on 127.0.0.1 sends digits_onnx requests one after
another for a while, and the suite counts its answers and refusals.

Baseline, in the same run: the same server with `--slow-body-secs 1e9`, which never takes a
place back, so the stalled bodies hold their places until the body timeout (30 s).

Target: with the defaults, the well-behaved client is served (at least 99% of its requests
answered 200), where the baseline refuses it.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import Context, SuiteResult, environment, free_port, start_server

SUITE = "slow_bodies"
TARGET = 0.99  # share of the well-behaved client's requests answered 200
HOSTILE = "127.0.0.2"
PLACES = 1024  # lockgate's default --limit-concurrency
ROW = [0.0] * 64


def write_repository(work: Path) -> Path:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    digits = [m for m in DEMO_MODELS if m.name == "digits_onnx"]
    return build_demo_repository(work / "repo", models=digits)


def hold_every_place(port: int) -> list[socket.socket]:
    """PLACES connections from HOSTILE, each with a complete head and a stalled body, opened
    again while any was refused on arrival (a burst of connections may lag the loop)."""
    head = (
        b"POST /v2/models/digits_onnx/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    )
    held: list[socket.socket] = []
    for _ in range(20):
        while len(held) < PLACES:
            sock = socket.create_connection(("127.0.0.1", port), source_address=(HOSTILE, 0))
            sock.sendall(head + b'{"inp')
            held.append(sock)
            time.sleep(0.001)
        time.sleep(0.3)
        kept = [sock for sock in held if _open(sock)]
        for sock in set(held) - set(kept):
            sock.close()
        held = kept
        if len(held) == PLACES:
            break
    return held


def _open(sock: socket.socket) -> bool:
    """Not answered (nor closed) yet."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def well_behaved(port: int, seconds: float) -> tuple[int, int, float]:
    """Answers 200, other answers, and the median latency (ms) of one request at a time."""
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}
    )
    ok = other = 0
    latencies = []
    end = time.monotonic() + seconds
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        while time.monotonic() < end:
            started = time.perf_counter()
            answer = client.post("/v2/models/digits_onnx/infer", content=body)
            latencies.append((time.perf_counter() - started) * 1000)
            ok, other = (ok + 1, other) if answer.status_code == 200 else (ok, other + 1)
    return ok, other, statistics.median(latencies)


def taken_back(held: list[socket.socket]) -> int:
    return sum(1 for sock in held if not _open(sock))


def trial(repo: Path, work: Path, seconds: float, *extra: str) -> dict[str, float]:
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    command += ["--no-llm", "--grpc-port", "off", *extra]
    server = start_server("lockgate", command, port, work)
    held: list[socket.socket] = []
    try:
        held = hold_every_place(port)
        time.sleep(1.5)  # past --slow-body-secs
        ok, other, p50 = well_behaved(port, seconds)
        return {
            "held": len(held),
            "ok": ok,
            "refused": other,
            "p50_ms": p50,
            "taken_back": taken_back(held),
        }
    finally:
        for sock in held:
            sock.close()
        server.stop()


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    seconds = ctx.scale(5.0)
    rounds = 1 if ctx.quick else max(2, ctx.repetitions - 1)
    trials: dict[str, list[dict[str, float]]] = {"defaults": [], "never": []}
    for r in range(rounds):
        for name, extra in (("never", ("--slow-body-secs", "1e9")), ("defaults", ())):
            found = trial(repo, ctx.work, seconds, *extra)
            trials[name].append(found)
            ctx.say(SUITE, f"round {r + 1}/{rounds} {name}: {found}")
    share = {
        name: statistics.median(t["ok"] / max(1, t["ok"] + t["refused"]) for t in found)
        for name, found in trials.items()
    }
    result = SuiteResult(
        suite=SUITE,
        title="1,024 stalled bodies hold every place: another client's requests, one at a time",
        target=f">= {TARGET:.0%} of the other client's requests answered with the defaults",
        met=share["defaults"] >= TARGET,
        environment=environment(),
        raw=trials,
    )
    never = trials["never"]
    for label, key, unit in (
        ("answered 200", "ok", "requests"),
        ("refused", "refused", "requests"),
        ("share answered", "", "share"),
        ("stalled places taken back", "taken_back", "connections"),
    ):
        value = (
            share["defaults"] if not key else statistics.median(t[key] for t in trials["defaults"])
        )
        base = share["never"] if not key else statistics.median(t[key] for t in never)
        result.add(
            f"defaults: {label}",
            value,
            unit,
            baseline_label="never taken back (--slow-body-secs 1e9)",
            baseline=base,
        )
    result.add(
        "defaults: median latency answered",
        statistics.median(t["p50_ms"] for t in trials["defaults"]),
        "ms",
    )
    result.notes.append(
        f"Medians of {rounds} alternating rounds of {seconds:g} s each, the server pinned to its "
        "core; the stalled client holds every place of --limit-concurrency 1024 before the "
        "other starts."
    )
    result.notes.append(f"Suite time {time.perf_counter() - started:.0f} s.")
    return result
