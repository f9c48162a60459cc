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

import functools
import re
from array import array as c_array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Annotated, Any, TypeGuard

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
from lockgate.protocol.json_arrays import count_scalars, kind_of, opening_depth, strings_at_least
from lockgate.protocol.shared_memory import SharedMemory, SharedSlice, slice_of

MAX_ELEMENTS = 1 << 27  # per input tensor
MAX_RANK = 32
MAX_TENSORS = 1024  # inputs, and requested outputs, of one request: no model takes more
MAX_PARAMETERS = 1024  # request parameters, of one request
# A header this small holds too few tensors to cost much to decode; a longer one has its
# tensors counted first (`_Counted`).
COUNT_TENSORS_ABOVE = 64 * 1024

_INTEGERS = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})
_JSON_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
JSON_CHARS_PER_ELEMENT = 48  # "-1.2345678901234567e-308," and brackets, with room to spare
# flat JSON data up to this is decoded before it is counted: a decoder stops at the first
# element of another kind, so it builds at most about half this many elements
FLAT_JSON_BYTES = 64 * 1024


# --- public types -------------------------------------------------------------------------


@dataclass(slots=True)
class RequestedOutput:
    """An entry of the request's `outputs`. `binary_data` None: the request's default."""

    name: str
    binary_data: bool | None = None
    class_count: int = 0  # classification extension: > 0 returns the top classes as BYTES
    shared: SharedSlice | None = None  # written to this shared memory, not into the answer


@dataclass(slots=True)
class V2InferRequest:
    id: str
    inputs: dict[str, np.ndarray]
    input_datatypes: dict[str, str]
    parameters: dict[str, Any]  # request-level; `priority` and `timeout` (µs) live here
    outputs: list[RequestedOutput]  # empty: all outputs
    binary_default: bool  # the request parameter `binary_data_output`
    # what the decoder's `check` returned; its inputs have the shapes and datatypes it saw
    checked: object = None

    @property
    def priority(self) -> int:
        return int(self.parameters.get("priority", 0))

    @property
    def timeout_us(self) -> int | None:
        timeout = self.parameters.get("timeout")
        return None if timeout is None else int(timeout)


@dataclass(slots=True)
class DeclaredInput:
    """An input as its request declares it, before its data is decoded."""

    name: str
    datatype: str
    shape: tuple[int, ...]


# Called with every input as declared, before any data is decoded; raises to refuse. What it
# returns is kept on the decoded request (`V2InferRequest.checked`), for the caller.
InputCheck = Callable[[list[DeclaredInput]], object]


# --- wire schema (what msgspec checks for us) ---------------------------------------------

# A parameter's value is a string, a number or a boolean (KServe v2): nothing nested, which
# would cost many times its JSON in memory before any check could see it.
Parameters = dict[str, str | int | float | bool | None]


class _TensorIn(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: absent
    parameters: Parameters = {}


class _OutputIn(msgspec.Struct):
    name: str
    parameters: Parameters = {}


class _RequestIn(msgspec.Struct):
    inputs: list[_TensorIn]
    id: str = ""
    outputs: list[_OutputIn] = []
    parameters: Annotated[Parameters, msgspec.Meta(max_length=MAX_PARAMETERS)] = {}


@dataclass(slots=True)
class _Planned:
    """An input checked as declared, with its share of the binary tail; its data undecoded."""

    wire: _TensorIn
    declared: DeclaredInput
    count: int  # elements
    binary: slice | None  # its bytes in the binary tail; None: its data is JSON or shared
    shared: SharedSlice | None = None  # its bytes in a shared memory region


class _Named(msgspec.Struct):
    name: str | None = None


class _Names(msgspec.Struct):
    inputs: list[_Named] = []


class _Counted(msgspec.Struct):
    """A request's tensors kept as raw items: counted at the cost of a scan, before any is
    built. A body of half a million tiny inputs took seconds of the event loop to decode
    and plan; its items alone take a few dozen milliseconds."""

    inputs: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_TENSORS)] = []
    outputs: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_TENSORS)] = []


_REQUEST_DECODER = msgspec.json.Decoder(_RequestIn)
_COUNTED = msgspec.json.Decoder(_Counted)
_NAMES = msgspec.json.Decoder(_Names)  # to name the input of a schema error
_INPUT_PATH = re.compile(r"\$\.inputs\[(\d+)\]")


# --- request decoding ---------------------------------------------------------------------


