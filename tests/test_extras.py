"""Optional dependencies: `pip install lockgate` alone serves ONNX models, and every feature that
needs an extra says which one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from lockgate.extras import EXTRAS, MissingExtra, import_for, missing_from
from tests.backends.test_onnx import BIAS, WEIGHTS, write_linear_onnx
from tests.conftest import ROOT, RunningServer, start_server

SIZE_TARGET_MB = 400


def test_missing_module_of_an_extra_names_the_extra() -> None:
    with pytest.raises(MissingExtra, match=r"pip install 'lockgate\[bench\]'") as info:
        try:
            import lockgate_no_such_module  # type: ignore[import-not-found]  # noqa: F401
        except ModuleNotFoundError as exc:
            exc.name = "aiohttp"  # as if aiohttp were missing
            missing = missing_from(exc, "bench", "lockgate bench")
            assert missing is not None
            raise missing from exc
    assert info.value.extra == "bench" and "aiohttp" in str(info.value)


def test_other_import_errors_pass_through() -> None:
    other = ModuleNotFoundError("No module named 'left_pad'", name="left_pad")
    assert missing_from(other, "llm", "x") is None
    assert missing_from(ImportError("cannot import name 'x'"), "llm", "x") is None
    with pytest.raises(ModuleNotFoundError):
        import_for("lockgate_no_such_module", "llm", "x")


def test_every_extra_is_declared_in_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for extra in (*EXTRAS, "all", "dev"):
        assert f"\n{extra} = [" in text, extra


# -- a fresh environment with `pip install .` only ------------------------------------------


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("core-venv")
    # without a pip of its own (ensurepip takes seconds): this environment's pip installs into
    # it, and the venv holds lockgate's install alone
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(venv / "bin" / "python"),
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    done = subprocess.run([*pip, str(ROOT)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"pip install . failed:\n{done.stderr[-3000:]}")
        pytest.skip(f"pip install . failed (offline?): {done.stderr[-300:]}")
    return venv


def test_core_install_has_no_optional_packages_and_fits_the_size_target(core_venv: Path) -> None:
    python = str(core_venv / "bin" / "python")
    probe = "import importlib.util as u; print([m for m in {mods!r} if u.find_spec(m)])"
    heavy = ("torch", "sklearn", "scipy", "aiohttp", "matplotlib", "tokenizers", "redis")
    found = subprocess.run(
        [python, "-c", probe.format(mods=heavy)], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "[]"
    size_mb = sum(f.stat().st_size for f in core_venv.rglob("*") if f.is_file()) / 2**20
    print(f"core install: {size_mb:.0f} MB (target <= {SIZE_TARGET_MB} MB)")
    assert size_mb <= SIZE_TARGET_MB


@pytest.fixture(scope="module")
def core_server(
    core_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("core-repo")
    write_linear_onnx(repo / "linear" / "1" / "model.onnx")
    (repo / "linear" / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 8\n")
    torch_model = repo / "torch_model"
    (torch_model / "1").mkdir(parents=True)
    (torch_model / "1" / "model.pt").write_bytes(b"not loaded")
    (torch_model / "config.yaml").write_text(
        "backend: pytorch\nmax_batch_size: 8\n"
        "inputs: [{name: x, datatype: FP32, dims: [4]}]\n"
        "outputs: [{name: y, datatype: FP32, dims: [3]}]\n"
    )
    server = start_server(
        repo, tmp_path_factory.mktemp("core-logs"), python=str(core_venv / "bin" / "python")
    )
    yield server
    server.stop()


def test_core_install_serves_an_onnx_model(core_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(core_server.address)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("linear", [inp])
    np.testing.assert_allclose(result.as_numpy("y"), x @ WEIGHTS + BIAS, rtol=1e-6)
    client.close()


def test_core_install_names_the_extra_a_model_needs(core_server: RunningServer) -> None:
    index = httpx.post(core_server.url + "/v2/repository/index", json={}).json()
    torch_model = next(m for m in index if m["name"] == "torch_model")
    assert torch_model["state"] != "READY"
    assert "pip install 'lockgate[torch]'" in torch_model["reason"]


def test_core_install_tools_name_their_extra(core_venv: Path, tmp_path: Path) -> None:
    lockgate = str(core_venv / "bin" / "lockgate")
    bench = subprocess.run([lockgate, "bench"], capture_output=True, text=True, cwd=tmp_path)
    assert bench.returncode == 2 and "pip install 'lockgate[bench]'" in bench.stderr
    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(tmp_path)}
    demo = subprocess.run(
        [lockgate, "serve"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert demo.returncode == 2 and "pip install 'lockgate[demo]'" in demo.stderr
