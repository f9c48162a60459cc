"""`lockgate route` in front of three real lockgate replicas on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import (
    ROOT,
    RunningServer,
    free_port,
    launch_server,
    start_server,
    start_servers,
)

WHO = '''
import time
import numpy as np

class Model:
    """y = x; `replica` says which replica answered. Every `stall_every`-th call of values
    >= 1000 sleeps `stall` seconds; `sleep` seconds on every such call."""

    def load(self, config, version_dir):
        p = config.parameters
        self.replica = int(p.get("replica", "0"))
        self.stall_every = int(p.get("stall_every", "0"))
        self.stall = float(p.get("stall", "0"))
        self.sleep = float(p.get("sleep", "0"))
        self.calls = 0

    def infer(self, inputs):
        x = inputs["x"]
        if float(x.flat[0]) >= 1000:
            self.calls += 1
            time.sleep(self.sleep)
            if self.stall_every and self.calls % self.stall_every == 0:
                time.sleep(self.stall)
        who = np.full((x.shape[0], 1), self.replica, dtype=np.int64)
        return {"y": x, "replica": who}
'''

CONFIG = """\
backend: python
max_batch_size: 8
inputs: [{name: x, datatype: FP32, dims: [2]}]
outputs: [{name: y, datatype: FP32, dims: [2]}, {name: replica, datatype: INT64, dims: [1]}]
"""


def repository(root: Path, replica: int, **parameters: str) -> Path:
    repo = root / f"replica-{replica}"
    for name, extra in (
        ("who", {}),
        ("slow", {"sleep": "0.3"}),
    ):
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(WHO)
        params = {"replica": str(replica), **extra, **(parameters if name == "who" else {})}
        lines = ", ".join(f"{k}: '{v}'" for k, v in params.items())
        text = CONFIG + f"parameters: {{{lines}}}\n"
        if name == "slow":
            text += "dynamic_batching: {max_queue_size: 1}\n"
        (folder / "config.yaml").write_text(textwrap.dedent(text))
    return repo


def start_router(tmp: Path, *args: str) -> RunningServer:
    port = free_port()
    log_path = tmp / f"router-{port}.log"
    cmd = [sys.executable, "-m", "lockgate.cli", "route", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return RunningServer(process, port, log_path).wait_ready(30)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("router-replicas")
    stall = {"stall_every": "20", "stall": "0.25"}  # replica 2 stalls on 5% of its calls
    servers = start_servers(
        *(launch_server(repository(root, i, **(stall if i == 2 else {})), root) for i in range(3))
    )
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def router(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    args = [a for r in replicas for a in ("--replica", r.url)]
    router = start_router(tmp_path_factory.mktemp("router"), *args, "--no-hedge")
    yield router
    router.stop()


def body(value: float = 1000.0) -> dict:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [value, 1]}]}


def who(client: httpx.Client, url: str, model: str = "who") -> int:
    r = client.post(f"{url}/v2/models/{model}/infer", json=body(), timeout=30)
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert out["y"] == [1000.0, 1.0]
    return int(out["replica"][0])


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_requests_spread_over_every_replica(router: RunningServer) -> None:
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
        answered = Counter(pool.map(lambda _: who(client, router.url), range(300)))
    assert set(answered) == {0, 1, 2}
    assert min(answered.values()) >= 20, answered
    # replica 2 stalls now and then: balancing on load sends it the fewest
    assert answered[2] < max(answered[0], answered[1]), answered


def test_errors_and_metadata_pass_through(router: RunningServer) -> None:
    bad = httpx.post(router.url + "/v2/models/who/infer", content=b"{not json")
    assert bad.status_code == 400 and "error" in bad.json()
    missing = httpx.post(router.url + "/v2/models/nope/infer", json=body())
    assert missing.status_code == 404
    meta = httpx.get(router.url + "/v2/models/who")
    assert meta.status_code == 200 and meta.json()["name"] == "who"
    replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
    assert len(replicas) == 3 and all(r["usable"] for r in replicas)
    for answer in (meta, httpx.get(router.url + "/v2/health/ready")):  # passed on; its own
        assert len(answer.headers.get_list("date")) == 1, answer.headers
        assert len(answer.headers.get_list("server")) == 1, answer.headers


def test_deadline_is_passed_on(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    router = start_router(tmp_path_factory.mktemp("deadline"), "--replica", replicas[0].url)
    url = router.url + "/v2/models/slow/infer"
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(httpx.post, url, json=body(), timeout=30)  # runs 300 ms
            time.sleep(0.05)
            late = httpx.post(url, json=body(), headers={"request-timeout": "0.1"}, timeout=30)
            assert busy.result().status_code == 200
        # queued behind 250 ms of work with 100 ms to go: the replica saw the deadline
        assert late.status_code in (503, 504), late.text
        spent = httpx.post(url, json=body(), headers={"request-timeout": "0.000001"})
        assert spent.status_code == 504
        bad = httpx.post(url, json=body(), headers={"request-timeout": "x"})
        assert bad.status_code == 400
    finally:
        router.stop()


def test_when_every_replica_is_full_the_router_refuses_at_once(router: RunningServer) -> None:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(
                lambda _: httpx.post(router.url + "/v2/models/slow/infer", json=body(), timeout=30),
                range(32),
            )
        )
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] >= 3 and statuses[503] > 0
    assert all("retry-after" in a.headers for a in answers if a.status_code == 503)


def test_hedging_cuts_the_tail_of_a_stalling_replica(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = [a for r in replicas for a in ("--replica", r.url)]
    tmp = tmp_path_factory.mktemp("hedge")
    plain = start_router(tmp, *args, "--no-hedge")
    hedged = start_router(tmp, *args, "--hedge-budget", "0.2")
    try:
        tails = {}
        for name, router in (("plain", plain), ("hedged", hedged)):
            times = []
            with httpx.Client() as client:
                for _ in range(400):
                    t0 = time.perf_counter()
                    who(client, router.url)
                    times.append(time.perf_counter() - t0)
            tails[name] = float(np.percentile(times, 99))
        hedges = metric(hedged.url, "lockgate_router_hedges_total")
        on_lane = metric(hedged.url, 'lockgate_router_lane_total{outcome="answered"}')
    finally:
        plain.stop()
        hedged.stop()
    assert tails["plain"] >= 0.2, tails  # replica 2 stalls 250 ms on 5% of its calls
    assert tails["hedged"] < tails["plain"] / 2, tails
    assert 0 < hedges <= 0.2 * 400 + 1
    assert on_lane >= 200  # most on the router's lane (`lockgate/router/lane.py`), hedged there


def test_a_replica_killed_under_load_loses_no_request(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("kill")
    servers = start_servers(*(launch_server(repository(root, i), root) for i in range(3)))
    args = [a for s in servers for a in ("--replica", s.url)]
    router = start_router(root, *args, "--no-hedge", "--probe-interval", "0.2")
    statuses: Counter[int] = Counter()
    stop = time.monotonic() + 4.0

    def worker() -> None:
        with httpx.Client() as client:
            while time.monotonic() < stop:
                r = client.post(router.url + "/v2/models/who/infer", json=body(), timeout=30)
                statuses[r.status_code] += 1

    try:
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        os.kill(servers[1].process.pid, signal.SIGKILL)
        for t in threads:
            t.join()
        retries = metric(router.url, "lockgate_router_retries_total")
        answered = metric(router.url, "lockgate_router_requests_total")
        replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
    finally:
        router.stop()
        for s in servers:
            s.stop()
    assert set(statuses) == {200}, statuses  # every request answered, none lost
    assert answered == sum(statuses.values())
    assert retries <= 0.1 * answered + 10  # within the budget
    dead = [r for r in replicas if r["url"] == servers[1].url]
    assert dead and not dead[0]["usable"]


def test_discovery_through_dns(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> None:
    router = start_router(
        tmp_path_factory.mktemp("dns"), "--discover", f"localhost:{replicas[0].port}"
    )
    try:
        with httpx.Client() as client:
            assert who(client, router.url) == 0
    finally:
        router.stop()


def test_no_ready_replica_means_not_ready(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    cmd = [sys.executable, "-m", "lockgate.cli", "route", "--port", str(free_port())]
    process = subprocess.Popen(
        [*cmd, "--replica", f"http://127.0.0.1:{port}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{cmd[-1]}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/v2/health/ready", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert ready.status_code == 503
        assert httpx.get(url + "/v2/health/live").status_code == 200
        r = httpx.post(url + "/v2/models/who/infer", json=body())
        assert r.status_code == 503 and "retry-after" in r.headers
    finally:
        process.terminate()
        process.wait(10)


def test_openai_streams_pass_through_once(
    llm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import openai

    router = start_router(tmp_path_factory.mktemp("llm-router"), "--replica", llm_server.url)
    try:
        direct = openai.OpenAI(base_url=llm_server.url + "/v1", api_key="x", max_retries=0)
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        ask = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 16,
            "temperature": 0,
        }
        expected = direct.chat.completions.create(**ask).choices[0].message.content
        before = metric(llm_server.url, "lockgate_llm_request_success_total")
        chunks = list(routed.chat.completions.create(**ask, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert len(chunks) > 3  # token by token, not one buffered answer
        # one generation on the replica: the stream was neither hedged nor retried
        assert metric(llm_server.url, "lockgate_llm_request_success_total") == before + 1
    finally:
        router.stop()


def _free_pair() -> int:
    """A port whose next port is free too."""
    import socket

    while True:
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base


def test_serve_with_replicas_runs_a_router_over_them(tmp_path: Path) -> None:
    base = _free_pair()
    server = start_server(
        repository(tmp_path, 0),
        tmp_path,
        *("--replicas", "2", "--balance", "router", "--replica-base-port", str(base)),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both replicas usable: each passed a probe
            listed = httpx.get(server.url + "/router/replicas").json()["replicas"]
            if len(listed) == 2 and all(r["usable"] for r in listed):
                break
            time.sleep(0.2)
        with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: who(client, server.url), range(60)))
        listed = httpx.get(server.url + "/router/replicas").json()["replicas"]
        assert [r["url"] for r in listed] == [
            f"http://127.0.0.1:{base}",
            f"http://127.0.0.1:{base + 1}",
        ]
        assert all(r["usable"] and r["answered"] > 0 for r in listed), listed
        shared_memory_reaches_every_replica(server, listed)
    finally:
        assert server.stop() == 0, server.log()[-2000:]
    # hedges that lost were cancelled by closing their connection: quietly, on the replica
    assert "Exception in ASGI application" not in server.log()
    for port in (base, base + 1):  # the replicas drained and exited with the router
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1)


def shared_memory_reaches_every_replica(
    server: RunningServer, before: list[dict[str, int]]
) -> None:
    """A region registered through the router (with one replica) is found by requests that the
    other answers: the replicas share their registrations."""
    key = f"lg_router_{os.getpid()}"
    Path("/dev/shm", key).write_bytes(np.array([1000, 1], dtype=np.float32).tobytes())
    try:
        register = {"key": key, "offset": 0, "byte_size": 8}
        url = server.url + "/v2/systemsharedmemory/region/in/register"
        assert httpx.post(url, json=register).status_code == 200
        x = {"name": "x", "shape": [1, 2], "datatype": "FP32"}
        x["parameters"] = {"shared_memory_region": "in", "shared_memory_byte_size": 8}
        with httpx.Client() as client:
            for _ in range(40):
                r = client.post(server.url + "/v2/models/who/infer", json={"inputs": [x]})
                assert r.status_code == 200, r.text
                assert r.json()["outputs"][0]["data"] == [1000.0, 1.0]
        after = httpx.get(server.url + "/router/replicas").json()["replicas"]
        assert all(a["answered"] > b["answered"] for a, b in zip(after, before, strict=True))
        status = httpx.get(server.url + "/v2/systemsharedmemory/status").json()
        assert [region["name"] for region in status] == ["in"]
        assert httpx.post(server.url + "/v2/systemsharedmemory/unregister").status_code == 200
    finally:
        Path("/dev/shm", key).unlink()


def test_the_drain_delay_serves_while_readiness_says_503(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    """SIGTERM with --drain-delay: readiness turns 503 at once, and what a load balancer still
    sends meanwhile is served (it was refused 503 for the whole delay); then the router exits
    cleanly."""
    args = [a for r in replicas for a in ("--replica", r.url)]
    router = start_router(tmp_path, *args, "--no-hedge", "--drain-delay", "2")
    router.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with httpx.Client() as client:
        assert client.get(router.url + "/v2/health/ready").status_code == 503
        served = [client.post(router.url + "/v2/models/who/infer", json=body()) for _ in range(5)]
    assert [r.status_code for r in served] == [200] * 5, served[0].text
    assert router.process.wait(timeout=30) == 0, router.log()


def test_a_replica_without_grpc_keeps_its_http_traffic(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    """gRPC calls to a replica with no gRPC port fail: they eject it from gRPC calls (which go
    to the replica that has one), never from HTTP traffic. (They ejected it from everything:
    a gRPC client turned the router's HTTP answers into 503 "no replica is ready".)"""
    import tritonclient.grpc as grpcclient

    with_grpc = start_server(repository(tmp_path, 7), tmp_path, grpc_port=free_port())
    without = replicas[0]
    router_grpc = free_port()
    args = ["--replica", f"{without.url}?grpc={free_port()}"]  # nothing listens there
    args += ["--replica", f"{with_grpc.url}?grpc={with_grpc.grpc_address.rsplit(':', 1)[1]}"]
    router = start_router(tmp_path, *args, "--no-hedge", "--grpc-port", str(router_grpc))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{router_grpc}")
        x = grpcclient.InferInput("x", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([[1000.0, 1.0]], dtype=np.float32))
        answered = 0
        for _ in range(30):
            try:
                client.infer("who", [x])
                answered += 1
            except Exception:
                pass
        assert answered >= 20  # once ejected from gRPC, its calls go to the other
        with httpx.Client() as http:
            seen = Counter(who(http, router.url) for _ in range(40))
        assert seen[0] > 0 and seen[7] > 0, seen  # both still take HTTP
    finally:
        router.stop()
        with_grpc.stop()


def test_a_compressed_openai_body_is_read_and_sent_on_inflated(
    llm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A gzip body on an OpenAI route is inflated at the router: its model is read (counted
    per model, and open to canaries and token quotas), and the replica gets it plain."""
    import gzip
    import json as json_module

    tmp = tmp_path_factory.mktemp("gzip-router")
    # every minilm request pinned to a version the replica lacks: a request whose model the
    # router read gets the replica's 404 for it
    pinned = start_router(tmp, "--replica", llm_server.url, "--canary", "minilm:9=100")
    router = start_router(tmp, "--replica", llm_server.url)
    try:
        body = {"model": "minilm", "input": ["a sentence to embed"]}
        packed = gzip.compress(json_module.dumps(body).encode())
        headers = {"content-encoding": "gzip", "content-type": "application/json"}
        answer = httpx.post(router.url + "/v1/embeddings", content=packed, headers=headers)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["data"][0]["embedding"]) == 384
        read = httpx.post(pinned.url + "/v1/embeddings", content=packed, headers=headers)
        assert read.status_code == 404 and "9" in read.text, read.text[:300]
        headers["content-encoding"] = "br"
        refused = httpx.post(router.url + "/v1/embeddings", content=packed, headers=headers)
        assert refused.status_code == 415
    finally:
        router.stop()
        pinned.stop()