def decode_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | str | None,
    *,
    max_elements: int = MAX_ELEMENTS,
    check: InputCheck | None = None,
    shared_memory: SharedMemory | None = None,
) -> V2InferRequest:
    """Decode a v2 inference request body.

    `header_length` is the `Inference-Header-Content-Length` value (None: the whole body is
    JSON). Each input's datatype, shape and binary size are checked first; then `check`
    sees every input as declared (the frontend holds them against the model's config); only
    then is any data decoded. Any malformed body raises BadRequest with a message that names
    the input. `shared_memory`: the registered regions inputs and outputs may name (None:
    shared memory is refused).
    """
    view = memoryview(body).cast("B")
    split = _header_split(len(view), header_length)
    parsed = _parse_header(view[:split])
    binary = view[split:]
    planned = _plan_inputs(parsed.inputs, len(binary), max_elements, shared_memory)
    check_request_parameters(parsed.parameters)
    outputs = _requested_outputs(parsed.outputs, shared_memory)
    checked = None if check is None else check([p.declared for p in planned])
    return V2InferRequest(
        id=parsed.id,
        inputs={p.declared.name: _decode(p, binary, shared_memory) for p in planned},
        input_datatypes={p.declared.name: p.declared.datatype for p in planned},
        parameters=parsed.parameters,
        outputs=outputs,
        binary_default=parsed.parameters.get("binary_data_output") is True,
        checked=checked,
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
        if len(header) > COUNT_TENSORS_ABOVE:
            _COUNTED.decode(header)
        return _REQUEST_DECODER.decode(header)
    except msgspec.ValidationError as error:
        raise BadRequest(_located(str(error), header)) from None
    except RecursionError:
        raise BadRequest("malformed JSON in inference request: nested too deeply") from None
    except _JSON_ERRORS as error:
        raise BadRequest(f"malformed JSON in inference request: {error}") from None


def _located(message: str, header: memoryview) -> str:
    """Prefix a schema error inside `inputs[i]` with the input's name, when it has one."""
    match = _INPUT_PATH.search(message)
    if match is None:
        return f"invalid inference request: {message}"
    index = int(match.group(1))
    try:  # the names alone: every other value is skipped, not built
        name = _NAMES.decode(header).inputs[index].name
    except (msgspec.ValidationError, *_JSON_ERRORS, IndexError):  # the name is what is broken
        name = None
    label = f"input '{name}'" if name is not None else f"input {index}"
    return f"{label}: {message}"


def _plan_inputs(
    tensors: list[_TensorIn],
    binary_length: int,
    max_elements: int,
    shared_memory: SharedMemory | None,
) -> list[_Planned]:
    """Every input checked as declared, and its share of the binary tail; no data decoded."""
    planned: list[_Planned] = []
    seen: set[str] = set()
    offset = 0
    for tensor in tensors:
        if tensor.name in seen:
            raise BadRequest(f"input '{tensor.name}' appears more than once")
        seen.add(tensor.name)
        plan = _plan(tensor, offset, binary_length - offset, max_elements, shared_memory)
        offset = plan.binary.stop if plan.binary is not None else offset
        planned.append(plan)
    if offset != binary_length:
        raise BadRequest(
            f"{binary_length - offset} bytes of binary data after the JSON header belong to "
            "no input"
        )
    return planned


def _plan(
    tensor: _TensorIn,
    offset: int,
    left: int,
    max_elements: int,
    shared_memory: SharedMemory | None,
) -> _Planned:
    name = tensor.name
    if not is_datatype(tensor.datatype):
        raise BadRequest(f"input '{name}': unknown datatype '{tensor.datatype}'")
    count = element_count(name, tensor.shape, max_elements)
    declared = DeclaredInput(name, tensor.datatype, tuple(tensor.shape))
    where = shared_slice("input", name, tensor.parameters, shared_memory)
    if where is not None:
        if tensor.data or "binary_data_size" in tensor.parameters:
            raise BadRequest(f"input '{name}': has both data and shared memory")
        data_size(declared, count, where.byte_size, where.byte_size, "shared_memory_byte_size")
        return _Planned(tensor, declared, count, None, where)
    size = tensor.parameters.get("binary_data_size")
    if size is None:
        if not tensor.data:
            raise BadRequest(f"input '{name}': no 'data' and no 'binary_data_size'")
        return _Planned(tensor, declared, count, None)
    if tensor.data:
        raise BadRequest(f"input '{name}': has both 'data' and 'binary_data_size'")
    size = data_size(declared, count, size, left)
    return _Planned(tensor, declared, count, slice(offset, offset + size))


def shared_slice(
    kind: str, name: str, parameters: Mapping[str, Any], shared_memory: SharedMemory | None
) -> SharedSlice | None:
    """The shared memory the parameters of `kind` (input or output) `name` name, inside a
    registered region (None: they name none, the common case, checked first); 400 when
    shared memory is off or the slice is not registered."""
    if "shared_memory_region" not in parameters:
        return None
    what = f"{kind} '{name}'"
    if shared_memory is None:
        raise BadRequest(f"{what}: shared memory is not supported here")
    where = slice_of(what, parameters)
    if where is not None:
        shared_memory.check(where)
    return where


def data_size(
    declared: DeclaredInput, count: int, size: object, left: int, field: str = "binary_data_size"
) -> int:
    """An input's `binary_data_size` (or `field`), checked against the bytes left and what
    the shape and datatype need."""
    name, datatype = declared.name, declared.datatype
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BadRequest(f"input '{name}': {field} must be a non-negative integer")
    if size > left:
        raise BadRequest(
            f"input '{name}': {field} {size} exceeds the {left} bytes of binary data left"
        )
    if datatype == "BYTES":  # every element takes at least its 4-byte length
        if count > size // 4:
            raise BadRequest(f"input '{name}': {size} bytes cannot hold {count} BYTES elements")
        return size
    need = count * numpy_dtype(datatype).itemsize
    if size != need:
        raise BadRequest(
            f"input '{name}': {field} {size} does not match shape "
            f"{dims_text(declared.shape)} of {datatype} ({need} bytes)"
        )
    return size


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


def _decode(plan: _Planned, binary: memoryview, shared_memory: SharedMemory | None) -> np.ndarray:
    if plan.shared is not None and shared_memory is not None:
        return _from_binary(plan, memoryview(shared_memory.read(plan.shared)))
    if plan.binary is None:
        return _from_json(plan)
    return _from_binary(plan, binary[plan.binary])


def _from_binary(plan: _Planned, chunk: memoryview) -> np.ndarray:
    # chunk: exactly the bytes the shape and datatype need (checked by data_size)
    name, datatype, shape = plan.declared.name, plan.declared.datatype, plan.declared.shape
    if datatype == "BYTES":
        return deserialize_bytes_tensor(chunk, plan.count, name=name).reshape(shape)
    if datatype == "BOOL":  # any non-zero byte is true
        return np.frombuffer(chunk, dtype=np.uint8).reshape(shape) != 0
    array = np.frombuffer(chunk, dtype=numpy_dtype(datatype)).reshape(shape)
    return array if array.flags.aligned else array.copy()


def _from_json(plan: _Planned) -> np.ndarray:
    """The array of a JSON `data` field, flat or nested no deeper than its shape. Its depth,
    leaves and lists are counted from the raw bytes first: data that cannot match the shape
    is refused before a Python list of it is built. Small flat data of numbers or booleans
    (the common case) is decoded at once, and counted only if that fails."""
    name, datatype, shape = plan.declared.name, plan.declared.datatype, plan.declared.shape
    data = bytes(plan.wire.data)
    if datatype != "BYTES":
        # a number takes at most JSON_CHARS_PER_ELEMENT characters with its separators
        limit = JSON_CHARS_PER_ELEMENT * plan.count + 64
        if len(data) > limit:
            raise BadRequest(
                f"input '{name}': data has {len(data)} characters, more than "
                f"{plan.count} elements of shape {dims_text(shape)} can take ({limit})"
            )
        if len(data) <= FLAT_JSON_BYTES:
            values = _flat_values(datatype, data)
            if values is not None and len(values) == plan.count:
                return to_array(name, datatype, values).reshape(shape)
    depth = opening_depth(data)
    if depth == 0:
        raise BadRequest(f"input '{name}': data must be an array, got {kind_of(data)}")
    if depth > max(1, len(shape)):
        raise BadRequest(
            f"input '{name}': data is nested {depth} deep, deeper than shape "
            f"{dims_text(shape)} (flat, or nested at most {max(1, len(shape))} deep)"
        )
    if datatype == "BYTES":
        _check_strings(plan, data)
    else:
        _check_scalars(plan, data)
    values = _json_values(name, datatype, data, depth)
    if len(values) != plan.count:
        raise BadRequest(_count_mismatch(plan, len(values)))
    return to_array(name, datatype, values).reshape(shape)


def _flat_values(datatype: str, data: bytes) -> list[Any] | None:
    """The elements of a flat array of the datatype's JSON kind, as the counted path would
    decode them, or None when `data` is anything else (nested, of another kind, malformed):
    the counted path then refuses it in its own words. Such data holds no list and no string,
    so it holds as many elements as the counted path finds, no more."""
    try:
        values: list[Any] = _decoder(json_element(datatype)[0], 1).decode(data)
    except (msgspec.ValidationError, *_JSON_ERRORS):
        return None
    return values


def _check_scalars(plan: _Planned, data: bytes) -> None:
    """Numbers or booleans: exactly as many leaves as the shape has elements, in no more
    lists than the shape nests; checked on the raw bytes."""
    name, datatype, shape = plan.declared.name, plan.declared.datatype, plan.declared.shape
    _, kind = json_element(datatype)
    for char, what in ((b"{", "objects"), (b'"', "strings")):
        if char in data:
            raise BadRequest(f"input '{name}': data for {datatype} must be {kind}, not {what}")
    counted = count_scalars(data)
    if counted.empty_inside:
        raise BadRequest(
            f"input '{name}': data has an empty array inside it "
            "(a tensor of no elements is sent as [])"
        )
    if counted.leaves != plan.count:
        raise BadRequest(_count_mismatch(plan, counted.leaves))
    most = nested_lists(shape)
    if counted.lists > most:
        raise BadRequest(
            f"input '{name}': data has {counted.lists} arrays, more than shape "
            f"{dims_text(shape)} nests ({most})"
        )


def _check_strings(plan: _Planned, data: bytes) -> None:
    """Strings: refused when they surely outnumber the shape's elements; otherwise a decoder
    builds at most about twice as many before it knows."""
    least = strings_at_least(data)
    if least > plan.count:
        raise BadRequest(_count_mismatch(plan, least, "at least "))


def _count_mismatch(plan: _Planned, found: int, qualifier: str = "") -> str:
    return (
        f"input '{plan.declared.name}': shape {dims_text(plan.declared.shape)} has "
        f"{plan.count} elements but data has {qualifier}{found}"
    )


def nested_lists(shape: Sequence[int]) -> int:
    """The arrays of data nested as `shape`: 1 + d0 + d0*d1 + ... (any flatter nesting has
    fewer)."""
    total = rows = 1
    for dim in shape[:-1]:
        rows *= dim
        total += rows
    return total


def to_array(name: str, datatype: str, values: list[Any]) -> np.ndarray:
    # values: flat, row-major, already checked to be of the datatype's JSON kind
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=np.object_)
        array[:] = [value.encode() for value in values]
        return array
    if datatype == "FP64":  # JSON numbers are doubles already: no overflow
        return np.asarray(values, dtype=np.float64)
    if datatype == "FP32":  # C's cast: out-of-range numbers become ±inf (no warning to silence)
        return np.frombuffer(c_array("f", values), dtype=np.float32)
    if datatype in _FLOATS:
        with np.errstate(over="ignore"):  # out-of-range numbers become ±inf, like a cast
            if datatype == "BF16":
                return bf16_bits_from_float32(np.asarray(values, dtype=np.float32))
            return np.asarray(values, dtype=numpy_dtype(datatype))
    try:
        return np.asarray(values, dtype=numpy_dtype(datatype))
    except OverflowError:
        raise BadRequest(f"input '{name}': a value is out of range for {datatype}") from None


