"""Cross-origin requests from browsers (CORS), for the origins `--allowed-origins` names.

Off unless origins are given. With them, a browser page of an allowed origin may call any
route, as vLLM's server allows (`--allowed-origins '*'` is its default there):

- **Preflight.** `OPTIONS` with `Origin` and `Access-Control-Request-Method` is answered 204
  at once, before authentication (a preflight carries no credentials): the methods and
  headers lockgate's routes take, and `Access-Control-Max-Age`. From another origin, or
  with CORS off, it is an ordinary request (405 on routes that do not take `OPTIONS`).
- **Answers** to a request with an allowed `Origin` carry `Access-Control-Allow-Origin` (the
  origin itself, or `*` when any is allowed), `Vary: Origin`, and
  `Access-Control-Expose-Headers` for the headers a client reads (`x-request-id`,
  `retry-after`, `inference-header-content-length`).

Credentials (cookies) are never allowed: lockgate's API keys travel in the `Authorization`
header, which a page sends itself. A refusal made by the connection gate before the request
reaches the app (503 when the process is saturated) carries no CORS headers, so a page sees
it as a network error and retries as it would one.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = b"GET, POST, HEAD, OPTIONS"
HEADERS = (
    b"authorization, content-type, content-encoding, accept-encoding, "
    b"inference-header-content-length, request-timeout, x-request-id, traceparent, "
    b"x-lockgate-model-version"
)
EXPOSED = b"x-request-id, retry-after, inference-header-content-length, content-encoding"
MAX_AGE = b"600"


@dataclass(frozen=True, slots=True)
class Cors:
    """The origins allowed to call lockgate from a browser (`*`: any)."""

    origins: frozenset[str]

    @classmethod
    def of(cls, text: str) -> Cors | None:
        """From `--allowed-origins`' comma-separated list; None when it names none."""
        origins = frozenset(o.strip().rstrip("/") for o in text.split(",") if o.strip())
        return cls(origins) if origins else None

    def allow(self, origin: bytes | None) -> bytes | None:
        """The `Access-Control-Allow-Origin` value for a request from `origin`, or None."""
        if origin is None:
            return None
        if "*" in self.origins:
            return b"*"
        return origin if origin.decode("latin-1") in self.origins else None

    def preflight(self, allowed: bytes) -> list[tuple[bytes, bytes]]:
        return [
            (b"access-control-allow-origin", allowed),
            (b"access-control-allow-methods", METHODS),
            (b"access-control-allow-headers", HEADERS),
            (b"access-control-max-age", MAX_AGE),
            (b"vary", b"Origin"),
        ]

    @staticmethod
    def answer(allowed: bytes) -> list[tuple[bytes, bytes]]:
        return [
            (b"access-control-allow-origin", allowed),
            (b"access-control-expose-headers", EXPOSED),
            (b"vary", b"Origin"),
        ]


def is_preflight(method: str, headers: list[tuple[bytes, bytes]]) -> bool:
    return method == "OPTIONS" and any(
        name == b"access-control-request-method" for name, _ in headers
    )


def origin_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"origin":
            return value
    return None
