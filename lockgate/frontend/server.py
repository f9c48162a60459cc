"""Run the server: uvicorn (uvloop, httptools) in front of the app, models loading behind it.

The HTTP port opens at once so liveness answers while models load; readiness turns true when
the repository has been loaded and warmed up. SIGTERM or SIGINT stops intake (readiness goes
false, new requests get 503), lets admitted requests finish within `drain_timeout`, then exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import uvicorn

from lockgate.core.metrics import Registry
from lockgate.core.models import ModelManager, ServingSettings
from lockgate.frontend.app import App, ServerSettings

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
    http: ServerSettings = field(default_factory=ServerSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    extensions: list[Extension] = field(default_factory=list)  # e.g. the LLM engine


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: App) -> None:
        super().__init__(config)
        self.lockgate_app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.lockgate_app.draining:
            log.info("signal %d: draining (no new requests), then exiting", sig)
        self.lockgate_app.draining = True
        for model in self.lockgate_app.models.models.values():
            for served in model.versions.values():
                if served.batcher is not None:
                    served.batcher.accepting = False
        super().handle_exit(sig, frame)


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
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        limit_concurrency=options.limit_concurrency,
        backlog=options.backlog,
        timeout_graceful_shutdown=int(options.drain_timeout),
        timeout_keep_alive=5,
    )
    server = _Server(config, app)
    loader = asyncio.get_running_loop().create_task(load(app, options))
    log.info("lockgate listening on http://%s:%d", options.host, options.port)
    await server.serve()
    loader.cancel()
    drained = await app.models.drain(options.drain_timeout)
    if not drained:
        log.warning("drain timed out after %.1f s; exiting with requests unanswered", options.drain_timeout)
    await app.models.close()
    for closer in app.closers:
        await closer()
    log.info("lockgate stopped")
    return 0


def run(options: ServeOptions) -> int:
    try:
        import uvloop

        return uvloop.run(serve(options))
    except ImportError:
        return asyncio.run(serve(options))
