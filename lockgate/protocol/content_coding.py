"""Content codings: of request bodies (`Content-Encoding`), a gzip or deflate body is
inflated under the body limit, any other coding is refused with 415; of answers
(`Accept-Encoding`), the coding a client takes, and a body compressed in it.

The limit is checked while inflating: no more than `limit + 1` bytes are ever produced, so a
small body that would inflate past it (a zip bomb) costs at most the limit in memory. The
first `INLINE_BYTES` are inflated on the event loop; a body that inflates to more goes on in
a worker thread (zlib releases the GIL while it inflates), so a large one does not hold the
loop.
"""

from __future__ import annotations

import asyncio
import sys
import zlib

from lockgate.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

# zlib's wbits for each coding: gzip's wrapper (RFC 1952); deflate is the zlib format
# (RFC 1950), as RFC 9110 defines it and as tritonclient sends it
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
INLINE_BYTES = 256 * 1024  # inflated on the event loop; beyond, on a worker thread
_STEP = 1024 * 1024  # the most inflated in one zlib call


def coding_of(header: bytes | None) -> bytes | None:
    """The coding a `Content-Encoding` value names (b"gzip" or b"deflate"); None for none or
    `identity`. 415 for any other coding, or for more than one."""
    if header is None:
        return None
    codings = [c.strip().lower() for c in header.split(b",")]
    codings = [c for c in codings if c and c != b"identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in _WBITS:
        return codings[0]
    named = header.decode("latin-1")[:100]
    raise UnsupportedMediaType(
        f"Content-Encoding {named!r} is not supported: send gzip, deflate or identity"
    )


class Inflater:
    """One body's inflation, in steps, refused with 413 past `limit` inflated bytes."""

    def __init__(self, body: bytes, coding: bytes, limit: int) -> None:
        self.wbits = _WBITS[coding]
        self.limit = limit
        self.size = 0  # bytes inflated so far
        self._zlib = zlib.decompressobj(self.wbits)
        self._pending = body  # compressed bytes not yet given to zlib
        self._parts: list[bytes] = []

    def run(self, budget: int = sys.maxsize) -> bool:
        """Inflate up to `budget` more bytes: True once the body is all inflated."""
        stop = self.size + budget
        while self.size < stop:
            room = min(_STEP, stop - self.size, self.limit + 1 - self.size)
            part = self._zlib.decompress(self._pending, room)
            self._pending = self._zlib.unconsumed_tail
            self.size += len(part)
            if self.size > self.limit:
                raise PayloadTooLarge(f"body inflates to over the limit of {self.limit} bytes")
            self._parts.append(part)
            if self._zlib.eof:
                if not self._next_member():
                    return True
            elif not part and not self._pending:
                raise BadRequest("compressed body is truncated")
        return False

    def _next_member(self) -> bool:
        """After the end of a stream: True when another gzip member follows (RFC 1952 lets
        members be concatenated). 400 for other bytes after a stream's end."""
        rest = self._zlib.unused_data
        if not rest:
            return False
        if self.wbits != _WBITS[b"gzip"]:
            raise BadRequest("bytes after the end of the deflate stream")
        self._zlib = zlib.decompressobj(self.wbits)
        self._pending = rest
        return True

    def result(self) -> bytes:
        return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)


async def inflate(body: bytes, coding: bytes, limit: int) -> bytes:
    """`body` decoded from `coding` (see `coding_of`): 413 past `limit` bytes, 400 when it
    is not valid gzip or deflate."""
    inflater = Inflater(body, coding, limit)
    try:
        if not inflater.run(INLINE_BYTES):
            await asyncio.to_thread(inflater.run)
    except zlib.error as exc:
        raise BadRequest(f"body is not valid {coding.decode()}: {exc}") from None
    return inflater.result()


# -- answers ---------------------------------------------------------------------------------

COMPRESS_LEVEL = 1  # zlib's fastest: most of the saving on JSON numbers, at a fraction of the CPU
COMPRESS_INLINE_BYTES = 256 * 1024  # compressed on the event loop; beyond, on a worker thread


def accepted_coding(header: bytes | None) -> bytes | None:
    """The coding to answer in, from an `Accept-Encoding` value: gzip, else deflate, when the
    client takes it (named, or `*`, with a q above 0); None for neither."""
    if not header:
        return None
    weights: dict[bytes, float] = {}
    for item in header.lower().split(b","):
        name, _, parameters = item.partition(b";")
        weight = 1.0
        key, _, value = parameters.partition(b"=")
        if key.strip() == b"q":
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
        weights[name.strip()] = weight
    for coding in (b"gzip", b"deflate"):
        if weights.get(coding, weights.get(b"*", 0.0)) > 0:
            return coding
    return None


def compress_now(body: bytes, coding: bytes) -> bytes:
    """`body` in `coding` (gzip or deflate, as `accepted_coding` names them)."""
    packer = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, _WBITS[coding])
    return packer.compress(body) + packer.flush()


async def compress(body: bytes, coding: bytes) -> bytes:
    """`compress_now`, on a worker thread for a large body (zlib releases the GIL)."""
    if len(body) <= COMPRESS_INLINE_BYTES:
        return compress_now(body, coding)
    return await asyncio.to_thread(compress_now, body, coding)
