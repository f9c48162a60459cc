"""A bare model file served through a real server (`lockgate serve model.onnx`, KServe's
/mnt/models holding one file): named by --model-name or the file, its config completed from the
file, answering as its runtime does; a folder that is no repository and holds no single model
refused at start with a message; poll mode reloading the file's config."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import joblib
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from sklearn.datasets import load_iris
from sklearn.tree import DecisionTreeClassifier

from tests.conftest import ROOT, RunningServer, digits_rows, free_port, start_server


@pytest.fixture(scope="module")
def onnx_file(demo_repo: Path) -> Path:
    return demo_repo / "digits_onnx" / "1" / "model.onnx"


@pytest.fixture(scope="module")
def digits(onnx_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """/mnt/models as KServe's storage initializer leaves it: a folder with one ONNX file."""
    models = tmp_path_factory.mktemp("mnt") / "models"
    models.mkdir()
    shutil.copy(onnx_file, models / "model.onnx")
    models.chmod(0o555)  # read-only, as a volume is
    running = start_server(models, tmp_path_factory.mktemp("bare"), "--model-name=digits")
    yield running
    running.stop()
    models.chmod(0o755)
    assert [p.name for p in models.iterdir()] == ["model.onnx"]  # nothing written into it


def test_a_folder_with_one_onnx_file_answers_as_onnxruntime(
    digits: RunningServer, onnx_file: Path
) -> None:
    x = digits_rows(8)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    labels, probabilities = session.run(["label", "probabilities"], {"input": x})
    client = httpclient.InferenceServerClient(digits.address)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("digits", [inp])
    np.testing.assert_array_equal(result.as_numpy("label"), labels)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-6)

    config = httpx.get(f"{digits.url}/v2/models/digits/config").json()
    signature = {i.name: i.shape for i in (*session.get_inputs(), *session.get_outputs())}
    served = {t["name"]: [-1, *t["dims"]] for t in (*config["input"], *config["output"])}
    assert set(served) == set(signature) and config["max_batch_size"] == 64
    for name, shape in signature.items():
        assert served[name] == [d if isinstance(d, int) else -1 for d in shape]
    index = httpx.post(f"{digits.url}/v2/repository/index").json()
    assert [m["name"] for m in index] == ["digits"]


def test_a_file_is_served_under_its_stem(
    onnx_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("file")
    shutil.copy(onnx_file, folder / "handwriting.onnx")
    (folder / "notes.txt").write_text("the folder may hold other files")
    server = start_server(folder / "handwriting.onnx", folder)
    try:
        x = digits_rows(2)
        r = httpx.post(f"{server.url}/v1/models/handwriting:predict", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/v2/models/model/ready").status_code == 404
    finally:
        assert server.stop() == 0


def test_a_sklearn_joblib_answers_kserve_v1_as_its_predict(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    x, y = load_iris(return_X_y=True)
    estimator = DecisionTreeClassifier(max_depth=3, random_state=0).fit(x, y)
    folder = tmp_path_factory.mktemp("sklearn")
    joblib.dump(estimator, folder / "model.joblib")
    server = start_server(folder, folder, "--model-name", "iris")
    try:
        rows = x[::10]  # [15, 4]
        r = httpx.post(f"{server.url}/v1/models/iris:predict", json={"instances": rows.tolist()})
        assert r.status_code == 200, r.text
        assert r.json()["predictions"] == estimator.predict(rows).tolist()
        metadata = httpx.get(f"{server.url}/v2/models/iris").json()
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 4]}]
        r = httpx.post(f"{server.url}/v1/models/iris:predict", json={"instances": [[1, 2]]})
        assert r.status_code == 400 and "error" in r.json()
    finally:
        assert server.stop() == 0


def test_lockgate_models_checks_a_file(
    onnx_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lockgate import cli

    shutil.copy(onnx_file, tmp_path / "digits.onnx")
    assert cli.main(["models", str(tmp_path / "digits.onnx")]) == 0
    line = capsys.readouterr().out.split()
    assert line[:4] == ["digits", "OK", "backend=onnxruntime", "versions=1"]
    shutil.copy(onnx_file, tmp_path / "other.onnx")
    assert cli.main(["models", str(tmp_path)]) == 2
    assert "holds 2 model files" in capsys.readouterr().err


def serve_exit(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`lockgate serve path` run to its exit (it must not start)."""
    cmd = [sys.executable, "-m", "lockgate.cli", "serve", str(path), "--port", str(free_port())]
    return subprocess.run(
        [*cmd, "--grpc-port", "off", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("files", "extra", "message"),
    [
        ((), (), "holds nothing; expected a model repository"),
        (("a.onnx", "b.onnx"), (), "holds 2 model files (a.onnx, b.onnx): serve one of them"),
        (("model.pt",), (), "put a config.yaml beside model.pt"),
        (("model.onnx",), ("--model-control-mode", "explicit"), "one model file is always"),
    ],
)
def test_what_cannot_be_served_stops_the_start(
    tmp_path: Path, onnx_file: Path, files: tuple[str, ...], extra: tuple[str, ...], message: str
) -> None:
    for name in files:
        shutil.copy(onnx_file, tmp_path / name)
    result = serve_exit(tmp_path, *extra)
    assert result.returncode == 2
    assert f"lockgate: {tmp_path}" in result.stderr and message in result.stderr


def test_poll_mode_reloads_the_file_when_its_config_changes(
    onnx_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("poll")
    shutil.copy(onnx_file, folder / "model.onnx")
    mode = ("--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    server = start_server(folder, folder, "--model-name", "digits", *mode)
    try:
        config_url = f"{server.url}/v2/models/digits/config"
        assert httpx.get(config_url).json()["max_batch_size"] == 64
        (folder / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 8\n")
        wait_for(lambda: httpx.get(config_url).json().get("max_batch_size") == 8)
        (folder / "model.onnx").unlink()
        wait_for(lambda: httpx.get(f"{server.url}/v2/models/digits/ready").status_code == 404)
    finally:
        assert server.stop() == 0


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the change was not acted on in time"
        time.sleep(0.05)
