from __future__ import annotations

import numpy as np
import pytest

from lockgate.config import ModelConfig, TensorSpec
from lockgate.core.validate import (
    expected_shape,
    validate_inputs,
    validate_outputs,
    validate_shapes,
)
from lockgate.errors import BadRequest


def config(max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        name="m",
        backend="onnx",
        max_batch_size=max_batch_size,
        inputs=(
            TensorSpec("x", "FP32", (-1, 64)),
            TensorSpec("ids", "INT64", (3,)),
            TensorSpec("note", "BYTES", (), optional=True),
        ),
        outputs=(TensorSpec("y", "FP32", (10,)),),
    )


def arrays(rows: int = 2, width: int = 64) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    inputs: dict[str, np.ndarray] = {
        "x": np.zeros((rows, 5, width), np.float32),
        "ids": np.zeros((rows, 3), np.int64),
    }
    return inputs, {"x": "FP32", "ids": "INT64"}


def test_batched_inputs_return_rows() -> None:
    inputs, datatypes = arrays(rows=3)
    assert validate_inputs(config(), inputs, datatypes) == 3


def test_optional_input_may_be_given() -> None:
    inputs, datatypes = arrays(rows=2)
    inputs["note"] = np.array([b"a", b"b"], dtype=object)
    datatypes["note"] = "BYTES"
    assert validate_inputs(config(), inputs, datatypes) == 2


def test_unbatched_model_is_one_row() -> None:
    inputs: dict[str, np.ndarray] = {
        "x": np.zeros((7, 64), np.float32),
        "ids": np.zeros(3, np.int64),
    }
    assert validate_inputs(config(0), inputs, {"x": "FP32", "ids": "INT64"}) == 1


def test_expected_shape() -> None:
    spec = config().inputs[0]
    assert expected_shape(config(), spec) == (-1, -1, 64)
    assert expected_shape(config(0), spec) == (-1, 64)


def test_unknown_input() -> None:
    inputs, datatypes = arrays()
    inputs["z"] = np.zeros((2,), np.float32)
    datatypes["z"] = "FP32"
    with pytest.raises(BadRequest, match="unexpected inference input 'z' for model 'm'"):
        validate_inputs(config(), inputs, datatypes)


def test_missing_required_input() -> None:
    inputs, datatypes = arrays()
    del inputs["ids"]
    with pytest.raises(BadRequest, match=r"missing required input\(s\) \['ids'\]; got \['x'\]"):
        validate_inputs(config(), inputs, datatypes)


def test_datatype_mismatch() -> None:
    inputs, datatypes = arrays()
    datatypes["ids"] = "INT32"
    with pytest.raises(
        BadRequest, match="input 'ids': model 'm' expects datatype INT64, got INT32"
    ):
        validate_inputs(config(), inputs, datatypes)


def test_fixed_dim_mismatch_message() -> None:
    inputs, datatypes = arrays(width=63)
    with pytest.raises(BadRequest, match=r"input 'x': expected shape \[-1,-1,64\], got \[2,5,63\]"):
        validate_inputs(config(), inputs, datatypes)


def test_wrong_rank() -> None:
    inputs, datatypes = arrays()
    inputs["ids"] = np.zeros((2, 3, 1), np.int64)
    with pytest.raises(BadRequest, match=r"input 'ids': expected shape \[-1,3\], got \[2,3,1\]"):
        validate_inputs(config(), inputs, datatypes)


def test_unbatched_rank_counts_no_batch_dim() -> None:
    inputs: dict[str, np.ndarray] = {
        "x": np.zeros((1, 7, 64), np.float32),
        "ids": np.zeros(3, np.int64),
    }
    with pytest.raises(BadRequest, match=r"expected shape \[-1,64\], got \[1,7,64\]"):
        validate_inputs(config(0), inputs, {"x": "FP32", "ids": "INT64"})


def test_batch_larger_than_max() -> None:
    inputs, datatypes = arrays(rows=9)
    with pytest.raises(BadRequest, match=r"batch size 9 is outside 1\.\.8"):
        validate_inputs(config(), inputs, datatypes)


def test_empty_batch() -> None:
    inputs, datatypes = arrays(rows=0)
    with pytest.raises(BadRequest, match="batch size 0"):
        validate_inputs(config(), inputs, datatypes)


def test_inconsistent_batch_dims() -> None:
    inputs, datatypes = arrays(rows=2)
    inputs["ids"] = np.zeros((3, 3), np.int64)
    with pytest.raises(BadRequest, match="input 'ids': batch size 3 differs from input 'x'"):
        validate_inputs(config(), inputs, datatypes)


def test_validate_outputs() -> None:
    validate_outputs(config(), ["y"])
    validate_outputs(config(), [])
    with pytest.raises(BadRequest, match="unexpected inference output 'q' for model 'm'"):
        validate_outputs(config(), ["y", "q"])


def test_validate_shapes_checks_a_declaration_as_validate_inputs_checks_arrays() -> None:
    """The same checks on declared shapes, before any array exists."""
    inputs, datatypes = arrays(rows=3)
    shapes = {name: array.shape for name, array in inputs.items()}
    assert validate_shapes(config(), shapes, datatypes) == validate_inputs(
        config(), inputs, datatypes
    )
    with pytest.raises(BadRequest, match="input 'x': expected shape \\[-1,-1,64\\], got \\[3,5\\]"):
        validate_shapes(config(), {**shapes, "x": (3, 5)}, datatypes)
    with pytest.raises(BadRequest, match="missing required input"):
        validate_shapes(config(), {"x": (3, 5, 64)}, datatypes)
