"""Rendezvous (highest random weight) hashing: a key's order of preference over replicas.

Each replica's weight for a key is a hash of the two; the key goes to the replica of highest
weight. When that replica leaves, only its keys move (each to its own next choice); the others
stay where they were. No state is kept, so several routers with the same replicas agree."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from lockgate.router.replica import Replica


def _weight(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest()


def first(key: bytes, replicas: Sequence[Replica]) -> Replica | None:
    """The replica `key` prefers."""
    return max(replicas, key=lambda r: _weight(key, r.url), default=None)


def ranked(key: bytes, replicas: Sequence[Replica]) -> list[Replica]:
    """Every replica in `key`'s order of preference."""
    return sorted(replicas, key=lambda r: _weight(key, r.url), reverse=True)
