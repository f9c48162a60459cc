"""KServe v2 / Open Inference Protocol over gRPC: protobuf messages to typed objects and back.

Pure functions, no I/O; the gRPC twin of `lockgate.protocol.v2_codec`. An input's data travels
either in `raw_input_contents` (one entry per input, in order: little-endian row-major
bytes, BYTES elements each a 4-byte little-endian length and then the bytes, as Triton
sends them) or in the typed fields of its `contents`. Outputs always travel raw, in
`raw_output_contents`, which is what Triton's clients read by default.

Decoded raw tensors of numeric datatypes are read-only zero-copy views of the message's
bytes (copied only when unaligned). BOOL and BYTES tensors are always fresh arrays.

The metadata, configuration and statistics messages are filled from the same documents
(`lockgate.protocol.v2_metadata`) that REST encodes as JSON: both protocols answer from one
source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from lockgate.datatypes import (
    datatype_of,
    deserialize_bytes_tensor,
    float32_from_bf16_bits,
    is_datatype,
    numpy_dtype,
)
from lockgate.errors import BadRequest, ServingError
from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.log_settings import LogSettings
from lockgate.protocol.shared_memory import SharedMemory, SharedSlice
from lockgate.protocol.v2_codec import (
    MAX_ELEMENTS,
    MAX_PARAMETERS,
    MAX_TENSORS,
    DeclaredInput,
    InputCheck,
    RequestedOutput,
    V2InferRequest,
    classify,
    data_size,
    dims_text,
    element_count,
    shared_slice,
    shared_write,
    tensor_bytes,
)

# datatype -> the InferTensorContents field that holds it. FP16 and BF16 have none: raw only.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_NARROW = frozenset({"INT8", "INT16", "UINT8", "UINT16"})  # carried in 32-bit fields

InputTensor = pb.ModelInferRequest.InferInputTensor
_SHM_SIZE = "shared_memory_byte_size"
M = TypeVar("M", bound=Message)


# --- request decoding ---------------------------------------------------------------------


def decode_infer_request(
    request: pb.ModelInferRequest,
    *,
    max_elements: int = MAX_ELEMENTS,
    check: InputCheck | None = None,
    shared_memory: SharedMemory | None = None,
) -> V2InferRequest:
    """The typed form of a ModelInferRequest. Any malformed part raises BadRequest. `check`
    sees every input as declared before any data is decoded (as in `v2_codec`). An input in
    shared memory (`shared_memory`'s regions) has no raw_input_contents entry: the entries
    are the other inputs', in order."""
    _check_counts(request)
    raw = request.raw_input_contents
    declared: dict[str, DeclaredInput] = {}
    shared: dict[str, SharedSlice] = {}
    for tensor in request.inputs:
        name = tensor.name
        if name in declared:
            raise BadRequest(f"input '{name}' appears more than once")
        declared[name] = _declared(tensor, max_elements)
        where = None
        if "shared_memory_region" in tensor.parameters:  # converted only then: the hot path
            params = parameters_of(tensor.parameters)
            where = shared_slice("input", name, params, shared_memory)
        if where is not None:
            if tensor.HasField("contents"):
                raise BadRequest(f"input '{name}': has both contents and shared memory")
            count = element_count(name, tensor.shape, max_elements)
            data_size(declared[name], count, where.byte_size, where.byte_size, _SHM_SIZE)
            shared[name] = where
    plain = [t.name for t in request.inputs if t.name not in shared]
    if raw and len(raw) != len(plain):
        raise BadRequest(
            f"raw_input_contents has {len(raw)} entries for {len(plain)} inputs not in shared "
            "memory: send the data of every such input raw, or of none"
        )
    parameters = parameters_of(request.parameters)
    _check_request_parameters(parameters)
    outputs = _requested_outputs(request.outputs, shared_memory)
    checked = None if check is None else check(list(declared.values()))
    raw_of = dict(zip(plain, raw, strict=True)) if raw else {}
    inputs = {}
    for tensor in request.inputs:
        where = shared.get(tensor.name)
        if where is not None and shared_memory is not None:
            d = declared[tensor.name]
            count = element_count(d.name, d.shape, max_elements)
            data = shared_memory.read(where)
            inputs[d.name] = _from_raw(d.name, d.datatype, d.shape, count, data)
        else:
            inputs[tensor.name] = decode_tensor(tensor, raw_of.get(tensor.name), max_elements)
    return V2InferRequest(
        id=request.id,
        inputs=inputs,
        input_datatypes={name: d.datatype for name, d in declared.items()},
        parameters=parameters,
        outputs=outputs,
        binary_default=True,
        checked=checked,
    )


def _check_counts(request: pb.ModelInferRequest) -> None:
    """The message's repeated fields, counted before any item is read: half a million inputs
    or parameters held the event loop for seconds."""
    for what, count, most in (
        ("inputs", len(request.inputs), MAX_TENSORS),
        ("outputs", len(request.outputs), MAX_TENSORS),
        ("parameters", len(request.parameters), MAX_PARAMETERS),
    ):
        if count > most:
            raise BadRequest(f"the request has {count} {what}, more than the {most} it may hold")


def _declared(tensor: InputTensor, max_elements: int) -> DeclaredInput:
    """An input as declared: its datatype known, its shape of a bounded element count."""
    name, datatype = tensor.name, tensor.datatype
    if not is_datatype(datatype):
        raise BadRequest(f"input '{name}': unknown datatype '{datatype}'")
    element_count(name, tensor.shape, max_elements)
    return DeclaredInput(name, datatype, tuple(tensor.shape))


def decode_tensor(tensor: InputTensor, raw: bytes | None, max_elements: int) -> np.ndarray:
    """One input's array, from its raw bytes when given, else from its typed contents."""
    declared = _declared(tensor, max_elements)
    name, datatype, shape = declared.name, declared.datatype, declared.shape
    count = element_count(name, shape, max_elements)
    if raw is not None:
        if tensor.HasField("contents"):
            raise BadRequest(f"input '{name}': has both contents and raw_input_contents")
        return _from_raw(name, datatype, shape, count, raw)
    return _from_contents(tensor, shape, count)


def _from_raw(
    name: str, datatype: str, shape: tuple[int, ...], count: int, raw: bytes
) -> np.ndarray:
    if datatype == "BYTES":
        return deserialize_bytes_tensor(raw, count, name=name).reshape(shape)
    dtype = numpy_dtype(datatype)
    if len(raw) != count * dtype.itemsize:
        raise BadRequest(
            f"input '{name}': raw_input_contents holds {len(raw)} bytes, but shape "
            f"{dims_text(shape)} of {datatype} needs {count * dtype.itemsize}"
        )
    if datatype == "BOOL":  # any non-zero byte is true
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape) != 0
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return array if array.flags.aligned else array.copy()


