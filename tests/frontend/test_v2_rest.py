"""KServe v2 REST through a real server process and a real HTTP client."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import numpy as np
import pytest

from tests.conftest import RunningServer, digits_rows


def infer_body(name: str, array: np.ndarray, datatype: str = "FP32", **extra: object) -> dict:
    return {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "data": array.ravel().tolist(),
            }
        ],
        **extra,
    }


def post(server: RunningServer, path: str, payload: object, **kwargs: object) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(server.url + path, content=content, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_health_and_server_metadata(server: RunningServer) -> None:
    live = httpx.get(server.url + "/v2/health/live")
    assert live.status_code == 200
    ready = httpx.get(server.url + "/v2/health/ready")
    assert ready.json() == {"ready": True}
    # the process's boot id, the same on every health answer of this process
    boot = ready.headers["x-lockgate-boot"]
    assert len(boot) == 16 and int(boot, 16) >= 0
    assert live.headers["x-lockgate-boot"] == boot
    assert httpx.get(server.url + "/health").headers["x-lockgate-boot"] == boot
    for path in ("/v2/health/live", "/v2/health/ready"):  # closing: answered on accept
        closing = httpx.get(server.url + path, headers={"connection": "close"})
        assert closing.headers["x-lockgate-boot"] == boot, path
    meta = httpx.get(server.url + "/v2").json()
    assert meta["name"] == "lockgate"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_config_and_ready(server: RunningServer) -> None:
    meta = httpx.get(server.url + "/v2/models/digits_onnx").json()
    assert meta["name"] == "digits_onnx"
    assert meta["versions"] == ["1"]
    assert meta["inputs"][0]["shape"] == [-1, 64]
    config = httpx.get(server.url + "/v2/models/digits_onnx/config").json()
    assert config["max_batch_size"] == 64
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    ready = httpx.get(server.url + "/v2/models/digits_onnx/versions/1/ready")
    assert ready.status_code == 200


def test_digits_predictions_match_sklearn(server: RunningServer) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits_rows(32)
    for model in ("digits_onnx", "digits_sklearn"):
        r = post(server, f"/v2/models/{model}/infer", infer_body("input", x))
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        labels = np.array(outputs["label"]["data"])
        assert (labels == digits.target[:32]).mean() > 0.9
        probs = np.array(outputs["probabilities"]["data"]).reshape(32, 10)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-4)


def test_version_in_path_and_output_selection(server: RunningServer) -> None:
    body = infer_body("input", digits_rows(2), outputs=[{"name": "label"}])
    r = post(server, "/v2/models/digits_onnx/versions/1/infer", body)
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["label"]
    assert r.json()["model_version"] == "1"


def test_concurrent_requests_are_batched_and_split_correctly(server: RunningServer) -> None:
    """Many clients at once: every answer belongs to its own request."""
    rows = digits_rows(64)

    def one(i: int) -> tuple[int, list[float]]:
        x = rows[i : i + 1] * (1 + i % 3)
        r = post(server, "/v2/models/echo/infer", infer_body("x", x[:, :4]))
        assert r.status_code == 200, r.text
        return i, r.json()["outputs"][0]["data"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    for i, data in results:
        expected = (rows[i : i + 1] * (1 + i % 3))[:, :4] * 2
        np.testing.assert_allclose(data, expected.ravel(), rtol=1e-6)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'lockgate_batch_size_bucket{le="1.0",model="echo",version="1"}' in metrics


def test_embeddings_from_text(server: RunningServer) -> None:
    texts = ["a cat sits on the mat", "a kitten rests on a rug", "quarterly tax filing deadline"]
    body = {
        "inputs": [
            {"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": texts},
        ]
    }
    r = post(server, "/v2/models/minilm/infer", body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [3, 384]
    vectors = np.array(out["data"]).reshape(3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-3)
    similar, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert similar > unrelated + 0.2


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"{not json", "JSON"),
        (
            {"inputs": [{"name": "nope", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}]},
            "nope",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0] * 63}]},
            "shape",
        ),
        (
            {
                "inputs": [
                    {"name": "input", "shape": [1, 64], "datatype": "INT32", "data": [0] * 64}
                ]
            },
            "datatype",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0] * 3}]},
            "64",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [100000, 100000, 100000],
                        "datatype": "FP32",
                        "data": [0],
                    }
                ]
            },
            "input",
        ),
        ({"inputs": []}, "input"),
    ],
)
def test_bad_input_is_400_with_message(
    server: RunningServer, payload: object, fragment: str
) -> None:
    r = post(server, "/v2/models/digits_onnx/infer", payload)
    assert r.status_code == 400, r.text
    assert fragment.lower() in r.json()["error"].lower()


def test_unknown_model_and_version_are_404(server: RunningServer) -> None:
    body = infer_body("input", digits_rows(1))
    assert post(server, "/v2/models/nope/infer", body).status_code == 404
    assert post(server, "/v2/models/digits_onnx/versions/7/infer", body).status_code == 404
    assert httpx.get(server.url + "/v2/models/nope").status_code == 404
    assert "error" in httpx.get(server.url + "/v2/models/nope").json()
    # a version of digits that are not ASCII ("¹" passes str.isdigit, not int) is unknown too
    for path in ("config", "ready", "infer"):
        url = server.url + "/v2/models/digits_onnx/versions/%C2%B9/" + path
        answer = httpx.post(url, json=body) if path == "infer" else httpx.get(url)
        assert answer.status_code == 404, answer.text


def test_body_over_limit_is_refused(server: RunningServer) -> None:
    big = b"x" * (65 * 1024 * 1024)
    r = post(server, "/v2/models/digits_onnx/infer", big)
    assert r.status_code == 413
    assert "limit" in r.json()["error"]


def test_failing_backend_fails_only_its_batch(server: RunningServer) -> None:
    x = np.full((1, 4), 1000.0, np.float32)
    statuses = [
        post(server, "/v2/models/faulty/infer", infer_body("x", x)).status_code for _ in range(30)
    ]
    assert statuses.count(500) == 3  # every tenth batch raises
    assert statuses.count(200) == 27
    r = post(server, "/v2/models/faulty/infer", infer_body("x", x))
    assert r.status_code in (200, 500)
    assert httpx.get(server.url + "/v2/models/faulty/ready").status_code == 200


def test_a_request_the_model_raises_on_fails_alone_not_its_batch(server: RunningServer) -> None:
    """Requests queued behind a busy instance share a batch; the model raises on one of them
    (-13): the others are answered, and only that one fails."""
    held = {
        "inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [0.3]},
        ]
    }
    values = [1.0, 2.0, -13.0, 3.0, 4.0, 5.0]
    with concurrent.futures.ThreadPoolExecutor(len(values) + 1) as pool:
        first = pool.submit(post, server, "/v2/models/echo/infer", held)
        time.sleep(0.1)  # the instance is busy: the rest queue and leave in one batch
        answers = [
            pool.submit(post, server, "/v2/models/echo/infer", infer_body("x", np.full((1, 4), v)))
            for v in values
        ]
        assert first.result().status_code == 200
        for value, answer in zip(values, answers, strict=True):
            r = answer.result()
            if value == -13.0:
                assert r.status_code == 500 and "cannot take -13" in r.json()["error"]
            else:
                assert r.status_code == 200, r.text
                assert r.json()["outputs"][0]["data"] == [2 * value] * 4
    assert "running each alone" in server.log()


def test_broken_model_reports_why_and_others_serve(server: RunningServer) -> None:
    r = httpx.get(server.url + "/v2/models/broken/ready")
    assert r.status_code == 503
    assert r.json()["error"]
    index = httpx.post(server.url + "/v2/repository/index").json()
    broken = [m for m in index if m["name"] == "broken"]
    assert broken and broken[0]["state"] == "UNAVAILABLE" and broken[0]["reason"]
    assert (
        post(
            server, "/v2/models/digits_onnx/infer", infer_body("input", digits_rows(1))
        ).status_code
        == 200
    )


def test_deadline_in_queue_gives_504(server: RunningServer) -> None:
    """A request stuck behind a slow one past its timeout parameter is answered 504."""
    slow = {
        "inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [1.0]},
        ]
    }
    quick = {**infer_body("x", np.ones((1, 4), np.float32)), "parameters": {"timeout": 200_000}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, server, "/v2/models/slow/infer", slow)
        time.sleep(0.2)
        second = post(server, "/v2/models/slow/infer", quick)
        assert first.result().status_code == 200
    assert second.status_code in (503, 504), second.text
    assert "deadline" in second.json()["error"]


def test_full_queue_gives_503_with_retry_after(server: RunningServer) -> None:
    slow = {
        "inputs": [
            {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [0.5]},
        ]
    }
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(post, server, "/v2/models/slow/infer", slow) for _ in range(12)]
        responses = [f.result() for f in futures]
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 4
    refused = [r for r in responses if r.status_code == 503]
    assert refused, statuses
    assert all("retry-after" in r.headers for r in refused)
    assert all(r.json()["error"] for r in refused)


def test_metrics_exposition(server: RunningServer) -> None:
    post(server, "/v2/models/digits_onnx/infer", infer_body("input", digits_rows(1)))
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "lockgate_requests_total",
        "lockgate_request_duration_seconds_bucket",
        "lockgate_queue_duration_seconds_bucket",
        "lockgate_compute_duration_seconds_bucket",
        "lockgate_batch_size_bucket",
        "lockgate_queue_depth",
        "lockgate_inflight_requests",
        "lockgate_model_load_seconds",
        "lockgate_model_warmup_seconds",
    ):
        assert name in text, name
    assert 'lockgate_requests_total{model="digits_onnx",outcome="success",version="1"}' in text


def test_statistics_endpoint(server: RunningServer) -> None:
    post(server, "/v2/models/digits_onnx/infer", infer_body("input", digits_rows(3)))
    stats = httpx.get(server.url + "/v2/models/digits_onnx/stats").json()
    entry = stats["model_stats"][0]
    assert entry["name"] == "digits_onnx"
    assert int(entry["inference_count"]) >= 3
    assert int(entry["inference_stats"]["success"]["count"]) >= 1


def test_statistics_of_an_unknown_model_or_version_are_404(server: RunningServer) -> None:
    for path in ("digits_onnx/versions/2/stats", "nope/stats", "nope/versions/1/stats"):
        answer = httpx.get(f"{server.url}/v2/models/{path}")
        assert answer.status_code == 404, (path, answer.text)
        assert "unknown" in answer.json()["error"]
    one = httpx.get(server.url + "/v2/models/digits_onnx/versions/1/stats").json()
    assert [s["version"] for s in one["model_stats"]] == ["1"]


def idle(server: RunningServer, model: str) -> None:
    """Wait until `model` has nothing queued and nothing in flight: requests of earlier tests
    on this module's server (a client that gave up leaves its request to run) would share a
    batch with the next ones."""
    labels = f'model="{model}",version="1"'
    deadline = time.monotonic() + 30
    while server.metric("lockgate_inflight_requests", labels) or server.metric(
        "lockgate_queue_depth", labels
    ):
        assert time.monotonic() < deadline, f"{model} never went idle"
        time.sleep(0.05)


def test_batch_statistics_per_batch_size(server: RunningServer) -> None:
    """Triton's batch_stats: per batch size that ran, its executions and phase times."""
    url = server.url + "/v2/models/digits_onnx/stats"

    def executions(rows: int) -> int:
        batches = httpx.get(url).json()["model_stats"][0]["batch_stats"]
        return sum(b["compute_infer"]["count"] for b in batches if b["batch_size"] == rows)

    def served(rows: int) -> None:
        """A deadline of its own (10 s), not the model's 50 ms SLO: admission on a loaded
        machine refuses none as late; a refusal at the door (503, Retry-After) is sent again."""
        body = infer_body("input", digits_rows(rows), parameters={"timeout": 10_000_000})
        for _ in range(20):
            r = post(server, "/v2/models/digits_onnx/infer", body)
            if r.status_code != 503:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text

    idle(server, "digits_onnx")
    before = executions(5)
    for _ in range(2):  # one after the other, nothing else in flight: two batches of 5
        served(5)
    assert executions(5) - before == 2

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: served(1), range(32)))  # batched dynamically
    stats = httpx.get(url).json()["model_stats"][0]
    batches = stats["batch_stats"]
    sizes = [b["batch_size"] for b in batches]
    assert sizes == sorted(set(sizes)) and 5 in sizes
    assert sum(b["compute_infer"]["count"] for b in batches) == stats["execution_count"]
    rows = sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches)
    assert rows == stats["inference_count"]
    for b in batches:
        phases = (b["compute_input"], b["compute_infer"], b["compute_output"])
        assert phases[0]["count"] == phases[1]["count"] == phases[2]["count"] > 0
    assert sum(b["compute_infer"]["ns"] for b in batches) > 0


def test_openapi_document(server: RunningServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert "/v2/models/{model}/infer" in doc["paths"]


def test_a_request_refused_before_the_model_counts_as_its_failure(server: RunningServer) -> None:
    """As Triton counts them: in the statistics' fail and in lockgate_requests_total."""

    def failures() -> int:
        stats = httpx.get(server.url + "/v2/models/digits_sklearn/stats").json()
        return sum(v["inference_stats"]["fail"]["count"] for v in stats["model_stats"])

    before = failures()
    wrong_shape = infer_body("input", np.ones((1, 63), np.float32))
    assert post(server, "/v2/models/digits_sklearn/infer", wrong_shape).status_code == 400
    not_json = httpx.post(server.url + "/v2/models/digits_sklearn/infer", content=b"{nope")
    assert not_json.status_code == 400
    assert failures() == before + 2
    metrics = httpx.get(server.url + "/metrics").text
    assert 'model="digits_sklearn",outcome="invalid_request",version="1"} 2.0' in metrics or (
        'model="digits_sklearn",version="1",outcome="invalid_request"} 2.0' in metrics
    ), [line for line in metrics.splitlines() if "invalid_request" in line]
