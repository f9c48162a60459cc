"""KServe v2 / Open Inference Protocol over REST: bytes in, typed objects out, and back.

Pure functions, no I/O. An inference body is a JSON header, optionally followed by binary
tensor data (Triton's binary tensor extension): the `Inference-Header-Content-Length`
HTTP header gives the JSON's length, and each tensor with `parameters.binary_data_size`
owns that many bytes of the tail, in order. BYTES elements travel as a 4-byte
little-endian length and then the bytes; BF16 as uint16 bits (see `datatypes`).

Decoded binary tensors of numeric datatypes are zero-copy views into the body (copied only
when unaligned): read-only when the body is `bytes`, writable when it is a `bytearray`.
BOOL and BYTES tensors are always fresh arrays.

JSON outputs of datatype BYTES are sent as text: elements that are not valid UTF-8 are
decoded with replacement characters. Ask for `binary_data` to get the exact bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from lockgate.datatypes import (
    bf16_bits_from_float32,
    datatype_of,
    deserialize_bytes_tensor,
    float32_from_bf16_bits,
    is_datatype,
    numpy_dtype,
    serialize_bytes_tensor,
)
from lockgate.errors import BadRequest, ServingError

MAX_ELEMENTS = 1 << 27  # per input tensor
MAX_RANK = 32

_INTEGERS = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})
_JSON_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
JSON_CHARS_PER_ELEMENT = 48  # "-1.2345678901234567e-308," and brackets, with room to spare


# --- public types -------------------------------------------------------------------------


@dataclass(slots=True)
class RequestedOutput:
    """An entry of the request's `outputs`. `binary_data` None: the request's default."""

    name: str
    binary_data: bool | None = None
    class_count: int = 0  # classification extension: > 0 returns the top classes as BYTES


@dataclass(slots=True)
class V2InferRequest:
    id: str
    inputs: dict[str, np.ndarray]
    input_datatypes: dict[str, str]
    parameters: dict[str, Any]  # request-level; `priority` and `timeout` (µs) live here
    outputs: list[RequestedOutput]  # empty: all outputs
    binary_default: bool  # the request parameter `binary_data_output`

    @property
    def priority(self) -> int:
        return int(self.parameters.get("priority", 0))

    @property
    def timeout_us(self) -> int | None:
        timeout = self.parameters.get("timeout")
        return None if timeout is None else int(timeout)


# --- wire schema (what msgspec checks for us) ---------------------------------------------


class _TensorIn(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: absent
    parameters: dict[str, Any] = {}


class _OutputIn(msgspec.Struct):
    name: str
    parameters: dict[str, Any] = {}


class _RequestIn(msgspec.Struct):
    inputs: list[_TensorIn]
    id: str = ""
    outputs: list[_OutputIn] = []
    parameters: dict[str, Any] = {}


_REQUEST_DECODER = msgspec.json.Decoder(_RequestIn)
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    element: msgspec.json.Decoder(list[element])  # type: ignore[valid-type]
    for element in (int, float, bool, str)
}
_INPUT_PATH = re.compile(r"\$\.inputs\[(\d+)\]")


# --- request decoding ---------------------------------------------------------------------


def decode_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | str | None,
    *,
    max_elements: int = MAX_ELEMENTS,
) -> V2InferRequest:
    """Decode a v2 inference request body.

    `header_length` is the `Inference-Header-Content-Length` value (None: the whole body is
    JSON). Any malformed body raises BadRequest with a message that names the input.
    """
    view = memoryview(body).cast("B")
    split = _header_split(len(view), header_length)
    parsed = _parse_header(view[:split])
    inputs, datatypes = _decode_inputs(parsed.inputs, view[split:], max_elements)
    _check_request_parameters(parsed.parameters)
    return V2InferRequest(
        id=parsed.id,
        inputs=inputs,
        input_datatypes=datatypes,
        parameters=parsed.parameters,
        outputs=_requested_outputs(parsed.outputs),
        binary_default=parsed.parameters.get("binary_data_output", False),
    )


def _header_split(body_length: int, header_length: int | str | None) -> int:
    if header_length is None:
        return body_length
    if isinstance(header_length, str):
        text = header_length.strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise BadRequest(
                "Inference-Header-Content-Length must be an integer of at most 18 digits, "
                f"got '{header_length[:40]}'"
            )
        header_length = int(text)
    if isinstance(header_length, bool) or not isinstance(header_length, int):
        raise BadRequest("Inference-Header-Content-Length must be an integer")
    if not 0 <= header_length <= body_length:
        raise BadRequest(
            f"Inference-Header-Content-Length {header_length} is outside the body "
            f"of {body_length} bytes"
        )
    return header_length


def _parse_header(header: memoryview) -> _RequestIn:
    try:
        return _REQUEST_DECODER.decode(header)
    except msgspec.ValidationError as error:
        raise BadRequest(_located(str(error), header)) from None
    except _JSON_ERRORS as error:
        raise BadRequest(f"malformed JSON in inference request: {error}") from None


def _located(message: str, header: memoryview) -> str:
    """Prefix a schema error inside `inputs[i]` with the input's name, when it has one."""
    match = _INPUT_PATH.search(message)
    if match is None:
        return f"invalid inference request: {message}"
    index = int(match.group(1))
    try:
        name = msgspec.json.decode(header)["inputs"][index]["name"]
    except Exception:  # the name itself is what is broken
        name = None
    label = f"input '{name}'" if isinstance(name, str) else f"input {index}"
    return f"{label}: {message}"


