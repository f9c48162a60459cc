from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockgate.config import TensorSpec
from lockgate.core.repository import (
    ModelEntry,
    is_safe_name,
    resolve_model_file,
    scan_repository,
)
from lockgate.errors import ConfigError
from tests.backends.test_onnx import write_linear_onnx

PYTHON_CONFIG = "backend: python\n"
MODEL_PY = "class Model:\n    def infer(self, inputs):\n        return inputs\n"


def add_model(root: Path, name: str, config: str, versions: tuple[int, ...] = (1,)) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    for version in versions:
        (folder / str(version)).mkdir()
        (folder / str(version) / "model.py").write_text(MODEL_PY)
    return folder


def by_name(entries: list[ModelEntry]) -> dict[str, ModelEntry]:
    return {entry.name: entry for entry in entries}


def test_versions_and_policies(tmp_path: Path) -> None:
    add_model(tmp_path, "latest", PYTHON_CONFIG, (1, 2, 10))
    add_model(
        tmp_path, "two", PYTHON_CONFIG + "version_policy: {latest: {num_versions: 2}}", (1, 2, 3)
    )
    add_model(tmp_path, "all", PYTHON_CONFIG + "version_policy: {all: {}}", (3, 1, 2))
    add_model(
        tmp_path,
        "pick",
        PYTHON_CONFIG + "version_policy: {specific: {versions: [1, 3]}}",
        (1, 2, 3),
    )
    (tmp_path / "latest" / "notes").mkdir()  # not a version: ignored
    entries = by_name(scan_repository(tmp_path))
    assert entries["latest"].versions == [10]
    assert entries["two"].versions == [3, 2]
    assert entries["all"].versions == [3, 2, 1]
    assert entries["pick"].versions == [3, 1]
    assert all(entry.ok for entry in entries.values())


def test_bad_model_is_reported_not_fatal(tmp_path: Path) -> None:
    add_model(tmp_path, "good", PYTHON_CONFIG)
    add_model(tmp_path, "bad", "backend: python\nmax_batch_size: -3\n")
    add_model(tmp_path, "typo", "backend: python\nmax_batch: 3\n")
    add_model(tmp_path, "empty", PYTHON_CONFIG, versions=())
    add_model(tmp_path, "missing", PYTHON_CONFIG + "version_policy: {specific: {versions: [7]}}")
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "README.md").write_text("not a model")
    entries = by_name(scan_repository(tmp_path))
    assert sorted(entries) == ["bad", "empty", "good", "missing", "noconfig", "typo"]
    assert entries["good"].ok and entries["good"].versions == [1]
    for name, fragment in [
        ("bad", "max_batch_size"),
        ("typo", "max_batch"),
        ("empty", "no numbered version folder"),
        ("missing", "selects none of the available versions (1)"),
        ("noconfig", "no config.yaml or config.pbtxt"),
    ]:
        entry = entries[name]
        assert entry.error is not None and fragment in entry.error, (name, entry.error)
        assert entry.versions == [] and not entry.ok


def test_hidden_and_unsafe_names(tmp_path: Path) -> None:
    add_model(tmp_path, ".hidden", PYTHON_CONFIG)
    add_model(tmp_path, "has space", PYTHON_CONFIG)
    add_model(tmp_path, "a..b", PYTHON_CONFIG)
    entries = by_name(scan_repository(tmp_path))
    assert ".hidden" not in entries
    assert "unsafe model name" in (entries["has space"].error or "")
    assert "unsafe model name" in (entries["a..b"].error or "")


@pytest.mark.parametrize(
    ("name", "safe"),
    [
        ("digits", True),
        ("m-1.v2_x", True),
        ("..", False),
        ("a/b", False),
        (".git", False),
        ("", False),
    ],
)
def test_is_safe_name(name: str, safe: bool) -> None:
    assert is_safe_name(name) is safe