def _json_values(name: str, datatype: str, data: bytes, depth: int) -> list[Any]:
    """The flat, type-checked element list of a JSON `data` array nested `depth` deep."""
    element, kind = json_element(datatype)
    try:
        values: list[Any] = _decoder(element, depth).decode(data)
    except msgspec.ValidationError as error:
        raise BadRequest(f"input '{name}': data for {datatype} must be {kind}: {error}") from None
    except _JSON_ERRORS as error:
        raise BadRequest(f"input '{name}': malformed data: {error}") from None
    for _ in range(depth - 1):
        values = list(chain.from_iterable(values))
    return values


@functools.cache
def _decoder(element: type, depth: int) -> msgspec.json.Decoder[Any]:
    """A decoder of arrays of `element` nested exactly `depth` deep; an inner array may not be
    empty, so a decoder never builds a run of empty lists."""
    kind: Any = element
    for _ in range(depth - 1):
        kind = Annotated[list[kind], msgspec.Meta(min_length=1)]  # type: ignore[valid-type]
    return msgspec.json.Decoder(list[kind])  # type: ignore[valid-type]


def json_element(datatype: str) -> tuple[type, str]:
    """The JSON element type of a datatype and how to say it in an error."""
    if datatype in _INTEGERS:
        return int, "integers"
    if datatype in _FLOATS:
        return float, "numbers"
    if datatype == "BOOL":
        return bool, "true or false"
    return str, "strings"


