"""What the router reads off a KServe v2 gRPC `ModelInferRequest`'s bytes without decoding the
message: the model it names (`model_name`, field 1), which the gRPC front's hedging keys its
delay by, and its sequence parameters (in `parameters`, field 4), which sequence affinity
routes by (`sequence_affinity.py`).

The scan walks the message's top-level fields, skipping each by its wire type. A serializer
writes fields in the order of their numbers, so the model comes first and the parameters
before the tensors (fields 5 to 7), which are never read nor copied: the scan stops at the
first field past the one it looks for. Only the entries of the parameters map are decoded,
and only when one of them names `sequence_id`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.router.sequence_affinity import SequenceRequest

MODEL_NAME = 1  # the field number of ModelInferRequest.model_name
PARAMETERS = 4  # ModelInferRequest.parameters: one length-delimited field per map entry
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_MARK = b"sequence_id"


@dataclass(frozen=True, slots=True)
class _Field:
    """One top-level field of a message: its number and wire type, where its tag begins,
    where its value begins (a length-delimited field's bytes) and where it ends."""

    number: int
    wire: int
    begin: int
    value: int
    end: int


def _fields(message: bytes) -> Iterator[_Field]:
    """The message's top-level fields in order, each skipped by its wire type. IndexError past
    the end; ValueError for a wire type no serializer writes (groups, long deprecated)."""
    at = 0
    while at < len(message):
        begin = at
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, after = _varint(message, at)
        elif wire == _FIXED64:
            after = at + 8
        elif wire == _FIXED32:
            after = at + 4
        elif wire == _LENGTH:
            size, at = _varint(message, at)
            after = at + size
        else:
            raise ValueError(f"wire type {wire}")
        yield _Field(number, wire, begin, at, after)
        at = after


def model_of(message: bytes) -> str | None:
    """The model the request names; None when it names none or its bytes are not a message."""
    try:
        for field in _fields(message):
            if field.number == MODEL_NAME and field.wire == _LENGTH:
                if field.end > len(message):
                    return None
                return message[field.value : field.end].decode() or None
    except (IndexError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return None


def sequence_of(message: bytes) -> SequenceRequest | None:
    """The sequence the request's parameters name; None when they name none (or its bytes are
    not a message: the replica answers)."""
    entries: list[bytes] = []  # the parameters map's entries, each with its tag and length
    try:
        for field in _fields(message):
            if field.number > PARAMETERS:
                break
            if field.number == PARAMETERS and field.wire == _LENGTH:
                entries.append(message[field.begin : field.end])
    except (IndexError, ValueError):
        return None
    if not any(_MARK in entry for entry in entries):
        return None
    try:
        parameters = pb.ModelInferRequest.FromString(b"".join(entries)).parameters
    except DecodeError:
        return None
    plain = {
        name: getattr(value, choice)
        for name, value in parameters.items()
        if (choice := value.WhichOneof("parameter_choice")) is not None
    }
    return SequenceRequest.of_parameters(plain)


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
