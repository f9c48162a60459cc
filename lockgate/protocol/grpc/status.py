"""gRPC status codes lockgate's servers count calls by, shared by the server and the router."""

from __future__ import annotations

from typing import Any

import grpc


def cancelled_code(context: Any) -> grpc.StatusCode:
    """How a call cut short is counted: DEADLINE_EXCEEDED when the client's deadline has
    passed (grpc cancels the handler then), else CANCELLED (the client went away).
    `context`: the call's grpc.aio.ServicerContext."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
