"""The router's gRPC front: KServe v2 over gRPC (`inference.GRPCInferenceService`) passed to
the replicas' gRPC servers as bytes, never decoded.

grpc.aio's generic handlers take every call of the service with no (de)serializer: the
request's bytes go to a replica picked by the router's balancer (power of two choices on load,
over the same replicas, probes and ejections as HTTP), and the replica's answer, or its status
code, message and trailing metadata, come back unchanged. One channel per replica.

- Unary calls (ServerLive, ModelReady, metadata, ModelInfer, RepositoryIndex, ...): a call
  that ended UNAVAILABLE (no connection, or the replica's admission refused) goes to a replica
  not tried yet, at most `max_attempts` tries, within the router's retry budget (one budget
  for HTTP and gRPC). The client's deadline is passed on less the time spent in the router;
  once it is spent, DEADLINE_EXCEEDED. When every usable replica is full, UNAVAILABLE at once
  with `retry-after`. Other codes (NOT_FOUND, INVALID_ARGUMENT, ...) are the replica's answer.
- ModelInfer is hedged as v2 inference over HTTP is, by the same policy, budget and metrics
  (and, as there, only for a model seen to answer as a classic one: a language model's
  answers carry the trailing metadata `x-lockgate-model-kind: language`, and its requests
  are never hedged nor retried but after a refusal, `model_kinds.py`):
  when a call has not ended after its model's delay (`HedgePolicy`: the model's recent 95th
  percentile latency, over HTTP and gRPC answers alike), a second copy goes to another replica
  within the hedge budget; the first to end with an answer or a status other than UNAVAILABLE
  wins, and the other copy's call is cancelled, so its replica drops the work. The model is
  read off the request's bytes (`grpc_model.py`); the tensors are not decoded.
- A ModelInfer of a stateful model's sequence (its parameters name a `sequence_id`) goes to
  the sequence's replica (`sequence_affinity.py`, one table for HTTP and gRPC), once: never
  hedged nor retried; when that replica is not usable, UNAVAILABLE with a message naming it.
- ModelStreamInfer: one bidirectional stream pinned to one replica, never retried nor hedged,
  but for the requests of a sequence, each of which goes to its sequence's replica on a call
  of the stream's own there (`_Spread`; a sequence whose replica is not usable gets an error
  answer in the stream, which goes on). At most `max_stream_inflight` messages are passed to
  each replica and not yet answered back to the client; past that the router stops reading
  the client's side, so a client that writes and never reads holds bounded memory (HTTP/2
  flow control then holds its writes).
- RepositoryModelLoad and RepositoryModelUnload go to every replica, as their HTTP routes do
  (`model_control.py`): the request is read and sent on to each replica's HTTP port as the
  same load or unload (a parameter's bytes in base64, metadata as headers); OK when every
  replica applied it, else the first failure's code and a message naming each replica that
  failed.
- ModelStatistics: every usable replica's statistics, summed per model and version
  (`statistics.py`): asked of each replica's HTTP port, as a statistics request over HTTP
  is, and answered as a ModelStatisticsResponse; the trailing metadata
  `x-lockgate-statistics-replicas` (and `-missing`) says which replicas the sum holds.
- LogSettings and TraceSetting: UNIMPLEMENTED, each replica's own (`replica_settings.py`).
- `grpc.health.v1.Health`: service "" is the router (SERVING while a replica is usable and the
  router is not draining); any other name (a model) is asked of a replica.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import msgspec
from google.protobuf.message import DecodeError
from grpc.aio import ServicerContext as Context
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockgate.errors import ServingError
from lockgate.protocol.grpc import codec
from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.grpc.status import STATUS_CODES, cancelled_code
from lockgate.protocol.llm_tensors import LANGUAGE_KIND, MODEL_KIND_HEADER
from lockgate.router import replica_settings
from lockgate.router.app import RouterApp
from lockgate.router.control_log import Control
from lockgate.router.groups import MAIN
from lockgate.router.grpc_model import model_of, sequence_of
from lockgate.router.hedge import finished_within
from lockgate.router.pool import split_url
from lockgate.router.replica import Replica
from lockgate.router.sequence_affinity import SequenceGone, SequenceRequest
from lockgate.router.statistics import StatisticsRequest

log = logging.getLogger("lockgate.router")

SERVICE = "inference.GRPCInferenceService"
PREFIX = f"/{SERVICE}/"
_DESCRIBED = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
KNOWN = frozenset(PREFIX + m.name for m in _DESCRIBED)
STREAMS = frozenset(PREFIX + m.name for m in _DESCRIBED if m.client_streaming)
MODEL_INFER = PREFIX + "ModelInfer"  # idempotent: hedged
STREAM_INFER = PREFIX + "ModelStreamInfer"
SERVER_READY = PREFIX + "ServerReady"  # answered not ready by the router itself when it is not
NOT_READY = b""  # a ServerReadyResponse with ready false (proto3 leaves a false bool out)
SERVER_LIVE = PREFIX + "ServerLive"  # the router's own liveness, as REST's /v2/health/live
LIVE = b"\x08\x01"  # a ServerLiveResponse with live true (field 1, varint 1)
MODEL_STATISTICS = PREFIX + "ModelStatistics"  # every replica's, summed
# the replica's own faults: counted towards ejection, as a 5xx on HTTP
REPLICA_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
# metadata that belongs to the call or its connection, not to the request: never forwarded
_OWN_KEYS = frozenset({"user-agent", "content-type", "te", "host", "content-length"})
# model control: to every replica, over HTTP
CONTROL: dict[str, tuple[str, Any]] = {
    PREFIX + "RepositoryModelLoad": ("load", pb.RepositoryModelLoadRequest),
    PREFIX + "RepositoryModelUnload": ("unload", pb.RepositoryModelUnloadRequest),
}
CONTROL_CODES = {**STATUS_CODES, 502: grpc.StatusCode.UNAVAILABLE}  # 502: a replica not reached
_KIND_KEY, _LANGUAGE = MODEL_KIND_HEADER.decode(), LANGUAGE_KIND.decode()
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
WATCH_INTERVAL_S = 0.5
Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True, slots=True)
class ReplicaGrpcPort:
    """Where each replica serves gRPC: `port` on every replica (as on Kubernetes), or else its
    HTTP port plus `offset` (replicas on one host); `explicit` ports, by replica URL, first."""

    port: int | None = None
    offset: int = 1
    explicit: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, rule: str, urls: Sequence[str] = ()) -> ReplicaGrpcPort:
        """`rule` is '8001' (the same port on every replica) or '+2' (the HTTP port plus 2);
        a replica URL may name its own port: 'http://10.0.0.5:8000?grpc=9001'."""
        text = rule.strip()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"replica gRPC port {rule!r}: give PORT or +OFFSET") from None
        explicit = {_normal(url): port for url in urls if (port := _query_port(url))}
        if text.startswith(("+", "-")):
            return cls(offset=value, explicit=explicit)
        return cls(port=_checked(value, rule), explicit=explicit)

    def target(self, url: str) -> str:
        host, http_port = split_url(url)
        port = self.explicit.get(_normal(url))
        if port is None:
            port = self.port if self.port is not None else http_port + self.offset
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _normal(url: str) -> str:
    """A replica's URL as the pool spells it: http://host:port."""
    host, port = split_url(url)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _query_port(url: str) -> int | None:
    """The `grpc=PORT` of a replica URL's query, or None."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    values = query.get("grpc")
    if not values:
        return None
    try:
        return _checked(int(values[-1]), url)
    except ValueError:
        raise ValueError(f"replica {url!r}: grpc= must be a port number") from None


def _checked(port: int, source: str) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"{source}: port {port} is outside 1-65535")
    return port


@dataclass(frozen=True, slots=True)
class GrpcFrontSettings:
    host: str = "127.0.0.1"
    port: int = 8001
    required: bool = True  # False: a port that cannot be bound is logged, HTTP serves alone
    replica_port: ReplicaGrpcPort = field(default_factory=ReplicaGrpcPort)
    max_receive_bytes: int = 64 * 2**20  # a larger request gets RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int | None = 1024  # calls beyond this get RESOURCE_EXHAUSTED at once
    max_stream_inflight: int = 64  # messages of one stream sent on and not yet answered
    drain_timeout: float = 30.0  # seconds for calls in progress to end when the router stops

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--grpc-port {self.port} is outside 1-65535")
        if self.max_stream_inflight < 1:
            raise ValueError("--grpc-max-stream-inflight must be at least 1")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError("--grpc-max-concurrent-rpcs must be at least 1")


class _Status(Exception):
    """How a call ends when it does not end with an answer."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError) -> _Status:
        return cls(error.code(), error.details() or "", _forwarded(error.trailing_metadata()))

    @property
    def refusal(self) -> bool:
        """The replica's admission said no (it sends retry-after), not a lost connection."""
        return self.code == grpc.StatusCode.UNAVAILABLE and any(
            key == "retry-after" for key, _ in self.trailing
        )


