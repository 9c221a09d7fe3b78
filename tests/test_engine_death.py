"""An engine that stops (SIGSTOP: alive, answering nothing) and one that dies (SIGKILL) under
a real server: health goes NOT_SERVING and every call, in flight or new, answers UNAVAILABLE
within seconds; nothing hangs. The module starts an engine of its own, since it kills it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import grpc
import psutil
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import generate_request

from helpers import long_request, serving, wait_for_state

HANG_TIMEOUT_S = 3.0
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest_asyncio.fixture(scope="module")
async def doomed(engines):
    async with engines.own(hang_timeout_s=HANG_TIMEOUT_S) as adapter:
        core = core_of(adapter)
        mine = [core, *core.children(recursive=True)]
        yield adapter
        for proc in mine:  # only this engine's: other modules' shared engines live on
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def engine_processes() -> list[psutil.Process]:
    """This test process's vLLM engine core, and its workers."""
    me = psutil.Process(os.getpid())
    cores = [p for p in me.children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
    return [p for core in cores for p in (core, *core.children(recursive=True))]


def core_of(adapter) -> psutil.Process:
    """The engine core serving `adapter`: the only one started after every other engine."""
    cores = [p for p in engine_processes() if "EngineCore" in " ".join(p.cmdline())]
    return max(cores, key=lambda p: p.create_time())


async def all_unavailable(s) -> None:
    """Every kind of call fails fast with UNAVAILABLE."""
    calls = {
        "generate": s.inference.Generate(generate_request("hi", max_new_tokens=4)),
        "pause": s.control.PauseGeneration(cpb.PauseGenerationRequest()),
        "resume": s.control.ResumeGeneration(cpb.ResumeGenerationRequest()),
        "version": s.control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="x")),
        "state": s.lifecycle.GetState(lpb.GetStateRequest()),
        "is_paused": s.control.IsPaused(cpb.IsPausedRequest()),
    }
    for name, call in calls.items():
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(call, 10)
            raise AssertionError(f"{name} succeeded on a dead engine")
        except grpc.aio.AioRpcError as e:
            assert e.code() == UNAVAILABLE, (name, e.code(), e.details())
        assert time.perf_counter() - t0 < 2, name


async def health_status(s) -> int:
    async with grpc.aio.insecure_channel(s.target) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status


async def test_a_stopped_then_killed_engine_turns_every_call_unavailable(doomed, engine_config):
    async with (
        serving(doomed, ServeConfig(engine=engine_config)) as s,
        serving(doomed, ServeConfig(engine=engine_config)) as other,
    ):
        assert await health_status(s) == health_pb2.HealthCheckResponse.SERVING
        stream = s.inference.GenerateStream(long_request("in flight", max_new_tokens=400))
        await stream.read()
        # A second server over the same engine holds a request while its generation is paused.
        await other.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
        held = asyncio.ensure_future(other.inference.Generate(generate_request("held", max_new_tokens=4)))
        await wait_for_state(other.lifecycle, lambda st: st.num_held_requests == 1)
        core = core_of(doomed)
        core.send_signal(signal.SIGSTOP)  # alive, but it takes no more work
        t0 = time.perf_counter()
        try:
            # The stream in flight ends with UNAVAILABLE once the engine is declared dead.
            while True:
                message = await asyncio.wait_for(stream.read(), HANG_TIMEOUT_S + 10)
                assert message != grpc.aio.EOF
        except grpc.aio.AioRpcError as e:
            assert e.code() == UNAVAILABLE and "dead" in e.details()
        assert time.perf_counter() - t0 < HANG_TIMEOUT_S + 5
        try:
            await asyncio.wait_for(held, 2)
            raise AssertionError("a held request succeeded on a dead engine")
        except grpc.aio.AioRpcError as e:
            assert e.code() == UNAVAILABLE, "a held request does not wait for a resume that never comes"
        assert await health_status(s) == health_pb2.HealthCheckResponse.NOT_SERVING
        await all_unavailable(s)
        core.send_signal(signal.SIGKILL)
        core.send_signal(signal.SIGCONT)
        await all_unavailable(s)


async def test_a_killed_engine_is_noticed_at_once(engines, engine_config):
    async with engines.own(hang_timeout_s=60.0) as adapter:
        async with serving(adapter, ServeConfig(engine=engine_config)) as s:
            stream = s.inference.GenerateStream(long_request("in flight", max_new_tokens=400))
            await stream.read()
            core_of(adapter).kill()
            t0 = time.perf_counter()
            try:
                while (await asyncio.wait_for(stream.read(), 10)) != grpc.aio.EOF:
                    pass
                raise AssertionError("the stream ended normally on a killed engine")
            except grpc.aio.AioRpcError as e:
                assert e.code() == UNAVAILABLE
            await all_unavailable(s)
            assert await health_status(s) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert time.perf_counter() - t0 < 10, "well before the 60 s hang timeout"
