"""KServe v2 datatypes and their numpy forms, and the binary form of BYTES tensors.

Every fixed-size datatype maps to one little-endian numpy dtype. Two need a word:

- BYTES is a numpy object array whose elements are `bytes`.
- BF16 has no numpy dtype. lockgate carries it as `uint16` holding the raw bfloat16 bits
  (the upper half of the float32 bits) and keeps the datatype name beside the array.
  `bf16_bits_from_float32` and `float32_from_bf16_bits` convert both ways.
"""

from __future__ import annotations

import struct

import numpy as np

from lockgate.errors import BadRequest, ServingError

Arrays = dict[str, np.ndarray]
"""Named tensors: what a request carries, a batch holds and a backend computes."""

_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),  # raw bfloat16 bits
    "BYTES": np.dtype(np.object_),
}

# (numpy kind, itemsize) -> datatype, for arrays whose datatype is not given.
# uint16 reads as UINT16: BF16 arrays need their datatype carried beside them.
_BY_NUMPY: dict[tuple[str, int], str] = {
    (dtype.kind, dtype.itemsize): name
    for name, dtype in _NUMPY.items()
    if name not in ("BF16", "BYTES")
}

_LENGTH = struct.Struct("<I")


def is_datatype(datatype: str) -> bool:
    return datatype in _NUMPY


def config_datatype(datatype: str) -> str:
    """A v2 datatype in model_config.proto's spelling: FP32 -> TYPE_FP32, BYTES -> TYPE_STRING."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def normalize_datatype(value: str) -> str | None:
    """`FP32`, `fp32` and Triton's `TYPE_FP32` are FP32; `TYPE_STRING` is BYTES; None for a
    name that is no datatype."""
    name = value.strip().upper().removeprefix("TYPE_")
    if name == "STRING":
        name = "BYTES"
    return name if name in _NUMPY else None


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype that holds `datatype` (object for BYTES, uint16 bits for BF16)."""
    dtype = _NUMPY.get(datatype)
    if dtype is None:
        raise BadRequest(f"unknown datatype '{datatype}'")
    return dtype


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype. BYTES has no fixed size."""
    if datatype == "BYTES":
        raise BadRequest("datatype BYTES has no fixed element size")
    return numpy_dtype(datatype).itemsize


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype of an array. Object, bytes_ and str_ arrays are BYTES."""
    kind = array.dtype.kind
    if kind in "OSU":
        return "BYTES"
    name = _BY_NUMPY.get((kind, array.dtype.itemsize))
    if name is None:
        raise ServingError(f"numpy dtype {array.dtype} has no KServe v2 datatype")
    return name


def bf16_bits_from_float32(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even); returns uint16 bits."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(values)
    if nan.any():  # keep NaN a (quiet) NaN; rounding could carry it into infinity
        rounded = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def float32_from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32, exactly."""
    widened = np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    return widened.view(np.float32)


def _element_bytes(item: object) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    return str(item).encode()


def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """Row-major elements, each a 4-byte little-endian length and then its bytes."""
    parts: list[bytes] = []
    for item in array.ravel(order="C").tolist():
        data = _element_bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(
    buffer: bytes | bytearray | memoryview, count: int, *, name: str = ""
) -> np.ndarray:
    """Parse exactly `count` length-prefixed elements that fill `buffer` exactly.

    Returns a 1-D object array of `bytes`. A truncated element, a length that runs past the
    buffer, or bytes left over raise BadRequest naming the tensor.
    """
    view = memoryview(buffer).cast("B")
    total = len(view)
    if count > total // 4:  # every element takes at least its 4-byte length
        raise BadRequest(f"input '{name}': {total} bytes cannot hold {count} BYTES elements")
    out = np.empty(count, dtype=np.object_)
    offset = 0
    for index in range(count):
        if offset + 4 > total:
            raise BadRequest(f"input '{name}': BYTES element {index} has a truncated length")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if length > total - offset:
            raise BadRequest(
                f"input '{name}': BYTES element {index} claims {length} bytes "
                f"but only {total - offset} remain"
            )
        out[index] = bytes(view[offset : offset + length])
        offset += length
    if offset != total:
        raise BadRequest(
            f"input '{name}': {total - offset} bytes left over after {count} BYTES elements"
        )
    return out
