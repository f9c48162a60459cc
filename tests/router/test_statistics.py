"""Model statistics through the router (`lockgate/router/statistics.py`): two real replicas
behind `lockgate route`, read with tritonclient's `get_inference_statistics` over HTTP and
gRPC, against the sum of the replicas' own statistics read on their own ports."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lockgate.router.statistics import NotStatistics, StatisticsRequest, merged
from tests.conftest import RunningServer, free_port, launch_server, start_servers
from tests.router.test_grpc_proxy import GrpcRouter, start_grpc_router
from tests.router.test_router import repository, start_router

Stats = dict[str, Any]


# -- what a client expects: the replicas' own statistics, summed here ---------------------


def own(server: RunningServer, model: str = "", version: str = "") -> Stats:
    """A replica's statistics, read on its own port."""
    client = httpclient.InferenceServerClient(server.address)
    found: Stats = client.get_inference_statistics(model, version)
    return found


def summed(documents: list[Stats]) -> Stats:
    """The sum a router should answer, written out plainly (not the router's code)."""
    out: dict[tuple[str, str], Stats] = {}
    for document in documents:
        for entry in document["model_stats"]:
            key = (entry["name"], entry["version"])
            total = out.setdefault(
                key,
                {
                    "name": key[0],
                    "version": key[1],
                    "last_inference": 0,
                    "inference_count": 0,
                    "execution_count": 0,
                    "inference_stats": {},
                    "batch_stats": {},
                },
            )
            total["last_inference"] = max(
                total["last_inference"], int(entry.get("last_inference", 0))
            )
            total["inference_count"] += int(entry.get("inference_count", 0))
            total["execution_count"] += int(entry.get("execution_count", 0))
            for phase, duration in entry.get("inference_stats", {}).items():
                into = total["inference_stats"].setdefault(phase, {"count": 0, "ns": 0})
                into["count"] += int(duration.get("count", 0))
                into["ns"] += int(duration.get("ns", 0))
            for batch in entry.get("batch_stats", []):
                size = int(batch["batch_size"])
                into = total["batch_stats"].setdefault(size, {})
                for phase in ("compute_input", "compute_infer", "compute_output"):
                    d = into.setdefault(phase, {"count": 0, "ns": 0})
                    d["count"] += int(batch.get(phase, {}).get("count", 0))
                    d["ns"] += int(batch.get(phase, {}).get("ns", 0))
    for total in out.values():
        total["batch_stats"] = [
            {"batch_size": size, **phases} for size, phases in sorted(total["batch_stats"].items())
        ]
    return {"model_stats": list(out.values())}


def plain(value: Any, key: str = "") -> Any:
    """A statistics document with every number an int and zeros left out, as gRPC's JSON
    writes it (uint64 as strings, default values omitted), so HTTP's and gRPC's compare."""
    if isinstance(value, dict):
        items = {k: plain(v, k) for k, v in value.items()}
        return {k: v for k, v in items.items() if v not in (0, {}, [])}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if key in ("name", "version"):
        return value
    return int(value)


def by_model(document: Stats) -> dict[tuple[str, str], Stats]:
    return {(e["name"], e["version"]): e for e in plain(document)["model_stats"]}


# -- servers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("stats-replicas")
    servers = start_servers(
        *(launch_server(repository(root, i), root, grpc_port=free_port()) for i in range(2))
    )
    yield servers
    for server in servers:
        server.stop()


