"""The router's ASGI app: its own health and metrics, and every other request passed to a
replica (but each replica's log and trace settings, refused: `replica_settings.py`).

For each request, in order:
1. Rate limits (`rate_limits.py`), when set: the client's request bucket before the body is
   read, its token quota for an OpenAI request after; past either, 429 with Retry-After.
2. Shedding: when every usable replica refused (503) within the last moment, the router
   answers 503 with Retry-After at once, using the replicas' own admission as its signal.
3. Routing: a canary may send the request to a version (a v2 path's, or for the OpenAI routes
   the header `x-lockgate-model-version`) or a replica group (`canary.py`); replicas labelled
   `URL#group` take only their group's traffic (`groups.py`).
4. Balancing, over the usable replicas of the request's group: a stateful model's sequence's
   replica (`sequence_affinity.py`), for KServe v2 inference that names a `sequence_id`; the
   replica that stored a response of the OpenAI Responses API, for a request that reads,
   deletes or continues it (`response_homes.py`); a
   sticky session's replica (`sticky.py`); for a completion request, the least loaded
   replica or the one its prompt's prefix prefers (`llm_routing.py`); otherwise power of two
   choices on load (`balancer.py`).
   Replicas report their requests in progress in the `x-lockgate-inflight` header of every
   answer.
5. Hedging, for KServe v2 inference (`POST /v2/models/.../infer`, idempotent) only: when no
   answer has come after the model's recent 95th-percentile latency, a second copy goes to
   another replica within the hedge budget; the first answer wins and the other copy's
   connection is closed, so its replica drops the work. Streams are never hedged, nor is a
   request of a sequence, nor of a model not seen to answer as a classic model
   (`model_kinds.py`: a language model's answers say so).
6. Retries: an attempt that got no answer (connection refused or broken) or a 503 goes to
   another replica, within the retry budget (10% of requests by default); a request of a
   sequence never does (its state lives on one replica), nor a language model's once it
   was sent (only a 503 or a connection refused: a generation is not run twice). Nothing is
   retried once a byte of the answer has gone to the client.
7. Deadlines: a `request-timeout` header (seconds) is passed on less the time already
   spent in the router; past it, 504 at once.

Model control (`POST /v2/repository/models/{m}/load` and `/unload`) takes none of 2-7: after
1, it goes to every replica at once, and a replica that joins later is sent what it missed
(`model_control.py`). So does a statistics request (`GET /v2/models[/{m}[/versions/{v}]]/stats`):
every usable replica is asked, and their statistics are answered summed (`statistics.py`).

The KServe v2 inference requests that need none of 1, 3 (a canary) or the shadow below, nor a
sticky session, nor name a sequence, take the lane (`lane.py`): passed to the replica and back
from the connections' own callbacks, below ASGI, and hedged there as in 5; an attempt there
that gets no answer or a 503 comes back to this path for its retries (6).

Answers, server-sent events included, are passed through as they arrive. A shadow
(`shadow.py`) may copy a v2 inference request to a candidate beside it; the client's answer is
then also kept for the comparison, never held up. When the answer has passed, a token quota is
settled with the prompt and completion tokens it used (`usage.py`; a stream is sent asking for
its usage chunk, which its client gets only if it asked too), and the request is counted by
model and version (`model_counts.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from lockgate.core.heap import freeze_heap
from lockgate.core.metrics import Registry
from lockgate.errors import ServingError
from lockgate.protocol.content_coding import coding_of, inflate
from lockgate.protocol.llm_tensors import LANGUAGE_KIND, MODEL_KIND_HEADER
from lockgate.protocol.openai import MODEL_VERSION_HEADER, error_body, openai_path
from lockgate.protocol.responses import RESPONSE_ID_HEADER
from lockgate.router import replica_settings
from lockgate.router.balancer import Balancer
from lockgate.router.budget import Budget
from lockgate.router.canary import Canary, CanaryRule
from lockgate.router.client_connection import HOLD
from lockgate.router.control_log import Control
from lockgate.router.groups import MAIN, ReplicaGroups
from lockgate.router.hedge import HedgePolicy, finished_within
from lockgate.router.lane import LANE_SCOPE, LaneCall, LaneClient
from lockgate.router.lane_answer import LaneAnswer
from lockgate.router.lane_head import LaneHead, LaneHeads
from lockgate.router.lane_target import LaneSeries, LaneTarget
from lockgate.router.llm_request import EMBEDDINGS_PATH, OPENAI_PATHS, LLMRequest
from lockgate.router.llm_routing import LLMRouting, LLMRoutingSettings
from lockgate.router.model_control import ControlSettings, ModelControl
from lockgate.router.model_counts import ModelCounts
from lockgate.router.model_kinds import ModelKinds
from lockgate.router.model_path import ModelPath
from lockgate.router.pool import ReplicaPool
from lockgate.router.rate_limits import RateLimiter, RateLimitSettings, Refusal
from lockgate.router.replica import Replica
from lockgate.router.response_homes import (
    RESPONSES_PATH,
    ResponseHomes,
    ResponseRequest,
)
from lockgate.router.route import Route
from lockgate.router.sequence_affinity import SequenceGone, SequenceRequest, SequenceTable
from lockgate.router.shadow import Mirror, Shadow, ShadowSettings
from lockgate.router.statistics import Statistics, StatisticsRequest
from lockgate.router.sticky import Sticky
from lockgate.router.tally import Tally
from lockgate.router.upstream import HOP_BY_HOP, Response, UpstreamError
from lockgate.router.usage import HiddenUsage, Metered

log = logging.getLogger("lockgate.router")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_encode = msgspec.json.Encoder().encode
# the paths the router answers itself
_OWN_PATHS = frozenset(
    {"/v2/health/live", "/health", "/v2/health/ready", "/metrics", "/router/replicas"}
)
_STATUS = {status: (str(status),) for status in range(100, 600)}  # label values, made once
_STATUS_TEXT = {status: str(status) for status in range(100, 600)}
_ANSWERED, _APP_PATH = ("answered",), ("app_path",)
_LANE_TARGETS = 4096  # request paths whose model the lane remembers
_INFLIGHT = b"\r\nx-lockgate-inflight:"  # in a lane answer's head (`LaneAnswer.header`)
_KIND = b"\r\n" + MODEL_KIND_HEADER + b":"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    max_body_bytes: int = 64 * 2**20
    retry_ratio: float = 0.1  # retries at most this share of requests (plus `retry_floor`)
    retry_floor: int = 10  # retries allowed in any 10 s window whatever the traffic
    max_attempts: int = 3  # tries of one request, the first included
    hedge: HedgePolicy = field(default_factory=HedgePolicy)
    hedge_ratio: float = 0.1  # hedged copies at most this share of requests
    shed_retry_after: int = 1  # seconds, on the router's own 503
    canary: tuple[CanaryRule, ...] = ()
    shadow: ShadowSettings = field(default_factory=ShadowSettings)
    sticky_header: str | None = None  # requests with the same value go to the same replica
    sequence_table_size: int = 65536  # sequences pinned to their replica (`sequence_affinity`)
    responses_table_size: int = 65536  # stored responses whose replica is known
    rate_limits: RateLimitSettings | None = None
    llm_routing: LLMRoutingSettings = field(default_factory=LLMRoutingSettings)
    max_model_series: int = 1000  # model names with request counters of their own
    control: ControlSettings = field(default_factory=ControlSettings)
    send_once: tuple[str, ...] = ()  # models never hedged nor retried once sent (`model_kinds`)


class Tap(Protocol):
    """Something that reads an answer as it passes to the client."""

    def head(self, response: Response) -> None: ...
    def feed(self, chunk: bytes) -> None: ...
    def end(self) -> None: ...


class Failure(Exception):
    """An attempt that ended without an answer worth passing on."""

    def __init__(self, message: str, status: int = 502, sent: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.sent = sent  # the request may have reached the replica


class RouterApp:
    def __init__(self, pool: ReplicaPool, settings: RouterSettings, registry: Registry) -> None:
        self.pool = pool
        self.settings = settings
        self.registry = registry
        self.balancer = Balancer()
        self.retries = Budget(settings.retry_ratio, settings.retry_floor)
        self.hedges = Budget(settings.hedge_ratio, 0)
        self.draining = False
        self.groups = ReplicaGroups.of_urls(pool.discovery.urls)
        self.canary = Canary(settings.canary)
        self.shadow = Shadow(settings.shadow, registry, self._pick_in)
        header = settings.sticky_header
        self.sticky = Sticky(header.lower().encode()) if header else None
        self.sequences = SequenceTable(settings.sequence_table_size)
        self.kinds = ModelKinds.naming(settings.send_once)  # which may be sent twice
        self.response_homes = ResponseHomes(settings.responses_table_size)
        limits = settings.rate_limits
        self.limits = RateLimiter(limits) if limits is not None and limits.enabled else None
        self.llm_routing = LLMRouting(settings.llm_routing, registry)
        self.model_counts = ModelCounts(registry, settings.max_model_series)
        self.lane_targets: dict[str, LaneTarget] = {}  # the model each lane path names
        # the heads the lane takes; none with rate limits or sticky sessions, which it lacks
        self.lane_heads: LaneHeads | None = None
        if self.limits is None and self.sticky is None:
            self.lane_heads = LaneHeads(self._lane_head)
        self.control = ModelControl(pool, settings.control, registry)
        copied = {rule.group for rule in settings.shadow.rules if rule.group is not None}
        self.statistics = Statistics(pool, self.groups, copied, registry)
        self.rate_limited = registry.counter(
            "lockgate_router_rate_limited_total",
            "Requests refused 429 by a rate limit ('requests') or a token quota ('tokens').",
            ("limit",),
        )
        if self.limits is not None:
            limiter = self.limits
            clients = registry.gauge(
                "lockgate_router_rate_limit_clients", "API keys whose buckets are tracked."
            )
            clients.set_function((), lambda: float(len(limiter.clients)))
        self.requests = Tally(
            registry.counter(
                "lockgate_router_requests_total",
                "Requests answered by the router, by status.",
                ("status",),
            )
        )
        self.attempts = Tally(
            registry.counter(
                "lockgate_router_attempts_total",
                "Requests sent to replicas, by replica and outcome (the replica's status, or "
                "'error' for no answer).",
                ("replica", "outcome"),
            )
        )
        self.lane_outcomes = Tally(
            registry.counter(
                "lockgate_router_lane_total",
                "KServe v2 inference requests sent to a replica on the lane (below ASGI), by "
                "outcome: 'answered' there, or 'app_path' (no answer or a 503: retried along "
                "the app's path).",
                ("outcome",),
            )
        )
        self.retried = registry.counter(
            "lockgate_router_retries_total", "Attempts sent again to another replica."
        )
        self.retries_denied = registry.counter(
            "lockgate_router_retries_denied_total",
            "Attempts not sent again because the retry budget was spent.",
        )
        self.hedged = registry.counter(
            "lockgate_router_hedges_total",
            "Second copies sent, by which copy answered first.",
            ("winner",),
        )
        self.shed = registry.counter(
            "lockgate_router_shed_total",
            "Requests refused by the router because every replica was full.",
        )
        self.latency = registry.histogram(
            "lockgate_router_request_duration_seconds",
            "Time from a request's arrival at the router to its answer's head.",
            ("status",),
        )
        up = registry.gauge(
            "lockgate_router_replicas", "Replicas known to the router, by state.", ("state",)
        )
        up.set_function(("usable",), lambda: self._count(True))
        up.set_function(("unusable",), lambda: self._count(False))

    def _count(self, usable: bool) -> float:
        now = time.monotonic()
        return float(sum(1 for r in self.pool.replicas if r.usable(now) == usable))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path not in _OWN_PATHS:  # the request goes to a replica
            lane: LaneCall | None = scope.get(LANE_SCOPE)
            arrived = time.monotonic()
            if lane is not None:
                arrived = lane.arrived
                self.lane_outcomes.inc(_APP_PATH)
            status = await self._serve(scope, receive, send, arrived)
            labels = _STATUS.get(status) or (str(status),)
            self.requests.inc(labels)
            self.latency.observe(labels, time.monotonic() - arrived)
        elif path in ("/v2/health/live", "/health"):
            await _json(send, 200, {"live": True})
        elif path == "/v2/health/ready":
            now = time.monotonic()
            main = self.groups.members(self.pool.replicas, MAIN)
            ready = any(r.usable(now) for r in main) and not self.draining
            await _json(send, 200 if ready else 503, {"ready": ready})
        elif path == "/metrics":
            accept = next((v for k, v in scope["headers"] if k.lower() == b"accept"), b"")
            self._fold_lane()
            tallies = (self.requests, self.attempts, self.model_counts.requests, self.lane_outcomes)
            for tally in tallies:
                tally.flush()
            body, content_type = self.registry.exposition(accept.decode("latin-1"))
            await _respond(send, 200, body, content_type.encode())
        else:
            await _json(send, 200, {"replicas": [self._describe(r) for r in self.pool.replicas]})

    def _describe(self, r: Replica) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "url": r.url,
            "group": self.groups.group(r) or "main",
            "usable": r.usable(now),
            "ready": r.ready,
            "joining": r.joining,
            "told": r.told,
            "boot": None if r.boot is None else r.boot.decode(errors="replace"),
            "ejected_for_s": max(0.0, r.ejected_until - now),
            "full": r.full(now),
            "in_flight": r.in_flight,
            "reported_in_flight": r.reported,
            "answered": r.answered,
        }

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.pool.start()
                freeze_heap()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shadow.close()
                await self.pool.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- proxying --------------------------------------------------------------------------
    async def _serve(self, scope: Scope, receive: Receive, send: Send, arrived: float) -> int:
        if replica_settings.per_replica(scope["path"]):
            return await _error(send, 501, replica_settings.MESSAGE)
        headers: list[tuple[bytes, bytes]] = scope["headers"]  # names in lower case (ASGI)
        client = self.limits.client(headers, arrived) if self.limits is not None else None
        path: str = scope["path"]
        refusal = client.admit_request(arrived) if client is not None else None
        if refusal is not None:
            return await self._refuse(send, refusal, path)
        body = await _read_body(receive, self.settings.max_body_bytes)
        if body is None:
            most = self.settings.max_body_bytes
            return await _error(send, 413, f"body over {most} bytes", path=path)
        timeout = _timeout(headers)
        if timeout is False:
            message = "request-timeout must be a positive number of seconds"
            return await _error(send, 400, message, path=path)
        control = Control.parse(scope["method"], path)
        if control is not None:  # to every replica
            deadline = None if timeout is None else arrived + timeout
            answer = await self.control.apply(control, headers, body, deadline)
            await _respond(send, answer.status, answer.body, b"application/json")
            return answer.status
        asked = StatisticsRequest.parse(scope["method"], path)
        if asked is not None:  # every replica's, summed
            deadline = None if timeout is None else arrived + timeout
            summed = await self.statistics.gather(asked, headers, deadline)
            await _respond(send, summed.status, summed.body, b"application/json", [*summed.headers])
            return summed.status
        if scope["method"] == "POST" and (path in OPENAI_PATHS or path == RESPONSES_PATH):
            # read for routing, metering and shadows: a compressed body goes on inflated
            try:
                body, headers = await self._inflated(body, headers)
            except ServingError as exc:
                return await _error(send, exc.status, exc.message, path=path)
        route = self._route(scope, headers, body)
        if route.target is not None and route.target.verb == "infer":
            route.sequence = await self._sequence_of(headers, body)
        elif path.startswith(RESPONSES_PATH):
            route.responses = ResponseRequest.parse(scope["method"], path, body)
        if route.pin is not None:
            headers = [*headers, (MODEL_VERSION_HEADER, route.pin.encode())]
        metered: Metered | None = None
        if client is not None and client.tokens is not None and route.llm is not None:
            refusal = client.admit_tokens(route.llm.charge, time.monotonic())
            if refusal is not None:
                return await self._refuse(send, refusal, path)
            metered = Metered.of(route.llm, body)
            body = metered.body
        mirror: Mirror | None = None
        status = 0
        try:
            if route.target is not None and route.target.verb == "infer" and not route.sequence:
                mirror = self.shadow.mirror(
                    route.target.model, scope["method"], route.original, headers, body
                )
            meter = metered.meter if metered is not None else None
            hidden = metered.hidden if metered is not None else None
            taps: list[Tap] = [tap for tap in (meter, mirror) if tap is not None]
            status = await self._forward(
                scope["method"],
                route,
                headers,
                body,
                arrived,
                timeout,
                send,
                receive,
                taps,
                hidden,
                scope.get(LANE_SCOPE),
            )
            return status
        finally:
            if client is not None and metered is not None:
                client.settle(metered.charge, metered.meter.used())
            if mirror is not None:
                mirror.close()
            if status and route.model is not None:
                self.model_counts.count(route.model, route.version, route.group, status)

    async def _forward(
        self,
        method: str,
        route: Route,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        arrived: float,
        timeout: float | None,
        send: Send,
        receive: Receive,
        taps: list[Tap],
        hidden: HiddenUsage | None = None,
        lane: LaneCall | None = None,
    ) -> int:
        """`lane`: the request's attempt on the lane, which counted it already."""
        now = time.monotonic()
        if lane is None:
            self.retries.request(now)
            if self.settings.hedge.enabled:  # the hedge budget is spent only by hedging
                self.hedges.request(now)
        # draining (`--drain-delay`): readiness says 503 so load balancers stop sending, and
        # what they still send is served until the port closes
        path = route.original.partition("?")[0]
        if lane is None and self.pool.all_full(now):  # (the lane looked before its attempt)
            self.shed.inc()
            retry = self.settings.shed_retry_after
            return await _error(send, 503, "every replica is full: retry later", retry, path)
        model = route.target.model if route.target and route.target.verb == "infer" else None
        try:
            if route.responses is not None and route.responses.rid is not None:
                route.home = await self._home(route.responses.rid, route.group, headers)
            response, replica = await self._answer(
                method, route, headers, body, arrived, timeout, model, lane
            )
            if route.responses is not None:
                self._stored(route.responses, response, replica)
        except Failure as exc:
            wait = 1 if exc.status == 503 else None
            return await _error(send, exc.status, str(exc), wait, path)
        except TimeoutError:
            return await _error(send, 504, "deadline passed in the router", path=path)
        return await self._pass(response, replica, send, receive, taps, hidden)

    # -- the lane ----------------------------------------------------------------------------
    def _lane_head(self, head: LaneHead) -> LaneHead | None:
        """`head` with its target, when what the head says lets the lane take it (its path
        names a v2 inference, its model has no canary or shadow, its body is within the limit,
        its request-timeout is valid); None: the app's path. Made once per head
        (`LaneHeads`), as none of it changes while the router runs."""
        target = self.lane_targets.get(head.path)
        if target is None:
            named = ModelPath.parse("POST", head.path)
            if named is None or named.verb != "infer" or len(self.lane_targets) >= _LANE_TARGETS:
                return None
            target = self.lane_targets[head.path] = LaneTarget(
                head.path, named.model, named.version
            )
        model = target.model
        if head.length > self.settings.max_body_bytes:
            return None
        if model in self.canary.rules or model in self.shadow.rules:
            return None
        if head.timeout is not None and _timeout([(b"request-timeout", head.timeout)]) is False:
            return None  # the app's path answers 400
        head.target = target
        return head

    def lane(self, client: LaneClient, head: LaneHead, request: bytes) -> LaneCall | None:
        """Send `request` (its head is `head`, its body all in, from `lane_heads`) to a
        replica on the lane (`lane.py`), as it came; None when it takes this app's path."""
        target = head.target
        if target is None or self.draining or target.model in self.kinds.language:
            return None
        if b'"sequence_id"' in request:  # a stateful model's sequence: the app's path
            return None
        now = time.monotonic()
        replica = self._lane_pick(now, ())
        if replica is None:
            return None
        hedge = self.settings.hedge
        delay = None
        # a model not seen to answer as a classic model yet is not sent twice (`model_kinds`);
        # with no other replica to take a second copy, no hedge is timed
        if (
            hedge.enabled
            and target.model in self.kinds.classic
            and self.has_other(MAIN, now, (replica,))
        ):
            delay = hedge.delay(target.model)
        # passed as it came: its request-timeout less nothing but this parse
        call = LaneCall(self, client, head, target, request, now, replica)
        if not call.send(delay):
            return None  # no idle connection: this app's path makes one
        self.retries.request(now)
        if hedge.enabled:
            self.hedges.request(now)
        return call

    def _lane_pick(self, now: float, exclude: Collection[Replica]) -> Replica | None:
        """A replica of the main group for a lane request (power of two choices, as `_pick`
        chooses); None when every usable one is full (the app's path sheds) or none is
        usable."""
        replicas = self.pool.replicas  # the main group's, unless some have a label
        members = self.groups.members(replicas, MAIN) if self.groups.labels else replicas
        choices = []
        for r in members:
            if r.open(now) and r not in exclude:
                choices.append(r)
        if len(choices) == 1:
            return choices[0]
        return self.balancer.choose(choices) if choices else None

    def lane_attempt(
        self, call: LaneCall, replica: Replica, answer: LaneAnswer | None, now: float
    ) -> bool:
        """A lane attempt on `replica` ended, as `_attempt` counts one: False when it gave no
        answer to pass on (none, or a 503)."""
        replica.in_flight -= 1
        if answer is None:
            self.attempts.inc((replica.url, "error"))
            self._failed(replica)
            return False
        status = answer.status
        model = call.target.model
        self._answered_by(replica, status, answer.header(_INFLIGHT), now)
        if model not in self.kinds.classic or _KIND in answer.lowered:
            self.kinds.learn(model, status, answer.header(_KIND) == LANGUAGE_KIND)
        if status == 503:
            return False
        if status == 200 and self.settings.hedge.enabled:
            self.settings.hedge.observe(model, now - call.arrived)
        return True

    def lane_hedge(self, call: LaneCall) -> Replica | None:
        """The replica for a lane request's second copy, if one is usable and the hedge
        budget allows it (as `_hedged` asks)."""
        now = time.monotonic()
        second = self._lane_pick(now, [c.replica for c in call.copies])
        if second is None or not self.hedges.try_spend(now):
            return None
        return second

    def lane_done(self, call: LaneCall, status: int, now: float, hedged: str | None) -> None:
        """A lane request's answer has gone to its client: counted as `__call__` counts;
        `hedged`: which copy answered first, when a second was sent."""
        if hedged is not None:
            self.hedged.inc((hedged,))
        target = call.target
        series = target.series.get(status)
        if series is None:
            labels = _STATUS.get(status) or (str(status),)
            model = self.model_counts.labels(target.model, target.version, MAIN, status)
            series = target.series[status] = LaneSeries(labels, self.latency.tally(labels), model)
        series.answered += 1  # added to the counters on the next scrape (`_fold_lane`)
        series.latency.observe(now - call.arrived)

    def _fold_lane(self) -> None:
        """Add the lane's answers counted since the last scrape to the router's counters."""
        for target in self.lane_targets.values():
            for series in target.series.values():
                answered = series.taken()
                if answered:
                    self.requests.inc(series.status, answered)
                    if series.model is not None:
                        self.model_counts.requests.inc(series.model, answered)
                    self.lane_outcomes.inc(_ANSWERED, answered)

    async def _sequence_of(
        self, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> SequenceRequest | None:
        """The sequence a v2 inference request names, read off its body (inflated to look, when
        compressed; sent on as it came)."""
        coding = coding_of(_header(headers, b"content-encoding"))
        if coding is not None:
            try:
                body = await inflate(body, coding, self.settings.max_body_bytes)
            except ServingError:
                return None  # the replica answers it
        return SequenceRequest.of_json(headers, body)

    async def _inflated(
        self, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """An OpenAI request's body decoded from its Content-Encoding (gzip or deflate; 415
        for another, 413 past the body limit inflated), and its headers without it."""
        coding = coding_of(_header(headers, b"content-encoding"))
        if coding is None:
            return body, headers
        body = await inflate(body, coding, self.settings.max_body_bytes)
        return body, [(k, v) for k, v in headers if k != b"content-encoding"]

    def _route(self, scope: Scope, headers: list[tuple[bytes, bytes]], body: bytes) -> Route:
        """Where the request goes: its path after a canary, its group, what balancing reads."""
        method, path = scope["method"], scope["path"]
        query = scope["query_string"].decode("latin-1")
        route = Route(path, path + ("?" + query if query else ""))
        route.target = ModelPath.parse(method, path)
        if route.target is not None:
            route.version = route.target.version
            rule = self.canary.choose(route.target.model, route.version is None)
        elif method == "POST" and path in OPENAI_PATHS:
            chars, generates = self.settings.llm_routing.prefix_chars, path != EMBEDDINGS_PATH
            route.llm = LLMRequest.parse(body, chars, generates)
            pinned = _header(headers, MODEL_VERSION_HEADER)  # the client names a version
            route.version = _version(pinned)
            rule = self.canary.choose(route.llm.model, pinned is None) if route.llm.model else None
        else:
            rule = None
        if rule is not None and rule.version is not None:
            if route.target is not None:
                route.path = route.target.at(rule.version)
            else:
                route.pin = rule.version
            route.version = rule.version
        elif rule is not None and rule.group is not None:
            now = time.monotonic()
            members = self.groups.members(self.pool.replicas, rule.group)
            if any(r.usable(now) for r in members):  # else the main replicas take it
                route.group = rule.group
        if self.sticky is not None:
            route.session = self.sticky.key(headers)
        if query:
            route.path += "?" + query
        return route

    def _pick(self, route: Route, now: float, exclude: Collection[Replica]) -> Replica | None:
        """The replica for the next try of `route`, of those not in `exclude`."""
        choices: list[Replica] = []
        full: list[Replica] = []  # taken only when no other is left
        for r in self.groups.members(self.pool.replicas, route.group):
            if r.usable(now) and r not in exclude:
                (full if r.full(now) else choices).append(r)
        if route.home is not None:  # a stored response's replica, or none
            return route.home if route.home in choices or route.home in full else None
        if route.sequence is not None:  # never moved for load: full replicas count
            return self.sequences.pick(route.sequence, [*choices, *full])
        choices = choices or full
        if not choices:
            return None
        if route.session is not None and self.sticky is not None:
            return self.sticky.pick(route.session, choices)
        if route.llm is not None and route.llm.generates:
            return self.llm_routing.pick(route.llm.prefix, choices)
        return self.balancer.choose(choices)

    def has_other(self, group: str, now: float, exclude: Collection[Replica]) -> bool:
        """Whether a usable replica of `group` not in `exclude` could take a copy now (HTTP
        and gRPC ask it before timing a hedge)."""
        members = self.groups.members(self.pool.replicas, group)
        return any(r.usable(now) and r not in exclude for r in members)

    def _pick_in(self, group: str) -> Replica | None:
        """A usable replica of `group` (for a shadow's copy)."""
        return self._pick(Route("", "", group=group), time.monotonic(), ())

    async def _refuse(self, send: Send, refusal: Refusal, path: str) -> int:
        self.rate_limited.inc((refusal.limit,))
        return await _error(send, 429, refusal.message, refusal.retry_after, path)

    async def _answer(
        self,
        method: str,
        route: Route,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        arrived: float,
        timeout: float | None,
        model: str | None,
        lane: LaneCall | None = None,
    ) -> tuple[Response, Replica]:
        """The answer to pass on, after retries and hedges (`lane`: the attempt made on the
        lane, which gave none)."""
        tried: list[Replica] = list(lane.tried) if lane is not None else []
        last = lane.refused if lane is not None else None
        # a sequence's state, a stored response, live on one replica: one try, never hedged
        pinned = route.sequence is not None or route.home is not None
        attempts = 1 if pinned else self.settings.max_attempts
        # a language model's (or one not seen to answer yet) is never sent twice: no hedge,
        # no retry once sent
        once = route.generates
        if model is not None:
            once = not self.kinds.repeatable(model)
        hedged = not once and route.sequence is None
        if once and lane is not None and lane.broken:  # it may have reached the replica
            raise Failure(f"{lane.replica.url} broke off before answering (not sent again)")
        for attempt in range(len(tried), attempts):
            now = time.monotonic()
            if attempt and not self.retries.try_spend(now):
                self.retries_denied.inc()
                break
            try:
                replica = self._pick(route, now, tried)
            except SequenceGone as exc:
                raise Failure(str(exc), 503) from None
            if replica is None:
                break
            if attempt:
                self.retried.inc()
            sent = _with_deadline(headers, timeout, arrived)
            delay = self.settings.hedge.delay(model) if hedged and model is not None else None
            if delay is not None and not self.has_other(route.group, now, [*tried, replica]):
                delay = None  # no other replica could take a second copy: no hedge to time
            try:
                if delay is not None:
                    response, replica = await self._hedged(
                        replica, method, route, sent, body, delay, tried
                    )
                else:
                    response = await self._attempt(replica, method, route.path, sent, body)
            except Failure as exc:
                tried.append(replica)
                if once and exc.sent:  # it may have reached the replica: not run twice
                    message = (
                        f"{exc} (not sent again: a language model's request, or one of a "
                        "model not seen to answer yet)"
                    )
                    raise Failure(message, exc.status) from None
                continue
            if response.status == 503:  # that replica's admission refused: try another
                tried.append(replica)
                if last is not None:
                    last[0].abort()
                last = (response, replica)
                continue
            if model is not None:
                self._learn(model, response)
                if response.status == 200 and self.settings.hedge.enabled and not once:
                    self.settings.hedge.observe(model, time.monotonic() - arrived)
            if last is not None:
                last[0].abort()
            return response, replica
        if last is not None:
            return last  # every replica tried refused: pass the last refusal on
        members = self.groups.members(self.pool.replicas, route.group)
        if not any(r.usable(time.monotonic()) for r in members):
            raise Failure("no replica is ready", 503)
        raise Failure("no replica answered")

    async def _attempt(
        self,
        replica: Replica,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        whole: bool = False,
    ) -> Response:
        """One try on one replica; Failure when it gave no answer or a server error."""
        replica.in_flight += 1
        try:
            try:
                response = await replica.upstream.request(method, path, headers, body)
                if whole:  # read it here, so that a hedge's winner is a complete answer
                    try:
                        data = await response.read()
                    except BaseException:
                        response.abort()
                        raise
                    response.put(data)
                    response.put(None)
            except UpstreamError as exc:
                self.attempts.inc((replica.url, "error"))
                self._failed(replica)
                raise Failure(str(exc), sent=exc.sent) from exc
        finally:
            replica.in_flight -= 1
        reported = response.header(b"x-lockgate-inflight")
        self._answered_by(replica, response.status, reported, time.monotonic())
        return response

    async def _home(self, rid: str, group: str, headers: list[tuple[bytes, bytes]]) -> Replica:
        """The replica that stored response `rid` (`response_homes.py`): the one the table
        names, else the one of the usable replicas of `group`, asked at once, that holds it;
        Failure (503: not usable, 404: none holds it) otherwise."""
        now = time.monotonic()
        members = [r for r in self.groups.members(self.pool.replicas, group) if r.usable(now)]
        url = self.response_homes.home(rid)
        if url is not None:
            home = next((r for r in members if r.url == url), None)
            if home is None:
                message = f"response '{rid[:80]}' is stored on replica {url}, not usable now"
                raise Failure(message, 503)
            return home
        path = f"{RESPONSES_PATH}/{urllib.parse.quote(rid, safe='')}"
        asked = [(k, v) for k, v in headers if not k.startswith(b"content-")]
        held = await asyncio.gather(*(self._holds(r, path, asked) for r in members))
        for replica, holds in zip(members, held, strict=True):
            if holds:
                self.response_homes.keep(rid, replica.url)
                return replica
        message = (
            f"no replica stores a response with id '{rid[:80]}' (each replica keeps the "
            "responses it answered, in memory)"
        )
        raise Failure(message, 404)

    async def _holds(self, replica: Replica, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        try:
            response = await self._attempt(replica, "GET", path, headers, b"", whole=True)
        except Failure:
            return False
        return response.status == 200

    def _stored(self, asked: ResponseRequest, response: Response, replica: Replica) -> None:
        """What an answer of the Responses API says of where responses are stored."""
        if response.status != 200:
            return
        if asked.creates:
            rid = response.header(RESPONSE_ID_HEADER)
            if rid:
                self.response_homes.keep(rid.decode("latin-1"), replica.url)
        elif asked.deletes and asked.rid is not None:
            self.response_homes.forget(asked.rid)

    def _learn(self, model: str, response: Response) -> None:
        """What an answer says of its model: a language model's, or a classic one."""
        language = response.header(MODEL_KIND_HEADER) == LANGUAGE_KIND
        self.kinds.learn(model, response.status, language)

    def _answered_by(
        self, replica: Replica, status: int, reported: bytes | None, now: float
    ) -> None:
        """Count an answer of `replica` and what it says of the replica: full (503),
        failing (another 5xx but 504), else healthy, with its reported load (the
        x-lockgate-inflight header's value)."""
        self.attempts.inc((replica.url, _STATUS_TEXT.get(status) or str(status)))
        if status == 503:
            replica.refused(now, self.pool.health)
        elif status >= 500 and status != 504:
            self._failed(replica)
        else:
            replica.succeeded(int(reported) if reported and reported.isdigit() else None)

    def _failed(self, replica: Replica) -> None:
        if replica.failed(time.monotonic(), self.pool.health):
            log.warning("router: %s ejected after repeated failures", replica.url)

    async def _hedged(
        self,
        first: Replica,
        method: str,
        route: Route,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        delay: float,
        tried: list[Replica],
    ) -> tuple[Response, Replica]:
        """The first complete answer of two copies, the second sent after `delay` s."""
        path = route.path
        one = asyncio.create_task(self._attempt(first, method, path, headers, body, True))
        if await finished_within(one, delay):
            return one.result(), first
        second = self._pick(route, time.monotonic(), [*tried, first])
        if second is None or not self.hedges.try_spend(time.monotonic()):
            return await one, first
        two = asyncio.create_task(self._attempt(second, method, path, headers, body, True))
        copies = {one: first, two: second}
        pending = set(copies)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None and task.result().status != 503:
                        self.hedged.inc(("first" if task is one else "second",))
                        return task.result(), copies[task]
            # both failed or refused: the first copy's outcome decides
            return one.result(), first
        finally:
            for task in pending:
                task.cancel()  # its connection is aborted: the replica drops the work

    async def _pass(
        self,
        response: Response,
        replica: Replica,
        send: Send,
        receive: Receive,
        taps: Collection[Tap] = (),
        hidden: HiddenUsage | None = None,
    ) -> int:
        """The answer to the client as it arrives, read by `taps`; `hidden`: a stream's usage
        chunks that the router asked for, not the client, are taken out."""
        for tap in taps:
            tap.head(response)
        headers = [(k, v) for k, v in response.headers if k not in HOP_BY_HOP]
        length = response.header(b"content-length")
        if length is not None:
            headers.append((b"content-length", length))
        if response.status != 200 or length is not None:
            hidden = None  # not a stream: passed on as it is
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        if hidden is None and response.at_hand:
            start[HOLD] = True
        await send(start)
        # The client's disconnect is watched only while the answer waits for the replica: an
        # answer already here whole (most of them) passes on without a task of its own.
        watch: asyncio.Task[None] | None = None
        try:
            while True:
                if watch is None and response.waiting:
                    watch = asyncio.create_task(_disconnected(receive, response))
                chunk = await response.next()
                if chunk is None:
                    break
                for tap in taps:
                    tap.feed(chunk)
                if hidden is not None and not (chunk := hidden.edit(chunk)):
                    continue
                if hidden is None and response.ending:  # the last chunk ends the answer too
                    for tap in taps:
                        tap.end()
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    return response.status
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if hidden is not None and (rest := hidden.rest()):
                await send({"type": "http.response.body", "body": rest, "more_body": True})
        except UpstreamError as exc:
            if watch is not None and watch.done():  # the client left: nothing more to do
                return response.status
            log.warning("router: %s broke off an answer: %s", replica.url, exc)
            raise  # the client's connection closes: it sees the answer cut short
        except BaseException:
            response.abort()
            raise
        finally:
            if watch is not None:
                watch.cancel()
        for tap in taps:
            tap.end()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return response.status


async def _disconnected(receive: Receive, response: Response) -> None:
    """When the client leaves mid-answer, close the replica's connection: it stops the work
    (a stream stops generating)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            response.abort()
            return


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def _version(text: bytes | None) -> str | None:
    """A version a header names, for counting; None when it names none (or no number: the
    replica answers 400)."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return str(int(text)) if int(text) > 0 else None


def _timeout(headers: list[tuple[bytes, bytes]]) -> float | bool | None:
    for name, value in headers:
        if name == b"request-timeout":
            try:
                seconds = float(value)
            except ValueError:
                return False
            return seconds if 0 < seconds < 1e7 and math.isfinite(seconds) else False
    return None


def _with_deadline(
    headers: list[tuple[bytes, bytes]], timeout: float | None, arrived: float
) -> list[tuple[bytes, bytes]]:
    if timeout is None:
        return headers
    left = timeout - (time.monotonic() - arrived)
    if left <= 0:
        raise TimeoutError
    kept = [(k, v) for k, v in headers if k != b"request-timeout"]
    return [*kept, (b"request-timeout", f"{left:.6f}".encode())]


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers, HOLD: True})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, payload: Any) -> None:
    await _respond(send, status, _encode(payload), b"application/json")


async def _error(
    send: Send, status: int, message: str, retry_after: int | None = None, path: str = ""
) -> int:
    """The router's own error: in the OpenAI API's shape on its paths (`path`), else v2's."""
    extra = [(b"retry-after", b"%d" % retry_after)] if retry_after is not None else None
    payload: Any = {"error": message}
    if openai_path(path):
        payload = error_body(message, _KINDS.get(status, "router_error"), status)
    with contextlib.suppress(Exception):
        await _respond(send, status, _encode(payload), b"application/json", extra)
    return status


# the error types of the router's own answers on the OpenAI API, by status
_KINDS = {
    400: "invalid_request",
    404: "not_found",
    413: "payload_too_large",
    429: "rate_limited",
    502: "bad_gateway",
    503: "unavailable",
    504: "deadline_exceeded",
}