def _from_contents(tensor: InputTensor, shape: tuple[int, ...], count: int) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise BadRequest(f"input '{name}': {datatype} data must be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadRequest(
            f"input '{name}': shape {dims_text(shape)} has {count} elements "
            f"but {field} has {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    return _numeric(name, datatype, values).reshape(shape)


def _numeric(name: str, datatype: str, values: Sequence[Any]) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    if datatype not in _NARROW:
        return np.asarray(values, dtype=dtype)
    wide = np.asarray(values, dtype=np.int64)  # int32 or uint32 values, checked before narrowing
    info = np.iinfo(dtype)
    if wide.size and (wide.min() < info.min or wide.max() > info.max):
        raise BadRequest(f"input '{name}': a value is out of range for {datatype}")
    return wide.astype(dtype)


def parameters_of(parameters: Any) -> dict[str, Any]:
    """A map<string, InferParameter> as a plain dict of bool, int, str or float."""
    out: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        out[key] = getattr(parameter, choice) if choice is not None else None
    return out


def _check_request_parameters(parameters: dict[str, Any]) -> None:
    for key in ("priority", "timeout"):
        value = parameters.get(key)
        if key in parameters and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise BadRequest(f"request parameter '{key}' must be a non-negative integer")


def _requested_outputs(
    entries: Sequence[Any], shared_memory: SharedMemory | None
) -> list[RequestedOutput]:
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise BadRequest(f"output '{entry.name}' is requested more than once")
        seen.add(entry.name)
        params = parameters_of(entry.parameters)
        where = shared_slice("output", entry.name, params, shared_memory)
        classes = params.get("classification", 0)
        if not isinstance(classes, int) or isinstance(classes, bool) or classes < 0:
            raise BadRequest(
                f"output '{entry.name}': classification must be a non-negative integer"
            )
        outputs.append(RequestedOutput(entry.name, True, classes, where))
    return outputs


# --- response encoding --------------------------------------------------------------------


def encode_infer_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: dict[str, np.ndarray],
    requested: Sequence[RequestedOutput],
    datatypes: dict[str, str],
    batched: bool,
    parameters: dict[str, str | bool] | None = None,
    shared_memory: SharedMemory | None = None,
    labels: Mapping[str, Sequence[str]] | None = None,
) -> pb.ModelInferResponse:
    """A ModelInferResponse with every output (or the requested ones) in raw_output_contents.

    `datatypes` names an output's datatype when its array does not say it (BF16 bits, or a
    cast to the configured type). `batched`: the model batches, so an output's first dim is
    the batch (a classification has one row per batch row). `labels`: an output's class
    names, for classification.
    """
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=request_id
    )
    for want in requested or [RequestedOutput(name) for name in outputs]:
        if want.name not in outputs:
            raise BadRequest(f"unexpected inference output '{want.name}'")
        named = (labels or {}).get(want.name, ())
        array, datatype = _output_array(want, outputs[want.name], datatypes, batched, named)
        entry = response.outputs.add(name=want.name, datatype=datatype, shape=array.shape)
        if want.shared is not None and shared_memory is not None:
            written = shared_write(shared_memory, want, array, datatype)
            entry.parameters["shared_memory_region"].string_param = want.shared.region
            size = written["shared_memory_byte_size"]
            entry.parameters["shared_memory_byte_size"].int64_param = size
            response.raw_output_contents.append(b"")  # keeps the others' entries in place
        else:
            response.raw_output_contents.append(tensor_bytes(array, datatype))
    for key, value in (parameters or {}).items():
        if isinstance(value, bool):
            response.parameters[key].bool_param = value
        else:
            response.parameters[key].string_param = value
    return response


