"""The predict protocol of KServe's v1 and TensorFlow Serving's REST API: bytes <-> arrays.

    POST /v1/models/{m}[/versions/{v}]:predict
    {"instances": [row, row, ...]}          ->  {"predictions": [row, row, ...]}
    {"inputs": column or {name: column}}    ->  {"outputs": column or {name: column}}

- **Row format** (`instances`): one item per row of the batch. With one input, a row is that
  input's value; with several, a row is an object of input values by name. Answers come the
  same way: `predictions` holds one item per row, the output's value, or an object of output
  values by name when the model has several outputs.
- **Columnar format** (`inputs`): the whole batch of one input, or an object of them by name;
  answered with `outputs` in the same form.
- A model that takes no batch dimension (`max_batch_size: 0`) gets the instances or inputs as
  its tensor, whole.
- Values are numbers, booleans or strings (a BYTES tensor: its UTF-8 text, or `{"b64": ...}`
  for other bytes, as TensorFlow Serving writes them); an answer's BYTES element is text when
  it is UTF-8, else `{"b64": ...}`.
- Errors are `{"error": "message"}`, as both servers write them.

A model's status, `GET /v1/models/{m}[/versions/{v}]`, is answered in both servers' forms at
once (`model_status`): KServe v1's `{"name", "ready"}` and TensorFlow Serving's
`model_version_status`, one entry per version with its state (START, LOADING, AVAILABLE,
UNLOADING, END) and, for one that failed, the reason (for a model whose config or folder
failed, with no version, the reason is `reason`).

Sizes are bounded before anything is built: at most `MAX_ELEMENTS` values in a request, counted
from the raw bytes (each value but the last of a list is followed by a comma), and arrays no
deeper than the model's tensors nest.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from lockgate.config import ModelConfig, TensorSpec
from lockgate.datatypes import Arrays, numpy_dtype
from lockgate.errors import BadRequest

MAX_ELEMENTS = 1 << 22  # values in one request, counted from its raw bytes
MAX_DEPTH = 64  # nesting of a request's arrays and objects


class PredictIn(msgspec.Struct, forbid_unknown_fields=True):
    """A predict request's body: `instances` (rows) or `inputs` (columns)."""

    instances: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: not given
    inputs: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    signature_name: str | None = None


_REQUEST = msgspec.json.Decoder(PredictIn)
_ANY = msgspec.json.Decoder()


@dataclass(slots=True)
class PredictRequest:
    """A decoded predict request: its tensors, and which form the answer takes."""

    inputs: Arrays
    datatypes: dict[str, str]
    columnar: bool  # sent as `inputs`: answered as `outputs`


def decode_predict(body: bytes, config: ModelConfig) -> PredictRequest:
    """The tensors of a predict request for the model of `config`; BadRequest (400) naming
    what is wrong, before any tensor is built when the sizes cannot be right."""
    try:
        parsed = _REQUEST.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid predict request: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if bool(parsed.instances) == bool(parsed.inputs):
        raise BadRequest('a predict request has either "instances" (rows) or "inputs" (columns)')
    if parsed.signature_name not in (None, "serving_default"):
        raise BadRequest(f"model '{config.name}' has one signature, 'serving_default'")
    columnar = bool(parsed.inputs)
    raw = bytes(parsed.inputs if columnar else parsed.instances)
    values = _bounded(raw)
    specs = [spec for spec in config.inputs if not spec.optional] or list(config.inputs)
    if not specs:
        raise BadRequest(f"model '{config.name}' declares no inputs")
    if columnar:
        named = len(specs) > 1 or _is_named(values)
        by_name = _named(values, specs, "inputs") if named else {specs[0].name: values}
    elif len(specs) == 1 and not (isinstance(values, list) and values and _is_named(values[0])):
        by_name = {specs[0].name: values}
    else:
        by_name = _columns(values, specs, config.batching)
    inputs: Arrays = {}
    for spec in config.inputs:
        if spec.name in by_name:
            inputs[spec.name] = _array(spec, by_name[spec.name])
    unknown = sorted(set(by_name) - {spec.name for spec in config.inputs})
    if unknown:
        raise BadRequest(f"model '{config.name}' has no input {unknown[0]!r}")
    return PredictRequest(inputs, {s.name: s.datatype for s in config.inputs}, columnar)


def encode_predict(outputs: Arrays, config: ModelConfig, columnar: bool) -> bytes:
    """`{"predictions": rows}` or `{"outputs": columns}`, in the model's output order."""
    order = [s.name for s in config.outputs if s.name in outputs]
    order += [name for name in outputs if name not in order]
    columns = {name: _listed(outputs[name]) for name in order}
    if columnar:
        doc: Any = columns[order[0]] if len(order) == 1 else columns
        return msgspec.json.encode({"outputs": doc})
    if len(order) == 1:
        rows: Any = columns[order[0]] if config.batching else [columns[order[0]]]
    elif config.batching:
        count = len(next(iter(columns.values())))
        rows = [{name: columns[name][i] for name in order} for i in range(count)]
    else:
        rows = [columns]
    return msgspec.json.encode({"predictions": rows})


