"""Run the router: uvicorn (uvloop, each connection a `ClientConnection`) in front of
`RouterApp`, and beside it on the same event loop the gRPC front (`grpc_proxy.py`) when a gRPC
port is given.

On SIGTERM or SIGINT readiness turns 503 at once (gRPC: health NOT_SERVING, new calls
UNAVAILABLE), the port closes after `drain_delay` seconds (so a load balancer in front stops
sending), and requests in progress finish within uvicorn's graceful shutdown; gRPC calls in
progress get the front's `drain_timeout`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from lockgate.core.metrics import Registry
from lockgate.router.app import RouterApp, RouterSettings
from lockgate.router.client_connection import ClientConnection
from lockgate.router.grpc_proxy import GrpcFront, GrpcFrontSettings
from lockgate.router.pool import Discovery, ReplicaPool
from lockgate.router.replica import HealthSettings, Replica

log = logging.getLogger("lockgate.router")


def build(discovery: Discovery, health: HealthSettings, settings: RouterSettings) -> RouterApp:
    def changed(replica: Replica, event: str) -> None:
        log.info("router: replica %s %s", replica.url, event)

    pool = ReplicaPool(discovery, health, changed)
    return RouterApp(pool, settings, Registry())


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: RouterApp,
        drain_delay: float,
        grpc: GrpcFrontSettings | None = None,
    ) -> None:
        super().__init__(config)
        self.router = app
        self.drain_delay = drain_delay
        self.grpc = grpc
        self.failed = False  # start-up failed (a gRPC port given that could not be bound)

    async def serve(self, sockets: Any = None) -> None:
        front = GrpcFront(self.router, self.grpc) if self.grpc is not None else None
        try:
            if front is not None:
                await front.start()
        except OSError as exc:
            log.error("router: %s", exc)
            self.failed = True
            return
        try:
            await super().serve(sockets)
        finally:
            if front is not None:
                await front.stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM drain; unlike uvicorn, do not re-raise them after (exit 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.router.draining or self.drain_delay <= 0:
            super().handle_exit(sig, frame)
            return
        self.router.draining = True
        log.info("router: draining for %.1f s", self.drain_delay)
        loop = asyncio.get_event_loop()
        loop.call_later(self.drain_delay, lambda: super(_Server, self).handle_exit(sig, frame))


def run(
    app: RouterApp,
    host: str,
    port: int,
    drain_delay: float = 0.0,
    keep_alive: int = 75,
    grpc: GrpcFrontSettings | None = None,
) -> int:
    """Serve until a signal; 1 when start-up failed."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=ClientConnection,  # uvicorn's protocol cut to what the router needs
        proxy_headers=False,  # the router reads no client address: no middleware to pass
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=keep_alive,
        backlog=2048,
    )
    server = _Server(config, app, drain_delay, grpc)
    log.info("lockgate router listening on http://%s:%d", host, port)
    server.run()
    return 1 if server.failed else 0