@dataclass(frozen=True, slots=True)
class _Call:
    """One unary call, as each copy of it is sent."""

    method: str
    request: bytes
    metadata: Metadata
    context: Context
    model: str | None = None  # a ModelInfer's: its answers tell the model's kind


class _Retry(Exception):
    """An attempt worth sending to another replica; `status` is what it ended with."""

    def __init__(self, status: _Status) -> None:
        super().__init__(status.details)
        self.status = status


class _Link:
    """One replica's channel, with a callable per method."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),  # the replica bounds its answers
                # a replica that restarted is reached again within a second, not minutes
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.unaries: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self.health = self.channel.unary_unary(
            HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    def unary(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        call = self.unaries.get(method)
        if call is None:
            call = self.channel.unary_unary(method)
            if method in KNOWN:  # a name a client made up is not kept
                self.unaries[method] = call
        return call

    def stream(self, method: str) -> grpc.aio.StreamStreamMultiCallable[bytes, bytes]:
        return self.channel.stream_stream(method)


class _Links:
    """A channel per replica, opened on first use; channels of replicas that left the pool
    are closed when a new replica is first used."""

    def __init__(self, ports: ReplicaGrpcPort) -> None:
        self.ports = ports
        self.links: dict[str, _Link] = {}
        self.closing: set[asyncio.Task[None]] = set()

    def get(self, replica: Replica, replicas: Sequence[Replica]) -> _Link:
        link = self.links.get(replica.url)
        if link is None:
            self._prune({r.url for r in replicas})
            link = self.links[replica.url] = _Link(self.ports.target(replica.url))
        return link

    def _prune(self, known: set[str]) -> None:
        for url in [u for u in self.links if u not in known]:
            task = asyncio.get_running_loop().create_task(self.links.pop(url).channel.close(5.0))
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*(link.channel.close() for link in self.links.values()))
        self.links.clear()


class _Window:
    """The messages of one stream sent to the replica and not yet answered to the client,
    counted on the replica's load too."""

    def __init__(self, limit: int, replica: Replica) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.replica = replica
        self.held = 0

    async def acquire(self) -> None:
        await self.slots.acquire()
        self.held += 1
        self.replica.in_flight += 1

    def release(self) -> None:
        if self.held:  # an answer beyond one per request takes no slot back
            self.held -= 1
            self.replica.in_flight -= 1
            self.slots.release()

    def close(self) -> None:
        self.replica.in_flight -= self.held
        self.held = 0