def _requested_outputs(
    entries: list[_OutputIn], shared_memory: SharedMemory | None
) -> list[RequestedOutput]:
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise BadRequest(f"output '{entry.name}' is requested more than once")
        seen.add(entry.name)
        outputs.append(_requested_output(entry, shared_memory))
    return outputs


def _requested_output(entry: _OutputIn, shared_memory: SharedMemory | None) -> RequestedOutput:
    params = entry.parameters
    where = shared_slice("output", entry.name, params, shared_memory)
    binary = params.get("binary_data")
    if binary is not None and not isinstance(binary, bool):
        raise BadRequest(f"output '{entry.name}': binary_data must be true or false")
    classes = params.get("classification", 0)
    if not _is_count(classes):
        raise BadRequest(f"output '{entry.name}': classification must be a non-negative integer")
    return RequestedOutput(entry.name, binary, classes, where)


def check_request_parameters(params: dict[str, Any]) -> None:
    for key in ("priority", "timeout"):
        if key in params and not _is_count(params[key]):
            raise BadRequest(f"request parameter '{key}' must be a non-negative integer")
    if not isinstance(params.get("binary_data_output", False), bool):
        raise BadRequest("request parameter 'binary_data_output' must be true or false")


def _is_count(value: object) -> TypeGuard[int]:
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
    batched: bool,
    parameters: dict[str, Any] | None = None,
    datatypes: dict[str, str] | None = None,
    shared_memory: SharedMemory | None = None,
    labels: Mapping[str, Sequence[str]] | None = None,
) -> tuple[bytes, int | None]:
    """Encode an inference response: the body and its JSON header length (None: all JSON).

    `requested` empty or None returns every output, in binary when `binary_default`.
    `batched`: the model batches (max_batch_size > 0), so an output's first dim is the batch.
    `datatypes` names the datatype of an output when its array does not say it (BF16 bits,
    or a cast to the configured type). An output asked into shared memory is written there
    (`shared_memory`), and its entry has no data. `labels`: an output's class names, for
    classification.
    """
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    any_binary = False
    for want in _selected(outputs, requested, binary_default):
        named = (labels or {}).get(want.name, ())
        array, datatype = _output_array(want, outputs[want.name], datatypes, batched, named)
        entry: dict[str, Any] = {"name": want.name, "datatype": datatype, "shape": array.shape}
        if want.shared is not None and shared_memory is not None:
            shared_write(shared_memory, want, array, datatype)  # no data, as Triton answers
        elif want.binary_data:
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
        chosen.append(RequestedOutput(want.name, flag, want.class_count, want.shared))
    return chosen


