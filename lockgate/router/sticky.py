"""Sticky sessions (`--sticky-header NAME`): requests with the same value of that header go to the
same replica while it is usable, chosen by rendezvous hashing over the usable replicas of the
request's group. When that replica leaves or is ejected, only its sessions move. A request
without the header is balanced as usual."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockgate.router import rendezvous
from lockgate.router.replica import Replica


@dataclass(frozen=True, slots=True)
class Sticky:
    header: bytes  # lower case

    def key(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
        """The session this request belongs to, or None."""
        for name, value in headers:
            if name == self.header:
                return value or None
        return None

    def pick(self, key: bytes, candidates: Sequence[Replica]) -> Replica | None:
        return rendezvous.first(key, candidates)
