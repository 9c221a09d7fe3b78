"""rlserve's grpc.health.v1 servicer (`rlserve.server.health`) over a real gRPC server, without
an engine: a watcher that never reads holds up nobody else, and every Watch ends at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.server.health import NOT_SERVING, SERVING, Health

# A client's choice: without BDP probing its receive window stays at 64 KiB, which a stream it
# does not read fills after a few thousand statuses.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


@contextlib.asynccontextmanager
async def health_server(**channel: object) -> AsyncIterator[tuple[Health, health_pb2_grpc.HealthStub]]:
    """A real gRPC server with only the health service, and a stub on a channel to it."""
    health = Health()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", **channel) as ch:
            yield health, health_pb2_grpc.HealthStub(ch)
    finally:
        await server.stop(0)


async def test_a_watcher_that_never_reads_holds_up_no_status_change_and_every_watch_ends_at_shutdown():
    """With grpc's reference servicer, which writes to watchers under the lock that guards the
    statuses, a change after about 9,400 (9,362 in one run) waited for ever on the unread
    stream: so would every later pause's health change, and the shutdown."""
    async with health_server(options=SMALL_WINDOW) as (health, stub):
        unread = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        async with asyncio.timeout(60):
            for i in range(20_000):
                await health.set("", NOT_SERVING if i % 2 == 0 else SERVING)
                await asyncio.sleep(0)  # the watcher gets to write each status
            await health.set("", NOT_SERVING)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == NOT_SERVING
            reader = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await reader.read()).status == NOT_SERVING
            await health.set("", SERVING)
            assert (await reader.read()).status == SERVING
            await health.enter_graceful_shutdown()
            assert (await reader.read()).status == NOT_SERVING
            assert await reader.read() == grpc.aio.EOF
            assert await reader.code() == grpc.StatusCode.OK
        # Ignored from now on: the server stays NOT_SERVING.
        await health.set("", SERVING)
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == NOT_SERVING
        unread.cancel()


async def test_check_names_an_unknown_service_not_found():
    async with health_server() as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.Such"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no.Such" in e.value.details()
