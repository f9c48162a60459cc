"""The ASGI application: routing, authentication, health, metrics and error answers.

Routes are matched on path segments, not regular expressions. Every error leaves as
`{"error": "..."}` with its status (OpenAI routes use OpenAI's error shape); a client
mistake never becomes a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric

from lockgate import __version__
from lockgate.backends.base import LLM_BACKEND
from lockgate.cache.redis_tier import RedisSettings
from lockgate.cache.response_cache import ResponseCache
from lockgate.compose.executor import Executor
from lockgate.core.compat_metrics import TritonMetrics
from lockgate.core.manager import ModelManager, ServedVersion
from lockgate.core.metrics import HistogramTally
from lockgate.errors import (
    BadRequest,
    Forbidden,
    NotFound,
    ServingError,
    Unauthorized,
)
from lockgate.extras import import_for
from lockgate.frontend import v2_routes
from lockgate.frontend.access_log import AccessEntry, AccessLog, model_of, request_id
from lockgate.frontend.cors import Cors, is_preflight, origin_of
from lockgate.frontend.dashboard import dashboard_page
from lockgate.frontend.generate_tensor_routes import generate_tensors_route
from lockgate.frontend.http import (
    ClientDisconnected,
    CompressingSend,
    HttpRequest,
    Message,
    Receive,
    Reply,
    Scope,
    Send,
    bearer_of,
    check_method,
    error_headers,
    error_reply,
    respond,
    respond_json,
    respond_reply,
)
from lockgate.frontend.lane import LaneRequest
from lockgate.frontend.model_files import ModelFiles
from lockgate.frontend.model_files import remove as remove_files
from lockgate.frontend.openapi import openapi_document
from lockgate.frontend.predict_routes import (
    predict_route,
    predict_target,
    status_route,
    status_target,
)
from lockgate.frontend.probe import Probe
from lockgate.frontend.v2_service import V2Service
from lockgate.protocol import readiness
from lockgate.protocol.content_coding import accepted_coding
from lockgate.protocol.openai import TOKEN_PATHS, OpenAILimits, error_body, openai_path
from lockgate.protocol.repository_control import (
    LoadRequest,
    UnloadRequest,
    load_request,
    parameters_of,
    unload_request,
)
from lockgate.protocol.trace_settings import TraceSettings, TraceValues

if TYPE_CHECKING:
    from lockgate.frontend.otel import Tracing

log = logging.getLogger("lockgate.frontend")

# the paths that answer only GET (and HEAD): any other method gets 405 with Allow
READ_ONLY_PATHS = frozenset(
    {
        *("/v2/health/live", "/v2/health/ready", "/health", "/metrics", "/openapi.json"),
        *("/v2", "/dashboard", "/"),
    }
)
READ = ("GET", "HEAD")  # the methods of a route that only reads
LIVE = msgspec.json.encode({"live": True})

WRITE = ("POST",)
# the methods of each route under /v2/models/{m}[/versions/{v}], by its last segment
# ("": the model's metadata)
MODEL_ROUTES = {
    **dict.fromkeys(("", "ready", "config", "stats"), READ),
    **dict.fromkeys(("infer", "generate", "generate_stream"), WRITE),
}
TRACED_KINDS = ("infer", "generate", "openai")  # route kinds whose requests may be traced


class OpenAIHandler(Protocol):
    """The OpenAI API's routes (`frontend/openai_routes.py`): /v1/..., and vLLM's
    /tokenize and /detokenize."""

    async def __call__(self, request: HttpRequest, parts: list[str]) -> None: ...

    async def tokenize(self, request: HttpRequest) -> None: ...

    async def detokenize(self, request: HttpRequest) -> None: ...

    def serves(self, name: str) -> bool:
        """`GET /v1/models/{name}` is one of this API's models."""
        ...


