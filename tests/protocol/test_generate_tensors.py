"""The generate extension on a model of named tensors (`protocol/generate_tensors.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BadRequest
from lockgate.protocol.generate_tensors import decode, encode, shape_of

CONFIG = ModelConfig(
    name="m",
    backend="python",
    max_batch_size=4,
    inputs=(
        TensorSpec("text_input", "BYTES", (1,)),
        TensorSpec("ids", "INT64", (-1,)),
        TensorSpec("pair", "FP32", (2, -1)),
        TensorSpec("flag", "BOOL", (1,), optional=True),
    ),
)


@pytest.mark.parametrize(
    ("count", "dims", "shape"),
    [
        (1, (1,), (1,)),
        (3, (-1,), (3,)),
        (1, (-1, 1), (1, 1)),  # the batch dim of a batching model
        (5, (-1, -1), (1, 5)),  # the innermost variable dim takes the rest
        (6, (-1, 2, -1), (1, 2, 3)),
        (0, (-1,), (0,)),
        (1, (), ()),
    ],
)
def test_shape_as_triton_spreads_the_values(
    count: int, dims: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    assert shape_of("x", count, dims) == shape


@pytest.mark.parametrize(("count", "dims"), [(3, (2,)), (2, (1,)), (0, (2,)), (2, ())])
def test_values_that_cannot_take_the_shape_are_refused(count: int, dims: tuple[int, ...]) -> None:
    with pytest.raises(BadRequest, match="cannot take its shape"):
        shape_of("x", count, dims)


def test_fields_named_as_inputs_are_inputs_and_the_others_parameters() -> None:
    body = (
        b'{"id": "r1", "text_input": "hi", "ids": [1, 2, 3], "temperature": 0.5,'
        b' "parameters": {"pair": [1, 2.5], "stream": true, "stop": "x", "id": 7}}'
    )
    decoded = decode(body, CONFIG)
    assert decoded.id == "r1"
    assert decoded.inputs["text_input"].tolist() == [[b"hi"]]
    assert decoded.inputs["ids"].dtype == np.int64 and decoded.inputs["ids"].shape == (1, 3)
    assert decoded.inputs["pair"].tolist() == [[[1.0], [2.5]]]
    assert decoded.input_datatypes == {"text_input": "BYTES", "ids": "INT64", "pair": "FP32"}
    assert decoded.parameters == {"temperature": 0.5, "stream": True, "stop": "x", "id": 7}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"flag": 1}', "BOOL takes true or false"),
        (b'{"ids": [1.5]}', "INT64 takes integers"),
        (b'{"ids": [true]}', "INT64 takes integers"),
        (b'{"ids": [1], "parameters": {"ids": [2]}}', "input 'ids' is given twice"),
        (b'{"p": 1, "parameters": {"p": 2}}', "parameter 'p' is given twice"),
        (b'{"p": null}', "parameter 'p' must be a string, a number or a boolean"),
        (b'{"id": 3}', "id must be a string"),
        (b'{"priority": -1}', "'priority' must be a non-negative integer"),
        (b'{"parameters": {"parameters": {}}}', "parameter 'parameters' must be"),
    ],
)
def test_mistakes_are_400_naming_the_field(body: bytes, says: str) -> None:
    with pytest.raises(BadRequest, match=says.replace("(", r"\(")):
        decode(body, CONFIG)


def test_an_output_of_one_element_is_its_value_and_any_other_a_flat_list() -> None:
    outputs = {
        "text_output": np.array([[b"caf\xc3\xa9"]], dtype=object),
        "ids": np.array([[1, 2], [3, 4]], dtype=np.int64),
        "model_name": np.array([1]),  # a reserved name keeps its meaning
    }
    answer = encode("m", "1", "", outputs, {"text_output": "BYTES"})
    assert answer == {
        "model_name": "m",
        "model_version": "1",
        "text_output": "café",
        "ids": [1, 2, 3, 4],
    }
    assert encode("m", "1", "r1", {}, {})["id"] == "r1"