def test_symlink_inside_is_allowed_outside_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "repo", tmp_path / "outside"
    root.mkdir()
    add_model(root, "real", PYTHON_CONFIG)
    os.symlink(root / "real", root / "alias")
    add_model(outside, "elsewhere", PYTHON_CONFIG)
    os.symlink(outside / "elsewhere", root / "escape")
    add_model(root, "sneaky", PYTHON_CONFIG, versions=())
    os.symlink(outside / "elsewhere" / "1", root / "sneaky" / "1")
    entries = by_name(scan_repository(root))
    assert entries["alias"].ok
    assert "outside the repository" in (entries["escape"].error or "")
    assert "outside the repository" in (entries["sneaky"].error or "")


def test_resolve_model_file(tmp_path: Path) -> None:
    add_model(tmp_path, "m", PYTHON_CONFIG, (1, 2))
    entry = by_name(scan_repository(tmp_path))["m"]
    assert resolve_model_file(tmp_path, entry, 2) == (tmp_path / "m" / "2" / "model.py").resolve()
    with pytest.raises(ConfigError, match="1 is not served"):
        resolve_model_file(tmp_path, entry, 1)


def test_resolve_model_file_refuses_escaping_symlink(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    add_model(root, "m", PYTHON_CONFIG)
    secret = tmp_path / "secret.py"
    secret.write_text(MODEL_PY)
    (root / "m" / "1" / "model.py").unlink()
    os.symlink(secret, root / "m" / "1" / "model.py")
    entry = by_name(scan_repository(root))["m"]
    with pytest.raises(ConfigError, match="resolves outside"):
        resolve_model_file(root, entry, 1)


def test_default_model_filename(tmp_path: Path) -> None:
    add_model(tmp_path, "m", PYTHON_CONFIG + "default_model_filename: custom.py\n")
    (tmp_path / "m" / "1" / "custom.py").write_text(MODEL_PY)
    entry = by_name(scan_repository(tmp_path))["m"]
    assert resolve_model_file(tmp_path, entry, 1).name == "custom.py"


def test_triton_pbtxt_onnx_model_is_autocompleted(tmp_path: Path) -> None:
    folder = tmp_path / "linear"
    write_linear_onnx(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        'name: "linear"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        "dynamic_batching { max_queue_delay_microseconds: 100 }\n"
        'model_warmup [{ name: "w" batch_size: 2 inputs { key: "x" value { '
        "data_type: TYPE_FP32 dims: [4] zero_data: true } } }]\n"
    )
    (entry,) = scan_repository(tmp_path)
    assert entry.ok and entry.config is not None
    assert entry.config.inputs == (TensorSpec("x", "FP32", (4,)),)
    assert [s.name for s in entry.config.outputs] == ["y", "label"]
    assert entry.config.batcher.max_queue_delay_us == 100


def test_autocomplete_checks_warmup_names(tmp_path: Path) -> None:
    folder = tmp_path / "linear"
    write_linear_onnx(folder / "1" / "model.onnx")
    (folder / "config.yaml").write_text(
        "backend: onnxruntime\nmax_batch_size: 4\nwarmup: [{inputs: {nope: zero}}]\n"
    )
    (entry,) = scan_repository(tmp_path)
    assert "no input named 'nope'" in (entry.error or "")


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        scan_repository(tmp_path / "absent")


def test_a_config_too_deep_to_read_fails_that_model_alone(tmp_path: Path) -> None:
    from lockgate.core.repository import scan_repository

    good = tmp_path / "good"
    (good / "1").mkdir(parents=True)
    (good / "1" / "model.py").write_text(
        "class Model:\n    def infer(self, inputs):\n        return inputs\n"
    )
    (good / "config.yaml").write_text("backend: python\nmax_batch_size: 0\n")
    deep = tmp_path / "deep"
    (deep / "1").mkdir(parents=True)
    (deep / "config.yaml").write_text("parameters: " + "[" * 100_000 + "]" * 100_000 + "\n")
    entries = {e.name: e for e in scan_repository(tmp_path)}
    assert entries["good"].error is None and entries["good"].config is not None
    assert entries["deep"].config is None and "config" in (entries["deep"].error or "")