def usable(router: RunningServer, count: int, timeout: float = 30.0) -> RunningServer:
    """`router` once `count` of its replicas are usable."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(router.url + "/router/replicas").json()["replicas"]
        if sum(r["usable"] for r in listed) >= count:
            return router
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} usable replicas: {listed}")


@pytest.fixture(scope="module")
def front(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcRouter]:
    tmp = tmp_path_factory.mktemp("stats-router")
    running = start_grpc_router(tmp, replicas, "--no-hedge", "--probe-interval", "0.2")
    usable(running.router, 2)
    yield running
    running.router.stop()


def x_input(value: float) -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[value, 1.0]], dtype=np.float32))
    return [x]


@pytest.fixture(scope="module")
def served(front: GrpcRouter, replicas: list[RunningServer]) -> GrpcRouter:
    """`front` after requests over HTTP and gRPC, which both replicas answered some of."""
    answered = set()
    with httpx.Client() as client:
        for i in range(40):
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [i, 1]}]}
            r = client.post(f"{front.router.url}/v2/models/who/infer", json=body, timeout=30)
            assert r.status_code == 200, r.text
            answered.add(
                int(next(o for o in r.json()["outputs"] if o["name"] == "replica")["data"][0])
            )
    grpc_client = front.client()
    for i in range(20):
        result = grpc_client.infer("who", x_input(float(i)), client_timeout=30)
        answered.add(int(result.as_numpy("replica")[0, 0]))
    assert answered == {0, 1}, answered
    for server in replicas:  # each replica did work: one replica's numbers are not the sum
        assert own(server, "who")["model_stats"][0]["inference_count"] > 0
    return front


# -- through the router ------------------------------------------------------------------


def test_http_statistics_are_the_sum_of_the_replicas(
    served: GrpcRouter, replicas: list[RunningServer]
) -> None:
    client = httpclient.InferenceServerClient(served.router.address)
    for model, version in (("who", ""), ("who", "1"), ("", "")):
        through = client.get_inference_statistics(model, version)
        expected = summed([own(r, model, version) for r in replicas])
        assert by_model(through) == by_model(expected), (model, version)
    counts = by_model(client.get_inference_statistics("who"))[("who", "1")]
    assert counts["inference_count"] == sum(
        own(r, "who")["model_stats"][0]["inference_count"] for r in replicas
    )
    answer = httpx.get(served.router.url + "/v2/models/who/stats")
    assert answer.headers["x-lockgate-statistics-replicas"] == "2/2"
    assert "x-lockgate-statistics-missing" not in answer.headers


def test_grpc_statistics_are_the_sum_of_the_replicas(
    served: GrpcRouter, replicas: list[RunningServer]
) -> None:
    client = served.client()
    for model, version in (("who", ""), ("who", "1"), ("", ""), ("", "1")):
        through = client.get_inference_statistics(model, version, as_json=True)
        mine = [own(r, model) for r in replicas]  # "" with a version: every model's, that one
        expected = summed(mine)
        if version:
            expected["model_stats"] = [
                e for e in expected["model_stats"] if e["version"] == version
            ]
        assert by_model(through) == by_model(expected), (model, version)
        # what each replica's own gRPC port answers sums to the same
        over_grpc = [
            grpcclient.InferenceServerClient(r.grpc_address).get_inference_statistics(
                model, version, as_json=True
            )
            for r in replicas
        ]
        assert by_model(through) == by_model(summed(over_grpc))


def test_an_unknown_model_or_version_is_the_replicas_404(served: GrpcRouter) -> None:
    for path in ("/v2/models/nope/stats", "/v2/models/who/versions/7/stats"):
        answer = httpx.get(served.router.url + path)
        assert answer.status_code == 404, answer.text
        assert "unknown" in answer.json()["error"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        served.client().get_inference_statistics("nope")
    # a method the extension does not take is passed to a replica, which refuses it
    assert httpx.post(served.router.url + "/v2/models/who/stats").status_code == 405


# -- a replica that does not answer ------------------------------------------------------


class _Broken(http.server.BaseHTTPRequestHandler):
    """A replica that is ready and fails every statistics request."""

    def do_GET(self) -> None:
        status = 200 if self.path == "/v2/health/ready" else 500
        body = b"{}" if status == 200 else b'{"error": "broken"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def broken() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_replica_that_fails_is_left_out_and_named(
    served: GrpcRouter, replicas: list[RunningServer], broken: str, tmp_path: Path
) -> None:
    router = start_router(tmp_path, "--replica", replicas[0].url, "--replica", broken)
    try:
        usable(router, 2)
        answer = httpx.get(router.url + "/v2/models/who/stats")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-lockgate-statistics-replicas"] == "1/2"
        assert broken in answer.headers["x-lockgate-statistics-missing"]
        assert "500" in answer.headers["x-lockgate-statistics-missing"]
        assert by_model(answer.json()) == by_model(own(replicas[0], "who"))
    finally:
        router.stop()
    alone = start_router(tmp_path, "--replica", broken)
    try:
        usable(alone, 1)
        answer = httpx.get(alone.url + "/v2/models/stats")
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert broken in answer.json()["error"]
    finally:
        alone.stop()


# -- the merging alone ---------------------------------------------------------------------


def entry(name: str, version: str, count: int, last: int, batches: dict[int, int]) -> Stats:
    d = {"count": count, "ns": 10 * count}
    return {
        "name": name,
        "version": version,
        "last_inference": last,
        "inference_count": count,
        "execution_count": count,
        "inference_stats": {"success": d, "queue": d},
        "batch_stats": [
            {"batch_size": s, "compute_infer": {"count": n, "ns": n}} for s, n in batches.items()
        ],
    }


def test_merging_sums_per_model_and_version() -> None:
    one = {"model_stats": [entry("a", "1", 2, 50, {1: 2}), entry("b", "1", 1, 10, {})]}
    two = {"model_stats": [entry("a", "1", 3, 40, {4: 1, 1: 1}), entry("a", "2", 5, 70, {})]}
    got = merged([one, two])
    keys = [(e["name"], e["version"]) for e in got["model_stats"]]
    assert keys == [("a", "1"), ("b", "1"), ("a", "2")]
    a1 = got["model_stats"][0]
    assert a1["last_inference"] == 50
    assert a1["inference_count"] == 5
    assert a1["inference_stats"]["success"] == {"count": 5, "ns": 50}
    assert [b["batch_size"] for b in a1["batch_stats"]] == [1, 4]
    assert a1["batch_stats"][0]["compute_infer"] == {"count": 3, "ns": 3}
    assert merged([one, two], "2")["model_stats"] == [entry("a", "2", 5, 70, {})]
    assert one["model_stats"][0]["inference_count"] == 2  # the inputs are left as they were


@pytest.mark.parametrize(
    "document",
    [
        [],
        {"model_stats": {}},
        {"model_stats": [{"name": "a"}]},
        {"model_stats": [{"name": "a", "version": "1", "batch_stats": [{}]}]},
    ],
)
def test_merging_refuses_what_is_not_statistics(document: Any) -> None:
    with pytest.raises(NotStatistics):
        merged([document])


def test_which_paths_are_statistics() -> None:
    parse = StatisticsRequest.parse
    assert parse("GET", "/v2/models/stats") == StatisticsRequest()
    assert parse("GET", "/v2/models/stats/stats") == StatisticsRequest("stats")
    assert parse("GET", "/v2/models/m/versions/3/stats") == StatisticsRequest("m", "3")
    assert parse("POST", "/v2/models/m/stats") is None
    assert parse("GET", "/v2/models/m/ready") is None
    assert parse("GET", "/v2/models/m/versions/stats") is None
    assert StatisticsRequest("a b/c", "1").path == "/v2/models/a%20b%2Fc/versions/1/stats"