# the OpenAI Responses API (`frontend/responses_routes.py`): (request, path after /v1/responses)
ResponsesHandler = Callable[[HttpRequest, list[str]], Awaitable[None]]
# Triton's generate extension on a language model: (request, model, version, streamed)
GenerateHandler = Callable[[HttpRequest, str, str | None, bool], Awaitable[None]]


@dataclass(slots=True)
class ServerSettings:
    max_body_bytes: int = 64 * 1024 * 1024
    body_timeout_s: float = 30.0  # a body not received in full by then gets 408
    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    # guard model load and unload and changes of the log and trace settings; empty: api keys
    admin_keys: frozenset[str] = frozenset()
    strict_readiness: bool = False  # True: ready only when every model is ready
    model_control: str = "none"  # "explicit": POST .../load and .../unload are served
    metrics_public: bool = False  # True: /metrics needs no key even when keys are set
    # other servers' metric names also exported on /metrics: "triton", "vllm"; empty: none
    metrics_compat: frozenset[str] = frozenset({"triton", "vllm"})
    # keys that may ask a priority above the model's default; empty: any client may
    priority_keys: frozenset[str] = frozenset()
    repository: Path | None = None
    access_log: bool = False  # one JSON line per request on the `lockgate.access` logger
    redis: RedisSettings | None = None  # the response cache's shared tier; None: in-process only
    otel_endpoint: str = ""  # OTLP/HTTP base URL: trace inference requests; "": no tracing
    # the trace settings at start-up (Triton's trace extension changes them at run time)
    trace: TraceValues = field(default_factory=TraceValues)
    openai: OpenAILimits = field(default_factory=OpenAILimits)  # what one OpenAI request may ask
    # responses of /v1/responses kept in memory for GET and previous_response_id; 0: none
    responses_store_size: int = 1024
    # answers of at least this many bytes go out gzip or deflate to a client that accepts it
    # (Accept-Encoding); 0: never compressed
    compress_min_bytes: int = 4096
    # system shared memory regions that may be registered at once; 0: the extension is off
    shared_memory_regions: int = 256
    # a directory the replicas of one `serve --replicas` share registrations in; "": none
    shared_memory_registry: str = ""
    allowed_origins: str = ""  # comma-separated origins browsers may call from (CORS); "": off
    public_paths: frozenset[str] = field(
        default_factory=lambda: frozenset(
            {
                "/v2/health/live",
                "/v2/health/ready",
                "/health",
                "/metrics",
                "/openapi.json",
                "/dashboard",
                "/",
            }
        )
    )


