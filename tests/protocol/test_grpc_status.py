"""How a gRPC call cut short is counted (`protocol/grpc/status.py`)."""

from __future__ import annotations

import grpc
import pytest

from lockgate.protocol.grpc.status import cancelled_code


class _Context:
    def __init__(self, left: float | None) -> None:
        self.left = left

    def time_remaining(self) -> float | None:
        return self.left


@pytest.mark.parametrize(
    ("left", "code"),
    [
        (-0.01, grpc.StatusCode.DEADLINE_EXCEEDED),
        (0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        (2.5, grpc.StatusCode.CANCELLED),
        (None, grpc.StatusCode.CANCELLED),  # no deadline: the client went away
    ],
)
def test_a_call_past_its_deadline_is_deadline_exceeded_else_cancelled(
    left: float | None, code: grpc.StatusCode
) -> None:
    assert cancelled_code(_Context(left)) is code