class GrpcFront:
    """The gRPC server in front of the replicas, on the router's event loop."""

    def __init__(self, router: RouterApp, settings: GrpcFrontSettings) -> None:
        self.router = router
        self.settings = settings
        self.links = _Links(settings.replica_port)
        self.server: grpc.aio.Server | None = None
        self.latency = router.registry.histogram(
            "lockgate_router_grpc_request_duration_seconds",
            "Time from a gRPC call's arrival at the router to its end, by method and status "
            "code (streams: the whole stream).",
            ("method", "code"),
        )

    @property
    def address(self) -> str:
        host = self.settings.host
        return f"[{host}]:{self.settings.port}" if ":" in host else f"{host}:{self.settings.port}"

    async def start(self) -> bool:
        """Serve on the running loop. False (logged) when the port cannot be bound and is not
        required; OSError when it is."""
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.settings.max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", self.settings.max_receive_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a second server on the port must fail, not share it
            ],
        )
        server.add_generic_rpc_handlers((_Handler(self),))
        health_pb2_grpc.add_HealthServicer_to_server(_Health(self), server)
        try:
            server.add_insecure_port(self.address)
        except RuntimeError as exc:
            if self.settings.required:
                raise OSError(f"cannot serve gRPC on {self.address}: {exc}") from None
            log.error("router: gRPC not served: cannot bind %s (%s)", self.address, exc)
            return False
        await server.start()
        self.server = server
        log.info("lockgate router gRPC listening on %s", self.address)
        return True

    async def stop(self) -> None:
        """Refuse new calls, give those in progress `drain_timeout` seconds, close channels."""
        if self.server is not None:
            await self.server.stop(self.settings.drain_timeout)
        await self.links.close()

    # -- unary calls -----------------------------------------------------------------------
    async def unary(self, method: str, request: bytes, context: Context) -> bytes:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await self._unary(method, request, context)
        except _Status as status:
            code = status.code
            await _abort(context, status)
        except asyncio.CancelledError:
            code = cancelled_code(context)
            raise
        finally:
            self.latency.observe((_label(method), code.name), time.perf_counter() - start)

    async def _unary(self, method: str, request: bytes, context: Context) -> bytes:
        if method == SERVER_LIVE:
            return LIVE
        if method in replica_settings.METHODS:
            raise _Status(grpc.StatusCode.UNIMPLEMENTED, replica_settings.MESSAGE)
        if method == SERVER_READY and (self.router.draining or not self.router.pool.ready()):
            return NOT_READY  # as REST's readiness says 503: not an error to the client
        if method in CONTROL:
            return await self._control(method, request, context)
        if method == MODEL_STATISTICS:
            return await self._statistics(request, context)
        arrived = time.monotonic()
        metadata = _forwarded(context.invocation_metadata())
        self._admit()
        router = self.router
        model = model_of(request) if method == MODEL_INFER else None
        call = _Call(method, request, metadata, context, model)
        sequence = sequence_of(request) if method == MODEL_INFER else None
        if sequence is not None:
            return await self._in_sequence(call, sequence)
        tried: list[Replica] = []
        refusal: _Status | None = None
        for attempt in range(router.settings.max_attempts):
            now = time.monotonic()
            if attempt and not router.retries.try_spend(now):
                router.retries_denied.inc()
                break
            main = router.groups.members(router.pool.replicas, MAIN)
            replica = router.balancer.pick(main, now, [*tried, *_out(router, now)])
            if replica is None:
                break
            if attempt:
                router.retried.inc()
            # a language model's (or one not seen to answer yet) is never sent twice
            once = model is not None and not router.kinds.repeatable(model)
            delay = router.settings.hedge.delay(model) if model is not None and not once else None
            if delay is not None and not router.has_other(MAIN, now, [*tried, replica]):
                delay = None  # no other replica could take a second copy: no hedge to time
            try:
                if delay is None:
                    response = await self._attempt(replica, call)
                else:
                    response = await self._hedged(replica, call, delay, tried)
            except _Retry as retry:
                tried.append(replica)
                if once and not retry.status.refusal:
                    raise retry.status from None  # it may have reached the replica
                refusal = retry.status if retry.status.refusal else refusal
                continue
            if model is not None and not once:
                router.settings.hedge.observe(model, time.monotonic() - arrived)
            return response
        if refusal is not None:
            raise refusal  # every replica tried refused: pass the last refusal on
        raise self._unanswered()

    async def _in_sequence(self, call: _Call, sequence: SequenceRequest) -> bytes:
        """A request of a sequence: to the replica that holds it, once."""
        try:
            replica = self.router.sequences.pick(sequence, self._usable())
        except SequenceGone as exc:
            raise _Status(grpc.StatusCode.UNAVAILABLE, str(exc), _retry_after()) from None
        if replica is None:
            raise self._unanswered()
        try:
            return await self._attempt(replica, call)
        except _Retry as retry:
            raise retry.status from None

    async def _control(self, method: str, request: bytes, context: Context) -> bytes:
        """A load or unload, sent to every replica (`model_control.py`) as its HTTP route."""
        action, kind = CONTROL[method]
        try:
            message = kind.FromString(request)
        except DecodeError:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "malformed request") from None
        name: str = message.model_name
        if not name or "/" in name or name in (".", ".."):
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"invalid model name {name[:200]!r}")
        parameters = {key: _plain(p) for key, p in message.parameters.items()}
        body = _encode_json({"parameters": parameters})
        headers = [(b"content-type", b"application/json"), *_http_headers(context)]
        left = _time_left(context)
        deadline = None if left is None else time.monotonic() + left
        answer = await self.router.control.apply(Control(name, action), headers, body, deadline)
        if answer.status != 200:
            code = CONTROL_CODES.get(answer.status, grpc.StatusCode.INTERNAL)
            raise _Status(code, answer.message[:_MAX_MESSAGE])
        return b""  # an empty RepositoryModelLoadResponse (or Unload)

    async def _statistics(self, request: bytes, context: Context) -> bytes:
        """Every replica's statistics, summed (`statistics.py`), asked over HTTP as their
        HTTP route asks them; which replicas the sum holds, in the trailing metadata."""
        try:
            message = pb.ModelStatisticsRequest.FromString(request)
        except DecodeError:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "malformed request") from None
        asked = StatisticsRequest(message.name or None, message.version or None)
        left = _time_left(context)
        deadline = None if left is None else time.monotonic() + left
        summed = await self.router.statistics.gather(asked, _http_headers(context), deadline)
        trailing = tuple((key.decode(), value.decode()) for key, value in summed.headers)
        if summed.status != 200:
            code = STATUS_CODES.get(summed.status, grpc.StatusCode.INTERNAL)
            raise _Status(code, summed.message[:_MAX_MESSAGE], trailing)
        try:
            answer = codec.from_document(
                msgspec.json.decode(summed.body), pb.ModelStatisticsResponse()
            )
        except ServingError as exc:
            raise _Status(grpc.StatusCode.INTERNAL, exc.message[:_MAX_MESSAGE], trailing) from None
        context.set_trailing_metadata(trailing)
        return answer.SerializeToString()

    async def _attempt(self, replica: Replica, call: _Call) -> bytes:
        """One try on one replica: its answer; _Retry for UNAVAILABLE, else its _Status."""
        timeout = _time_left(call.context)
        send = self.links.get(replica, self.router.pool.replicas).unary(call.method)
        replica.in_flight += 1
        try:
            sent = send(call.request, timeout=timeout, metadata=call.metadata)
            response = await sent
            if call.model is not None:
                self._learn(call.model, grpc.StatusCode.OK, await sent.trailing_metadata())
        except grpc.aio.AioRpcError as error:
            if call.model is not None:
                self._learn(call.model, error.code(), error.trailing_metadata())
            raise self._failed(replica, _Status.of(error)) from None
        finally:
            replica.in_flight -= 1
        self.router.attempts.inc((replica.url, "OK"))
        replica.succeeded(None, grpc=True)
        return response

    async def _hedged(
        self, first: Replica, call: _Call, delay: float, tried: list[Replica]
    ) -> bytes:
        """The answer of the copy that ends first, of two: the second goes to another replica
        after `delay` s, within the hedge budget. A copy that ends UNAVAILABLE does not win
        (its replica joins `tried` when it was the second): the other copy goes on, and when
        both end so, the first copy's _Retry is raised. The copy that did not win is
        cancelled."""
        router = self.router
        loop = asyncio.get_running_loop()
        one = loop.create_task(self._attempt(first, call))
        copies = {one: first}
        try:
            if await finished_within(one, delay):
                return one.result()  # an answer, a status, or the _Retry it ended with
            now = time.monotonic()
            main = router.groups.members(router.pool.replicas, MAIN)
            second = router.balancer.pick(main, now, [*tried, first, *_out(router, now)])
            if second is not None and router.hedges.try_spend(now):
                copies[loop.create_task(self._attempt(second, call))] = second
            pending = set(copies)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not isinstance(task.exception(), _Retry):
                        if len(copies) > 1:
                            router.hedged.inc(("first" if task is one else "second",))
                        return task.result()  # an answer, or the status the replica gave
                    if task is not one:
                        tried.append(copies[task])
            return one.result()  # both ended UNAVAILABLE: raises the first copy's _Retry
        finally:
            for task in copies:
                if not task.done():
                    task.cancel()  # the copy still running: its call is cancelled
                elif not task.cancelled():
                    task.exception()  # a copy that ended unread: its end is no news

    def _learn(self, model: str, code: grpc.StatusCode, trailing: Any) -> None:
        """What a ModelInfer's end says of its model (`model_kinds.py`)."""
        language = any(key == _KIND_KEY and value == _LANGUAGE for key, value in trailing or ())
        self.router.kinds.learn(model, 200 if code == grpc.StatusCode.OK else 500, language)

    def _failed(self, replica: Replica, status: _Status) -> Exception:
        """What an attempt that ended with `status` raises; the replica's books updated."""
        now = time.monotonic()
        self.router.attempts.inc((replica.url, status.code.name))
        if status.refusal:
            replica.refused(now, self.router.pool.health)
            return _Retry(status)
        if status.code == grpc.StatusCode.UNAVAILABLE or status.code in REPLICA_FAULTS:
            if replica.failed(now, self.router.pool.health, grpc=True):
                log.warning("router: %s ejected from gRPC after repeated failures", replica.url)
            if status.code == grpc.StatusCode.UNAVAILABLE:
                return _Retry(status)
        elif status.code != grpc.StatusCode.DEADLINE_EXCEEDED:
            replica.succeeded(None, grpc=True)  # an answer: the request's fault (NOT_FOUND, ...)
        return status

    def _admit(self) -> None:
        """Count the call in the retry and hedge budgets; refuse it when every replica is full.
        (While draining, health says NOT_SERVING and calls are still served until the front
        stops.)"""
        router, now = self.router, time.monotonic()
        router.retries.request(now)
        router.hedges.request(now)
        if router.pool.all_full(now):
            router.shed.inc()
            wait = router.settings.shed_retry_after
            message = "every replica is full: retry later"
            raise _Status(grpc.StatusCode.UNAVAILABLE, message, _retry_after(wait))

    def _unanswered(self) -> _Status:
        if not self.router.pool.ready():
            return _Status(grpc.StatusCode.UNAVAILABLE, "no replica is ready", _retry_after())
        return _Status(grpc.StatusCode.UNAVAILABLE, "no replica answered", _retry_after())

    # -- streams ---------------------------------------------------------------------------
    async def stream(self, method: str, requests: AsyncIterator[bytes], context: Context) -> None:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            await self._stream(method, requests, context)
        except _Status as status:
            code = status.code
            await _abort(context, status)
        except asyncio.CancelledError:
            code = cancelled_code(context)
            raise
        finally:
            self.latency.observe((_label(method), code.name), time.perf_counter() - start)

    async def _stream(self, method: str, requests: AsyncIterator[bytes], context: Context) -> None:
        metadata = _forwarded(context.invocation_metadata())
        self._admit()
        now = time.monotonic()
        main = self.router.groups.members(self.router.pool.replicas, MAIN)
        replica = self.router.balancer.pick(main, now, _out(self.router, now))
        if replica is None:
            raise self._unanswered()
        spread = _Spread(self, method, metadata, _time_left(context), context)
        spread.leg(replica)
        sender = asyncio.get_running_loop().create_task(self._send(spread, requests, replica))
        try:
            status = await spread.ended(sender)
        finally:
            sender.cancel()
            await asyncio.wait({sender})
            if not sender.cancelled():
                sender.exception()  # a write to a call that had ended: its end is the answer
            await spread.close()
        if status is not None:
            raise status

    async def _send(self, spread: _Spread, requests: AsyncIterator[bytes], own: Replica) -> None:
        """The client's messages, each to the stream's `own` replica or, for a request of a
        sequence, to the sequence's; at most the window's bound unanswered on each."""
        async for message in requests:
            replica = own
            sequence = sequence_of(message) if spread.method == STREAM_INFER else None
            if sequence is not None:
                try:
                    replica = self.router.sequences.pick(sequence, self._usable()) or own
                except SequenceGone as exc:
                    await spread.answer(_stream_error(message, str(exc)))
                    continue
            leg = spread.leg(replica)
            await leg.window.acquire()
            await leg.call.write(message)

    def _usable(self) -> list[Replica]:
        """The main group's replicas that may take a gRPC call now."""
        router, now = self.router, time.monotonic()
        out = _out(router, now)
        main = router.groups.members(router.pool.replicas, MAIN)
        return [r for r in main if r.usable(now) and r not in out]

    def _failed_stream(self, replica: Replica, status: _Status) -> _Status:
        """A stream is never sent again: whatever it ended with is passed on."""
        failed = self._failed(replica, status)
        return failed.status if isinstance(failed, _Retry) else status

    # -- health ----------------------------------------------------------------------------
    def serving(self) -> bool:
        return self.router.pool.ready() and not self.router.draining

    async def model_health(self, service: str, metadata: Metadata) -> Any:
        """A replica's status of `service` (a model); None when the replica knows no such name."""
        replica = self.router.balancer.pick(
            self.router.groups.members(self.router.pool.replicas, MAIN), time.monotonic()
        )
        if replica is None:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        link = self.links.get(replica, self.router.pool.replicas)
        request = health_pb2.HealthCheckRequest(service=service)
        timeout = self.router.pool.health.probe_timeout
        try:
            answer = await link.health(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return answer.status


@dataclass(slots=True)
class _Leg:
    """A client stream's call on one replica."""

    call: Any  # grpc.aio.StreamStreamCall
    window: _Window
    reader: asyncio.Task[None] | None = None


class _Spread:
    """One client stream over the replicas its messages go to: a call on each, opened when its
    first message goes there (all of them go to one replica but a sequence's, which go to the
    sequence's), and every call's answers back on the client's stream. The first call to end
    other than OK ends the stream with its status."""

    def __init__(
        self,
        front: GrpcFront,
        method: str,
        metadata: Metadata,
        timeout: float | None,
        context: Context,
    ) -> None:
        self.front, self.method, self.metadata = front, method, metadata
        self.timeout, self.context = timeout, context
        self.legs: dict[str, _Leg] = {}  # by replica URL
        self.failure: asyncio.Future[_Status] = asyncio.get_running_loop().create_future()
        self.writing = asyncio.Lock()  # one write to the client at a time

    def leg(self, replica: Replica) -> _Leg:
        leg = self.legs.get(replica.url)
        if leg is None:
            link = self.front.links.get(replica, self.front.router.pool.replicas)
            call = link.stream(self.method)(timeout=self.timeout, metadata=self.metadata)
            window = _Window(self.front.settings.max_stream_inflight, replica)
            leg = self.legs[replica.url] = _Leg(call, window)
            leg.reader = asyncio.get_running_loop().create_task(self._read(leg))
        return leg

    async def answer(self, message: bytes) -> None:
        async with self.writing:
            await self.context.write(message)  # resumes once the client can take more

    async def _read(self, leg: _Leg) -> None:
        call, replica = leg.call, leg.window.replica
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                await self.answer(message)
                leg.window.release()
            code = await call.code()
            if code != grpc.StatusCode.OK:
                details = await call.details()
                trailing = _forwarded(await call.trailing_metadata())
                raise _Status(code, details or "", trailing)
        except grpc.aio.AioRpcError as error:
            self._fail(self.front._failed_stream(replica, _Status.of(error)))
        except _Status as status:
            self._fail(self.front._failed_stream(replica, status))
        else:
            self.front.router.attempts.inc((replica.url, "OK"))
            replica.succeeded(None, grpc=True)

    def _fail(self, status: _Status) -> None:
        if not self.failure.done():
            self.failure.set_result(status)

    async def ended(self, sender: asyncio.Task[None]) -> _Status | None:
        """When every call has ended: None when all ended OK, else the first one's status."""
        waits: set[asyncio.Future[Any]] = {sender, self.failure}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.failure.done():
            return self.failure.result()
        for leg in self.legs.values():  # the client is done writing (or a write failed)
            with contextlib.suppress(Exception):
                await leg.call.done_writing()
        readers: set[asyncio.Future[Any]] = {
            leg.reader for leg in self.legs.values() if leg.reader is not None
        }
        while readers and not self.failure.done():
            await asyncio.wait({*readers, self.failure}, return_when=asyncio.FIRST_COMPLETED)
            readers = {reader for reader in readers if not reader.done()}
        return self.failure.result() if self.failure.done() else None

    async def close(self) -> None:
        for leg in self.legs.values():
            leg.call.cancel()
            if leg.reader is not None:
                leg.reader.cancel()
        readers = [leg.reader for leg in self.legs.values() if leg.reader is not None]
        await asyncio.gather(*readers, return_exceptions=True)
        for leg in self.legs.values():
            leg.window.close()


def _stream_error(message: bytes, error: str) -> bytes:
    """A stream's answer that a request failed (its id and model, when they can be read)."""
    try:
        request = pb.ModelInferRequest.FromString(message)
    except DecodeError:
        request = pb.ModelInferRequest()
    answer = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    return pb.ModelStreamInferResponse(
        error_message=error, infer_response=answer
    ).SerializeToString()


class _Method:
    """One method of the service, as grpc.aio calls it: bound coroutines, bytes in and out."""

    def __init__(self, front: GrpcFront, method: str) -> None:
        self.front, self.method = front, method

    async def unary(self, request: bytes, context: Context) -> bytes:
        return await self.front.unary(self.method, request, context)

    async def stream(self, requests: AsyncIterator[bytes], context: Context) -> None:
        await self.front.stream(self.method, requests, context)

    def handler(self) -> grpc.RpcMethodHandler:
        if self.method in STREAMS:
            return grpc.stream_stream_rpc_method_handler(self.stream)
        return grpc.unary_unary_rpc_method_handler(self.unary)


class _Handler(grpc.GenericRpcHandler):
    """Every method of the KServe v2 service, passed through; other services are not served."""

    def __init__(self, front: GrpcFront) -> None:
        self.front = front
        self.known = {method: _Method(front, method).handler() for method in KNOWN}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = details.method  # type: ignore[attr-defined]
        found = self.known.get(method)
        if found is None and method.startswith(PREFIX):
            return _Method(self.front, method).handler()  # newer than this router: unary
        return found


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, front: GrpcFront) -> None:
        self.front = front

    async def status(self, service: str, context: Context) -> Any:
        if service == "":
            serving = self.front.serving()
            return health_pb2.HealthCheckResponse.SERVING if serving else _NOT_SERVING
        return await self.front.model_health(service, _forwarded(context.invocation_metadata()))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        status = await self.status(request.service, context)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = await self.status(request.service, context)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)


