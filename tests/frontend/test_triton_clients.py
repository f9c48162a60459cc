"""Triton's own clients against lockgate: tritonclient.http (JSON and binary) and perf_analyzer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import PERF_ANALYZER, RunningServer, digits_rows


@pytest.fixture(scope="module")
def client(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.address, concurrency=4)


def test_server_and_model_status(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits_onnx")
    assert client.get_server_metadata()["name"] == "lockgate"
    config = client.get_model_config("digits_onnx")
    assert config["max_batch_size"] == 64
    assert client.get_model_metadata("minilm")["inputs"][0]["datatype"] == "BYTES"
    stats = client.get_inference_statistics("digits_onnx")
    assert stats["model_stats"][0]["name"] == "digits_onnx"


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("model", ["digits_onnx", "digits_sklearn"])
def test_digits_models(client: httpclient.InferenceServerClient, model: str, binary: bool) -> None:
    from sklearn.datasets import load_digits

    x = digits_rows(16)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("label", binary_data=binary),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary),
    ]
    result = client.infer(model, [inp], outputs=outputs)
    labels = result.as_numpy("label")
    probs = result.as_numpy("probabilities")
    assert labels is not None and probs is not None
    assert probs.shape == (16, 10)
    assert (labels.ravel() == load_digits().target[:16]).mean() > 0.9


@pytest.mark.parametrize("binary", [False, True])
def test_minilm_bytes(client: httpclient.InferenceServerClient, binary: bool) -> None:
    text = np.array(
        [[b"the weather is lovely today"], ["caf\u00e9 cr\u00e8me".encode()]], dtype=object
    )
    inp = httpclient.InferInput("text", [2, 1], "BYTES")
    inp.set_data_from_numpy(text, binary_data=binary)
    out = httpclient.InferRequestedOutput("embedding", binary_data=binary)
    result = client.infer("minilm", [inp], outputs=[out])
    vectors = result.as_numpy("embedding")
    assert vectors is not None and vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-3)


@pytest.mark.parametrize("binary", [False, True])
def test_classification_has_a_row_per_batch_row(
    client: httpclient.InferenceServerClient, binary: bool
) -> None:
    """Triton's classification of a batching model: BYTES [batch, count], row by row."""
    x = digits_rows(3)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    plain = client.infer("digits_sklearn", [inp])
    labels, probs = plain.as_numpy("label"), plain.as_numpy("probabilities")
    assert labels is not None and probs is not None
    top = [
        httpclient.InferRequestedOutput("label", binary_data=binary, class_count=1),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary, class_count=1),
    ]
    result = client.infer("digits_sklearn", [inp], outputs=top)
    label_classes, prob_classes = result.as_numpy("label"), result.as_numpy("probabilities")
    assert label_classes is not None and label_classes.shape == (3, 1)
    assert [_text(c) for c in label_classes[:, 0]] == [f"{float(v):f}:0" for v in labels]
    assert prob_classes is not None and prob_classes.shape == (3, 1)
    indices = [int(_text(c).split(":")[1]) for c in prob_classes[:, 0]]
    assert indices == probs.argmax(axis=1).tolist()


def _text(item: bytes | str) -> str:
    return item.decode() if isinstance(item, bytes) else item


def test_async_requests_batch(client: httpclient.InferenceServerClient) -> None:
    x = digits_rows(20)
    pending = []
    for i in range(20):
        inp = httpclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(x[i : i + 1], binary_data=True)
        pending.append(client.async_infer("digits_onnx", [inp]))
    direct = [p.get_result().as_numpy("probabilities") for p in pending]
    batch_inp = httpclient.InferInput("input", [20, 64], "FP32")
    batch_inp.set_data_from_numpy(x, binary_data=True)
    together = client.infer("digits_onnx", [batch_inp]).as_numpy("probabilities")
    assert together is not None
    np.testing.assert_allclose(np.concatenate(direct), together, rtol=1e-5, atol=1e-6)


def test_errors_surface_as_exceptions(client: httpclient.InferenceServerClient) -> None:
    from tritonclient.utils import InferenceServerException

    inp = httpclient.InferInput("input", [1, 10], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 10), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("digits_onnx", [inp])


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason="perf_analyzer not installed (scripts/install-perf-analyzer.sh)",
)
def test_perf_analyzer_drives_the_server(server: RunningServer, tmp_path: Path) -> None:
    csv = tmp_path / "perf.csv"
    cmd = [
        str(PERF_ANALYZER),
        "-m",
        "digits_onnx",
        "-u",
        server.address,
        "-i",
        "http",
        # digits_onnx's 50 ms SLO is its default deadline; a stalled machine must not turn
        # into a 504, which ends perf_analyzer's run
        "-H",
        "Request-Timeout:10",
        "--concurrency-range",
        "1:4:3",
        "--measurement-interval",
        "1000",
        "--max-trials",
        "4",
        "--stability-percentage",
        "100",
        "-f",
        str(csv),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Throughput" in result.stdout
    rows = csv.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency")
    assert len(rows) == 3  # concurrency 1 and 4
    for row in rows[1:]:
        assert float(row.split(",")[1]) > 10  # inferences per second
