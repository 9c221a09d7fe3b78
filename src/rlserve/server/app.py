"""The gRPC server: binds first (health NOT_SERVING), starts or attaches the engine (SERVING),
and on shutdown reports NOT_SERVING, drains in-flight RPCs for a grace period, then stops.
When the engine dies (its process exits, or it stops answering) health goes NOT_SERVING and
every call answers UNAVAILABLE; the process stays up so that a supervisor sees it.

Owns the grpc.aio server, health and reflection; not the engine's internals.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from rlserve.config import ServeConfig
from rlserve.engine.adapter import EngineAdapter
from rlserve.lifecycle.controller import LifecycleController
from rlserve.server.backend import EngineSlot
from rlserve.server.control import ControlServicer
from rlserve.server.inference import InferenceServicer
from rlserve.server.lifecycle import LifecycleServicer

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
    lifecycle_pb2.DESCRIPTOR.services_by_name["Lifecycle"].full_name,
)


class RlserveServer:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.slot = EngineSlot()
        self._owns_engine = False
        self._health = health.aio.HealthServicer()
        opts = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
        ]
        self._server = grpc.aio.server(options=opts)
        limits = config.limits
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self.slot, limits), self._server)
        control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(self.slot, limits), self._server)
        lifecycle_pb2_grpc.add_LifecycleServicer_to_server(LifecycleServicer(self.slot), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self._server)
        self.port = 0

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); returns the bound port."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await self._server.start()
        logger.info("rlserve listening on %s:%d (engine starting)", self.config.host, self.port)
        return self.port

    async def start_engine(self) -> None:
        """Start the configured engine off the event loop, so health keeps answering."""
        engine = await asyncio.to_thread(EngineAdapter.start, self.config.engine)
        self._owns_engine = True
        await self.attach_engine(engine)

    async def attach_engine(self, engine: EngineAdapter) -> None:
        """Serve an engine started elsewhere (tests share one); stop() will not shut it down."""
        config = self.config
        lifecycle = await LifecycleController.create(
            engine,
            max_held_requests=config.max_held_requests,
            max_held_bytes=config.max_held_bytes,
            transfer_timeout_s=config.transfer_timeout_s,
            lease_s=config.lease_s,
            max_transfer_info_bytes=config.limits.max_transfer_info_bytes,
        )
        self.slot.set(engine, lifecycle)
        engine.monitor.on_dead(self._engine_died)
        engine.monitor.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info("rlserve serving %s", engine.model_info().served_model_name)

    def _engine_died(self, reason: str) -> None:
        if self.slot.is_set:
            self.slot.clear(reason)
            asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, then refuse new RPCs and drain in-flight ones for `grace_s` seconds;
        RPCs still running after that are cancelled, which aborts their engine requests."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        engine = self.slot.engine_or_none
        self.slot.clear("the server is shutting down")
        if engine is not None and self._owns_engine:
            await engine.close()
            await asyncio.to_thread(engine.shutdown)

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, status)


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully."""
    server = RlserveServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(server.start_engine())
    stop_task = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if engine_task in done:
            engine_task.result()  # an engine that failed to start ends the server with its error
            await stop_task
        else:
            engine_task.cancel()
    finally:
        logger.info("shutting down: draining in-flight requests for up to %.1f s", config.shutdown_grace_s)
        await server.stop()
