"""The response cache, coalescing, ensembles, cascades, Python compositions and fallbacks,
through a real server and real clients; the Redis tier against a real redis-server."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import RunningServer, free_port, launch_server, start_server, start_servers

COUNTING = '''
import time
import numpy as np

class Model:
    """y = x * factor + offset; `calls` counts the batches this instance ran."""

    def load(self, config, version_dir):
        self.factor = float(config.parameters.get("factor", "1"))
        self.offset = float(config.parameters.get("offset", "0"))
        self.sleep = float(config.parameters.get("sleep", "0"))
        self.calls = 0

    def infer(self, inputs):
        x = inputs["x"]
        if float(x.flat[0]) >= 1000:  # warmup sends zeros: only test traffic counts
            self.calls += 1
            time.sleep(self.sleep)
        calls = np.full((x.shape[0], 1), self.calls, dtype=np.int64)
        return {"y": x * self.factor + self.offset, "calls": calls}
'''

SLEEPY = '''
import time
import numpy as np

class Model:
    """y = x, after `sleep` seconds for every batch, warmup included."""

    def load(self, config, version_dir):
        self.sleep = float(config.parameters["sleep"])

    def infer(self, inputs):
        time.sleep(self.sleep)
        x = inputs["x"]
        return {"y": x, "calls": np.zeros((x.shape[0], 1), dtype=np.int64)}
'''

CONFIDENT = '''
import numpy as np

class Model:
    """probabilities: confident (0.95) on rows whose first value is even, unsure (0.5) else;
    label: the model's `mark`, so a test sees which model answered each row."""

    def load(self, config, version_dir):
        self.mark = int(config.parameters["mark"])

    def infer(self, inputs):
        x = inputs["x"]
        even = (x[:, 0].astype(np.int64) % 2) == 0
        top = np.where(even, 0.95, 0.5).astype(np.float32)
        probabilities = np.stack([top, 1 - top], axis=1)
        label = np.full(x.shape[0], self.mark, dtype=np.int64)
        return {"label": label, "probabilities": probabilities}
'''

COMPOSED = '''
import numpy as np

class Model:
    """(x * 2) + 1, by calling two other models: lockgate's BLS."""

    async def infer(self, inputs, ctx):
        doubled = await ctx.infer("double", {"x": inputs["x"]})
        added = await ctx.infer("add_one", {"x": doubled["y"]})
        return {"y": added["y"]}
'''

EMBED = '''
import numpy as np

class Model:
    """A toy text embedding: [length, first byte, 1] per text."""

    def infer(self, inputs):
        texts = inputs["text"].reshape(-1)
        rows = [[len(t), t[0] if t else 0, 1] for t in texts]
        return {"embedding": np.array(rows, dtype=np.float32)}
