"""The standard gRPC health service (`grpc.health.v1.Health`), so Kubernetes' gRPC probes and
grpc-health-probe work against lockgate.

Service "" is the server: SERVING exactly when `/v2/health/ready` answers 200 (NOT_SERVING
while loading, draining, or with no model loaded). A model's name is that model: SERVING while
a version of it serves. An unknown name answers NOT_FOUND to Check, and SERVICE_UNKNOWN to
Watch (until the model appears). Statuses are read from the server when asked, so they are
never stale; Watch looks again every `WATCH_INTERVAL_S` and sends only changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from lockgate.frontend.app import App

WATCH_INTERVAL_S = 0.5
Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, app: App) -> None:
        self.app = app

    def status(self, service: str) -> Any:
        """The service's status now, or None for a name lockgate does not serve."""
        if service == "":
            return SERVING if self.app.not_ready() is None else NOT_SERVING
        model = self.app.models.models.get(service)
        if model is None:
            return None
        return (
            SERVING if model.latest_ready() is not None and not self.app.draining else NOT_SERVING
        )

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            # the name cut, so the status fits the client's metadata limit
            name = request.service[:256]
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {name!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status(request.service)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)


def add_health_service(app: App, server: grpc.aio.Server) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(app), server)
