"""Model load and unload (explicit model control mode) through tritonclient, HTTP and gRPC:
a load's config override, its errors, and unloading an ensemble with its steps."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, free_port, start_server
from tests.frontend.test_composition import COUNTING, SLEEPY, XY, _model


@pytest.fixture(scope="module")
def repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("control-repo")
    shutil.copytree(demo_repo / "digits_onnx", repo / "digits_onnx")
    py = "backend: python\n"
    _model(repo, "double", COUNTING, py + XY + "parameters: {factor: '2'}\n")
    _model(repo, "add_one", COUNTING, py + XY + "parameters: {offset: '1'}\n")
    cached = py + XY + "parameters: {factor: '2'}\nresponse_cache: {enable: true}\n"
    _model(repo, "cached", COUNTING, cached)
    _model(repo, "cached_steps", "", "backend: ensemble\n" + XY + CACHED_ENSEMBLE)
    unbatched = XY.replace("max_batch_size: 8\n", "")  # one size to profile: 2 runs of 0.2 s
    _model(repo, "sleepy", SLEEPY, py + unbatched + "parameters: {sleep: '0.2'}\n")
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.yaml").write_text(
        "backend: ensemble\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n"
        "outputs: [{name: y, datatype: FP32, dims: [4]}]\nensemble:\n"
        "  - {model: add_one, input_map: {x: doubled}, output_map: {y: y}}\n"
        "  - {model: double, input_map: {x: x}, output_map: {y: doubled}}\n"
    )
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    logs = tmp_path_factory.mktemp("control-logs")
    # a load's warmup threads hold the GIL at times: the loop-lag refusals are off, so a
    # request right after a load is never refused as saturated on a busy machine
    running = start_server(
        repo,
        logs,
        "--no-llm",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--max-loop-lag-ms",
        "0",
        "--queue-target-ms",
        "0",
        grpc_port=free_port(),
    )
    yield running
    running.stop()


CACHED_ENSEMBLE = """\
response_cache: {enable: true}
ensemble:
  - {model: double, input_map: {x: x}, output_map: {y: y, calls: calls}}
"""


def http_client(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def test_a_load_applies_the_config_it_gives(server: RunningServer) -> None:
    """The config read back, changed and sent with the load replaces the repository's (as in
    Triton); a load without one goes back to the repository's."""
    client = http_client(server)
    config = client.get_model_config("digits_onnx")
    assert config["max_batch_size"] == 64
    config["max_batch_size"] = 8
    config["model_warmup"] = []  # its batches of 64 would not fit (400, as in Triton)
    client.load_model("digits_onnx", config=json.dumps(config))
    assert client.get_model_config("digits_onnx")["max_batch_size"] == 8
    client.load_model("digits_onnx", config=json.dumps({"max_batch_size": 16}))
    changed = client.get_model_config("digits_onnx")  # backend and tensors as the model has them
    assert changed["max_batch_size"] == 16 and changed["input"][0]["name"] == "input"
    client.load_model("digits_onnx")
    assert client.get_model_config("digits_onnx")["max_batch_size"] == 64
    assert client.is_model_ready("digits_onnx")


@pytest.mark.parametrize(
    ("config", "files", "fragment"),
    [
        ("{not json", None, "the load request's config"),
        (json.dumps({"max_batch_size": "many"}), None, "the load request's config"),
        (json.dumps({"name": "other"}), None, "does not match"),
        (json.dumps({"instance_group": [{"count": 100000}]}), None, "must be <= 256"),
        (None, {"file:1/model.onnx": b"\x00"}, "field 'backend': missing"),
        (None, {"file:../1/model.onnx": b"\x00"}, "inside its version folder"),
        (None, {"file:model.onnx": b"\x00"}, "inside its version folder"),
        (None, {"file:1/../../x": b"\x00"}, "inside its version folder"),
    ],
)
def test_a_load_that_cannot_be_applied_is_refused(
    server: RunningServer, config: str | None, files: dict[str, bytes] | None, fragment: str
) -> None:
    client = http_client(server)
    with pytest.raises(InferenceServerException) as refused:
        if files is not None:
            client.load_model("digits_onnx", config="{}", files=files)
        else:
            client.load_model("digits_onnx", config=config)
    assert fragment in str(refused.value)
    assert client.get_model_config("digits_onnx")["max_batch_size"] == 64  # still as it was


