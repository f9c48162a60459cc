"""A bare model file (`core/bare_model.py`): told from a repository, refused with a message
that says what was found and what is expected, and its config built in memory from the file,
a config beside it, or MLServer's model-settings.json."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import joblib
import numpy as np
import pytest
from sklearn.datasets import load_iris
from sklearn.linear_model import LinearRegression, LogisticRegression

from lockgate.config import TensorSpec
from lockgate.core.bare_model import DEFAULT_MAX_BATCH_SIZE, bare_entry, find_bare_model
from lockgate.errors import ConfigError


@pytest.fixture(scope="module")
def onnx_file(demo_repo: Path) -> Path:
    return demo_repo / "digits_onnx" / "1" / "model.onnx"


def test_a_repository_is_no_bare_model(tmp_path: Path, onnx_file: Path) -> None:
    (tmp_path / "digits" / "1").mkdir(parents=True)
    shutil.copy(onnx_file, tmp_path / "digits" / "1" / "model.onnx")
    shutil.copy(onnx_file, tmp_path / "stray.onnx")  # a repository's own folders win
    assert find_bare_model(tmp_path) is None


def test_a_file_is_named_by_its_stem_a_folder_by_its_name(tmp_path: Path, onnx_file: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(onnx_file, folder / "model.onnx")
    (folder / "README.md").write_text("not a model")
    bare = find_bare_model(folder)
    assert bare is not None and (bare.name, bare.file) == ("models", folder / "model.onnx")
    bare = find_bare_model(folder / "model.onnx", "digits")
    assert bare is not None and bare.name == "digits"
    bare = find_bare_model(folder / "model.onnx")
    assert bare is not None and bare.name == "model"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ((), "holds nothing; expected a model repository"),
        (("a.onnx", "b.joblib"), "holds 2 model files (a.onnx, b.joblib): serve one of them"),
        (("notes.txt",), "holds notes.txt; expected a model repository"),
        (("config.yaml", "1/"), "is one model's folder"),
    ],
)
def test_a_folder_that_is_neither_is_refused(
    tmp_path: Path, files: tuple[str, ...], message: str
) -> None:
    for name in files:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ConfigError, match=re.escape(message)):
        find_bare_model(tmp_path)


def test_an_empty_folder_may_be_an_empty_repository(tmp_path: Path) -> None:
    assert find_bare_model(tmp_path, empty_ok=True) is None


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("model.txt", "not a model file"),
        ("model.py", "not a model file"),  # code is served from a repository only
    ],
)
def test_a_file_that_is_no_model_is_refused(tmp_path: Path, name: str, problem: str) -> None:
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ConfigError, match=problem):
        find_bare_model(tmp_path / name)


def test_an_unsafe_name_is_refused(tmp_path: Path, onnx_file: Path) -> None:
    shutil.copy(onnx_file, tmp_path / "model.onnx")
    with pytest.raises(ConfigError, match="give --model-name"):
        find_bare_model(tmp_path, "../up")


def test_torchscript_needs_a_config_beside_it(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"not read before the config is found")
    with pytest.raises(ConfigError, match=r"put a config\.yaml beside model\.pt"):
        find_bare_model(tmp_path)
    (tmp_path / "config.yaml").write_text("backend: pytorch\n")
    bare = find_bare_model(tmp_path, "resnet")
    assert bare is not None and bare.backend == "pytorch"


def test_onnx_is_autocompleted_and_batched(tmp_path: Path, onnx_file: Path) -> None:
    shutil.copy(onnx_file, tmp_path / "digits.onnx")
    bare = find_bare_model(tmp_path / "digits.onnx")
    assert bare is not None
    entry = bare_entry(bare)
    assert entry.ok and entry.bare and entry.versions == [1] and entry.path == tmp_path
    assert entry.config is not None
    assert entry.config.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert entry.config.default_model_filename == "digits.onnx"
    assert entry.config.inputs == (TensorSpec("input", "FP32", (64,)),)
    assert [(o.name, o.dims) for o in entry.config.outputs] == [
        ("label", ()),
        ("probabilities", (10,)),
    ]


def test_a_config_beside_is_used_as_written_under_the_served_name(
    tmp_path: Path, onnx_file: Path
) -> None:
    shutil.copy(onnx_file, tmp_path / "model.onnx")
    (tmp_path / "config.pbtxt").write_text(
        'name: "digits_v0"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    )
    bare = find_bare_model(tmp_path, "digits")
    assert bare is not None
    config = bare_entry(bare).config
    assert config is not None and (config.name, config.max_batch_size) == ("digits", 8)
    assert config.inputs[0].dims == (64,)  # autocompleted under the config's batching


def test_model_settings_json_is_honoured(tmp_path: Path, onnx_file: Path) -> None:
    shutil.copy(onnx_file, tmp_path / "model.onnx")
    settings = {
        "name": "mlserver-name",
        "implementation": "mlserver_onnx.OnnxModel",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}],
        "max_batch_size": 16,
        "max_batch_time": 0.002,
    }
    (tmp_path / "model-settings.json").write_text(json.dumps(settings))
    bare = find_bare_model(tmp_path, "digits")
    assert bare is not None
    config = bare_entry(bare).config
    assert config is not None and config.name == "digits"
    assert config.max_batch_size == 16 and config.batcher.max_queue_delay_us == 2000
    assert [(o.name, o.dims) for o in config.outputs] == [("label", ())]


def test_a_broken_model_settings_json_is_the_models_error(tmp_path: Path, onnx_file: Path) -> None:
    shutil.copy(onnx_file, tmp_path / "model.onnx")
    (tmp_path / "model-settings.json").write_text('{"inputs": [{"name": "x"}]}')
    bare = find_bare_model(tmp_path)
    assert bare is not None
    entry = bare_entry(bare)
    assert not entry.ok and entry.error is not None
    assert "model-settings.json: field 'inputs[0].datatype'" in entry.error


def test_sklearn_classifier_and_regressor_are_autocompleted(tmp_path: Path) -> None:
    x, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    joblib.dump(LogisticRegression(max_iter=500).fit(x, names), tmp_path / "iris.joblib")
    bare = find_bare_model(tmp_path / "iris.joblib")
    assert bare is not None
    config = bare_entry(bare).config
    assert config is not None and config.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert config.inputs == (TensorSpec("input", "FP64", (4,)),)
    assert config.outputs == (TensorSpec("label", "BYTES", ()),)

    joblib.dump(LinearRegression().fit(x, np.c_[y, y]), tmp_path / "two.pkl")
    bare = find_bare_model(tmp_path / "two.pkl")
    assert bare is not None
    config = bare_entry(bare).config
    assert config is not None and config.outputs == (TensorSpec("predict", "FP64", (2,)),)


def test_a_link_is_followed_to_a_file_named_by_its_hash(tmp_path: Path, onnx_file: Path) -> None:
    (tmp_path / "blobs").mkdir()
    shutil.copy(onnx_file, tmp_path / "blobs" / "9f2c1e")  # as a model hub's cache keeps it
    (tmp_path / "digits.onnx").symlink_to(tmp_path / "blobs" / "9f2c1e")
    bare = find_bare_model(tmp_path / "digits.onnx")
    assert bare is not None and (bare.name, bare.backend) == ("digits", "onnxruntime")
    entry = bare_entry(bare)
    assert entry.ok and entry.path == tmp_path / "blobs"
    assert entry.config is not None and entry.config.default_model_filename == "9f2c1e"
