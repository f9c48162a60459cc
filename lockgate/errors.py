"""The one error vocabulary of lockgate: every failure a client sees has a status and a message."""

from __future__ import annotations


class ServingError(Exception):
    """An error with an HTTP status. Frontends turn it into the wire format of their protocol."""

    status: int = 500
    kind: str = "internal_error"

    def __init__(
        self, message: str, *, retry_after: float | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.param = param  # the request field it is about, when one is (OpenAI's error.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after)))}


class BadRequest(ServingError):
    status = 400
    kind = "invalid_request"


class Unauthorized(ServingError):
    status = 401
    kind = "unauthorized"


class Forbidden(ServingError):
    status = 403
    kind = "forbidden"


class RequestTimeout(ServingError):
    """The client did not send its whole request in time (a stalled or trickled body)."""

    status = 408
    kind = "request_timeout"

    def headers(self) -> dict[str, str]:
        return {"connection": "close"}  # the rest of the body may still be on its way


class NotFound(ServingError):
    status = 404
    kind = "not_found"


class MethodNotAllowed(ServingError):
    """The path exists, but not for this method; `allow` lists those it takes."""

    status = 405
    kind = "method_not_allowed"

    def __init__(self, message: str, allow: str) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"allow": self.allow}


class PayloadTooLarge(ServingError):
    status = 413
    kind = "payload_too_large"


class UnsupportedMediaType(ServingError):
    status = 415
    kind = "unsupported_media_type"


class TooManyRequests(ServingError):
    status = 429
    kind = "rate_limited"


class BackendError(ServingError):
    """The model itself raised on this request (a batch that fails runs again request by
    request, so only the requests the model raised on see it)."""

    status = 500
    kind = "backend_error"


class Unsupported(ServingError):
    """What the model does not do (a Triton Python model's `TritonError.UNSUPPORTED`)."""

    status = 501
    kind = "unsupported"


class Unavailable(ServingError):
    status = 503
    kind = "unavailable"


class DeadlineExceeded(ServingError):
    status = 504
    kind = "deadline_exceeded"


class ConfigError(Exception):
    """A model repository or config file is wrong. The message names the file and the field."""

    def __init__(self, path: str, field: str, problem: str) -> None:
        super().__init__(f"{path}: field '{field}': {problem}")
        self.path = path
        self.field = field
        self.problem = problem