def files_folders(name: str) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"lockgate-{name}-*"))


def test_a_load_with_files_serves_them_in_place_of_the_repository(
    server: RunningServer, repo: Path
) -> None:
    """tritonclient's load_model(config=..., files=...), over HTTP (base64) and gRPC (bytes):
    a model the repository does not have is loaded from the files sent, answers as the
    repository's copy of it does, and its folder goes when it is loaded again or unloaded."""
    http = http_client(server)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    config = http.get_model_config("digits_onnx")
    config["name"] = "sent_digits"
    files = {"file:1/model.onnx": (repo / "digits_onnx" / "1" / "model.onnx").read_bytes()}
    rows = np.random.default_rng(1).random((3, 64), dtype=np.float32)
    x = httpclient.InferInput("input", [3, 64], "FP32")
    x.set_data_from_numpy(rows)
    expected = http.infer("digits_onnx", [x]).as_numpy("probabilities")
    for client in (http, grpc):
        client.load_model("sent_digits", config=json.dumps(config), files=files)
        assert http.is_model_ready("sent_digits")
        answer = http.infer("sent_digits", [x]).as_numpy("probabilities")
        np.testing.assert_allclose(answer, expected, rtol=1e-6)
        assert len(files_folders("sent_digits")) == 1  # the one it serves from
    with pytest.raises(InferenceServerException, match=r"needs parameters\.config"):
        http.load_model("sent_digits", files=files)
    with pytest.raises(InferenceServerException, match="failed to load"):  # not ONNX
        http.load_model("sent_digits", config=json.dumps(config), files={"file:1/model.onnx": b"x"})
    assert len(files_folders("sent_digits")) == 1  # its own removed; the loaded one serves on
    assert http.infer("sent_digits", [x]).as_numpy("probabilities").shape == (3, 10)
    http.unload_model("sent_digits")
    assert not files_folders("sent_digits")
    assert not (repo / "sent_digits").exists()  # nothing was written into the repository


def test_grpc_unloads_an_ensemble_with_its_steps_and_loads_it_again(
    server: RunningServer,
) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    http = http_client(server)
    assert all(http.is_model_ready(m) for m in ("pipeline", "add_one", "double"))
    client.unload_model("pipeline", unload_dependents=True)
    assert not any(http.is_model_ready(m) for m in ("pipeline", "add_one", "double"))
    assert http.is_model_ready("digits_onnx")  # not one of its steps
    client.unload_model("pipeline")  # not loaded: nothing to do, as in Triton
    for model in ("double", "add_one", "pipeline"):
        client.load_model(model)
    assert all(http.is_model_ready(m) for m in ("pipeline", "add_one", "double"))
    client.unload_model("double")  # without dependents: the ensemble's steps stay
    assert http.is_model_ready("add_one")
    assert not http.is_model_ready("pipeline")  # one of its steps is gone
    x = np.ones((1, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("x", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="the model 'double' it runs") as down:
        http.infer("pipeline", inputs)
    assert down.value.status() == "503"
    client.load_model("double")
    assert http.is_model_ready("pipeline")
    answer = http.infer("pipeline", inputs).as_numpy("y")
    assert answer is not None and answer.tolist() == [[3.0, 3.0, 3.0, 3.0]]
    with pytest.raises(InferenceServerException, match="no model 'nosuch' in the repository"):
        client.load_model("nosuch")


def test_explicit_mode_loads_what_load_model_names_and_lists_the_rest(
    tmp_path: Path,
) -> None:
    """As in Triton: explicit mode loads at start-up only the --load-model models, and the
    repository index lists every model of the repository, those not loaded as UNAVAILABLE
    ("unloaded")."""
    repo = tmp_path / "repo"
    py = "backend: python\n"
    _model(repo, "double", COUNTING, py + XY + "parameters: {factor: '2'}\n")
    _model(repo, "add_one", COUNTING, py + XY + "parameters: {offset: '1'}\n")
    running = start_server(
        repo, tmp_path, "--no-llm", "--model-control-mode", "explicit", "--load-model", "double"
    )
    try:
        client = http_client(running)
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["double"]["state"] == "READY"
        assert index["add_one"]["state"] == "UNAVAILABLE"
        assert index["add_one"]["reason"] == "unloaded"
        assert client.is_server_ready() and not client.is_model_ready("add_one")
        client.load_model("add_one")
        assert client.is_model_ready("add_one")
    finally:
        running.stop()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--load-model", "x"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--model-control-mode explicit" in done.stderr


def _y(server: RunningServer, model: str) -> tuple[list[float], bool]:
    """y of x = 1000s from `model`, and whether the response cache answered."""
    x = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1000.0] * 4}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": [x]})
    assert r.status_code == 200, r.text
    answer = r.json()
    return answer["outputs"][0]["data"], bool(answer.get("parameters", {}).get("cache_hit"))


