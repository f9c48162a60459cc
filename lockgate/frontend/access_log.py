"""Request ids and structured access logs.

Every HTTP response carries `X-Request-Id`: the client's own when it sent a usable one (1 to
128 characters of letters, digits and `._:-`), else one made here (a random per-process
prefix and a counter: unique, and cheap). With `--access-log`, each request is logged as one
JSON line on the `lockgate.access` logger, refusals by the connection gate included.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
import time
from dataclasses import dataclass

import msgspec

MAX_ID_CHARS = 128
_USABLE = re.compile(rb"[A-Za-z0-9._:\-]{1,%d}" % MAX_ID_CHARS)
_PREFIX = secrets.token_hex(4).encode()
_COUNTER = itertools.count(1)
log = logging.getLogger("lockgate.access")


def request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's `X-Request-Id` when usable, else a new one."""
    return client_request_id(headers) or new_request_id()


def client_request_id(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The client's `X-Request-Id` when usable, else None."""
    for name, value in headers:
        if name == b"x-request-id" and _USABLE.fullmatch(value):
            return value
    return None


def new_request_id() -> bytes:
    return b"%s-%x" % (_PREFIX, next(_COUNTER))


class AccessEntry(msgspec.Struct, omit_defaults=True):
    time: float  # seconds since the epoch, when the response started
    request_id: str
    method: str
    path: str
    status: int
    duration_ms: float  # from the request's first byte to its response headers
    client: str = ""
    bytes_in: int = 0
    bytes_out: int = 0
    model: str = ""
    refused: str = ""  # the connection gate's reason, for a request refused before its body


_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class AccessLog:
    enabled: bool = False

    def write(self, entry: AccessEntry) -> None:
        log.info(_encode(entry).decode())

    def refused(
        self,
        rid: bytes,
        method: bytes,
        path: str,
        received: float,
        client: str,
        reason: str,
    ) -> None:
        now = time.monotonic()
        self.write(
            AccessEntry(
                time=time.time(),
                request_id=rid.decode("ascii"),
                method=method.decode("latin-1"),
                path=path[:512],
                status=503,
                duration_ms=round((now - received) * 1000, 3),
                client=client,
                refused=reason,
            )
        )


def model_of(path: str) -> str:
    """The model a v2 path names (`/v2/models/{m}/...`), else ""."""
    if not path.startswith("/v2/models/"):
        return ""
    name = path[len("/v2/models/") :].partition("/")[0]
    return "" if name == "stats" else name[:128]
