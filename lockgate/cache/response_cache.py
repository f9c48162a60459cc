"""The two-tier response cache of one server, with its metrics.

Tier 1 is an LRU per model version, bounded by the model's `response_cache.max_bytes`. Tier 2
is Redis, shared by replicas, when the server has a Redis URL. A lookup tries tier 1, then
Redis (a Redis hit is kept in tier 1 too); a store writes tier 1 at once and Redis in the
background.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lockgate.cache import blob
from lockgate.cache.lru import LRUTier
from lockgate.cache.redis_tier import RedisSettings, RedisTier
from lockgate.config import ResponseCacheConfig
from lockgate.core.metrics import Registry
from lockgate.datatypes import Arrays

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheHit:
    outputs: Arrays
    tier: str  # "memory" or "redis"
    stale: bool = False  # past its TTL: answered only as a fallback


class ResponseCache:
    def __init__(self, registry: Registry, redis: RedisSettings | None = None) -> None:
        self._tiers: dict[tuple[str, int], LRUTier] = {}
        m, mt = ("model",), ("model", "tier")
        self.hits = registry.counter(
            "lockgate_cache_hits_total", "Response-cache lookups answered, by tier.", mt
        )
        self.misses = registry.counter(
            "lockgate_cache_misses_total", "Response-cache lookups not answered, by tier.", mt
        )
        self.stores = registry.counter(
            "lockgate_cache_stores_total", "Answers written to the response cache, by tier.", mt
        )
        self.bytes = registry.gauge(
            "lockgate_cache_bytes", "Bytes held by the in-process response cache.", m
        )
        self.entries = registry.gauge(
            "lockgate_cache_entries", "Entries held by the in-process response cache.", m
        )
        self.lookup = registry.histogram(
            "lockgate_cache_lookup_duration_seconds", "Response-cache lookup time.", ("tier",)
        )
        self.errors = registry.counter(
            "lockgate_cache_errors_total",
            "Redis commands that failed or timed out (the request went on without Redis).",
        )
        self.coalesced = registry.counter(
            "lockgate_requests_coalesced_total",
            "Requests answered by an identical request already in flight.",
            m,
        )
        self.redis = RedisTier(redis, self.errors.inc) if redis is not None else None

    def tier(
        self, model: str, version: int, config: ResponseCacheConfig, generation: str = ""
    ) -> LRUTier:
        """The in-process tier of a model version; a new one, empty, when the version was
        reloaded as another model (`generation`, its fingerprint) or with another bound."""
        key = (model, version)
        tier = self._tiers.get(key)
        if tier is None or tier.max_bytes != config.max_bytes or tier.generation != generation:
            tier = self._tiers[key] = LRUTier(config.max_bytes, generation)
        return tier

    def forget(self, model: str, version: int | None = None) -> None:
        """Drop the in-process entries of a model (one version, or all) that left service."""
        for key in [k for k in self._tiers if k[0] == model and version in (None, k[1])]:
            del self._tiers[key]
        self.bytes.remove((model,))
        self.entries.remove((model,))

    async def get(
        self,
        model: str,
        version: int,
        config: ResponseCacheConfig,
        digest: str,
        generation: str = "",
    ) -> CacheHit | None:
        """The answer kept under `digest` (a key made with the same `generation`)."""
        start = time.perf_counter()
        tier = self.tier(model, version, config, generation)
        outputs = tier.get(digest, time.monotonic())
        self.lookup.observe(("memory",), time.perf_counter() - start)
        if outputs is not None:
            self.hits.inc((model, "memory"))
            return CacheHit(outputs, "memory")
        self.misses.inc((model, "memory"))
        if self.redis is None or not config.redis or not self.redis.available:
            return None
        start = time.perf_counter()
        found = await self.redis.get(self.redis.key(model, version, digest))
        self.lookup.observe(("redis",), time.perf_counter() - start)
        if found is None:
            self.misses.inc((model, "redis"))
            return None
        try:
            outputs = blob.decode(found)
        except Exception as exc:  # a foreign or damaged value under our prefix
            log.warning("Redis response cache: unreadable entry for %s: %s", model, exc)
            self.misses.inc((model, "redis"))
            return None
        self.hits.inc((model, "redis"))
        self._keep(tier, model, digest, outputs, config)
        return CacheHit(outputs, "redis")

    def get_stale(
        self,
        model: str,
        version: int,
        config: ResponseCacheConfig,
        digest: str,
        generation: str = "",
    ) -> CacheHit | None:
        """An in-process entry even past its TTL, for a fallback answer."""
        tier = self.tier(model, version, config, generation)
        outputs = tier.get(digest, time.monotonic(), stale=True)
        return None if outputs is None else CacheHit(outputs, "memory", stale=True)

    def put(
        self,
        model: str,
        version: int,
        config: ResponseCacheConfig,
        digest: str,
        outputs: Arrays,
        generation: str = "",
    ) -> None:
        held = self._tiers.get((model, version))
        if held is None or held.generation == generation:  # else: a replaced model's answer
            tier = self.tier(model, version, config, generation)
            if self._keep(tier, model, digest, outputs, config):
                self.stores.inc((model, "memory"))
        if self.redis is not None and config.redis:
            key = self.redis.key(model, version, digest)
            if self.redis.put(key, blob.encode(outputs), config.ttl_s):
                self.stores.inc((model, "redis"))

    def _keep(
        self, tier: LRUTier, model: str, digest: str, outputs: Arrays, config: ResponseCacheConfig
    ) -> bool:
        expires = None if config.ttl_s is None else time.monotonic() + config.ttl_s
        kept = tier.put(digest, outputs, blob.nbytes(outputs), expires)
        self.bytes.set((model,), sum(t.bytes for k, t in self._tiers.items() if k[0] == model))
        self.entries.set((model,), sum(len(t) for k, t in self._tiers.items() if k[0] == model))
        return kept

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()
