"""Named arrays to bytes and back, for the Redis tier: msgpack of dtype, shape and raw bytes."""

from __future__ import annotations

import msgspec
import numpy as np

from lockgate.datatypes import Arrays


class _Tensor(msgspec.Struct, array_like=True):
    dtype: str  # numpy's dtype.str, or "object" for BYTES
    shape: list[int]
    data: bytes = b""  # raw bytes of a numeric array
    items: list[bytes] = []  # elements of a BYTES array


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, _Tensor])


def encode(outputs: Arrays) -> bytes:
    tensors: dict[str, _Tensor] = {}
    for name, array in outputs.items():
        shape = list(array.shape)
        if array.dtype == object:
            items = [x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)]
            tensors[name] = _Tensor("object", shape, items=items)
        else:
            tensors[name] = _Tensor(array.dtype.str, shape, np.ascontiguousarray(array).tobytes())
    return _encoder.encode(tensors)


def decode(blob: bytes) -> Arrays:
    """The arrays `encode` wrote; msgspec.DecodeError or ValueError when `blob` is not one."""
    outputs: Arrays = {}
    for name, t in _decoder.decode(blob).items():
        if t.dtype == "object":
            array = np.empty(len(t.items), dtype=object)
            array[:] = t.items
            outputs[name] = array.reshape(t.shape)
        else:
            outputs[name] = np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape)
    return outputs


def nbytes(outputs: Arrays) -> int:
    """Memory the arrays hold, counting the bytes of BYTES elements."""
    total = 0
    for array in outputs.values():
        if array.dtype == object:
            total += sum(len(x) if isinstance(x, bytes) else 64 for x in array.reshape(-1))
            total += 8 * array.size
        else:
            total += array.nbytes
    return total + 64 * len(outputs)
