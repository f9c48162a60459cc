"""The model a KServe v2 gRPC `ModelInferRequest` names (`model_name`, field 1), read off the
request's bytes without decoding the message: what the gRPC front's hedging keys its delay by.

The scan walks the message's top-level fields, skipping each by its wire type, and stops at
field 1; a serializer writes it first, so that is the first field seen. Its tensors are never
read nor copied."""

from __future__ import annotations

MODEL_NAME = 1  # the field number of ModelInferRequest.model_name
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def model_of(message: bytes) -> str | None:
    """The model the request names; None when it names none or its bytes are not a message."""
    at, end = 0, len(message)
    try:
        while at < end:
            key, at = _varint(message, at)
            field, wire = key >> 3, key & 7
            if wire == _VARINT:
                _, at = _varint(message, at)
            elif wire == _FIXED64:
                at += 8
            elif wire == _FIXED32:
                at += 4
            elif wire == _LENGTH:
                size, at = _varint(message, at)
                if field == MODEL_NAME:
                    if at + size > end:
                        return None
                    return message[at : at + size].decode() or None
                at += size
            else:
                return None  # groups (long deprecated) or no message at all
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and where the next field starts; IndexError past the end."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")
