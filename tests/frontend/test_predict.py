"""KServe v1's and TensorFlow Serving's predict protocol through a real server: rows
(`instances` -> `predictions`) and columns (`inputs` -> `outputs`), answering as KServe v2 does
for the same tensors, and every malformed request a 4xx with `{"error": ...}`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BadRequest
from lockgate.protocol import predict
from tests.conftest import RunningServer, digits_rows


def v2_answer(server: RunningServer, model: str, rows: np.ndarray) -> dict[str, list[object]]:
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.ravel().tolist(),
            }
        ]
    }
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_rows_are_answered_as_rows_the_same_as_kserve_v2(server: RunningServer) -> None:
    rows = digits_rows(3)
    r = httpx.post(
        f"{server.url}/v1/models/digits_sklearn:predict",
        json={"instances": rows.tolist()},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    expected = v2_answer(server, "digits_sklearn", rows)
    assert [p["label"] for p in predictions] == expected["label"]
    np.testing.assert_allclose(
        [p["probabilities"] for p in predictions],
        np.reshape(expected["probabilities"], (3, 10)),
        rtol=1e-6,
    )


def test_columns_are_answered_as_columns(server: RunningServer) -> None:
    rows = digits_rows(2)
    r = httpx.post(
        f"{server.url}/v1/models/digits_sklearn/versions/1:predict",
        json={"inputs": {"input": rows.tolist()}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    assert outputs["label"] == v2_answer(server, "digits_sklearn", rows)["label"]
    assert np.shape(outputs["probabilities"]) == (2, 10)


def test_one_input_and_one_output_take_bare_values(server: RunningServer) -> None:
    """echo's one required input x (its optional input left out) and its one output y, 2x."""
    rows = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    doubled = [[2 * v for v in row] for row in rows]
    url = f"{server.url}/v1/models/echo:predict"
    assert httpx.post(url, json={"instances": rows}).json() == {"predictions": doubled}
    assert httpx.post(url, json={"inputs": rows}).json() == {"outputs": doubled}
    named = [{"x": row} for row in rows]
    assert httpx.post(url, json={"instances": named}).json() == {"predictions": doubled}


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"instances": [[1, 2, 3, 4]], "inputs": [[1, 2, 3, 4]]}, 400, "either"),
        ({}, 400, "either"),
        ({"instances": [[1, 2, 3, 4], [1, 2]]}, 400, "rectangular"),
        ({"instances": [[1, 2, 3]]}, 400, "x"),
        ({"instances": [{"x": [1, 2, 3, 4]}, {"z": [1, 2, 3, 4]}]}, 400, "other inputs"),
        ({"instances": [{"nope": [1, 2, 3, 4]}]}, 400, "no input 'nope'"),
        ({"instances": [["a", "b", "c", "d"]]}, 400, "FP32"),
        ({"instances": [[1, 2, 3, 4]], "signature_name": "other"}, 400, "serving_default"),
        ({"instances": [[1, 2, 3, 4]], "extra": 1}, 400, "extra"),
    ],
)
def test_malformed_requests_are_4xx_with_an_error(
    server: RunningServer, body: dict[str, object], status: int, words: str
) -> None:
    r = httpx.post(f"{server.url}/v1/models/echo:predict", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert words in r.json()["error"], r.json()


def test_unknown_models_methods_and_sizes(server: RunningServer) -> None:
    r = httpx.post(f"{server.url}/v1/models/nope:predict", json={"instances": [[1]]})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.get(f"{server.url}/v1/models/echo:predict")
    assert r.status_code == 405
    huge = b'{"instances": [' + b"1," * predict.MAX_ELEMENTS + b"1]}"
    r = httpx.post(f"{server.url}/v1/models/echo:predict", content=huge, timeout=60)
    assert r.status_code == 400 and "more than" in r.json()["error"]
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_bytes_tensors_take_text_and_base64_and_answer_text_or_base64() -> None:
    config = ModelConfig(
        name="t",
        backend="python",
        max_batch_size=4,
        inputs=(TensorSpec("s", "BYTES", (1,)),),
        outputs=(TensorSpec("o", "BYTES", (1,)),),
    )
    decoded = predict.decode_predict(b'{"instances": [["hi"], [{"b64": "/w=="}]]}', config)
    assert decoded.inputs["s"].tolist() == [[b"hi"], [b"\xff"]] and not decoded.columnar
    answer = predict.encode_predict({"o": decoded.inputs["s"]}, config, columnar=False)
    assert answer == b'{"predictions":[["hi"],[{"b64":"/w=="}]]}'
    with pytest.raises(BadRequest, match="base64"):
        predict.decode_predict(b'{"instances": [[{"b64": "%%"}]]}', config)
    floats = ModelConfig(
        "f", "python", 4, (TensorSpec("x", "FP32", (2,)),), (TensorSpec("y", "FP32", (2,)),)
    )
    nan = np.array([[np.nan, np.inf]], dtype=np.float32)
    assert predict.encode_predict({"y": nan}, floats, True) == b'{"outputs":[["NaN","Infinity"]]}'


def test_a_models_status_in_kserve_v1_and_tensorflow_serving_form(server: RunningServer) -> None:
    """`GET /v1/models/{m}`: KServe v1's `ready` and TensorFlow Serving's version states."""
    status = httpx.get(server.url + "/v1/models/digits_onnx")
    assert status.status_code == 200, status.text
    body = status.json()
    assert body["name"] == "digits_onnx" and body["ready"] is True
    ok = {"error_code": "OK", "error_message": ""}
    assert body["model_version_status"] == [{"version": "1", "state": "AVAILABLE", "status": ok}]
    one = httpx.get(server.url + "/v1/models/digits_onnx/versions/1").json()
    assert one == body
    assert httpx.get(server.url + "/v1/models/digits_onnx/versions/7").status_code == 404
    assert httpx.get(server.url + "/v1/models/no_such_model").status_code == 404
    # a model that failed to load: known, not ready, and why
    broken = httpx.get(server.url + "/v1/models/broken")
    assert broken.status_code == 200, broken.text
    assert broken.json()["ready"] is False, broken.json()
    failed = broken.json()["model_version_status"]
    reasons = [v["status"]["error_message"] for v in failed] + [broken.json().get("reason")]
    assert all(v["state"] == "END" for v in failed) and any(reasons), broken.json()