def _decode_inputs(
    tensors: list[_TensorIn], binary: memoryview, max_elements: int
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for tensor in tensors:
        if tensor.name in inputs:
            raise BadRequest(f"input '{tensor.name}' appears more than once")
        inputs[tensor.name], offset = _decode_tensor(tensor, binary, offset, max_elements)
        datatypes[tensor.name] = tensor.datatype
    if offset != len(binary):
        raise BadRequest(
            f"{len(binary) - offset} bytes of binary data after the JSON header belong to no input"
        )
    return inputs, datatypes


def _decode_tensor(
    tensor: _TensorIn, binary: memoryview, offset: int, max_elements: int
) -> tuple[np.ndarray, int]:
    """One input: its array and the binary offset after it."""
    name = tensor.name
    if not is_datatype(tensor.datatype):
        raise BadRequest(f"input '{name}': unknown datatype '{tensor.datatype}'")
    count = element_count(name, tensor.shape, max_elements)
    if "shared_memory_region" in tensor.parameters:
        raise BadRequest(f"input '{name}': shared memory is not supported")
    size = tensor.parameters.get("binary_data_size")
    if size is None:
        if not tensor.data:
            raise BadRequest(f"input '{name}': no 'data' and no 'binary_data_size'")
        return _from_json(tensor, count), offset
    if tensor.data:
        raise BadRequest(f"input '{name}': has both 'data' and 'binary_data_size'")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BadRequest(f"input '{name}': binary_data_size must be a non-negative integer")
    if size > len(binary) - offset:
        raise BadRequest(
            f"input '{name}': binary_data_size {size} exceeds the "
            f"{len(binary) - offset} bytes of binary data left"
        )
    return _from_binary(tensor, binary[offset : offset + size], count), offset + size


def element_count(name: str, shape: Sequence[int], max_elements: int) -> int:
    """The number of elements `shape` claims, checked before anything is allocated."""
    if len(shape) > MAX_RANK:
        raise BadRequest(f"input '{name}': shape has {len(shape)} dims, at most {MAX_RANK}")
    count = 1
    for dim in shape:
        if dim < 0 or dim > max_elements:
            raise BadRequest(f"input '{name}': invalid dim {dim} in shape {dims_text(shape)}")
        count *= dim
    if count > max_elements:
        raise BadRequest(
            f"input '{name}': shape {dims_text(shape)} has {count} elements, "
            f"more than the limit of {max_elements}"
        )
    return count


def _from_binary(tensor: _TensorIn, chunk: memoryview, count: int) -> np.ndarray:
    shape = tuple(tensor.shape)
    if tensor.datatype == "BYTES":
        return deserialize_bytes_tensor(chunk, count, name=tensor.name).reshape(shape)
    dtype = numpy_dtype(tensor.datatype)
    if len(chunk) != count * dtype.itemsize:
        raise BadRequest(
            f"input '{tensor.name}': binary_data_size {len(chunk)} does not match shape "
            f"{dims_text(tensor.shape)} of {tensor.datatype} ({count * dtype.itemsize} bytes)"
        )
    if tensor.datatype == "BOOL":  # any non-zero byte is true
        return np.frombuffer(chunk, dtype=np.uint8).reshape(shape) != 0
    array = np.frombuffer(chunk, dtype=dtype).reshape(shape)
    return array if array.flags.aligned else array.copy()


def _from_json(tensor: _TensorIn, count: int) -> np.ndarray:
    # Before any Python list is built: a number takes at most JSON_CHARS_PER_ELEMENT
    # characters with its separators and brackets, so longer data holds more than the
    # declared shape, or nesting that would cost many times the body in memory.
    limit = JSON_CHARS_PER_ELEMENT * count + 64
    if tensor.datatype != "BYTES" and len(tensor.data) > limit:
        raise BadRequest(
            f"input '{tensor.name}': data has {len(tensor.data)} characters, more than "
            f"{count} elements of shape {dims_text(tensor.shape)} can take ({limit})"
        )
    values = _json_values(tensor.name, tensor.datatype, tensor.data)
    if len(values) != count:
        raise BadRequest(
            f"input '{tensor.name}': shape {dims_text(tensor.shape)} has {count} elements "
            f"but data has {len(values)}"
        )
    return _to_array(tensor.name, tensor.datatype, values).reshape(tuple(tensor.shape))


def _to_array(name: str, datatype: str, values: list[Any]) -> np.ndarray:
    # values: flat, row-major, already checked to be of the datatype's JSON kind
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=np.object_)
        array[:] = [value.encode() for value in values]
        return array
    if datatype == "FP64":  # JSON numbers are doubles already: no overflow
        return np.asarray(values, dtype=np.float64)
    if datatype in _FLOATS:
        with np.errstate(over="ignore"):  # out-of-range numbers become ±inf, like a cast
            if datatype == "BF16":
                return bf16_bits_from_float32(np.asarray(values, dtype=np.float32))
            return np.asarray(values, dtype=numpy_dtype(datatype))
    try:
        return np.asarray(values, dtype=numpy_dtype(datatype))
    except OverflowError:
        raise BadRequest(f"input '{name}': a value is out of range for {datatype}") from None


