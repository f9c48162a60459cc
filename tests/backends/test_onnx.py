from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockgate.backends.base import get_factory
from lockgate.backends.onnx import autocomplete, load, session_options
from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BackendError, BadRequest, ConfigError

WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3) / 10  # [4, 3]
BIAS = np.array([1.0, -1.0, 0.5], dtype=np.float32)  # [3]


def write_linear_onnx(path: Path, *, batch_dim: str | int = "batch") -> Path:
    """y = x @ W + b and its argmax: input x [batch, 4] FP32 -> y [batch, 3], label [batch]."""
    graph = helper.make_graph(
        nodes=[
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["label"], axis=1, keepdims=0),
        ],
        name="linear",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 4])],
        outputs=[
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 3]),
            helper.make_tensor_value_info("label", TensorProto.INT64, [batch_dim]),
        ],
        initializer=[numpy_helper.from_array(WEIGHTS, "W"), numpy_helper.from_array(BIAS, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def config(**changes: object) -> ModelConfig:
    base: dict[str, object] = {
        "name": "linear",
        "backend": "onnxruntime",
        "max_batch_size": 8,
        "source": "linear/config.yaml",
    }
    base.update(changes)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    write_linear_onnx(tmp_path / "1" / "model.onnx")
    return tmp_path / "1"


def test_infer_matches_numpy(version_dir: Path) -> None:
    backend = load(config(), version_dir)
    x = np.random.default_rng(0).random((5, 4), dtype=np.float32)
    out = backend.infer({"x": x})
    assert set(out) == {"y", "label"}  # no outputs declared: all of the graph's
    np.testing.assert_allclose(out["y"], x @ WEIGHTS + BIAS, rtol=1e-5)
    np.testing.assert_array_equal(out["label"], np.argmax(x @ WEIGHTS + BIAS, axis=1))
    backend.close()


def test_returns_only_declared_outputs(version_dir: Path) -> None:
    outputs = (TensorSpec("label", "INT64", ()),)
    backend = get_factory("onnxruntime")(config(outputs=outputs), version_dir)
    out = backend.infer({"x": np.zeros((2, 4), np.float32), "unused": np.zeros(1)})
    assert list(out) == ["label"]


def test_unknown_declared_output_is_a_config_error(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match="'z' is not in the ONNX graph"):
        load(config(outputs=(TensorSpec("z", "FP32", (3,)),)), version_dir)


def test_missing_input_and_bad_dtype(version_dir: Path) -> None:
    backend = load(config(), version_dir)
    with pytest.raises(BadRequest, match="missing input 'x'"):
        backend.infer({})
    with pytest.raises(BackendError, match="onnxruntime"):
        backend.infer({"x": np.zeros((2, 4), np.float64)})


def test_thread_parameters() -> None:
    options = session_options(config(parameters={"intra_op_threads": "2"}))
    assert options.intra_op_num_threads == 2 and options.inter_op_num_threads == 1
    with pytest.raises(ConfigError) as info:
        session_options(config(parameters={"inter_op_threads": "many"}))
    assert info.value.field == "parameters.inter_op_threads"


def test_corrupt_model_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(ConfigError, match="onnxruntime cannot load"):
        load(config(), tmp_path)


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds no model\.onnx"):
        load(config(), tmp_path)


def test_autocomplete_strips_batch_dim(version_dir: Path) -> None:
    completed = autocomplete(config(), version_dir)
    assert completed.inputs == (TensorSpec("x", "FP32", (4,)),)
    assert completed.outputs == (TensorSpec("y", "FP32", (3,)), TensorSpec("label", "INT64", ()))


def test_autocomplete_without_batching_keeps_all_dims(version_dir: Path) -> None:
    completed = autocomplete(config(max_batch_size=0), version_dir)
    assert completed.inputs == (TensorSpec("x", "FP32", (-1, 4)),)


def test_autocomplete_keeps_declared_io(version_dir: Path) -> None:
    inputs = (TensorSpec("x", "FP32", (4,)),)
    completed = autocomplete(config(inputs=inputs), version_dir)
    assert completed.inputs is inputs
    assert [spec.name for spec in completed.outputs] == ["y", "label"]


def test_autocomplete_refuses_fixed_batch_dim(tmp_path: Path) -> None:
    write_linear_onnx(tmp_path / "model.onnx", batch_dim=2)
    with pytest.raises(ConfigError) as info:
        autocomplete(config(), tmp_path)
    assert info.value.field == "max_batch_size"
