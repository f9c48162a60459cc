"""Triton's generate extension on a model of named tensors (any model but a language model):
the fields of a JSON body become the model's inputs and the request's parameters, and the
outputs of each response the fields of a JSON object.

    {"text_input": "hi", "count": 3, "parameters": {"scale": 2}}
        -> input text_input BYTES ["hi"], input count INT32 [3], request parameter scale 2
    {"model_name": "m", "model_version": "1", "text_output": "hi", "index": [0, 1]}
        <- outputs text_output ["hi"] and index [0, 1]

As Triton maps them:
- a field named as one of the model's inputs is that input: a value, or a flat list of
  values, of its datatype (strings for BYTES). Its shape is the one its config declares
  (with the batch dim of a batching model): the fixed dims take what they hold, the innermost
  variable dim the rest, any other variable dim 1;
- any other field is a request parameter: a string, a number or a boolean;
- the fields of `parameters` are read the same way (an input may stand there too);
- `id` is the request's id;
- an output of one element is its value, any other a flat list.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from lockgate.config import ModelConfig, TensorSpec
from lockgate.datatypes import Arrays, datatype_of
from lockgate.errors import BadRequest
from lockgate.protocol.v2_codec import (
    MAX_PARAMETERS,
    V2InferRequest,
    check_request_parameters,
    dims_text,
    json_data,
    json_element,
    to_array,
)

PARAMETERS = "parameters"  # the field whose fields are read as the body's own
ID = "id"
_JSON_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # values kept raw until placed


class _Fields:
    """What the fields of a body map to, as they are read."""

    __slots__ = ("config", "datatypes", "inputs", "parameters")

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.inputs: dict[str, np.ndarray] = {}
        self.datatypes: dict[str, str] = {}
        self.parameters: dict[str, Any] = {}

    def read(self, fields: Mapping[str, msgspec.Raw], nested: bool) -> None:
        for name, raw in fields.items():
            spec = self.config.input(name)
            if spec is not None:
                if name in self.inputs:
                    raise BadRequest(
                        f"input '{name}' is given twice (at the top and in parameters)"
                    )
                self.inputs[name] = tensor(spec, raw, self.config.batching)
                self.datatypes[name] = spec.datatype
            elif name == PARAMETERS and not nested:
                if bytes(raw).lstrip()[:1] != b"{":
                    raise BadRequest("parameters must be an object of name/value pairs")
                self.read(_decode(raw, _FIELDS, PARAMETERS), nested=True)
            elif name != ID or nested:
                if name in self.parameters:
                    raise BadRequest(
                        f"parameter '{name}' is given twice (at the top and in parameters)"
                    )
                self.parameters[name] = parameter(name, raw)
        if len(self.parameters) > MAX_PARAMETERS:
            raise BadRequest(f"a request takes at most {MAX_PARAMETERS} parameters")


def decode(body: bytes, config: ModelConfig) -> V2InferRequest:
    """The v2 request a generate body amounts to on the model `config` describes; BadRequest
    (400) naming what is wrong. Whether every input the model needs is there, and at the
    right batch size, is checked later, as for any v2 request."""
    if body.lstrip()[:1] != b"{":
        raise BadRequest("the body must be a JSON object of fields")
    fields = _decode(body, _FIELDS, "the body")
    request_id = msgspec.json.decode(fields.pop(ID, b'""'))
    if not isinstance(request_id, str):
        raise BadRequest("id must be a string")
    read = _Fields(config)
    read.read(fields, nested=False)
    check_request_parameters(read.parameters)
    return V2InferRequest(request_id, read.inputs, read.datatypes, read.parameters, [], False)


def tensor(spec: TensorSpec, raw: msgspec.Raw | bytes, batching: bool) -> np.ndarray:
    """An input's array from its field: a value or a flat list of values of its datatype."""
    element, kind = json_element(spec.datatype)
    try:
        value = _values(element).decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(
            f"input '{spec.name}': {spec.datatype} takes {kind}, a value or a flat list of "
            f"them: {exc}"
        ) from None
    except _JSON_ERRORS as exc:
        raise BadRequest(f"input '{spec.name}': malformed JSON: {exc}") from None
    values = value if isinstance(value, list) else [value]
    dims = (-1, *spec.dims) if batching else spec.dims
    return to_array(spec.name, spec.datatype, values).reshape(
        shape_of(spec.name, len(values), dims)
    )


@functools.cache
def _values(element: type) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(element | list[element])  # type: ignore[valid-type]


def _decode(raw: msgspec.Raw | bytes, decoder: msgspec.json.Decoder[Any], what: str) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{what} must be a JSON object of fields: {exc}") from None
    except _JSON_ERRORS as exc:
        raise BadRequest(f"malformed JSON in {what}: {exc}") from None


def shape_of(name: str, count: int, dims: Sequence[int]) -> tuple[int, ...]:
    """Triton's shape of `count` values for an input of `dims` (-1: variable): the fixed dims
    take their share, the innermost variable dim the rest, the other variable dims 1."""
    rest = count
    for dim in dims:
        if dim != -1:
            if dim == 0 or rest % dim:
                raise BadRequest(_unshaped(name, count, dims))
            rest //= dim
    shape = list(dims)
    for index in reversed(range(len(shape))):
        if shape[index] == -1:
            shape[index], rest = rest, 1
    if rest != 1:
        raise BadRequest(_unshaped(name, count, dims))
    return tuple(shape)


def _unshaped(name: str, count: int, dims: Sequence[int]) -> str:
    return f"input '{name}': {count} value(s) cannot take its shape {dims_text(dims)}"


def parameter(name: str, raw: msgspec.Raw | bytes) -> str | int | float | bool:
    """A request parameter's value: a string, a number or a boolean."""
    data = bytes(raw)
    value = None if data.lstrip()[:1] in (b"[", b"{") else _decode(data, _ANY, f"'{name[:80]}'")
    if isinstance(value, str | int | float):  # bool is an int
        return value
    raise BadRequest(
        f"parameter '{name[:80]}' must be a string, a number or a boolean "
        "(or name one of the model's inputs)"
    )


_ANY = msgspec.json.Decoder()


def encode(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: Arrays,
    datatypes: Mapping[str, str],
) -> dict[str, Any]:
    """One response as Triton's generate answers it: its id (if any), the model, and each
    output as a field, its one value or its values as a flat list."""
    answer: dict[str, Any] = {}
    if request_id:
        answer[ID] = request_id
    answer["model_name"] = model_name
    answer["model_version"] = model_version
    for name, array in outputs.items():
        array = np.asarray(array)
        values = json_data(array, datatypes.get(name) or datatype_of(array))
        answer.setdefault(name, values[0] if array.size == 1 else values)
    return answer