class App:
    def __init__(
        self,
        models: ModelManager,
        settings: ServerSettings | None = None,
        openai: OpenAIHandler | None = None,
    ) -> None:
        self.models = models
        self.settings = settings or ServerSettings()
        self.cache = ResponseCache(models.registry, self.settings.redis)
        self.executor = Executor(models, self.cache, models.registry)
        exporting = bool(self.settings.otel_endpoint)
        trace = TraceSettings(self.settings.trace, exporting)
        self.v2 = V2Service(
            models,
            self.executor,
            self.settings.shared_memory_regions,
            trace,
            self.settings.shared_memory_registry,
        )
        self.access = AccessLog(self.settings.access_log)
        self.openai = openai
        self.generate: GenerateHandler | None = None  # set with the OpenAI routes
        self.responses: ResponsesHandler | None = None  # set with the OpenAI routes
        self.started = False  # set once the repository has been loaded
        self.boot = readiness.boot_id()  # on every health answer: this process's start
        self.draining = False
        self.closers: list[Callable[[], Awaitable[None]]] = [self.cache.close]  # at shutdown
        self.background: list[asyncio.Task[None]] = []  # cancelled before the models close
        # told each request's delay from its first byte to its handler (the connection gate)
        self.front_delay: Callable[[float, float], None] | None = None
        self.answered: Callable[[], None] | None = None  # told of each request answered
        self.in_flight = 0  # HTTP requests received and not yet answered
        self.tracing = _tracing(self.settings.otel_endpoint, trace, self.closers)
        self.closers.append(self._close_shared_memory)
        self.model_files = ModelFiles()  # models loaded from files sent in a load request
        self.cors = Cors.of(self.settings.allowed_origins)  # None: no cross-origin calls
        self.closers.append(self._remove_model_files)
        models.registry.gauge(
            "lockgate_http_requests_in_progress", "HTTP requests received and not yet answered."
        ).set_function((), lambda: float(self.in_flight))
        self.lane_answered = 0  # v2 inference requests answered from the protocol's lane
        models.registry.register(_LaneCount(self))
        if "triton" in self.settings.metrics_compat:
            models.registry.register(TritonMetrics(models))
        self.http_latency = models.registry.histogram(
            "lockgate_http_request_duration_seconds",
            "Time from the request's first byte to its response headers, by route kind and status.",
            ("route", "status"),
        )
        self._lane_latency: dict[int, HistogramTally] = {}  # by status: `_lane_latency_of`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        received = scope.get("lockgate.received")  # the first byte, stamped by the protocol
        now = time.monotonic()
        start = received if isinstance(received, float) else now
        if self.front_delay is not None:  # from the end of a pause the gate made it wait
            self.front_delay(now - scope.get("lockgate.queued", start), now)
        allowed = None if self.cors is None else self.cors.allow(origin_of(scope["headers"]))
        if allowed is not None and is_preflight(scope["method"], scope["headers"]):
            assert self.cors is not None
            headers = self.cors.preflight(allowed)
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        route = _route_kind(scope["path"])
        rid = request_id(scope["headers"])
        entry: AccessEntry | None = None
        traced = None
        if self.tracing is not None and route in TRACED_KINDS:
            headers, method = scope["headers"], scope["method"]
            traced = self.tracing.start_http(headers, rid.decode(), method, scope["path"], start)
        status = 0  # until a response starts

        async def timed_send(message: Message) -> None:
            nonlocal entry, status
            if message["type"] == "http.response.start":
                status = message["status"]
                elapsed = time.monotonic() - start
                trace_id = traced.trace_id if traced is not None else ""
                self.http_latency.observe((route, str(status)), elapsed, trace_id)
                # the load a router in front balances on: requests in progress here
                load = (b"x-lockgate-inflight", b"%d" % self.in_flight)
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid), load]
                if allowed is not None:
                    message["headers"] += Cors.answer(allowed)
                if self.access.enabled:
                    entry = self._access_entry(scope, rid, status, elapsed)
            elif entry is not None:
                entry.bytes_out += len(message.get("body", b""))
            await send(message)

        coding = self.response_coding(scope["headers"])
        out = (
            timed_send if coding is None else CompressingSend(timed_send, coding, self.compressing)
        )
        request = HttpRequest(
            scope,
            receive,
            out,
            scope["method"],
            scope["path"],
            self.settings.max_body_bytes,
            self.settings.body_timeout_s,
            trace=traced,
        )
        openai = openai_path(request.path)
        if openai or route == "generate":  # decoded whole on the loop
            payload = self.settings.openai.max_payload_bytes
            if payload < request.max_body:
                request.max_body, request.body_flag = payload, "--max-payload-bytes"
        self.in_flight += 1
        try:
            self._authenticate(request)
            await self._route(request)
        except ClientDisconnected:
            return
        except ServingError as exc:
            await self._error(request, exc, openai)
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.path)
            await self._error(
                request, ServingError(f"internal error: {type(exc).__name__}"), openai
            )
        finally:
            self.in_flight -= 1
            if self.answered is not None:
                self.answered()
            if entry is not None:
                entry.bytes_in = request.bytes_read
                self.access.write(entry)
            if traced is not None and self.tracing is not None:
                self.tracing.finish_http(traced, status, time.monotonic())

    async def _close_shared_memory(self) -> None:
        self.v2.shared_memory.close()

    @property
    def compressing(self) -> int:
        """Answers of at least this many bytes are compressed for a client that takes it."""
        return self.settings.compress_min_bytes

    def response_coding(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
        """The coding to answer a request with these headers in, if any (compression on)."""
        if not self.settings.compress_min_bytes:
            return None
        for name, value in headers:
            if name == b"accept-encoding":
                return accepted_coding(value)
        return None

    def probe_open(self, probe: Probe) -> bool:
        """Whether a health probe may be answered below ASGI (`frontend/probe.py`): not while
        the access log is on, nor a browser's cross-origin probe while CORS is on, nor one
        a key is asked of (the ASGI path answers those). Reads only settings fixed at start:
        the accepting thread asks it too (`frontend/acceptor.py`)."""
        if self.access.enabled or (self.cors is not None and origin_of(probe.headers)):
            return False
        try:
            self.authenticate("GET", probe.path, lambda: bearer_of(probe.header(b"authorization")))
        except ServingError:
            return False
        return True

    def probe_reply(self, probe: Probe) -> Reply | None:
        """The answer to a health probe read by the protocol (`frontend/probe.py`), as the
        ASGI routes answer it; None when the ASGI path must answer it (`probe_open`)."""
        if not self.probe_open(probe):
            return None
        if probe.path == "/v2/health/ready":
            reason = self.not_ready()
            ready = {"ready": True} if reason is None else {"ready": False, "error": reason}
            reply = Reply(200 if reason is None else 503, msgspec.json.encode(ready))
        else:
            reply = Reply(200, LIVE)
        self.http_latency.observe(("health", str(reply.status)), time.monotonic() - probe.received)
        load = b"%d" % self.in_flight
        reply.headers += [
            (b"x-request-id", request_id(probe.headers)),
            (b"x-lockgate-inflight", load),
            self._boot,
        ]
        return reply

    @property
    def lane_open(self) -> bool:
        """Whether v2 inference requests may be answered from the protocol's lane
        (`frontend/lane.py`), asked per request: not while each request must leave an
        access-log line, nor while a trace setting may trace it (the ASGI path writes both;
        the trace settings change at run time)."""
        return not self.access.enabled and not self.v2.trace.tracing

    async def infer_lane(self, request: LaneRequest) -> Reply:
        """Answer a v2 inference request from the protocol's lane, as `__call__` would:
        authentication, priority keys, the same handler core, the same error answers,
        metrics and headers. Its delay in front (`front_delay`) was told when its head was
        let through, as for the ASGI path, whose handler starts before the body is read.
        One coroutine from the lane's task to the model's: each awaited layer costs its
        task a frame to resume."""
        self.in_flight += 1
        self.lane_answered += 1
        try:
            try:
                reply = await self._lane_infer(request)
            except ServingError as exc:
                reply = error_reply(exc)
            except Exception as exc:
                log.exception("unhandled error on POST %s", request.path)
                reply = error_reply(ServingError(f"internal error: {type(exc).__name__}"))
            elapsed = time.monotonic() - request.received
            self._lane_latency_of(reply.status).observe(elapsed)
            rid = request_id(request.headers)
            load = b"%d" % self.in_flight
            reply.headers += [(b"x-request-id", rid), (b"x-lockgate-inflight", load)]
            return reply
        finally:
            self.in_flight -= 1
            if self.answered is not None:
                self.answered()

    def _lane_latency_of(self, status: int) -> HistogramTally:
        """The HTTP latency series of the lane's answers with `status`, as a tally: the lane
        runs on the loop's thread, and observes one for every request."""
        tally = self._lane_latency.get(status)
        if tally is None:
            tally = self._lane_latency[status] = self.http_latency.tally(("infer", str(status)))
        return tally

    def _lane_infer(self, request: LaneRequest) -> Awaitable[Reply]:
        """The lane's checks before the handler core (`v2_routes.infer_reply`), whose answer
        `infer_lane` awaits."""

        def bearer() -> bytes | None:
            return bearer_of(request.header(b"authorization"))

        self.authenticate("POST", request.path, bearer)
        served = self.v2.served(request.name, request.version)
        granted = not self.settings.priority_keys or self.priority_granted(bearer())
        return v2_routes.infer_reply(
            self.v2,
            served,
            request.name,
            request.body,
            request.header(b"inference-header-content-length"),
            request.header(b"request-timeout"),
            request.received,
            granted,
        )

    @staticmethod
    def _access_entry(scope: Scope, rid: bytes, status: int, elapsed: float) -> AccessEntry:
        client = scope.get("client")
        return AccessEntry(
            time=time.time(),
            request_id=rid.decode("ascii"),
            method=scope["method"],
            path=scope["path"][:512],
            status=status,
            duration_ms=round(elapsed * 1000, 3),
            client=f"{client[0]}:{client[1]}" if client else "",
            model=model_of(scope["path"]),
        )

    def early_refusal(
        self,
        target: tuple[str, str | None],
        timeout: float | None,
        received: float,
        now: float,
        loop_wait: float = 0.0,
    ) -> ServingError | None:
        """Asked by the protocol once the head of a POST to a v2 inference path is in
        (`target`: its model and version, `lane_target`; `timeout`: its Request-Timeout,
        `request_timeout`) and before its body is read: the refusal it would certainly get
        from its model's admission, so a saturated model refuses at the cost of a head, not
        of a decoded body. `loop_wait`: the seconds of event-loop work (requests in progress)
        its handler will wait for.

        A model with a response cache or a fallback is never refused here: a cache hit skips
        admission, and a refused request goes to the fallback, and both need the body."""
        served = self.inference_target(*target)
        if served is None or served.batcher is None:
            return None
        if served.config.response_cache.enable or served.config.fallback:
            return None
        return served.batcher.early_refusal(received, timeout, now, loop_wait)

    def budget(self, target: tuple[str, str | None] | None, timeout: float | None) -> float | None:
        """Seconds a v2 inference request for `target` (`lane_target`) may take: its
        Request-Timeout, `timeout`, else its model's SLO; None when neither is known."""
        served = None if target is None else self.inference_target(*target)
        if served is None or served.batcher is None:
            return None
        return timeout if timeout is not None else served.batcher.slo

    def inference_target(self, name: str, version: str | None) -> ServedVersion | None:
        """The model version a v2 inference path names (`lane_target`), if ready. Looked up
        anew for every request: a reload or an unload replaces what a path names."""
        model = self.models.models.get(name)
        if model is None:
            return None
        if version is None:
            return model.latest_ready()
        if not (version.isascii() and version.isdigit() and len(version) <= 18):
            return None
        return model.versions.get(int(version))

    async def _error(self, request: HttpRequest, exc: ServingError, openai: bool) -> None:
        if openai:
            payload = error_body(exc.message, exc.kind, exc.status, exc.param)
            await respond_json(request.send, exc.status, payload, error_headers(exc))
        else:
            await respond_reply(request.send, error_reply(exc))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- authentication ----------------------------------------------------------------
    def priority_granted(self, presented: bytes | None) -> bool:
        """Whether a client presenting this key may ask a priority above the model's
        default: always, unless priority keys are set."""
        keys = self.settings.priority_keys
        if not keys:
            return True
        return presented is not None and any(
            hmac.compare_digest(presented, k.encode()) for k in keys
        )

    def _authenticate(self, request: HttpRequest) -> None:
        if self.settings.api_keys or self.settings.admin_keys:
            self.authenticate(request.method, request.path, request.bearer)

    def authenticate(self, method: str, path: str, bearer: Callable[[], bytes | None]) -> None:
        """Raise 401 or 403 unless the request may use `path`; `bearer` gives its key."""
        if not (self.settings.api_keys or self.settings.admin_keys):
            return  # no keys: every route is open
        parts = [p for p in path.split("/") if p]  # as `_route` splits it
        admin = _admin_use(method, parts)
        keys = (
            self.settings.admin_keys
            if admin and self.settings.admin_keys
            else self.settings.api_keys
        )
        if not keys:
            return
        public = path in self.settings.public_paths
        if path == "/metrics":
            public = self.settings.metrics_public
        if public and not admin:
            return
        presented = bearer()
        if presented is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not any(hmac.compare_digest(presented, k.encode()) for k in keys):
            raise Forbidden("API key not accepted" + (f" for {admin}" if admin else ""))

    # -- routing -----------------------------------------------------------------------
    def _classic(self, name: str) -> bool:
        """`GET /v1/models/{name}` is KServe v1's model status, not the OpenAI API's model:
        a model of the repository that no language model serves under that name (or any
        model, with no language model served)."""
        if not self.v2.knows(name):
            return self.openai is None  # 404 as KServe v1 answers it
        return self.openai is None or not self.openai.serves(name)

    async def _route(self, request: HttpRequest) -> None:
        path, method = request.path, request.method
        if path in READ_ONLY_PATHS:
            check_method(method, path, READ)
        parts = [p for p in path.split("/") if p]
        if parts == ["v2", "models", "stats"]:  # before a model named "stats"
            check_method(method, path, READ)
            await v2_routes.document(request, self.v2.statistics(None, None))
        elif parts[:2] == ["v2", "models"] and len(parts) >= 3:
            await self._model_route(request, parts[2:])
        elif (target := predict_target(parts)) is not None:  # before the OpenAI API's /v1
            await predict_route(request, self.v2, *target, self._granted(request))
        elif (target := status_target(method, parts)) is not None and self._classic(target[0]):
            await status_route(request, self.v2, *target)
        elif parts[:2] == ["v1", "responses"] and self.responses is not None:
            await self.responses(request, parts[2:])
        elif parts and parts[0] == "v1" and self.openai is not None:
            await self.openai(request, parts[1:])
        elif path in TOKEN_PATHS and self.openai is not None:
            await (self.openai.tokenize if path == "/tokenize" else self.openai.detokenize)(request)
        elif path == "/version":
            check_method(method, path, READ)
            await respond_json(request.send, 200, {"version": __version__})
        elif path in ("/v2/health/live", "/health"):
            await respond(request.send, 200, LIVE, headers=[self._boot])
        elif path == "/v2/health/ready":
            await self._ready(request)
        elif path == "/v2":
            await respond(request.send, 200, v2_routes.SERVER_METADATA_JSON)
        elif path == "/metrics":
            accept = request.header_str(b"accept") or ""
            body, content_type = self.models.registry.exposition(accept)
            await respond(request.send, 200, body, content_type.encode())
        elif path == "/dashboard":
            page = dashboard_page(self.settings.model_control, self.settings.repository)
            await respond(request.send, 200, page, b"text/html; charset=utf-8")
        elif path == "/":
            await respond(request.send, 302, b"", b"text/plain", [(b"location", b"/dashboard")])
        elif path == "/openapi.json":
            await respond_json(request.send, 200, openapi_document())
        elif parts[:2] == ["v2", "repository"]:
            await self._repository(request, parts[2:])
        elif path == "/v2/logging":
            await v2_routes.log_settings(request, self.v2)
        elif path == "/v2/trace/setting":
            await v2_routes.trace_settings(request, self.v2)
        elif parts[:2] == ["v2", "systemsharedmemory"]:
            await v2_routes.shared_memory(request, self.v2.shared_memory, parts[2:])
        elif parts[:2] == ["v2", "cudasharedmemory"]:
            raise BadRequest("CUDA shared memory is not supported: lockgate runs on the CPU")
        else:
            raise NotFound(f"no route for {method} {path[:200]}")

    async def _model_route(self, request: HttpRequest, rest: list[str]) -> None:
        name, rest = rest[0], rest[1:]
        version: str | None = None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        if rest == ["trace", "setting"] and version is None:  # Triton's: per model, not version
            await v2_routes.trace_settings(request, self.v2, name)
            return
        action = rest[0] if rest else ""
        allowed = MODEL_ROUTES.get(action) if len(rest) <= 1 else None
        if allowed is None:
            raise NotFound(f"no route for {request.method} {request.path[:200]}")
        check_method(request.method, request.path, allowed)
        if action == "infer":
            await v2_routes.infer(request, self.v2, name, version, self._granted(request))
        elif action in ("generate", "generate_stream"):
            await self._generate(request, name, version, action == "generate_stream")
        elif action == "":
            await v2_routes.document(request, self.v2.model_metadata(name, version))
        elif action == "ready":
            await v2_routes.model_ready(request, self.v2, name, version)
        elif action == "config":
            await v2_routes.document(request, self.v2.model_config(name, version))
        else:  # stats
            await v2_routes.document(request, self.v2.statistics(name, version))

    def _granted(self, request: HttpRequest) -> bool:
        """Whether the request may ask for a priority above its model's default."""
        return not self.settings.priority_keys or self.priority_granted(request.bearer())

    async def _generate(
        self, request: HttpRequest, name: str, version: str | None, stream: bool
    ) -> None:
        """Triton's generate extension: a language model's text, or any other model's
        tensors from the body's fields."""
        if self.v2.served(name, version).config.backend != LLM_BACKEND:
            granted = self._granted(request)
            await generate_tensors_route(request, self.v2, name, version, stream, granted)
        elif self.generate is None:
            raise NotFound("generate serves language models: this server runs without them")
        else:
            await self.generate(request, name, version, stream)

    def not_ready(self) -> str | None:
        """Why the server is not ready (REST, gRPC and the gRPC health service ask this),
        or None when it is."""
        models = self.models
        if self.draining:
            return readiness.DRAINING
        if not self.started:
            return readiness.LOADING
        if not any(m.latest_ready() is not None for m in models.models.values()):
            return readiness.NO_MODEL
        if self.settings.strict_readiness and not models.ready():
            not_ready = [m.name for m in models.models.values() if m.latest_ready() is None]
            return f"models not ready: {not_ready}"
        return None

    async def _ready(self, request: HttpRequest) -> None:
        reason = self.not_ready()
        if reason is None:
            await respond_json(request.send, 200, {"ready": True}, [self._boot])
        else:
            await respond_json(request.send, 503, {"ready": False, "error": reason}, [self._boot])

    @property
    def _boot(self) -> tuple[bytes, bytes]:
        return (readiness.BOOT_HEADER, self.boot)

    async def _repository(self, request: HttpRequest, rest: list[str]) -> None:
        control = len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload")
        if rest != ["index"] and not control:
            raise NotFound(f"no route for {request.method} {request.path[:200]}")
        check_method(request.method, request.path, WRITE)
        if not control:
            await v2_routes.repository_index(request, self.v2)
            return
        name, action = rest[1], rest[2]
        self.check_model_control(name)
        parameters = parameters_of(await request.body())
        if action == "load":
            await self.load(name, load_request(parameters))
        else:
            await self.unload(name, unload_request(parameters))
        await respond_json(request.send, 200, {})

    def check_model_control(self, name: str) -> None:
        """Load and unload are served only in explicit model control mode, as in Triton."""
        from lockgate.core.repository import is_safe_name

        if not is_safe_name(name):
            raise BadRequest(f"invalid model name {name[:200]!r}")
        if self.settings.model_control != "explicit":
            raise Forbidden(
                "model load and unload are off: start lockgate with --model-control-mode explicit"
            )

    async def load(self, name: str, ask: LoadRequest) -> None:
        """Load (or reload without a gap) the repository's model `name`, with the config the
        request gives in place of the repository's when it gives one, or from the files it
        sends (`frontend/model_files.py`)."""
        from lockgate.core.repository import scan_model

        if ask.files:
            folder = await asyncio.to_thread(ModelFiles.write, name, ask.files)
        else:
            folder = self._model_folder(name)
        try:
            entry = scan_model(folder.parent.resolve(), folder, ask.config)
            if ask.config is not None and entry.error:
                raise BadRequest(f"model '{name}': {entry.error}")
            model = await self.models.load_model(
                entry.name, entry.path, entry.config, entry.versions, entry.error
            )
            if model.latest_ready() is None or model.failures:
                why = model.error or "; ".join(model.failures) or self.models._why_not_ready(model)
                raise BadRequest(f"model '{name}' failed to load: {why}")
        except BaseException:
            if ask.files:
                await asyncio.to_thread(remove_files, folder.parent)
            raise
        before = self.model_files.loaded(name, folder if ask.files else None)
        await asyncio.to_thread(remove_files, before)

    async def unload(self, name: str, ask: UnloadRequest) -> None:
        """Unload `name` (a model of the repository that is not loaded: nothing to do, as in
        Triton), and with `dependents` the models its ensemble or cascade runs."""
        served = self.models.models.get(name)
        if served is None:
            self._model_folder(name)  # 404 when the repository has no such model
            return
        runs = served.config.runs if ask.dependents and served.config is not None else ()
        await self.models.unload(name)
        self.cache.forget(name)  # its in-process answers, and their gauges
        await asyncio.to_thread(remove_files, self.model_files.unloaded(name))
        for step in dict.fromkeys(model for model, _ in runs):
            if step in self.models.models:
                await self.models.unload(step)
                self.cache.forget(step)

    async def _remove_model_files(self) -> None:
        for root in self.model_files.close():
            await asyncio.to_thread(remove_files, root)

    def _model_folder(self, name: str) -> Path:
        root = self.settings.repository
        if root is None:
            raise BadRequest("the server was started without a model repository")
        folder = root / name
        if not folder.is_dir():
            raise NotFound(f"no model '{name[:200]}' in the repository")
        return folder


class _LaneCount:
    """The lane's count as a Prometheus counter, read at scrape time: the request path adds
    one to an integer."""

    def __init__(self, app: App) -> None:
        self.app = app

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "lockgate_http_lane_requests",
            "v2 inference requests answered from the HTTP protocol itself, below ASGI "
            "(their head came whole in one read); the others took the ASGI path.",
            value=self.app.lane_answered,
        )


