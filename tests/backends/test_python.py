from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from lockgate.backends.python import load
from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BackendError, BadRequest, ConfigError

MODEL_PY = """
import numpy as np
from dataclasses import dataclass

from lockgate.errors import BadRequest

COUNTER = [0]


@dataclass
class Settings:
    scale: float


class Model:
    def load(self, config, version_dir):
        self.settings = Settings(float(config.parameters.get("scale", "1")))
        self.version = version_dir.name

    def infer(self, inputs):
        COUNTER[0] += 1
        if "fail" in inputs:
            raise ValueError("user code failed")
        if "reject" in inputs:
            raise BadRequest("rejected by the model")
        return {"y": inputs["x"] * self.settings.scale, "calls": np.array([COUNTER[0]])}


class Broken:
    def infer(self, inputs):
        return [1, 2]


class NotAModel:
    pass


class FailsToLoad:
    def load(self, config, version_dir):
        raise RuntimeError("no weights")

    def infer(self, inputs):
        return {}
"""


def config(**parameters: str) -> ModelConfig:
    return ModelConfig(name="py", backend="python", parameters=parameters, source="py/config.yaml")


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "model.py").write_text(MODEL_PY)
    return tmp_path / "3"


def test_load_and_infer(version_dir: Path) -> None:
    backend = load(config(scale="2"), version_dir)
    out = backend.infer({"x": np.arange(3.0)})
    np.testing.assert_array_equal(out["y"], [0.0, 2.0, 4.0])
    backend.close()


def test_instances_do_not_share_module_state(version_dir: Path) -> None:
    first, second = load(config(), version_dir), load(config(), version_dir)
    first.infer({"x": np.zeros(1)})
    first.infer({"x": np.zeros(1)})
    assert second.infer({"x": np.zeros(1)})["calls"][0] == 1
    first.close()
    second.close()


def test_close_removes_the_module(version_dir: Path) -> None:
    before = set(sys.modules)
    backend = load(config(), version_dir)
    assert len(set(sys.modules) - before) == 1
    backend.close()
    assert not {m for m in set(sys.modules) - before if m.startswith("lockgate_user_model")}


def test_user_errors_become_backend_errors(version_dir: Path) -> None:
    backend = load(config(), version_dir)
    with pytest.raises(BackendError, match="ValueError: user code failed"):
        backend.infer({"x": np.zeros(1), "fail": np.zeros(1)})
    with pytest.raises(BadRequest, match="rejected"):
        backend.infer({"x": np.zeros(1), "reject": np.zeros(1)})
    with pytest.raises(BackendError, match="not a dict"):
        load(config(class_name="Broken"), version_dir).infer({})


def test_declared_outputs_must_be_returned(version_dir: Path) -> None:
    declared = ModelConfig(
        name="py",
        backend="python",
        outputs=(TensorSpec("y", "FP64", (-1,)), TensorSpec("z", "FP64", (-1,))),
        source="py/config.yaml",
    )
    with pytest.raises(BackendError, match="returned no output 'z'"):
        load(declared, version_dir).infer({"x": np.zeros(2)})


def test_class_problems(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match="no class 'Missing'"):
        load(config(class_name="Missing"), version_dir)
    with pytest.raises(ConfigError, match="has no infer"):
        load(config(class_name="NotAModel"), version_dir)
    with pytest.raises(BackendError, match="load failed: RuntimeError: no weights"):
        load(config(class_name="FailsToLoad"), version_dir)


def test_import_error_is_a_backend_error(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("import numpy as np\nraise ImportError('missing dep')\n")
    with pytest.raises(BackendError, match="import failed: ImportError: missing dep"):
        load(config(), tmp_path)
    (tmp_path / "model.py").write_text("def broken(:\n")
    with pytest.raises(BackendError, match="SyntaxError"):
        load(config(), tmp_path)