def shared_write(
    shared_memory: SharedMemory, want: RequestedOutput, array: np.ndarray, datatype: str
) -> dict[str, Any]:
    """An output's bytes written to the shared memory it asked for, and the parameters its
    answer carries in place of its data."""
    assert want.shared is not None
    raw = tensor_bytes(array, datatype)
    shared_memory.write(want.shared, raw, f"output '{want.name}'")
    return {"shared_memory_region": want.shared.region, "shared_memory_byte_size": len(raw)}


def _output_array(
    want: RequestedOutput,
    array: np.ndarray,
    datatypes: dict[str, str] | None,
    batched: bool,
    labels: Sequence[str] = (),
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
        return classify(array, want.class_count, batched, labels), "BYTES"
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


def classify(
    array: np.ndarray, class_count: int, batched: bool, labels: Sequence[str] = ()
) -> np.ndarray:
    """Triton's classification extension: the top classes as b"value:index", or
    b"value:index:label" for an index that `labels` (the output's label file) names.

    For a batching model (`batched`) the first dim is the batch: each of its rows is
    classified alone, into BYTES of shape [batch, k]. Otherwise the whole tensor is one row,
    classified into shape [k]. k = min(count, the elements of a row).
    """
    # rows: [batch, elements of one row] or [1, elements]
    batch = array.shape[0] if batched and array.ndim else 1
    rows = array.reshape(batch, array.size // batch if batch else 0)
    k = min(class_count, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=np.object_)
    for r, indices in enumerate(order.tolist()):
        for c, index in enumerate(indices):
            label = f":{labels[index]}" if index < len(labels) else ""
            out[r, c] = f"{float(rows[r, index]):f}:{index}{label}".encode()
    return out if batched and array.ndim else out.reshape(k)


def encode_error(message: str) -> bytes:
    """The v2 error body: {"error": message}."""
    return msgspec.json.encode({"error": message})