def _output_array(
    want: RequestedOutput,
    array: np.ndarray,
    datatypes: dict[str, str],
    batched: bool,
    labels: Sequence[str] = (),
) -> tuple[np.ndarray, str]:
    array = np.asarray(array)
    datatype = datatypes.get(want.name) or datatype_of(array)
    if want.class_count > 0:
        if datatype == "BF16":
            array = float32_from_bf16_bits(array)
        return classify(array, want.class_count, batched, labels), "BYTES"
    return array, datatype


# --- metadata, configuration, statistics --------------------------------------------------


def from_document(document: dict[str, Any], message: M) -> M:
    """Fill `message` from a v2 metadata document (Triton's JSON mapping, as plain data).

    Fields the gRPC subset does not carry are skipped.
    """
    try:
        json_format.ParseDict(document, message, ignore_unknown_fields=True)
    except json_format.ParseError as error:
        raise ServingError(f"cannot encode {type(message).__name__}: {error}") from None
    return message


# -- Triton's trace and logging extensions ---------------------------------------------------


def log_change(request: pb.LogSettingsRequest) -> dict[str, bool | int | str | None]:
    """The settings a LogSettings request changes, as plain values (a value with no choice
    set: None, which leaves the setting as it is)."""
    found: dict[str, bool | int | str | None] = {}
    for name, value in request.settings.items():
        choice = value.WhichOneof("parameter_choice")
        found[name] = getattr(value, choice) if choice is not None else None
    return found


def encode_log_settings(settings: LogSettings) -> pb.LogSettingsResponse:
    response = pb.LogSettingsResponse()
    for name, value in settings.document().items():
        entry = response.settings[name]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = value
    return response


def trace_change(request: pb.TraceSettingRequest) -> dict[str, list[str] | None]:
    """The settings a TraceSetting request changes, each a list of strings (empty: clear)."""
    return {name: list(value.value) for name, value in request.settings.items()}


def encode_trace_settings(document: dict[str, list[str]]) -> pb.TraceSettingResponse:
    response = pb.TraceSettingResponse()
    for name, values in document.items():
        response.settings[name].value.extend(values)
    return response
