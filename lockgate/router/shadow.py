"""Shadow traffic (`--shadow MODEL=TARGET:PERCENT`): a share of a model's KServe v2 inference
requests (`POST /v2/models/MODEL[/versions/V]/infer`) is also sent to a candidate, a URL or the
replicas of a group (`#label`), with the header `x-lockgate-shadow: 1`.

The copy runs beside the client's request and never holds it up: the client's answer passes
through as it would without a shadow, only also kept (up to `compare_max_bytes`) for the
comparison. The candidate's answer is read whole (up to that size, within `timeout`), compared
with the client's (`compare.py`), counted, and dropped. At most `max_in_flight` copies are under
way; a request past that is not copied, and counted as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from lockgate.core.metrics import Registry
from lockgate.errors import ServingError
from lockgate.protocol.content_coding import Inflater, coding_of
from lockgate.router.canary import parse_percent
from lockgate.router.compare import Answer, agree
from lockgate.router.groups import check_label
from lockgate.router.pool import split_url
from lockgate.router.replica import Replica
from lockgate.router.upstream import Response, Upstream, UpstreamError

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class ShadowRule:
    model: str
    target: str  # http://host:port, or #label: the replicas of that group
    percent: float

    @property
    def group(self) -> str | None:
        return self.target[1:] if self.target.startswith("#") else None

    @classmethod
    def parse(cls, text: str) -> ShadowRule:
        """`MODEL=URL:PERCENT` or `MODEL=#GROUP:PERCENT`."""
        model, eq, rest = text.partition("=")
        target, colon, share = rest.rpartition(":")
        if not eq or not colon or not model or not target:
            raise ValueError(f"--shadow {text!r}: give MODEL=URL:PERCENT or MODEL=#GROUP:PERCENT")
        option = f"--shadow {text!r}"
        if target.startswith("#"):
            check_label(target[1:], option)
        else:
            split_url(target)
        return cls(model, target, parse_percent(share, option))


@dataclass(frozen=True, slots=True)
class ShadowSettings:
    rules: tuple[ShadowRule, ...] = ()
    max_in_flight: int = 16  # copies under way at once; past it, dropped
    timeout: float = 10.0  # seconds a copy may take
    compare_max_bytes: int = 2**20  # answers larger than this are not compared
    tolerance: float = 1e-5  # relative and absolute, for numbers

    def __post_init__(self) -> None:
        models = [rule.model for rule in self.rules]
        if len(set(models)) != len(models):
            raise ValueError("--shadow: one rule per model")
        if self.max_in_flight < 1 or self.timeout <= 0 or self.compare_max_bytes < 1:
            raise ValueError("--shadow-max-in-flight, --shadow-timeout and the size must be > 0")
        if not 0 <= self.tolerance < 1:
            raise ValueError("--shadow-tolerance must be at least 0 and below 1")


class Mirror:
    """The client's side of one copied request: its answer, kept as it passes to the client."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.started = time.monotonic()
        self.seconds = 0.0  # arrival to the end of the client's answer
        self.status = 0
        self.header_length: int | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = False
        self.coding: bytes | None = None  # the client's answer's Content-Encoding
        self.answered: asyncio.Future[Answer | None] = asyncio.get_running_loop().create_future()

    def head(self, response: Response) -> None:
        self.status = response.status
        self.header_length = _header_length(response)
        self.coding = response.header(b"content-encoding")

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.limit:
            self.parts.append(chunk)
        else:
            self.parts.clear()

    def end(self) -> None:
        self.complete = True
        self.seconds = time.monotonic() - self.started

    def close(self) -> None:
        """The client's request is over: hand its answer (None: none whole) to the shadow."""
        if self.answered.done():
            return
        body = b"".join(self.parts) if self.size <= self.limit else None
        if body is not None and self.coding is not None:
            body = _inflated(body, self.coding, self.limit)
        whole = self.complete and self.status > 0
        self.answered.set_result(Answer(self.status, body, self.header_length) if whole else None)


