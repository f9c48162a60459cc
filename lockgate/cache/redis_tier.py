"""Tier 2: Redis, shared by every replica. An outage costs a warning and a metric, never a
request: after an error the tier stands aside for `retry_after_s`, and every call is bounded
by `timeout_s`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockgate.extras import import_for

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str  # redis://host:port/db
    prefix: str = "lockgate"  # keys are <prefix>:<model>:<version>:<hash>
    timeout_s: float = 0.05  # one command; past it the lookup is a miss
    retry_after_s: float = 5.0  # after an error, stand aside this long
    max_entry_bytes: int = 4 * 2**20  # larger answers stay in tier 1 only
    max_pending_writes: int = 256  # writes in flight; past it a write is skipped


class RedisTier:
    def __init__(self, settings: RedisSettings, on_error: Callable[[], None]) -> None:
        redis = import_for("redis.asyncio", "redis", "the Redis response cache")
        self.settings = settings
        self._client: Any = redis.Redis.from_url(
            settings.url,
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s,
        )
        self._down_until = 0.0
        self._writes: set[asyncio.Task[None]] = set()
        self.on_error = on_error  # counts failed commands (a metric)

    def key(self, model: str, version: int, digest: str) -> str:
        return f"{self.settings.prefix}:{model}:{version}:{digest}"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def get(self, key: str) -> bytes | None:
        if not self.available:
            return None
        try:
            value = await asyncio.wait_for(self._client.get(key), self.settings.timeout_s)
        except Exception as exc:
            self._failed("GET", exc)
            return None
        return value if isinstance(value, bytes) else None

    def put(self, key: str, blob: bytes, ttl_s: float | None) -> bool:
        """Write in the background; False when skipped (down, too large, too many pending)."""
        s = self.settings
        if not self.available or len(blob) > s.max_entry_bytes:
            return False
        if len(self._writes) >= s.max_pending_writes:
            return False
        task = asyncio.ensure_future(self._set(key, blob, ttl_s))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return True

    async def _set(self, key: str, blob: bytes, ttl_s: float | None) -> None:
        expire_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        try:
            command = self._client.set(key, blob, px=expire_ms)
            await asyncio.wait_for(command, self.settings.timeout_s * 4)
        except Exception as exc:
            self._failed("SET", exc)

    def _failed(self, command: str, exc: Exception) -> None:
        self.on_error()
        if self.available:  # one warning per outage, not one per request
            log.warning(
                "Redis response cache: %s failed (%s: %s); tier 1 only for %.0f s",
                command,
                type(exc).__name__,
                exc,
                self.settings.retry_after_s,
            )
        self._down_until = time.monotonic() + self.settings.retry_after_s

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=1.0)
        with contextlib.suppress(Exception):  # closing a client whose server is gone
            await self._client.aclose()