@dataclass(frozen=True, slots=True)
class VersionStatus:
    """One version of a model as the repository holds it (states as the v2 index spells
    them: LOADING, READY, UNLOADING, UNAVAILABLE)."""

    version: int
    state: str
    error: str = ""


# the v2 index's states in TensorFlow Serving's words
_TF_STATES = {"LOADING": "LOADING", "READY": "AVAILABLE", "UNLOADING": "UNLOADING"}


def model_status(
    name: str, versions: Sequence[VersionStatus], ready: bool, reason: str = ""
) -> dict[str, Any]:
    """KServe v1's and TensorFlow Serving's answer to a model status request, together: the
    two share the path, and each client reads only its own keys. `reason`: why a model with
    no version loaded has none (its config or folder failed)."""
    status: dict[str, Any] = {
        "name": name,
        "ready": ready,
        "model_version_status": [
            {
                "version": str(v.version),
                "state": _TF_STATES.get(v.state, "END"),
                "status": {
                    "error_code": "UNKNOWN" if v.error else "OK",
                    "error_message": v.error,
                },
            }
            for v in versions
        ],
    }
    if reason:
        status["reason"] = reason
    return status


def _bounded(raw: bytes) -> Any:
    values = raw.count(b",") + 1
    if values > MAX_ELEMENTS:
        raise BadRequest(f"the request holds more than {MAX_ELEMENTS} values")
    try:
        return _ANY.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def _is_named(value: Any) -> bool:
    """An object of values by input name; not a BYTES value written `{"b64": ...}`."""
    return isinstance(value, dict) and set(value) != {"b64"}


def _named(values: Any, specs: Sequence[TensorSpec], field: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        names = ", ".join(s.name for s in specs)
        raise BadRequest(f'"{field}" must be an object by input name for a model of inputs {names}')
    return values


def _columns(values: Any, specs: Sequence[TensorSpec], batching: bool) -> dict[str, Any]:
    """Rows of objects by input name, as columns: each input's values in row order."""
    if not isinstance(values, list) or not values:
        raise BadRequest('"instances" must be a list of at least one row')
    if not batching:
        if len(values) != 1:
            raise BadRequest(
                "the model takes no batch dimension: send one instance, an object of inputs"
            )
        return _named(values[0], specs, "instances[0]")
    columns: dict[str, list[Any]] = {}
    for index, row in enumerate(values):
        if not isinstance(row, dict):
            raise BadRequest(f"instances[{index}] must be an object of input values by name")
        if index and row.keys() != columns.keys():
            raise BadRequest(f"instances[{index}] names other inputs than instances[0]")
        for name, value in row.items():
            columns.setdefault(name, []).append(value)
    return columns


def _array(spec: TensorSpec, value: Any) -> np.ndarray:
    """One input's values as an array of its datatype."""
    if spec.datatype == "BYTES":
        return _bytes_array(spec.name, value)
    if _depth(value) > MAX_DEPTH:
        raise BadRequest(f"input '{spec.name}': arrays nested too deeply")
    try:
        array = np.asarray(value, dtype=numpy_dtype(spec.datatype))
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(
            f"input '{spec.name}': not a rectangular array of {spec.datatype} values ({exc})"
        ) from None
    return array


def _bytes_array(name: str, value: Any) -> np.ndarray:
    def element(item: Any) -> bytes:
        if isinstance(item, str):
            return item.encode()
        if isinstance(item, dict) and set(item) == {"b64"} and isinstance(item["b64"], str):
            try:
                return base64.b64decode(item["b64"], validate=True)
            except binascii.Error:
                raise BadRequest(f"input '{name}': b64 is not base64") from None
        raise BadRequest(f"input '{name}': BYTES values are strings or {{\"b64\": ...}}")

    def build(item: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise BadRequest(f"input '{name}': arrays nested too deeply")
        return [build(i, depth + 1) for i in item] if isinstance(item, list) else element(item)

    built = build(value, 0)
    array = np.empty(_shape(built), dtype=object)
    flat = list(_leaves(built))
    if len(flat) != array.size:
        raise BadRequest(f"input '{name}': not a rectangular array")
    array.reshape(-1)[:] = flat
    return array


def _shape(value: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return tuple(shape)


def _leaves(value: Any) -> Any:
    if isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list) and value:
        depth, value = depth + 1, value[0]
    return depth


def _listed(array: np.ndarray) -> Any:
    if array.dtype == object or array.dtype.kind in "SU":
        return _text(np.asarray(array, dtype=object)).tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        if array.ndim == 0:
            return _finite(float(array))
        if array.ndim == 1:
            return [_finite(v) for v in array.tolist()]
        return [_listed(row) for row in array]
    return array.tolist()


def _finite(value: float) -> float | str:
    """JSON has no NaN or infinity: written as TensorFlow Serving writes them."""
    if math.isnan(value):
        return "NaN"
    return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")


def _text(array: np.ndarray) -> np.ndarray:
    def one(item: Any) -> Any:
        if isinstance(item, bytes):
            try:
                return item.decode()
            except UnicodeDecodeError:
                return {"b64": base64.b64encode(item).decode()}
        return item

    return np.vectorize(one, otypes=[object])(array) if array.size else array