'''

XY = """\
max_batch_size: 8
inputs: [{name: x, datatype: FP32, dims: [4]}]
outputs: [{name: y, datatype: FP32, dims: [4]}, {name: calls, datatype: INT64, dims: [1]}]
"""


def _model(repo: Path, name: str, code: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.yaml").write_text(textwrap.dedent(config))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("composition-repo")
    py = "backend: python\n"
    _model(repo, "double", COUNTING, py + XY + "parameters: {factor: '2'}\n")
    _model(repo, "add_one", COUNTING, py + XY + "parameters: {offset: '1'}\n")
    _model(
        repo,
        "cached",
        COUNTING,
        py + XY + "parameters: {sleep: '0.3'}\nresponse_cache: {enable: true, ttl_s: 60}\n",
    )
    _model(
        repo,
        "busy",
        COUNTING,
        py
        + XY
        + "parameters: {sleep: '0.5'}\n"
        + "dynamic_batching: {max_queue_size: 1}\n"
        + "fallback: [{model: add_one}]\n",
    )
    _model(
        repo,
        "busy_static",
        COUNTING,
        py
        + XY
        + "parameters: {sleep: '0.5'}\n"
        + "dynamic_batching: {max_queue_size: 1}\n"
        + "fallback: [{static: {y: [0, 0, 0, 0], calls: [-1]}}]\n",
    )
    # deadline-aware admission (400 ms SLO, 300 ms per batch of one) with a cache, a fallback
    slo = "parameters: {sleep: '0.3'}\nmax_batch_size: 1\nlatency_slo_ms: 400\n"
    slo_xy = XY.replace("max_batch_size: 8\n", "")
    _model(repo, "slo_cached", SLEEPY, py + slo_xy + slo + "response_cache: {enable: true}\n")
    _model(repo, "slo_fallback", SLEEPY, py + slo_xy + slo + "fallback: [{model: add_one}]\n")
    _model(
        repo,
        "embed",
        EMBED,
        "backend: python\nmax_batch_size: 8\n"
        "inputs: [{name: text, datatype: BYTES, dims: [1]}]\n"
        "outputs: [{name: embedding, datatype: FP32, dims: [3]}]\n"
        "response_cache: {enable: true}\n",
    )
    xy_out = "outputs: [{name: y, datatype: FP32, dims: [4]}]\n"
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.yaml").write_text(
        "backend: ensemble\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n" + xy_out + "ensemble:\n"
        "  - {model: add_one, input_map: {x: doubled}, output_map: {y: y}}\n"
        "  - {model: double, input_map: {x: x}, output_map: {y: doubled}}\n"
    )
    for name, step in (
        ("mismapped", "{model: double, input_map: {x: x}, output_map: {z: y}}"),
        ("pinned", "{model: double, version: 7, input_map: {x: x}, output_map: {y: y}}"),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.yaml").write_text(
            "backend: ensemble\nmax_batch_size: 8\n"
            "inputs: [{name: x, datatype: FP32, dims: [4]}]\n" + xy_out + f"ensemble: [{step}]\n"
        )
    _model(
        repo,
        "composed",
        COMPOSED,
        "backend: python\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n" + xy_out,
    )
    judged = (
        "backend: python\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n"
        "outputs: [{name: label, datatype: INT64, dims: []}, "
        "{name: probabilities, datatype: FP32, dims: [2]}]\n"
    )
    _model(repo, "small", CONFIDENT, judged + "parameters: {mark: '1'}\n")
    _model(repo, "large", CONFIDENT, judged + "parameters: {mark: '2'}\n")
    (repo / "tiered" / "1").mkdir(parents=True)
    (repo / "tiered" / "config.yaml").write_text(
        judged.replace("backend: python", "backend: cascade")
        + "cascade: {models: [small, large], confidence_output: probabilities, threshold: 0.9}\n"
    )
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(repo, tmp_path_factory.mktemp("composition-logs"), grpc_port=free_port())
    yield server
    server.stop()


def infer(server: RunningServer, model: str, x: np.ndarray) -> httpx.Response:
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)


def output(response: httpx.Response, name: str) -> np.ndarray:
    assert response.status_code == 200, response.text
    entry = next(o for o in response.json()["outputs"] if o["name"] == name)
    return np.array(entry["data"]).reshape(entry["shape"])


def metric(server: RunningServer, prefix: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def rows(*firsts: float) -> np.ndarray:
    return np.array([[f, 1, 2, 3] for f in firsts], dtype=np.float32)


def test_ensemble_runs_steps_in_dependency_order(server: RunningServer) -> None:
    x = rows(1000, 1001)
    np.testing.assert_allclose(output(infer(server, "pipeline", x), "y"), x * 2 + 1)


def test_python_composition_calls_other_models(server: RunningServer) -> None:
    x = rows(1000, 1003, 1005)
    np.testing.assert_allclose(output(infer(server, "composed", x), "y"), x * 2 + 1)


def test_cascade_escalates_only_unsure_rows(server: RunningServer) -> None:
    before = metric(server, 'lockgate_cascade_rows_total{model="tiered",stage="1",version="1"}')
    labels = output(infer(server, "tiered", rows(2, 3, 4, 5, 7)), "label")
    assert labels.tolist() == [1, 2, 1, 2, 2]  # even rows: confident small model
    after = metric(server, 'lockgate_cascade_rows_total{model="tiered",stage="1",version="1"}')
    assert after - before == 3


def test_cache_hit_is_marked_and_skips_the_model(server: RunningServer) -> None:
    x = rows(1000.5)
    first = infer(server, "cached", x)
    second = infer(server, "cached", x)
    assert "x-lockgate-cache" not in first.headers
    assert second.headers["x-lockgate-cache"] == "hit"
    assert second.json()["parameters"] == {"cache_hit": True}
    np.testing.assert_array_equal(output(first, "calls"), output(second, "calls"))
    third = infer(server, "cached", rows(1000.25))  # another input: computed
    assert output(third, "calls")[0, 0] == output(first, "calls")[0, 0] + 1


def test_identical_requests_in_flight_run_once(server: RunningServer) -> None:
    x = rows(1777)
    before = metric(server, 'lockgate_requests_coalesced_total{model="cached"}')
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: infer(server, "cached", x), range(8)))
    calls = {int(output(a, "calls")[0, 0]) for a in answers}
    assert len(calls) == 1  # one batch computed every answer
    coalesced = metric(server, 'lockgate_requests_coalesced_total{model="cached"}') - before
    hits = sum(a.headers.get("x-lockgate-cache") == "hit" for a in answers)
    assert coalesced + hits == 7


def test_embeddings_are_cached_per_text(server: RunningServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    hits = 'lockgate_cache_hits_total{model="embed",tier="memory"}'
    rows_run = 'lockgate_batch_size_sum{model="embed",version="1"}'
    first = client.embeddings.create(model="embed", input=["ab", "xyz"])
    before_hits, before_rows = metric(server, hits), metric(server, rows_run)
    second = client.embeddings.create(model="embed", input=["xyz", "hello"])
    assert metric(server, hits) - before_hits == 1  # "xyz" from the cache
    assert metric(server, rows_run) - before_rows == 1  # only "hello" ran
    assert second.data[0].embedding == first.data[1].embedding == [3.0, ord("x"), 1.0]
    assert second.data[1].embedding == [5.0, ord("h"), 1.0]


def test_overload_falls_back_to_a_cheaper_model(server: RunningServer) -> None:
    x = rows(1000)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: infer(server, "busy", x), range(6)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    fallback = [a for a in answers if a.headers.get("x-lockgate-fallback") == "model:add_one"]
    assert fallback, "the queue of one must have refused some requests"
    for a in fallback:
        assert a.json()["parameters"] == {"fallback": "model:add_one"}
        np.testing.assert_allclose(output(a, "y"), x + 1)
    for a in answers:
        if a not in fallback:
            np.testing.assert_allclose(output(a, "y"), x)
    answered = metric(server, 'lockgate_fallback_answers_total{kind="model",model="busy"')
    assert answered >= len(fallback)


def _saturate(server: RunningServer, model: str, first: float, extra: float | None) -> list:
    """Teach the model's profile with two requests, then send four distinct ones at once and,
    50 ms later, `extra` (a row already answered) while they queue."""
    for f in (first, first + 1):
        assert infer(server, model, rows(f)).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        queued = [pool.submit(infer, server, model, rows(first + 2 + i)) for i in range(4)]
        time.sleep(0.05)
        late = pool.submit(infer, server, model, rows(extra)) if extra is not None else None
        return [f.result() for f in queued] + ([late.result()] if late else [])


def test_a_cache_hit_is_answered_while_admission_refuses_misses(server: RunningServer) -> None:
    answers = _saturate(server, "slo_cached", 5000, extra=5000)
    hit = answers[-1]
    assert hit.status_code == 200, hit.text
    assert hit.headers.get("x-lockgate-cache") == "hit"
    assert 503 in {a.status_code for a in answers[:-1]}, "admission must refuse some misses"


def test_admission_refusals_go_to_the_fallback(server: RunningServer) -> None:
    answers = _saturate(server, "slo_fallback", 6000, extra=None)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    fallback = [a for a in answers if a.headers.get("x-lockgate-fallback") == "model:add_one"]
    assert fallback, "deadline-aware admission must have refused some requests"


def test_static_fallback_over_grpc(server: RunningServer) -> None:
    def call(_: int) -> grpcclient.InferResult:
        client = grpcclient.InferenceServerClient(server.grpc_address)
        inp = grpcclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(rows(1000))
        try:
            return client.infer("busy_static", [inp])
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    static = [r for r in results if r.get_response().parameters["fallback"].string_param]
    assert static
    for r in static:
        assert r.get_response().parameters["fallback"].string_param == "static"
        assert r.as_numpy("calls").tolist() == [[-1]]
        np.testing.assert_array_equal(r.as_numpy("y"), np.zeros((1, 4), np.float32))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("mismapped", "its step 'double' maps the output 'z', which that model does not have"),
        ("pinned", "the model 'double' version 7 it runs is not loaded"),
    ],
)
def test_an_ensemble_whose_steps_do_not_fit_is_not_ready(
    server: RunningServer, model: str, reason: str
) -> None:
    """Readiness and every request say which step does not fit (each request was a 500)."""
    ready = httpx.get(f"{server.url}/v2/models/{model}/ready")
    assert ready.status_code == 503 and reason in ready.json()["error"]
    answer = infer(server, model, np.ones((1, 4), np.float32))
    assert answer.status_code == 503 and reason in answer.json()["error"]


def test_bad_ensemble_config_is_reported_not_served(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    (tmp_path / "loop" / "1").mkdir(parents=True)
    (tmp_path / "loop" / "config.yaml").write_text(
        "backend: ensemble\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n"
        "outputs: [{name: y, datatype: FP32, dims: [4]}]\n"
        "ensemble:\n"
        "  - {model: a, input_map: {x: z}, output_map: {y: y}}\n"
    )
    server = start_server(tmp_path, tmp_path_factory.mktemp("bad-logs"), wait_ready=False)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            index = httpx.post(server.url + "/v2/repository/index", json={}).json()
            if index and index[0]["state"] != "LOADING":
                break
            time.sleep(0.1)
        assert index[0]["state"] == "UNAVAILABLE"
        assert "'z' is neither an ensemble input nor produced" in index[0]["reason"]
    finally:
        server.stop()


# -- the Redis tier ------------------------------------------------------------------------


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing (make test installs it)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            import redis

            if redis.Redis.from_url(url).ping():
                break
        except Exception:
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(10)


def test_replicas_share_answers_through_redis_and_survive_its_loss(
    repo: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import redis

    logs = tmp_path_factory.mktemp("redis-logs")
    a, b = start_servers(*(launch_server(repo, logs, "--redis-url", redis_url) for _ in "ab"))
    try:
        x = rows(1234)
        first = infer(a, "cached", x)
        assert "x-lockgate-cache" not in first.headers
        deadline = time.monotonic() + 5  # the write to Redis is in the background
        while not redis.Redis.from_url(redis_url).keys("lockgate:cached:1:*"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        shared = infer(b, "cached", x)  # never computed on b
        assert shared.headers["x-lockgate-cache"] == "hit"
        np.testing.assert_array_equal(output(shared, "calls"), output(first, "calls"))
        assert metric(b, 'lockgate_cache_hits_total{model="cached",tier="redis"}') == 1
        redis.Redis.from_url(redis_url).shutdown(nosave=True)
        fresh = infer(b, "cached", rows(4321))  # Redis gone: computed, not failed
        assert fresh.status_code == 200 and "x-lockgate-cache" not in fresh.headers
        again = infer(b, "cached", rows(4321))  # and tier 1 still answers
        assert again.headers["x-lockgate-cache"] == "hit"
        assert metric(b, "lockgate_cache_errors_total") >= 1
    finally:
        a.stop()
        b.stop()
