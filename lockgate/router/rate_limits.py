"""Rate limits and token quotas per API key (`--rate-limit-*`, `--rate-limits FILE`).

A client is its API key: the `Authorization: Bearer KEY` header's key, or the whole value of the
header `--rate-limit-key-header` names. Clients without a key share one bucket, `anonymous`.
Each client has up to two token buckets:

- requests: `requests_per_second` flow in, up to `burst`; each request takes one.
- tokens (the OpenAI routes): `tokens_per_minute` flow in, up to a minute's worth, and both
  prompt and completion tokens are taken. A completion request is charged its `max_tokens`
  (16, the replica's default, when it names none) at admission, an embeddings request nothing;
  when its answer has passed, the charge is settled against the prompt plus completion tokens
  the answer reported in `usage` (a stream's usage chunk, which the router asks for: see
  `usage.py`; for a stream cut short before it, one per streamed chunk), and an answer other
  than 200 is refunded. The router has no tokenizer: a prompt's tokens are known from the
  answer only. A request is admitted while the bucket holds its charge, at least one token and
  at most a minute's worth, so an empty bucket refuses every request before it is sent; the
  bucket may go below zero (a long prompt), and the debt is paid by time.

Past a limit the router answers 429 with `Retry-After` (whole seconds until the bucket has
room) and a JSON error. The file gives limits per key; keys it does not list get `default`.
The clients tracked are bounded (`max_keys`, least recently seen forgotten first; a forgotten
client starts again with full buckets). Keys are held as BLAKE2b digests, never in clear.

```yaml
default: {requests_per_second: 10, burst: 20, tokens_per_minute: 20000}
anonymous: {requests_per_second: 1, burst: 5}
keys:
  sk-team-a: {requests_per_second: 100, burst: 200, tokens_per_minute: 200000}
```
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from lockgate.router.token_bucket import TokenBucket

ANONYMOUS = b""  # the key of clients that give none


@dataclass(frozen=True, slots=True)
class Limit:
    requests_per_second: float = 0.0  # 0: no request limit
    burst: float = 0.0  # requests at once; 0: max(1, requests_per_second)
    tokens_per_minute: float = 0.0  # 0: no token quota

    def __post_init__(self) -> None:
        for name in ("requests_per_second", "burst", "tokens_per_minute"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, not {value}")

    @property
    def unlimited(self) -> bool:
        return self.requests_per_second == 0 and self.tokens_per_minute == 0

    def buckets(self, now: float) -> Client:
        requests = tokens = None
        if self.requests_per_second > 0:
            burst = self.burst or max(1.0, self.requests_per_second)
            requests = TokenBucket.full(self.requests_per_second, burst, now)
        if self.tokens_per_minute > 0:
            per_second = self.tokens_per_minute / 60
            tokens = TokenBucket.full(per_second, self.tokens_per_minute, now)
        return Client(requests, tokens)


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: str  # 'requests' or 'tokens'
    retry_after: int  # whole seconds until the bucket has room
    message: str


@dataclass(slots=True)
class Client:
    """One key's buckets."""

    requests: TokenBucket | None
    tokens: TokenBucket | None

    def admit_request(self, now: float) -> Refusal | None:
        if self.requests is None:
            return None
        wait = self.requests.wait(1, now)
        if wait > 0:
            rate = self.requests.rate
            return Refusal("requests", _seconds(wait), f"rate limit: {rate:g} requests/s")
        self.requests.take(1, now)
        return None

    def admit_tokens(self, charge: int, now: float) -> Refusal | None:
        """Take `charge` tokens if the bucket holds them, and at least one (it is not empty)."""
        if self.tokens is None:
            return None
        wait = self.tokens.wait(max(1, charge), now)
        if wait > 0:
            quota = self.tokens.capacity
            return Refusal("tokens", _seconds(wait), f"token quota: {quota:g} tokens/minute")
        self.tokens.take(charge, now)
        return None

    def settle(self, charged: int, used: int | None) -> None:
        """The answer used `used` tokens of the `charged` (None: unknown, keep the charge)."""
        if self.tokens is not None and used is not None:
            self.tokens.give(charged - used)


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))


def digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class RateLimitSettings:
    default: Limit = field(default_factory=Limit)
    anonymous: Limit = field(default_factory=Limit)
    keys: Mapping[bytes, Limit] = field(default_factory=dict)  # by digest of the key
    max_keys: int = 10_000
    key_header: str = "authorization"

    def __post_init__(self) -> None:
        if self.max_keys < 1:
            raise ValueError("--rate-limit-max-keys must be at least 1")

    @property
    def enabled(self) -> bool:
        limits = [self.default, self.anonymous, *self.keys.values()]
        return not all(limit.unlimited for limit in limits)

    def limit(self, tracked: bytes) -> Limit:
        """The limit of a client by the digest of its key (ANONYMOUS: no key)."""
        if tracked == ANONYMOUS:
            return self.anonymous
        return self.keys.get(tracked, self.default)


class _LimitFile(msgspec.Struct, forbid_unknown_fields=True):
    requests_per_second: float = 0.0
    burst: float = 0.0
    tokens_per_minute: float = 0.0


class _File(msgspec.Struct, forbid_unknown_fields=True):
    default: _LimitFile | None = None
    anonymous: _LimitFile | None = None
    keys: dict[str, _LimitFile] = {}


def load_limits(
    path: Path | None, default: Limit, max_keys: int, key_header: str
) -> RateLimitSettings:
    """Settings from the flags (`default`, also for anonymous clients) and the file, whose
    entries win; ValueError naming the file and the field when it is wrong."""
    if path is None:
        return RateLimitSettings(default, default, {}, max_keys, key_header)
    try:
        data = msgspec.yaml.decode(path.read_bytes(), type=_File)
        base = _limit(data.default) if data.default is not None else default
        anonymous = _limit(data.anonymous) if data.anonymous is not None else base
        keys = {digest(k.encode()): _limit(v) for k, v in data.keys.items()}
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"--rate-limits {path}: {exc}") from None
    return RateLimitSettings(base, anonymous, keys, max_keys, key_header)


def _limit(entry: _LimitFile) -> Limit:
    return Limit(entry.requests_per_second, entry.burst, entry.tokens_per_minute)


class RateLimiter:
    """Each client's buckets, the least recently seen forgotten past `max_keys`."""

    def __init__(self, settings: RateLimitSettings) -> None:
        self.settings = settings
        self.header = settings.key_header.lower().encode()
        self.clients: OrderedDict[bytes, Client] = OrderedDict()

    def key(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        for name, value in headers:
            if name == self.header:
                if self.header == b"authorization" and value[:7].lower() == b"bearer ":
                    value = value[7:]
                return value.strip()
        return ANONYMOUS

    def client(self, headers: Sequence[tuple[bytes, bytes]], now: float) -> Client | None:
        """The buckets of the request's client; None when no limit applies to it."""
        key = self.key(headers)
        tracked = digest(key) if key != ANONYMOUS else ANONYMOUS
        client = self.clients.get(tracked)
        if client is not None:
            self.clients.move_to_end(tracked)
            return client
        limit = self.settings.limit(tracked)
        if limit.unlimited:
            return None
        client = self.clients[tracked] = limit.buckets(now)
        if len(self.clients) > self.settings.max_keys:
            self.clients.popitem(last=False)
        return client