def _reload_with_factor(client: httpclient.InferenceServerClient, model: str, factor: str) -> None:
    config = client.get_model_config(model)
    config["parameters"] = {"factor": {"string_value": factor}}
    client.load_model(model, config=json.dumps(config))


def test_a_reloaded_model_never_answers_from_the_cache_of_the_one_it_replaced(
    server: RunningServer, repo: Path
) -> None:
    """A version reloaded under the same number with another config or file, or an ensemble
    whose step was, answers from the new model, not from the old one's cached answers."""
    client = http_client(server)
    assert _y(server, "cached") == ([2000.0] * 4, False)
    assert _y(server, "cached") == ([2000.0] * 4, True)
    _reload_with_factor(client, "cached", "3")  # another config, the same version
    assert _y(server, "cached") == ([3000.0] * 4, False)
    code = repo / "cached" / "1" / "model.py"
    code.write_text(COUNTING.replace("x * self.factor", "x * self.factor * 10"))
    client.load_model("cached")  # another file, the same version
    assert _y(server, "cached") == ([20000.0] * 4, False)
    assert _y(server, "cached_steps") == ([2000.0] * 4, False)
    assert _y(server, "cached_steps") == ([2000.0] * 4, True)
    _reload_with_factor(client, "double", "4")  # the ensemble's step is another model now
    assert _y(server, "cached_steps") == ([4000.0] * 4, False)
    client.load_model("double")


def test_a_version_being_reloaded_stays_ready_on_metrics(server: RunningServer) -> None:
    """The loaded version serves while its replacement warms up: its lockgate_model_ready
    stays 1 (it read 0 for the whole reload)."""
    url = f"{server.url}/v2/repository/models/sleepy/load"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(httpx.post, url, timeout=30)
        seen = []
        while not reload.done():
            seen.append(server.metric("lockgate_model_ready", 'model="sleepy",version="1"'))
            time.sleep(0.05)
        assert reload.result().status_code == 200
    assert len(seen) > 2 and set(seen) == {1.0}, seen


def test_an_unloaded_model_leaves_no_cached_answers(server: RunningServer) -> None:
    """Unloading frees the model's in-process answers: lockgate_cache_entries drops it."""
    client = http_client(server)
    entries = 'lockgate_cache_entries{model="cached"}'
    _y(server, "cached")
    assert entries in httpx.get(server.url + "/metrics").text
    client.unload_model("cached")
    assert entries not in httpx.get(server.url + "/metrics").text
    client.load_model("cached")
    assert _y(server, "cached")[1] is False
