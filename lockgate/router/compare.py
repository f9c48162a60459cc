"""Whether two answers to one KServe v2 inference request agree: a shadow's check.

Two answers agree when their statuses are equal and, for a 200, their outputs are: the same
names, datatypes and shapes; numbers equal within `tolerance` (relative and absolute; NaN,
written null in JSON, equals NaN); strings and booleans exactly equal; and the binary part of
an answer with binary tensors (after its `Inference-Header-Content-Length` bytes of JSON) byte
for byte equal. The id, model name and version, and parameters are not compared. A body that
is not v2 JSON is compared byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes | None  # None: over the size compared
    header_length: int | None = None  # a binary answer's JSON part

    def split(self) -> tuple[bytes, bytes]:
        """The JSON part and the binary part."""
        body = self.body or b""
        if self.header_length is None:
            return body, b""
        return body[: self.header_length], body[self.header_length :]


class _Output(msgspec.Struct):
    name: str
    datatype: str = ""
    shape: list[int] = []
    data: Any = None


class _Outputs(msgspec.Struct):
    outputs: list[_Output]


_decode = msgspec.json.Decoder(_Outputs).decode


def agree(a: Answer, b: Answer, tolerance: float) -> bool:
    if a.status != b.status:
        return False
    if a.status != 200:
        return True  # the same refusal or error
    (head_a, tail_a), (head_b, tail_b) = a.split(), b.split()
    if tail_a != tail_b:
        return False
    try:
        outputs_a = {o.name: o for o in _decode(head_a).outputs}
        outputs_b = {o.name: o for o in _decode(head_b).outputs}
    except (msgspec.DecodeError, msgspec.ValidationError):
        return head_a == head_b
    if outputs_a.keys() != outputs_b.keys():
        return False
    return all(_same(outputs_a[name], outputs_b[name], tolerance) for name in outputs_a)


def _same(a: _Output, b: _Output, tolerance: float) -> bool:
    if a.datatype != b.datatype or a.shape != b.shape:
        return False
    if a.data is None or b.data is None or a.datatype in ("BYTES", "BOOL"):
        return bool(a.data == b.data)
    try:
        x = np.asarray(a.data, dtype=np.float64)
        y = np.asarray(b.data, dtype=np.float64)
    except (TypeError, ValueError):  # ragged or not numbers
        return bool(a.data == b.data)
    if x.shape != y.shape:
        return False
    return bool(np.allclose(x, y, rtol=tolerance, atol=tolerance, equal_nan=True))
