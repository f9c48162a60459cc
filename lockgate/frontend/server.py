"""Run the server: uvicorn (uvloop, httptools) in front of the app, models loading behind it.

The HTTP port opens at once so liveness answers while models load; readiness turns true when
the repository has been loaded and warmed up. SIGTERM or SIGINT starts the drain: the port
stays open, readiness answers 503 and new inference requests get 503, while admitted
requests finish within `drain_timeout`; then the port closes and the process exits with 0.
A second signal ends the drain at once.

The gRPC server (KServe v2 / Triton's GRPCInferenceService, `grpc_port`, 8001 by default)
runs on the same loop and shares the app; on the drain it refuses new RPCs at once and
lets those in flight finish within `drain_timeout`.

The request head (request line and headers) is bounded by `max_head_bytes`: past it the
client gets 431 and the connection closes, so a header flood cannot grow memory. Requests
the HTTP parser rejects get a JSON 400 like every other error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lockgate.core.metrics import Registry
from lockgate.core.models import ModelManager, ServingSettings
from lockgate.frontend.app import App, ServerSettings
from lockgate.protocol.v2 import encode_error

log = logging.getLogger("lockgate.server")

Extension = Callable[[App], Awaitable[None]]


@dataclass(slots=True)
class ServeOptions:
    repository: Path | None
    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout: float = 30.0
    limit_concurrency: int | None = 1024  # connections beyond this get 503 at once
    backlog: int = 2048
    max_head_bytes: int = 64 * 1024  # request line and headers, as nginx's 4 x 8 KiB and more
    # idle seconds before a kept-alive connection closes: longer than the idle timeout of the
    # proxies in front (60 s on AWS ALB and nginx), so they never reuse a connection this end
    # is closing, which the client would see as a reset
    keep_alive_timeout: int = 75
    http: ServerSettings = field(default_factory=ServerSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    extensions: list[Extension] = field(default_factory=list)  # e.g. the LLM engine
    grpc_port: int | None = 8001  # None: no gRPC server
    grpc_port_required: bool = False  # True: a port that cannot be bound stops start-up
    grpc_max_concurrent_rpcs: int | None = 1024


class HeadTooLarge(httptools.HttpParserCallbackError):
    """The request line and headers are over the limit."""


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head and JSON parser errors."""

    max_head_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_bytes = 0
        self.head_too_large = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > self.max_head_bytes:
            self.head_too_large = True
            raise HeadTooLarge(f"request head is over {self.max_head_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        status, text = 400, "invalid HTTP request"
        if self.head_too_large:
            status, text = 431, f"request line and headers are over {self.max_head_bytes} bytes"
        body = encode_error(text)
        head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status])]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body)]
        head += [b"connection: close", b"", b""]
        self.transport.write(b"\r\n".join(head) + body)
        self.transport.close()


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


def _protocol_class(max_head_bytes: int) -> type[_Protocol]:
    return type("LockgateHttpProtocol", (_Protocol,), {"max_head_bytes": max_head_bytes})


class _Server(uvicorn.Server):
    """uvicorn's server, draining the models before it closes the port on a signal."""

    def __init__(
        self, config: uvicorn.Config, app: App, drain_timeout: float, grpc_server: Any = None
    ) -> None:
        super().__init__(config)
        self.lockgate_app = app
        self.drain_timeout = drain_timeout
        self.grpc_server = grpc_server  # grpc.aio.Server, or None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drainer: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM as a drain; unlike uvicorn, do not re-raise them after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it re-raises the signal after shutdown (exit status -15).
        app = self.lockgate_app
        if app.draining:  # a second signal: stop waiting for requests, close now
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining (readiness 503, no new requests), then exiting", sig)
        app.draining = True
        for model in app.models.models.values():
            for served in model.versions.values():
                if served.batcher is not None:
                    served.batcher.accepting = False
        if self.loop is None:
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self.loop is not None
        self.drainer = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        start = time.monotonic()
        drains = [self.lockgate_app.models.drain(self.drain_timeout)]
        if self.grpc_server is not None:  # refuses new RPCs at once, waits for the others
            drains.append(self.grpc_server.stop(self.drain_timeout))
        drained, *_ = await asyncio.gather(*drains)
        if not drained:
            log.warning(
                "drain timed out after %.1f s; closing with requests unanswered", self.drain_timeout
            )
        left = self.drain_timeout - (time.monotonic() - start)
        self.config.timeout_graceful_shutdown = max(1, int(left))  # for responses being written
        self.should_exit = True


def build_app(options: ServeOptions) -> App:
    registry = Registry()
    models = ModelManager(registry, options.serving)
    options.http.repository = options.repository
    return App(models, options.http)


async def load(app: App, options: ServeOptions) -> None:
    start = time.monotonic()
    try:
        if options.repository is not None:
            await app.models.load_repository(options.repository)
        for extension in options.extensions:
            await extension(app)
    except Exception:
        log.exception("start-up failed")
    app.started = True
    log.info("start-up complete in %.2f s", time.monotonic() - start)


async def serve(options: ServeOptions) -> int:
    app = build_app(options)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        loop="none",
        lifespan="off",
        http=_protocol_class(options.max_head_bytes),
        access_log=False,
        log_level="warning",
        limit_concurrency=options.limit_concurrency,
        backlog=options.backlog,
        timeout_graceful_shutdown=int(options.drain_timeout),
        timeout_keep_alive=options.keep_alive_timeout,
    )
    try:
        grpc_server = await _start_grpc(app, options)
    except OSError as exc:
        log.error("%s", exc)
        return 1
    server = _Server(config, app, options.drain_timeout, grpc_server)
    loader = asyncio.get_running_loop().create_task(load(app, options))
    log.info("lockgate listening on http://%s:%d", options.host, options.port)
    await server.serve()
    loader.cancel()
    if grpc_server is not None:
        await grpc_server.stop(0)  # cancels RPCs still running after a second signal
    await _cancel_requests(server)
    await app.models.close()
    for closer in app.closers:
        await closer()
    log.info("lockgate stopped")
    return 0


async def _start_grpc(app: App, options: ServeOptions) -> Any:
    if options.grpc_port is None:
        return None
    from lockgate.frontend.grpc_server import GrpcSettings, start_grpc

    settings = GrpcSettings(
        host=options.host,
        port=options.grpc_port,
        max_receive_bytes=options.http.max_body_bytes,
        max_concurrent_rpcs=options.grpc_max_concurrent_rpcs,
        required=options.grpc_port_required,
    )
    return await start_grpc(app, settings)


async def _cancel_requests(server: uvicorn.Server) -> None:
    """Requests still running after a second signal are cancelled: closing the models would
    otherwise wait for them."""
    tasks = list(server.server_state.tasks)
    for task in tasks:
        task.cancel("server is stopping")
    if tasks:
        await asyncio.wait(tasks, timeout=1.0)


def run(options: ServeOptions) -> int:
    try:
        import uvloop

        code = uvloop.run(serve(options))
    except ImportError:
        code = asyncio.run(serve(options))
    _exit_past_busy_threads(code)
    return code


def _exit_past_busy_threads(code: int, grace: float = 1.0) -> None:
    """Leave now if a model call outlived the drain: its worker thread would hold the exit
    (Python joins executor threads at exit) for as long as the call runs."""
    deadline = time.monotonic() + grace
    busy = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            busy.append(thread.name)
    if busy:
        log.warning("exiting past %d busy thread(s): %s", len(busy), ", ".join(busy))
        logging.shutdown()
        os._exit(code)
