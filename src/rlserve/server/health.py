"""grpc.health.v1 for rlserve's listeners: Check and Watch per service name ("" is the server).

As grpc's reference servicer, except that a Watch ends (OK) once the server shuts down,
right after it has said NOT_SERVING. A server stops when every RPC in flight has ended or
its grace period has run out, and a Watch never ends by itself: one open watcher (a load
balancer, Dynamo's sidecar, a Kubernetes probe) held every shutdown for its whole grace
period, 10 s by default, however soon the requests had drained. A watcher that calls again
then is refused (UNAVAILABLE), as every new call is while the server shuts down.

A status is written to a watcher outside the lock that guards the statuses, so a watcher that
does not read holds up only its own stream, never the server's next status change.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._changed = asyncio.Condition()
        self._shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service named {request.service[:200]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        sent = None
        while True:
            async with self._changed:
                while (status := self._status.get(request.service, SERVICE_UNKNOWN)) == sent:
                    if self._shutting_down:
                        return
                    await self._changed.wait()
            await context.write(health_pb2.HealthCheckResponse(status=status))
            sent = status

    async def set(self, service: str, status: int) -> None:
        """Ignored once the server shuts down: every service stays NOT_SERVING."""
        async with self._changed:
            if not self._shutting_down:
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; each Watch says so and ends."""
        async with self._changed:
            self._shutting_down = True
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._changed.notify_all()
