"""A replica's whole answer to a request the router makes on its own behalf (model control,
statistics): sent with what is left of the deadline as `request-timeout`, read whole, or why
there was none (the connection failed, or the deadline passed)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from lockgate.router.replica import Replica
from lockgate.router.upstream import UpstreamError

DEADLINE = "no answer within the request's deadline"
_LEAST_LEFT_S = 0.001  # what a request past its deadline still tells the replica


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """The status (0: no answer) and body, or why there was no answer."""

    status: int
    body: bytes = b""
    why: str = ""


async def whole_answer(
    replica: Replica,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    deadline: float | None,
) -> WholeAnswer:
    """Send the request to `replica` and read its answer whole, by `deadline`
    (`time.monotonic()`; None: none), counting it in the replica's in-flight requests."""
    sent = headers
    if deadline is not None:
        left = max(deadline - time.monotonic(), _LEAST_LEFT_S)
        sent = [*headers, (b"request-timeout", f"{left:.6f}".encode())]
    replica.in_flight += 1
    try:
        async with asyncio.timeout(None if deadline is None else deadline - time.monotonic()):
            response = await replica.upstream.request(method, path, sent, body)
            try:
                data = await response.read()
            except BaseException:
                response.abort()
                raise
    except UpstreamError as exc:
        return WholeAnswer(0, why=str(exc))
    except TimeoutError:
        return WholeAnswer(0, why=DEADLINE)
    finally:
        replica.in_flight -= 1
    return WholeAnswer(response.status, data)