def _admin_use(method: str, parts: list[str]) -> str:
    """What a request guarded by the admin keys (when set) does: POST
    /v2/repository/models/{m}/load|unload, and a change of the log or trace settings (POST
    /v2/logging, /v2[/models/{m}]/trace/setting); "" for any other request."""
    if method != "POST":
        return ""
    if len(parts) == 5 and parts[:3] == ["v2", "repository", "models"]:
        return "model management" if parts[4] in ("load", "unload") else ""
    if parts in (["v2", "logging"], ["v2", "trace", "setting"]) or (
        len(parts) == 5 and parts[:2] == ["v2", "models"] and parts[3:] == ["trace", "setting"]
    ):
        return "changing log and trace settings"
    return ""


def _route_kind(path: str) -> str:
    """A bounded label for the metrics: never the raw path, which clients choose."""
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return "infer"
    if path.startswith("/v2/models/") and path.endswith(("/generate", "/generate_stream")):
        return "generate"
    if path.startswith("/v1/"):
        return "predict" if path.endswith(":predict") else "openai"
    if path.startswith("/v2/health") or path == "/health":
        return "health"
    if path.startswith("/v2"):
        return "v2"
    return "other"


def _tracing(
    endpoint: str, settings: TraceSettings, closers: list[Callable[[], Awaitable[None]]]
) -> Tracing | None:
    """The server's tracer when an endpoint is set, sampling by `settings`; its buffered spans
    are sent at shutdown."""
    if not endpoint:
        return None
    otel = import_for("lockgate.frontend.otel", "otel", "tracing (--otel-endpoint)")
    tracing: Tracing = otel.Tracing(endpoint, settings)

    async def close() -> None:
        await asyncio.to_thread(tracing.shutdown)

    closers.append(close)
    return tracing