def _json_values(name: str, datatype: str, raw: msgspec.Raw) -> list[Any]:
    """The flat, type-checked element list of a JSON `data` field, flat or nested."""
    element, kind = _json_element(datatype)
    try:
        return _DECODERS[element].decode(raw)  # flat: the common case, one C call
    except msgspec.ValidationError:
        pass
    except _JSON_ERRORS as error:
        raise BadRequest(f"input '{name}': malformed data: {error}") from None
    try:
        nested = msgspec.json.decode(raw)  # valid JSON: the typed decode disliked a type
    except _JSON_ERRORS as error:
        raise BadRequest(f"input '{name}': malformed data: {error}") from None
    if not isinstance(nested, list):
        raise BadRequest(f"input '{name}': data must be an array, got {type(nested).__name__}")
    try:
        return msgspec.convert(_flatten(nested), list[element])  # type: ignore[valid-type]
    except msgspec.ValidationError as error:
        raise BadRequest(f"input '{name}': data for {datatype} must be {kind}: {error}") from None


def _json_element(datatype: str) -> tuple[type, str]:
    """The JSON element type of a datatype and how to say it in an error."""
    if datatype in _INTEGERS:
        return int, "integers"
    if datatype in _FLOATS:
        return float, "numbers"
    if datatype == "BOOL":
        return bool, "true or false"
    return str, "strings"


def _flatten(values: list[Any]) -> list[Any]:
    """Row-major leaves of nested lists, without recursion (nesting may be deep)."""
    out: list[Any] = []
    stack = [iter(values)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def _requested_outputs(entries: list[_OutputIn]) -> list[RequestedOutput]:
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise BadRequest(f"output '{entry.name}' is requested more than once")
        seen.add(entry.name)
        outputs.append(_requested_output(entry))
    return outputs


def _requested_output(entry: _OutputIn) -> RequestedOutput:
    params = entry.parameters
    if "shared_memory_region" in params:
        raise BadRequest(f"output '{entry.name}': shared memory is not supported")
    binary = params.get("binary_data")
    if binary is not None and not isinstance(binary, bool):
        raise BadRequest(f"output '{entry.name}': binary_data must be true or false")
    classes = params.get("classification", 0)
    if not _is_count(classes):
        raise BadRequest(f"output '{entry.name}': classification must be a non-negative integer")
    return RequestedOutput(entry.name, binary, classes)


def _check_request_parameters(params: dict[str, Any]) -> None:
    for key in ("priority", "timeout"):
        if key in params and not _is_count(params[key]):
            raise BadRequest(f"request parameter '{key}' must be a non-negative integer")
    if not isinstance(params.get("binary_data_output", False), bool):
        raise BadRequest("request parameter 'binary_data_output' must be true or false")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dims_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(dim) for dim in shape) + "]"