_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _forwarded(metadata: Any) -> Metadata:
    """The request's own metadata (authorization, custom keys), without the call's."""
    if not metadata:
        return ()
    return tuple(
        (key, value)
        for key, value in metadata
        if key not in _OWN_KEYS and not key.startswith((":", "grpc-"))
    )


def _http_headers(context: Context) -> list[tuple[bytes, bytes]]:
    """The request's own metadata as HTTP headers, for a call the router sends on over HTTP
    (binary values left out)."""
    return [
        (key.encode(), value.encode())
        for key, value in _forwarded(context.invocation_metadata())
        if isinstance(value, str) and not key.endswith("-bin")
    ]


_encode_json = msgspec.json.Encoder().encode
_MAX_MESSAGE = 4096  # characters of a status message: a client drops a trailer over 8 KiB


def _plain(parameter: Any) -> Any:
    """A ModelRepositoryParameter as its HTTP route's JSON takes it (bytes in base64)."""
    choice = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, choice) if choice is not None else None
    return base64.b64encode(value).decode() if isinstance(value, bytes) else value


def _time_left(context: Context) -> float | None:
    """The client's deadline less the time already spent; _Status once it is spent."""
    left: float | None = context.time_remaining()
    if left is not None and left <= 0:
        raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed in the router")
    return left


def _out(router: RouterApp, now: float) -> list[Replica]:
    """Replicas ejected from gRPC calls (their gRPC port failed), whatever their HTTP."""
    return [r for r in router.pool.replicas if r.grpc.out(now)]


def _retry_after(seconds: int = 1) -> Metadata:
    return (("retry-after", str(seconds)),)


def _label(method: str) -> str:
    """The method's name for metrics; names a client made up share one label."""
    return method[len(PREFIX) :] if method in KNOWN else "other"


async def _abort(context: Context, status: _Status) -> NoReturn:
    await context.abort(status.code, status.details, status.trailing)
    raise AssertionError("grpc.aio's abort always raises")
