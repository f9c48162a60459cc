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

from google.protobuf.message import DecodeError

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.router.sequence_affinity import SequenceRequest

MODEL_NAME = 1  # the field number of ModelInferRequest.model_name
PARAMETERS = 4  # ModelInferRequest.parameters: one length-delimited field per map entry
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_MARK = b"sequence_id"


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


def sequence_of(message: bytes) -> SequenceRequest | None:
    """The sequence the request's parameters name; None when they name none (or its bytes are
    not a message: the replica answers)."""
    entries: list[bytes] = []  # the parameters map's entries, each with its tag and length
    at, end = 0, len(message)
    try:
        while at < end:
            begin = at
            key, at = _varint(message, at)
            field, wire = key >> 3, key & 7
            if field > PARAMETERS:
                break
            if wire == _VARINT:
                _, at = _varint(message, at)
            elif wire == _FIXED64:
                at += 8
            elif wire == _FIXED32:
                at += 4
            elif wire == _LENGTH:
                size, at = _varint(message, at)
                at += size
                if field == PARAMETERS:
                    entries.append(message[begin:at])
            else:
                return None
    except IndexError:
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