# --- response encoding --------------------------------------------------------------------


def encode_infer_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: dict[str, np.ndarray],
    requested: list[RequestedOutput] | None,
    binary_default: bool,
    parameters: dict[str, Any] | None = None,
    datatypes: dict[str, str] | None = None,
) -> tuple[bytes, int | None]:
    """Encode an inference response: the body and its JSON header length (None: all JSON).

    `requested` empty or None returns every output, in binary when `binary_default`.
    `datatypes` names the datatype of an output when its array does not say it (BF16 bits,
    or a cast to the configured type).
    """
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    any_binary = False
    for want in _selected(outputs, requested, binary_default):
        array, datatype = _output_array(want, outputs[want.name], datatypes)
        entry: dict[str, Any] = {"name": want.name, "datatype": datatype, "shape": array.shape}
        if want.binary_data:
            raw = tensor_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
            any_binary = True
        else:
            entry["data"] = json_data(array, datatype)
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id:
        response["id"] = request_id
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = entries
    header = msgspec.json.encode(response)
    if not any_binary:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _selected(
    outputs: dict[str, np.ndarray], requested: list[RequestedOutput] | None, binary: bool
) -> list[RequestedOutput]:
    if not requested:
        return [RequestedOutput(name, binary) for name in outputs]
    chosen: list[RequestedOutput] = []
    for want in requested:
        if want.name not in outputs:
            raise BadRequest(f"unexpected inference output '{want.name}'")
        flag = binary if want.binary_data is None else want.binary_data
        chosen.append(RequestedOutput(want.name, flag, want.class_count))
    return chosen


def _output_array(
    want: RequestedOutput, array: np.ndarray, datatypes: dict[str, str] | None
) -> tuple[np.ndarray, str]:
    array = np.asarray(array)
    datatype = (datatypes or {}).get(want.name) or datatype_of(array)
    if want.class_count > 0:
        if datatype == "BF16":
            array = float32_from_bf16_bits(array)
        elif datatype in ("BYTES", "BOOL") or array.dtype.kind not in "iuf":
            raise BadRequest(
                f"output '{want.name}': classification needs a numeric output, not {datatype}"
            )
        return classify(array, want.class_count), "BYTES"
    return array, datatype


def tensor_bytes(array: np.ndarray, datatype: str) -> bytes:
    """The binary wire form of a tensor: row-major little-endian, BYTES length-prefixed."""
    if datatype == "BYTES":
        return serialize_bytes_tensor(array)
    return _cast(array, datatype).tobytes(order="C")


def json_data(array: np.ndarray, datatype: str) -> list[Any]:
    """The flat, row-major JSON `data` list of a tensor."""
    if datatype == "BYTES":
        return [_text(item) for item in array.ravel().tolist()]
    if datatype == "BF16":
        return float32_from_bf16_bits(_cast(array, datatype)).ravel().tolist()
    return _cast(array, datatype).ravel().tolist()


def _cast(array: np.ndarray, datatype: str) -> np.ndarray:
    """`array` in the datatype's little-endian numpy form (BF16: rounded to uint16 bits)."""
    try:
        if datatype == "BF16" and array.dtype.kind == "f":
            return bf16_bits_from_float32(array.astype(np.float32))
        dtype = numpy_dtype(datatype)
        if array.dtype == dtype:
            return array
        with np.errstate(all="ignore"):
            return array.astype(dtype)
    except (TypeError, ValueError, BadRequest) as error:
        raise ServingError(f"cannot encode a {array.dtype} array as {datatype}: {error}") from None


def _text(item: object) -> str:
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    return item if isinstance(item, str) else str(item)


def classify(array: np.ndarray, class_count: int) -> np.ndarray:
    """Triton's classification extension: the top classes of each row as b"value:index".

    An array of rank 2 or more has rows along its first dim; a lower rank is one row.
    Returns a BYTES array of shape [rows, k] (or [k] for one row), k = min(count, classes).
    """
    rows = array.reshape(array.shape[0], -1) if array.ndim >= 2 else array.reshape(1, -1)
    k = min(class_count, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=np.object_)
    for r, indices in enumerate(order.tolist()):
        for c, index in enumerate(indices):
            out[r, c] = f"{float(rows[r, index]):f}:{index}".encode()
    return out if array.ndim >= 2 else out.reshape(k)


def encode_error(message: str) -> bytes:
    """The v2 error body: {"error": message}."""
    return msgspec.json.encode({"error": message})