class Shadow:
    def __init__(
        self,
        settings: ShadowSettings,
        registry: Registry,
        pick: Callable[[str], Replica | None],
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.rules = {rule.model: rule for rule in settings.rules}
        self.pick = pick  # a usable replica of a group, or None
        self.random = rng or random.Random()
        self.upstreams = {
            rule.target: Upstream(*split_url(rule.target))
            for rule in settings.rules
            if rule.group is None
        }
        self.tasks: set[asyncio.Task[None]] = set()
        self.outcomes = registry.counter(
            "lockgate_router_shadow_requests_total",
            "Copies of requests sent to a shadow, by model and outcome: 'agree', 'disagree' (a "
            "different status or outputs), 'error' (no answer in time), 'uncompared' (the "
            "client's answer failed, or an answer was too large) or 'dropped' (too many copies "
            "under way, or no usable candidate).",
            ("model", "outcome"),
        )
        self.latency = registry.histogram(
            "lockgate_router_shadow_duration_seconds",
            "Copied requests: time to the end of the answer, of the client's request "
            "('primary') and of the copy ('shadow').",
            ("model", "side"),
        )
        in_flight = registry.gauge(
            "lockgate_router_shadow_in_flight", "Copies of requests under way to shadows."
        )
        in_flight.set_function((), lambda: float(len(self.tasks)))

    def mirror(
        self, model: str, method: str, path: str, headers: Headers, body: bytes
    ) -> Mirror | None:
        """Start a copy of this request if its model has a shadow and the draw says so; the
        Mirror to feed with the client's answer."""
        rule = self.rules.get(model)
        if rule is None or self.random.random() * 100 >= rule.percent:
            return None
        upstream = self._upstream(rule)
        if upstream is None or len(self.tasks) >= self.settings.max_in_flight:
            self.outcomes.inc((model, "dropped"))
            return None
        mirror = Mirror(self.settings.compare_max_bytes)
        # the candidate answers plain, to be compared (the client's answer is inflated)
        copy = [(k, v) for k, v in headers if k != b"accept-encoding"]
        copy.append((b"x-lockgate-shadow", b"1"))
        task = asyncio.create_task(self._shadow(model, upstream, method, path, copy, body, mirror))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return mirror

    def _upstream(self, rule: ShadowRule) -> Upstream | None:
        if rule.group is None:
            return self.upstreams[rule.target]
        replica = self.pick(rule.group)
        return replica.upstream if replica is not None else None

    async def _shadow(
        self,
        model: str,
        upstream: Upstream,
        method: str,
        path: str,
        headers: Headers,
        body: bytes,
        mirror: Mirror,
    ) -> None:
        started = time.monotonic()
        answer = await self._ask(upstream, method, path, headers, body)
        if answer is not None:
            self.latency.observe((model, "shadow"), time.monotonic() - started)
        primary = await mirror.answered
        if primary is not None:
            self.latency.observe((model, "primary"), mirror.seconds)
        self.outcomes.inc((model, self._outcome(primary, answer)))

    def _outcome(self, primary: Answer | None, shadow: Answer | None) -> str:
        if shadow is None:
            return "error"
        if primary is None or primary.body is None or shadow.body is None:
            return "uncompared"
        return "agree" if agree(primary, shadow, self.settings.tolerance) else "disagree"

    async def _ask(
        self, upstream: Upstream, method: str, path: str, headers: Headers, body: bytes
    ) -> Answer | None:
        """The candidate's answer (its body None when too large); None when none came."""
        try:
            async with asyncio.timeout(self.settings.timeout):
                response = await upstream.request(method, path, headers, body)
                return await _read(response, self.settings.compare_max_bytes)
        except (UpstreamError, TimeoutError):
            return None

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for upstream in self.upstreams.values():
            upstream.close()


async def _read(response: Response, limit: int) -> Answer:
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in response.body():
            size += len(chunk)
            if size > limit:
                response.abort()
                return Answer(response.status, None, _header_length(response))
            parts.append(chunk)
    except BaseException:
        response.abort()
        raise
    return Answer(response.status, b"".join(parts), _header_length(response))


def _inflated(body: bytes, header: bytes, limit: int) -> bytes | None:
    """An answer's body decoded from its Content-Encoding; None when it cannot be (another
    coding, a bad stream) or inflates past `limit`: then it is not compared."""
    try:
        coding = coding_of(header)
        if coding is None:
            return body
        inflater = Inflater(body, coding, limit)
        inflater.run()
    except (ServingError, zlib.error):
        return None
    return inflater.result()


def _header_length(response: Response) -> int | None:
    value = response.header(b"inference-header-content-length")
    return int(value) if value is not None and value.isdigit() else None
