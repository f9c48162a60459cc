"""gRPC status codes, shared by the server and the router: how lockgate's servers count calls, and
the code of an HTTP status."""

from __future__ import annotations

from typing import Any

import grpc

# the gRPC code of an HTTP status (of a ServingError, or a replica's answer)
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def cancelled_code(context: Any) -> grpc.StatusCode:
    """How a call cut short is counted: DEADLINE_EXCEEDED when the client's deadline has
    passed (grpc cancels the handler then), else CANCELLED (the client went away).
    `context`: the call's grpc.aio.ServicerContext."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
